"""strategy: parameter-server (TensorFlow's ParameterServerStrategy + ClusterCoordinator), real processes: `unifit
launch --num-ps 2` starts 2 parameter servers, 2 workers (tf.distribute.Server) and the chief that coordinates.

The Keras digits train asynchronously to a useful accuracy (the hidden kernel partitioned over the 2 parameter
servers), a worker killed with SIGKILL mid-run is left behind and the run finishes, the coordinator's checkpoint holds the variables (a one-process validation of it equals the
value logged at that epoch) and a fit resumes from it; SIGTERM to the whole job stops the chief with a checkpoint
(the servers serve on until it is written); a parameter server or the chief killed mid-run ends every process with
one line; two hosts (two launches, 127.0.0.1 and 127.0.0.2) make one cluster; bad input is one line, exit 2."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import assert_ok, metrics_lines, start_python, start_unifit, stop
from unifit.strategies.launchers.tf_config import _free_ports

pytestmark = pytest.mark.tf

DIGITS = "examples/digits/keras.yaml"


# the hidden layer's 64 x 64 kernel (16 KiB) in 2 shards, one on each parameter server; the rest whole
SHARDED = json.dumps({"max_shards": 2, "min_shard_bytes": 4096})


def _cluster(root: Path, *overrides: str) -> list[str]:
    head = ["launch", "--nproc-per-node", "2", "--num-ps", "2", "-c", DIGITS, "--trainer.strategy_options", SHARDED]
    return [*head, "--trainer.strategy", "parameter-server", "--trainer.root_dir", str(root), *overrides]


def _wait_for_first_epoch(proc, root: Path, lines_before: int = 0) -> None:
    """Until the run (whose root already holds `lines_before` metrics lines) logs its first epoch."""
    deadline = time.time() + 120
    while not (root / "metrics.jsonl").exists() or len(metrics_lines(root)) <= lines_before:
        assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before its first epoch"
        time.sleep(0.2)


def _kill_task_after_first_epoch(proc, root: Path, kind: str, index: int = 0, lines_before: int = 0) -> float:
    """SIGKILL the launch's `kind` task (ps, worker or chief) once the first epoch is logged; when it was."""
    _wait_for_first_epoch(proc, root, lines_before)
    for child in psutil.Process(proc.pid).children(recursive=True):
        task = json.loads(child.environ().get("TF_CONFIG", "{}")).get("task", {})
        if task == {"type": kind, "index": index}:
            child.kill()
            return time.time()
    raise AssertionError(f"no {kind} {index} task among the launch's processes")


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_trains_past_a_killed_worker_checkpoints_resumes_is_preempted_and_ends_with_a_killed_chief(cli, tmp_path):
    run = tmp_path / "run"
    proc = start_unifit(*_cluster(run, "--trainer.max_epochs", "5", "--trainer.export_dir", str(tmp_path / "export")))
    _kill_task_after_first_epoch(proc, run, "worker", 1)
    out, err = stop(proc, timeout=200)
    assert proc.returncode == 0, err[-3000:]
    assert "sequential/dense/kernel in 2 shards" in err, err[-3000:]
    assert "worker 1 ended (exit -9); the coordinator runs its steps on the other workers" in err
    lines = metrics_lines(run)
    assert [line["epoch"] for line in lines] == [1, 2, 3, 4, 5]
    assert lines[-1]["step"] == 5 * 45 and lines[-1]["lr"] == pytest.approx(
        0.05
    )  # one worker's batch a step: no lr scaling
    assert lines[-1]["val/acc"] >= 0.9, lines[-1]
    last = next((run / "checkpoints").glob("epoch=0005-*"))
    # the coordinator's checkpoint holds the variables the parameter server had: one process validates it exactly
    checked = tmp_path / "checked"
    single = ["-c", DIGITS, "--trainer.strategy", "single", "--trainer.root_dir", str(checked)]
    assert_ok(cli("validate", *single, "--ckpt-path", str(last)))
    validated = json.loads((checked / "validate.json").read_text())["metrics"]
    assert validated["val/acc"] == pytest.approx(lines[-1]["val/acc"], abs=1e-6)
    assert validated["val/loss"] == pytest.approx(lines[-1]["val/loss"], rel=1e-5)
    # the exported weights of the partitioned model load into one that is not
    from examples.digits.keras_module import DigitsKeras

    plain = DigitsKeras().build_model()
    plain.load_weights(tmp_path / "export" / "model.weights.h5")
    assert plain.layers[0].kernel.shape == (64, 64)
    # a fit goes on from it, at its step; SIGTERM to every process of the job at once (scancel, a terminal's
    # Ctrl-C): the servers serve on while the chief stops at a step boundary with a checkpoint
    resumed = tmp_path / "resumed"
    proc = start_unifit(*_cluster(resumed, "--trainer.max_epochs", "40", "--ckpt-path", str(last)))
    children = psutil.Process(proc.pid).children(recursive=True)
    _wait_for_first_epoch(proc, resumed)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = stop(proc, timeout=90)
    assert "resumed from" in err and "(epoch 5, step 225)" in err, err[-3000:]
    assert (metrics_lines(resumed)[0]["epoch"], metrics_lines(resumed)[0]["step"]) == (6, 270)
    assert proc.returncode == 128 + signal.SIGTERM and "preempted by SIGTERM" in err, err[-3000:]
    preempted = json.loads((resumed / "checkpoints" / "last.json").read_text())
    assert preempted["global_step"] >= 270, preempted
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    # and on from that checkpoint; its chief (the coordinator) killed then ends every process in one line
    proc = start_unifit(*_cluster(resumed, "--trainer.max_epochs", "40", "--ckpt-path", "auto"))
    children = psutil.Process(proc.pid).children(recursive=True)
    killed_at = _kill_task_after_first_epoch(proc, resumed, "chief", lines_before=len(metrics_lines(resumed)))
    out, err = stop(proc, timeout=90)
    assert f"(epoch {preempted['epoch']}, step {preempted['global_step']}" in err, err[-3000:]
    _ended_in_one_line(proc, err, children, killed_at, "the chief (the coordinator) died (killed by SIGKILL)")


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_two_hosts_train_a_compiled_keras_model_and_a_killed_parameter_server_ends_every_process_with_one_line(
    tmp_path,
):
    """Two hosts (127.0.0.1 and 127.0.0.2: one machine, the ports numbered across hosts), each with one worker and
    one parameter server, the chief on the first; the module a compiled Keras model, built before the Trainer as
    users write it (the chief connects to the cluster when the Trainer is made, so its variables are the
    cluster's), the data tf.data pipelines batched by 8 (each worker reads the whole training pipeline, repeated).
    Killing parameter server 0 ends the chief, and the second host's launch once the chief is gone."""
    experiment = tmp_path / "compiled.yaml"
    experiment.write_text(
        json.dumps(
            {
                "module": {"class_path": "tests.probe.keras_compiled_probe.compiled_model", "init_args": {}},
                "data": {"class_path": "tests.probe.keras_compiled_probe.PipelineData"},
                "trainer": {"seed": 0, "progress_bar": False, "collective_timeout_s": 60},
            }
        )
    )
    base = random.randrange(30000, 40000, 10)  # 5 ports from here: the chief, then each host's worker and ps
    args = ["launch", "--hosts", "127.0.0.1,127.0.0.2", "--master-port", str(base), "--nproc-per-node", "1"]
    args += ["--num-ps", "1", "-c", str(experiment), "--trainer.max_epochs", "400"]
    args += ["--trainer.strategy", "parameter-server", "--trainer.root_dir", str(tmp_path)]
    second = start_unifit(*args, "--node-rank", "1")
    proc = start_unifit(*args, "--node-rank", "0")
    children = [c for p in (proc, second) for c in psutil.Process(p.pid).children(recursive=True)]
    killed_at = _kill_task_after_first_epoch(proc, tmp_path, "ps")
    out, err = stop(proc, timeout=90)
    first = metrics_lines(tmp_path)[0]
    assert first["step"] == 4 and "val/sparse_categorical_accuracy" in first, first
    assert "2 worker(s), 2 parameter server(s)" in err, err[-3000:]
    _, second_err = stop(second, timeout=max(1, 60 - (time.time() - killed_at)))
    assert f"the chief at 127.0.0.1:{base} ended; stopping this host's servers" in second_err, second_err[-3000:]
    _ended_in_one_line(proc, err, children, killed_at, "parameter server 0 ended (exit -9)")


def _ended_in_one_line(proc, err: str, children: list, killed_at: float, named: str) -> None:
    assert time.time() - killed_at < 60, "not ended within 60 s"
    assert proc.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("unifit: error")]
    assert any(named in line for line in errors), err[-3000:]
    assert "Traceback" not in err
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--num-ps", "0"], ["--num-ps: received 0", "at least 1 parameter server"]),
        (["--num-ps", "1", "--max-restarts", "1"], ["--max-restarts 1", "has no restarting launcher"]),
        (["--num-ps", "1", "--hosts", "a,b", "--node-rank", "2"], ["--node-rank 2", "give 0 to 1"]),
    ],
)
def test_bad_input_is_one_line(cli, tmp_path, args, needles):
    result = cli("launch", "--nproc-per-node", "2", "-c", DIGITS, *args, "--trainer.strategy", "parameter-server")
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
    assert errors and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_without_a_cluster_and_with_another_strategy_is_one_line(cli, tmp_path):
    alone = cli("fit", "-c", DIGITS, "--trainer.strategy", "parameter-server", "--trainer.root_dir", str(tmp_path))
    assert alone.returncode == 2 and "unifit launch --nproc-per-node N --num-ps K" in alone.stderr, alone.stderr
    other = cli("launch", "--nproc-per-node", "2", "--num-ps", "1", "-c", DIGITS, "--trainer.strategy", "mwms")
    assert other.returncode == 2 and "--num-ps 1: strategy 'mwms' has no parameter servers" in other.stderr


def test_a_pytorch_module_is_one_line(cli, tmp_path):
    """PyTorch has no maintained parameter server (torch.distributed.rpc is in maintenance mode)."""
    torch_digits = ["-c", "examples/digits/torch.yaml", "--trainer.strategy", "parameter-server"]
    result = cli("fit", *torch_digits, "--trainer.root_dir", str(tmp_path))
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
    assert len(errors) == 1 and "DigitsClassifier is a torch module; use one of: single, ddp" in errors[0], errors
    assert "fsdp" in errors[0] and "horovod" in errors[0]


def test_a_parameter_server_cluster_runs_unifits_loop_in_the_chief_alone():
    """TF_CONFIG of a cluster with ps tasks (a TFJob's Chief/Worker/PS replicas, SageMaker's master): the chief is
    a world of one; a ps or worker task is a server, and `unifit fit` there says what to run instead."""
    from unifit.errors import ConfigError
    from unifit.strategies.environment import detect

    cluster = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}
    for kind in ("chief", "master"):
        env = detect({"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": 0}})})
        assert (env.rank, env.world_size, env.source) == (0, 1, "tf_config_ps")
    for kind in ("worker", "ps"):
        with pytest.raises(ConfigError, match=f"task type '{kind}'.*python -m unifit.strategies.tf_server"):
            detect({"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": 0}})})


# SageMaker's TensorFlow toolkit (sagemaker-tensorflow-training's `_run_ps`) starts one of these on every host
_TOOLKIT_PS = """
import json, os, tensorflow as tf
config = json.loads(os.environ["TF_CONFIG"])
tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name="ps", task_index=config["task"]["index"],
                     config=tf.compat.v1.ConfigProto(device_count={"GPU": 0})).join()
"""


# what SageMaker's entry point is given: an experiment, or a user's script (hyperparameter `script`) that makes
# unifit.Trainer(strategy="parameter-server") itself; each logs its validation accuracy under its own name
SAGEMAKER_ENTRIES = {
    "experiment": (
        ["--config", DIGITS, "--trainer.strategy", "parameter-server", "--trainer.max_epochs", "3"],
        ["--trainer.progress_bar", "false", "--trainer.root_dir"],
        "val/acc",
    ),
    "script": (["--script", "tests/probe/tf_ps_trainer.py"], ["--root-dir"], "val/accuracy"),
}


@pytest.mark.launch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("given", sorted(SAGEMAKER_ENTRIES))
def test_sagemakers_parameter_server_distribution_runs_the_chief_on_the_master_and_serves_on_the_other_hosts(
    tmp_path, given
):
    """What SageMaker's TensorFlow toolkit does with distribution={"parameter_server": {"enabled": True}} on two
    hosts (its `_build_tf_config_for_ps`, free ports here instead of its fixed 2222 and 2223 so both hosts fit on
    one machine): a parameter server on each host, started by the toolkit with the TF 1 name "master" in its
    cluster, then the entry point on each host with TF_CONFIG. The master trains as the chief (an experiment, or a
    user's script run as the chief); the worker host's entry point serves until the chief ends, then ends by
    itself."""
    hosts = ["127.0.0.1", "localhost"]
    master, worker, *ps = [f"{host}:{port}" for host, port in zip(hosts + hosts, _free_ports(4))]
    cluster = {"master": [master], "ps": ps, "worker": [worker]}

    def env(kind: str, index: int, host: str) -> dict[str, str]:
        task = {"cluster": cluster, "environment": "cloud", "task": {"index": index, "type": kind}}
        return {"TF_CONFIG": json.dumps(task), "SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": host}

    servers = [
        subprocess.Popen([sys.executable, "-c", _TOOLKIT_PS], env={**os.environ, **env("ps", i, hosts[i])})
        for i in range(2)
    ]
    what, where, accuracy = SAGEMAKER_ENTRIES[given]
    entry = ["examples/sagemaker/train.py", *what, *where, str(tmp_path)]
    try:
        serving = start_python(*entry, env=env("worker", 0, hosts[1]))
        chief = start_python(*entry, env=env("master", 0, hosts[0]))
        out, err = stop(chief, timeout=240)
        assert chief.returncode == 0, err[-3000:]
        assert "1 worker(s), 2 parameter server(s)" in err, err[-3000:]
        lines = metrics_lines(tmp_path)
        assert [line["epoch"] for line in lines] == [1, 2, 3] and lines[-1][accuracy] >= 0.9, lines[-1]
        assert lines[-1]["val/loss"] < lines[0]["val/loss"], lines
        _, served = stop(serving, timeout=30)
        assert serving.returncode == 0 and f"the chief at {master} ended" in served, served[-3000:]
    finally:
        for server in servers:
            server.kill()
            server.wait()


def test_sagemaker_without_a_distribution_launches_the_cluster_on_every_host(monkeypatch):
    """No estimator distribution: unifit's entry point starts the cluster itself, one parameter server and a
    worker per GPU on every host (the chief on the first), through the same launcher as `unifit launch --hosts`."""
    from unifit import sagemaker
    from unifit.strategies.launchers.parameter_servers import ParameterServerLauncher, layout

    launched = []
    monkeypatch.setattr(ParameterServerLauncher, "launch", lambda self, spec: launched.append(spec) or 0)
    monkeypatch.setenv("SM_HOSTS", '["algo-1", "algo-2"]')
    monkeypatch.setenv("SM_CURRENT_HOST", "algo-2")
    monkeypatch.setenv("SM_NUM_GPUS", "2")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert sagemaker.main(["--config", DIGITS, "--trainer.strategy", "parameter-server"]) == 0
    cluster, mine = layout(launched[0])
    assert cluster == {
        "chief": ["algo-1:29500"],
        "worker": ["algo-1:29501", "algo-1:29502", "algo-2:29504", "algo-2:29505"],
        "ps": ["algo-1:29503", "algo-2:29506"],
    }
    assert mine == [("ps", 1), ("worker", 2), ("worker", 3)]
