"""Run a unifit experiment as SageMaker SDK 3's ModelTrainer runs a job, in its LOCAL_CONTAINER mode.

    python -m tests.probe.sagemaker_model_trainer ROOT SOURCE_DIR INSTANCES TORCHRUN_PROCESSES HYPERPARAMETERS_JSON ENVIRONMENT_JSON

The call is docs/sagemaker.md's, but for the image and `training_mode`: the SDK lays out /opt/ml per instance and
runs `docker compose up` (tests/probe/compose_shim.py where Docker is missing). TORCHRUN_PROCESSES 0: no
`distributed` (the entry point starts the processes itself).
"""

from __future__ import annotations

import json
import sys

from sagemaker.core.training.configs import Compute, SourceCode
from sagemaker.train import ModelTrainer
from sagemaker.train.distributed import Torchrun
from sagemaker.train.model_trainer import Mode


def main(
    root: str, source_dir: str, instances: str, torchrun_processes: str, hyperparameters: str, environment: str
) -> None:
    processes = int(torchrun_processes)
    trainer = ModelTrainer(
        training_image="unifit-local:cpu",
        training_mode=Mode.LOCAL_CONTAINER,
        local_container_root=root,
        base_job_name="unifit-digits",
        source_code=SourceCode(source_dir=source_dir, entry_script="train.py", requirements="requirements.txt"),
        distributed=Torchrun(process_count_per_node=processes) if processes else None,
        compute=Compute(instance_type="local_cpu", instance_count=int(instances)),
        hyperparameters=json.loads(hyperparameters),
        environment=json.loads(environment),
    )
    trainer.train()


if __name__ == "__main__":
    main(*sys.argv[1:])
