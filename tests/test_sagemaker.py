"""SageMaker integration, run through SageMaker's own in-container training toolkit, locally
(the PyPI packages sagemaker-training and sagemaker-pytorch-training; no Docker, no AWS)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from unifit.cli.main import parse_overrides
from unifit.config.loading import apply_overrides
from unifit.errors import ConfigError
from unifit.sagemaker import SageMakerEnvironment, dotted_arguments, parse_hosts

TRAIN_BIN = Path(sys.executable).parent / "train"
DIGITS = str(REPO / "examples" / "digits" / "torch.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toolkit(
    base: Path,
    hosts: list[str],
    current: str,
    hyperparameters: dict,
    *,
    channels: dict[str, Path] | None = None,
    torch_distributed: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Lay out a SageMaker base dir the way SageMaker does and start its toolkit's `train`."""
    config = base / "input" / "config"
    config.mkdir(parents=True)
    code = base / "src"
    code.mkdir()
    shutil.copy(REPO / "examples" / "sagemaker" / "train.py", code / "train.py")
    (config / "resourceconfig.json").write_text(
        json.dumps({"current_host": current, "hosts": hosts, "network_interface_name": "lo"})
    )
    hps = {"sagemaker_program": "train.py", "sagemaker_submit_directory": str(code), **hyperparameters}
    if torch_distributed:
        hps.update(sagemaker_torch_distributed_enabled=True, sagemaker_mpi_num_of_processes_per_host=2)
    (config / "hyperparameters.json").write_text(json.dumps({k: json.dumps(v) for k, v in hps.items()}))
    channels = channels or {}
    (config / "inputdataconfig.json").write_text(
        json.dumps({name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated"} for name in channels})
    )
    for name, source in channels.items():
        shutil.copytree(source, base / "input" / "data" / name)
    for folder in ("output", "model", "tmp"):
        (base / folder).mkdir()
    full_env = {
        **os.environ,
        "SAGEMAKER_BASE_DIR": str(base),
        "SM_STUDIO_LOCAL_MODE": "true",
        "TMPDIR": str(base / "tmp"),
        "PATH": f"{TRAIN_BIN.parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    if torch_distributed:
        full_env["SAGEMAKER_TRAINING_MODULE"] = "sagemaker_pytorch_container.training:main"
    return subprocess.Popen(
        [str(TRAIN_BIN)],
        cwd=base,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-6000:]
    return outputs


def _check_trained(base: Path, world: int, output: str) -> None:
    assert (base / "output" / "success").exists()
    assert f"world size {world}" in output, output[-3000:]
    state = torch.load(base / "model" / "model.pt", weights_only=True)  # the final model, in SM_MODEL_DIR
    assert "net.0.weight" in state
    lines = (base / "output" / "data" / "runs" / "digits" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["val/acc"] > 0.9


FAST = {
    "config": DIGITS,
    "trainer.max_epochs": 4,
    "trainer.root_dir": "runs/digits",
    "trainer.checkpoint.dir": "runs/digits/ckpt",
    "trainer.tensorboard.log_dir": "runs/digits/tb",
}


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_plain_launch_one_host_starts_torchrun_itself(tmp_path):
    base = tmp_path / "host"
    out = _finish(
        [
            _toolkit(
                base,
                ["localhost"],
                "localhost",
                {**FAST, "nproc-per-node": 2},
                env={"UNIFIT_MASTER_PORT": str(_free_port())},
            )
        ]
    )[0]
    _check_trained(base, 2, out)


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_plain_launch_one_host_with_horovod_starts_horovodrun(tmp_path):
    base = tmp_path / "host"
    out = _finish(
        [_toolkit(base, ["localhost"], "localhost", {**FAST, "trainer.strategy": "horovod", "nproc-per-node": 2})]
    )[0]
    _check_trained(base, 2, out)
    assert "strategy horovod" in out


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_plain_launch_two_simulated_hosts(tmp_path):
    hosts, port = ["127.0.0.1", "localhost"], str(_free_port())
    bases = [tmp_path / "h0", tmp_path / "h1"]
    outs = _finish(
        [_toolkit(base, hosts, host, FAST, env={"UNIFIT_MASTER_PORT": port}) for base, host in zip(bases, hosts)]
    )
    _check_trained(bases[0], 2, outs[0])  # rank 0 lives on the first host
    assert (bases[1] / "output" / "success").exists()
    assert not (bases[1] / "model" / "model.pt").exists()  # only rank 0 exports


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_torch_distributed_launch_one_host(tmp_path):
    base = tmp_path / "host"
    out = _finish(
        [_toolkit(base, ["localhost"], "localhost", {**FAST, "trainer.strategy": "smddp-like"}, torch_distributed=True)]
    )[0]
    _check_trained(base, 2, out)


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_torch_distributed_launch_two_simulated_hosts(tmp_path):
    hosts = ["127.0.0.1", "localhost"]
    bases = [tmp_path / "h0", tmp_path / "h1"]
    outs = _finish(
        [
            _toolkit(base, hosts, host, {**FAST, "trainer.strategy": "smddp-like"}, torch_distributed=True)
            for base, host in zip(bases, hosts)
        ]
    )
    _check_trained(bases[0], 4, outs[0])
    assert "smddp-like: hierarchical allreduce, 2 node(s) x 2 rank(s)" in outs[0]


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_channels_become_dataset_paths(tmp_path):
    from examples.digits.make_shards import write_shards

    shards = tmp_path / "shards"
    write_shards(str(shards), shards=2)
    train, val = tmp_path / "train", tmp_path / "val"
    for folder, prefix in ((train, "train"), (val, "val")):
        folder.mkdir()
        for f in shards.glob(f"{prefix}-*.npz"):
            shutil.copy(f, folder / f.name)
    base = tmp_path / "host"
    hps = {**FAST, "config": str(REPO / "examples" / "digits" / "sharded.yaml"), "nproc-per-node": 2}
    out = _finish(
        [
            _toolkit(
                base,
                ["localhost"],
                "localhost",
                hps,
                channels={"train": train, "val": val},
                env={"UNIFIT_MASTER_PORT": str(_free_port())},
            )
        ]
    )[0]
    _check_trained(base, 2, out)
    saved = (base / "output" / "data" / "runs" / "digits" / "config.yaml").read_text()
    assert f"{base}/input/data/train/train-*.npz" in saved


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_mpi_style_launch_as_sagemakers_mpi_and_smdistributed_launchers_set_it(tmp_path):
    """Those launchers need sshd and Open MPI; here 2 processes get the variables mpirun sets."""
    port = str(_free_port())
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "SM_HOSTS": json.dumps(["localhost"]),
        "SM_CURRENT_HOST": "localhost",
        "SM_MODEL_DIR": str(tmp_path / "model"),
        "SM_OUTPUT_DATA_DIR": str(tmp_path / "output"),
        "MASTER_PORT": port,
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "examples" / "sagemaker" / "train.py"),
                "--config",
                DIGITS,
                "--trainer.strategy",
                "smddp-like",
                "--trainer.max_epochs",
                "3",
                "--trainer.root_dir",
                "run",
                "--trainer.checkpoint.dir",
                "run/ckpt",
                "--trainer.tensorboard.log_dir",
                "run/tb",
            ],
            cwd=REPO,
            env={**env, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in (0, 1)
    ]
    outs = _finish(procs, timeout=180)
    assert "world size 2" in outs[0]
    assert (tmp_path / "model" / "model.pt").exists()
    assert (tmp_path / "output" / "run" / "metrics.jsonl").exists()


def test_nested_hyperparameters_merge_into_the_experiment_as_dotted_ones_do():
    """SDK 3's ModelTrainer passes {"trainer": {...}} as `--trainer '{...}'` (a dotted name breaks its sm_train.sh)."""
    nested = {"max_epochs": 10, "strategy": "ddp", "checkpoint": {"dir": "ckpt"}, "callbacks": [], "export_dir": None}
    arguments = ["--trainer", json.dumps(nested), "--module.init_args.lr", "0.1", "--data.init_args.path", "{x}"]
    dotted = dotted_arguments(arguments)
    assert dotted == [
        "--trainer.max_epochs", "10", "--trainer.strategy", '"ddp"', "--trainer.checkpoint.dir", '"ckpt"',
        "--trainer.callbacks", "[]", "--trainer.export_dir", "null",
        "--module.init_args.lr", "0.1", "--data.init_args.path", "{x}",
    ]  # fmt: skip
    experiment = {"trainer": {"max_epochs": 3, "seed": 7, "checkpoint": {"dir": "old", "keep_last_n": 2}}}
    merged = apply_overrides(experiment, parse_overrides(dotted))["trainer"]
    assert merged["seed"] == 7 and merged["checkpoint"] == {"dir": "ckpt", "keep_last_n": 2}
    assert (merged["max_epochs"], merged["strategy"], merged["export_dir"]) == (10, "ddp", None)


def test_malformed_sm_hosts_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"SM_HOSTS: received 'algo-1,algo-2'; expected a JSON list"):
        parse_hosts("algo-1,algo-2")
    with pytest.raises(ConfigError, match="SM_CURRENT_HOST: received 'algo-9', which is not in SM_HOSTS"):
        SageMakerEnvironment.detect({"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-9"})


def test_environment_maps_onto_the_config():
    sm = SageMakerEnvironment.detect(
        {
            "SM_HOSTS": '["algo-1", "algo-2"]',
            "SM_CURRENT_HOST": "algo-2",
            "SM_NUM_GPUS": "8",
            "SM_MODEL_DIR": "/opt/ml/model",
            "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data",
            "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train",
            "SM_CHANNEL_EXTRA": "/opt/ml/input/data/extra",
        }
    )
    assert (sm.node_rank, sm.num_gpus) == (1, 8)
    config = {
        "data": {"init_args": {"train": "s3://b/train-*.npz"}},
        "trainer": {"root_dir": "runs/x", "checkpoint": {"dir": "s3://b/ckpt"}, "tensorboard": {"log_dir": "/abs/tb"}},
    }
    assert sm.overrides(config) == {
        "data.init_args.train": '"/opt/ml/input/data/train/train-*.npz"',
        "trainer.export_dir": "/opt/ml/model",
        "trainer.root_dir": "/opt/ml/output/data/runs/x",
    }


def test_managed_spot_checkpoints_resume_by_themselves(tmp_path):
    """With checkpoint_s3_uri set, SageMaker syncs /opt/ml/checkpoints: unifit checkpoints there and
    resumes from whatever SageMaker restored into it (a restarted spot job continues)."""
    env = {"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1", "UNIFIT_SM_CHECKPOINT_DIR": str(tmp_path)}
    sm = SageMakerEnvironment.detect(env)
    assert sm.overrides({"trainer": {"root_dir": "runs/x"}}) == {
        "trainer.checkpoint.dir": str(tmp_path),
        "trainer.resume": "auto",
    }
    assert sm.overrides({"trainer": {"checkpoint": {"dir": "runs/ckpt"}}}) == {  # relative: not kept past the job
        "trainer.checkpoint.dir": str(tmp_path),
        "trainer.resume": "auto",
    }
    # the user's own choices win
    assert sm.overrides({"trainer": {"checkpoint": {"dir": "s3://b/c"}, "resume": "last"}}) == {}
    assert sm.overrides({"trainer": {"resume": "best"}}) == {"trainer.checkpoint.dir": str(tmp_path)}
    # no checkpoint directory (checkpoint_s3_uri not set): nothing changes
    assert (
        SageMakerEnvironment.detect({**env, "UNIFIT_SM_CHECKPOINT_DIR": str(tmp_path / "absent")}).overrides({}) == {}
    )


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_restarted_spot_job_continues_from_the_synced_checkpoints(tmp_path):
    checkpoints = tmp_path / "opt-ml-checkpoints"
    checkpoints.mkdir()
    env = {"UNIFIT_SM_CHECKPOINT_DIR": str(checkpoints)}
    hp = {k: v for k, v in FAST.items() if k != "trainer.checkpoint.dir"}
    first = _finish([_toolkit(tmp_path / "job1", ["algo-1"], "algo-1", {**hp, "trainer.max_epochs": 2}, env=env)])[0]
    assert "starting fresh" in first, first[-3000:]
    assert json.loads((checkpoints / "last.json").read_text())["name"].startswith("epoch=0002")
    second = _finish([_toolkit(tmp_path / "job2", ["algo-1"], "algo-1", hp, env=env)])[0]  # the restarted job
    assert "resumed from" in second and "epoch=0002" in second, second[-3000:]
    _check_trained(tmp_path / "job2", 1, second)
