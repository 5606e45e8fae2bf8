"""SageMaker entry point: ModelTrainer(source_code=SourceCode(entry_script="train.py", ...),
hyperparameters={"config": "exp.yaml", "trainer": {...}}), or an SDK 2 estimator(entry_point="train.py", ...)."""

from unifit.sagemaker import main

if __name__ == "__main__":
    raise SystemExit(main())
