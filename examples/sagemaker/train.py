"""SageMaker entry point: estimator(entry_point="train.py", hyperparameters={"config": "exp.yaml", ...})."""

from unifit.sagemaker import main

if __name__ == "__main__":
    raise SystemExit(main())
