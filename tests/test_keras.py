"""Keras modules under mirrored and mwms: the examples, the chief's files, and bad input."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess

import pytest

from tests.helpers import assert_ok, at_most, launch_probe, metrics_lines, run_unifit

pytestmark = pytest.mark.tf

KERAS_DIGITS = "examples/digits/keras.yaml"
DIGITS = {"mirrored": (1, "{devices: 2}"), "mwms": (2, "{}")}


def _digits(strategy: str, root) -> subprocess.CompletedProcess:
    procs, options = DIGITS[strategy]
    return run_unifit(
        "launch", "--nproc-per-node", str(procs), "-c", KERAS_DIGITS, "--trainer.strategy", strategy,
        "--trainer.strategy_options", options, "--trainer.root_dir", str(root), timeout=280,
    )  # fmt: skip


def _unreachable_worker(root) -> subprocess.CompletedProcess:
    """A user-provided TF_CONFIG naming a second worker that never starts."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = [a.getsockname()[1], b.getsockname()[1]]
    tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": 0}}
    return run_unifit(
        "fit", "-c", KERAS_DIGITS, "--trainer.strategy", "mwms", "--trainer.root_dir", str(root),
        "--trainer.collective_timeout_s", "10", env={"TF_CONFIG": json.dumps(tf_config)}, timeout=170,
    )  # fmt: skip


def _non_chief_copies(root) -> subprocess.CompletedProcess:
    (root / "tmp").mkdir()
    return launch_probe("mwms", root / "run", env={"TMPDIR": str(root / "tmp")})


JOBS = {
    "digits-mirrored": functools.partial(_digits, "mirrored"),
    "digits-mwms": functools.partial(_digits, "mwms"),
    "non-chief-copies": _non_chief_copies,
    "unreachable-worker": _unreachable_worker,
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Name -> (root, result): this module's four TensorFlow launches, two at a time (a TensorFlow process of
    these small models keeps about one core busy, a worker waiting for a gone peer none)."""
    roots = {name: tmp_path_factory.mktemp(name) for name in JOBS}
    results = at_most(2, [functools.partial(job, roots[name]) for name, job in JOBS.items()])
    return {name: (roots[name], result) for name, result in zip(JOBS, results, strict=True)}


def _launched(launched: dict, name: str):
    root, result = launched[name]
    if isinstance(result, BaseException):
        raise result
    return root, result


@pytest.mark.launch
@pytest.mark.timeout(900)  # the first test makes the module's four launches, two at a time
@pytest.mark.parametrize("strategy", list(DIGITS))
def test_keras_digits_reach_95_percent(launched, strategy):
    tmp_path, result = _launched(launched, f"digits-{strategy}")
    assert_ok(result)
    last = metrics_lines(tmp_path)[-1]
    assert last["epoch"] == 10 and last["val/acc"] >= 0.95, last
    assert last["lr"] == pytest.approx(0.1)  # base 0.05 x 2 replicas


@pytest.mark.launch
@pytest.mark.timeout(900)
def test_mwms_non_chief_checkpoint_copies_are_removed(launched):
    tmp_path, result = _launched(launched, "non-chief-copies")
    scratch = tmp_path / "tmp"
    assert_ok(result)
    assert not [p for p in scratch.iterdir() if p.name.startswith("unifit-tf-ckpt-")]
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["epoch=0001-step=0000004", "epoch=0002-step=0000008", "epoch=0003-step=0000012", "last.json"]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints" / ckpts[0] / "tf")) == [
        "ckpt.data-00000-of-00001",
        "ckpt.index",
    ]


def _one_line(result, *needles):
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
    assert lines and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.timeout(120)
def test_torch_module_with_a_tensorflow_strategy(tmp_path, cli):
    _one_line(
        cli(
            "fit",
            "-c",
            "examples/digits/torch.yaml",
            "--trainer.strategy",
            "mirrored",
            "--trainer.root_dir",
            str(tmp_path),
        ),
        "'mirrored' trains tensorflow modules",
        "DigitsClassifier is a torch module",
        "use one of: single, ddp",
    )


@pytest.mark.timeout(120)
def test_keras_module_with_a_torch_strategy(tmp_path, cli):
    _one_line(
        cli("fit", "-c", KERAS_DIGITS, "--trainer.strategy", "ddp", "--trainer.root_dir", str(tmp_path)),
        "'ddp' trains torch modules",
        "DigitsKeras is a tensorflow module",
        "mirrored, mwms",
    )


@pytest.mark.timeout(120)
def test_mirrored_with_more_devices_than_exist(tmp_path, cli):
    _one_line(
        cli(
            "fit",
            "-c",
            KERAS_DIGITS,
            "--trainer.strategy_options",
            "{devices: 64}",
            "--trainer.root_dir",
            str(tmp_path),
        ),
        "trainer.strategy_options.devices: received 64",
        f"has {os.cpu_count()} CPU cores",
        "at most",
    )


@pytest.mark.timeout(120)
def test_malformed_tf_config(tmp_path, cli):
    _one_line(
        cli(
            "fit",
            "-c",
            KERAS_DIGITS,
            "--trainer.strategy",
            "mwms",
            "--trainer.root_dir",
            str(tmp_path),
            env={"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker"}}'},
        ),
        "TF_CONFIG: received",
        "expected",
    )


@pytest.mark.launch
@pytest.mark.timeout(900)
def test_unreachable_worker_fails_instead_of_hanging(launched):
    """A user-provided TF_CONFIG naming a second worker that never starts."""
    _, result = _launched(launched, "unreachable-worker")
    assert result.returncode != 0
    assert "unifit: error" in result.stderr and "a worker is gone or unreachable" in result.stderr, result.stderr[
        -3000:
    ]


@pytest.mark.timeout(120)
def test_smddp_like_with_a_keras_module(tmp_path, cli):
    _one_line(
        cli("fit", "-c", KERAS_DIGITS, "--trainer.strategy", "smddp-like", "--trainer.root_dir", str(tmp_path)),
        "'smddp-like' trains torch modules",
        "DigitsKeras is a tensorflow module",
    )


def test_tf_config_launcher_addresses_every_host():
    """`--hosts h1,h2 --node-rank R`: worker i of host h at h:(master_port + i); this node starts its own."""
    from unifit.strategies.launchers.base import LaunchSpec
    from unifit.strategies.launchers.tf_config import TFConfigLauncher

    spec = LaunchSpec(nproc_per_node=2, nnodes=2, node_rank=1, master_port=23456, hosts=["h1", "h2"])
    workers, mine = TFConfigLauncher("mwms").cluster(spec)
    assert workers == ["h1:23456", "h1:23457", "h2:23456", "h2:23457"]
    assert mine == [2, 3]
