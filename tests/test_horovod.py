"""The horovod strategy beyond the shared conformance suite: the examples, launches and failures.

The conformance suite (test_conformance.py) runs horovod with the torch probe and, as
"horovod-keras", with the Keras probe, both as 2 processes started by horovodrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import PROBE_YAML, REPO, assert_ok, metrics_lines, reports, run_unifit, stop
from unifit.strategies.environment import from_horovodrun
from unifit.strategies.launchers.base import LaunchSpec
from unifit.strategies.launchers.horovodrun import HorovodrunLauncher


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(400)
@pytest.mark.parametrize("example", ["torch", "keras"])
def test_digits_examples_reach_95_percent_under_horovod(tmp_path, example):
    result = run_unifit(
        "launch",
        "--nproc-per-node",
        "2",
        "-c",
        f"examples/digits/{example}.yaml",
        "--trainer.strategy",
        "horovod",
        "--trainer.root_dir",
        str(tmp_path),
        "--trainer.checkpoint.dir",
        str(tmp_path / "ckpt"),
        "--trainer.tensorboard.log_dir",
        str(tmp_path / "tb"),
        timeout=380,
    )
    assert_ok(result)
    assert "world size 2" in result.stdout
    last = metrics_lines(tmp_path)[-1]
    assert last["val/acc"] >= 0.95, last
    base_lr = {"torch": 0.05, "keras": 0.05}[example]
    assert last["lr"] == pytest.approx(2 * base_lr, rel=1e-6)  # linear scaling by the 2 workers


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_hand_written_horovodrun_command_works(tmp_path):
    """`horovodrun -np 2 python -m unifit fit -c exp.yaml`, as the Horovod guides write it."""
    report = {"class_path": "tests.probe.callbacks.ProbeReport", "init_args": {"out_dir": str(tmp_path / "reports")}}
    cmd = [
        sys.executable,
        "-m",
        "horovod.runner.launch",
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        sys.executable,
        "-m",
        "unifit",
        "fit",
        "-c",
        str(PROBE_YAML),
        "--trainer.strategy",
        "horovod",
        "--trainer.root_dir",
        str(tmp_path),
        "--trainer.max_epochs",
        "1",
        "--trainer.callbacks",
        json.dumps([report]),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    out, err = stop(proc, timeout=180)
    assert proc.returncode == 0, err
    got = reports(tmp_path)
    assert [r["rank"] for r in got] == [0, 1] and all(r["world_size"] == 2 for r in got)
    assert got[0]["weights_sha256"] == got[1]["weights_sha256"]


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_without_a_launcher_runs_a_world_of_one_and_says_so_once(tmp_path):
    result = run_unifit(
        "fit",
        "-c",
        str(PROBE_YAML),
        "--trainer.strategy",
        "horovod",
        "--trainer.root_dir",
        str(tmp_path),
        "--trainer.max_epochs",
        "1",
        timeout=100,
    )
    assert_ok(result)
    assert result.stderr.count("horovod: no launcher environment found") == 1, result.stderr
    assert "world size 1" in result.stdout


# a NaN on one rank and save_checkpoint on one rank: test_distributed_failures.py, for ddp and horovod


@pytest.mark.launch
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "hidden, expected",
    [
        ("horovod", "Horovod, which is not installed; fix: bash scripts/build_horovod.sh"),
        ("horovod.torch", "Horovod is installed without its torch part"),
    ],
)
def test_missing_horovod_or_its_framework_part_says_what_to_install(tmp_path, hidden, expected):
    script = textwrap.dedent(f"""
        import sys
        sys.modules[{hidden!r}] = None  # what Python does for a package (or extension) that is not there
        from unifit.cli.main import main
        sys.exit(main(["fit", "-c", {str(PROBE_YAML)!r}, "--trainer.strategy", "horovod",
                       "--trainer.root_dir", {str(tmp_path)!r}]))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_launcher_command_line_one_and_several_hosts():
    launcher = HorovodrunLauncher("horovod")
    one = launcher.command(LaunchSpec(nproc_per_node=2, fit_args=["-c", "exp.yaml"]))
    assert one[:3] == [sys.executable, "-m", "horovod.runner.launch"]
    assert one[3:8] == ["-np", "2", "-H", "localhost:2", "--gloo"]
    assert one[-5:] == ["-m", "unifit", "fit", "-c", "exp.yaml"]
    two = launcher.command(LaunchSpec(nproc_per_node=4, nnodes=2, hosts=["h1", "h2"], fit_args=["-c", "e.yaml"]))
    assert two[3:7] == ["-np", "8", "-H", "h1:4,h2:4"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--nnodes", "2"], "horovodrun needs every host's name; give --hosts"),
        (["--hosts", "h1,h2", "--node-rank", "1"], "run 'unifit launch' there only"),
    ],
)
def test_launcher_refuses_what_horovodrun_cannot_do(tmp_path, cli, flags, expected):
    result = cli(
        "launch",
        "--nproc-per-node",
        "2",
        *flags,
        "-c",
        str(PROBE_YAML),
        "--trainer.strategy",
        "horovod",
        "--trainer.root_dir",
        str(tmp_path),
    )
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_horovodrun_environment_reader():
    env = {
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
    }
    found = from_horovodrun(env)
    assert (found.rank, found.world_size, found.local_rank, found.local_world_size, found.node_rank) == (3, 4, 1, 2, 1)
    assert found.master_addr == "10.0.0.1" and found.source == "horovodrun"
    assert from_horovodrun({"RANK": "0", "WORLD_SIZE": "2"}) is None


@pytest.mark.timeout(60)
def test_unknown_strategy_option_is_a_one_line_error(tmp_path, cli):
    result = cli(
        "fit",
        "-c",
        str(PROBE_YAML),
        "--trainer.strategy",
        "horovod",
        "--trainer.root_dir",
        str(tmp_path),
        "--trainer.strategy_options",
        "{fusion_mb: 8}",
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
    assert len(errors) == 1 and "trainer.strategy_options.fusion_mb" in errors[0], result.stderr
