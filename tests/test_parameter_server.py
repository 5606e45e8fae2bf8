"""strategy: parameter-server (TensorFlow's ParameterServerStrategy + ClusterCoordinator), real processes: `unifit
launch --num-ps 1` starts a parameter server, 2 workers (tf.distribute.Server) and the chief that coordinates.

The Keras digits train asynchronously to a useful accuracy, a worker killed with SIGKILL mid-run is left behind
and the run finishes, the coordinator's checkpoint holds the variables (a one-process validation of it equals the
value logged at that epoch) and a fit resumes from it; a parameter server or the chief killed mid-run ends every process with
one line; bad input is one line, exit 2."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import assert_ok, metrics_lines, start_unifit, stop

DIGITS = "examples/digits/keras.yaml"


def _cluster(root: Path, *overrides: str) -> list[str]:
    head = ["launch", "--nproc-per-node", "2", "--num-ps", "1", "-c", DIGITS]
    return [*head, "--trainer.strategy", "parameter-server", "--trainer.root_dir", str(root), *overrides]


def _kill_task_after_first_epoch(proc, root: Path, kind: str, index: int = 0) -> float:
    """SIGKILL the launch's `kind` task (ps, worker or chief) once the first epoch is logged; when it was."""
    deadline = time.time() + 120
    while not (root / "metrics.jsonl").exists() or not metrics_lines(root):
        assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before its first epoch"
        time.sleep(0.2)
    for child in psutil.Process(proc.pid).children(recursive=True):
        task = json.loads(child.environ().get("TF_CONFIG", "{}")).get("task", {})
        if task == {"type": kind, "index": index}:
            child.kill()
            return time.time()
    raise AssertionError(f"no {kind} {index} task among the launch's processes")


@pytest.mark.timeout(300)
def test_trains_past_a_killed_worker_checkpoints_the_variables_resumes_and_ends_with_a_killed_chief(cli, tmp_path):
    run = tmp_path / "run"
    proc = start_unifit(*_cluster(run, "--trainer.max_epochs", "5"))
    _kill_task_after_first_epoch(proc, run, "worker", 1)
    out, err = stop(proc, timeout=200)
    assert proc.returncode == 0, err[-3000:]
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
    # a fit goes on from it, at its step; its chief (the coordinator) killed then ends every process in one line
    resumed = tmp_path / "resumed"
    proc = start_unifit(*_cluster(resumed, "--trainer.max_epochs", "40", "--ckpt-path", str(last)))
    children = psutil.Process(proc.pid).children(recursive=True)
    killed_at = _kill_task_after_first_epoch(proc, resumed, "chief")
    out, err = stop(proc, timeout=90)
    assert "resumed from" in err and "(epoch 5, step 225)" in err, err[-3000:]
    assert (metrics_lines(resumed)[0]["epoch"], metrics_lines(resumed)[0]["step"]) == (6, 270)
    _ended_in_one_line(proc, err, children, killed_at, "the chief (the coordinator) died (killed by SIGKILL)")


@pytest.mark.timeout(200)
def test_a_compiled_keras_model_trains_and_a_killed_parameter_server_ends_every_process_with_one_line(tmp_path):
    """A compiled Keras model passed as the module (built before the Trainer, as users write it: the chief
    connects to the cluster when the Trainer is made, so its variables are the cluster's)."""
    experiment = tmp_path / "compiled.yaml"
    experiment.write_text(
        json.dumps(
            {
                "module": {"class_path": "tests.probe.keras_compiled_probe.compiled_model", "init_args": {}},
                "data": {"class_path": "tests.probe.keras_compiled_probe.Data"},
                "trainer": {"batch_size": 8, "seed": 0, "progress_bar": False, "collective_timeout_s": 60},
            }
        )
    )
    args = ["launch", "--nproc-per-node", "2", "--num-ps", "1", "-c", str(experiment), "--trainer.max_epochs", "400"]
    proc = start_unifit(*args, "--trainer.strategy", "parameter-server", "--trainer.root_dir", str(tmp_path))
    children = psutil.Process(proc.pid).children(recursive=True)
    killed_at = _kill_task_after_first_epoch(proc, tmp_path, "ps")
    out, err = stop(proc, timeout=90)
    first = metrics_lines(tmp_path)[0]
    assert first["step"] == 4 and "val/sparse_categorical_accuracy" in first, first
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
