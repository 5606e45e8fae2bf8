"""Run unifit commands in subprocesses with a hard timeout that kills every process they started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE_YAML = REPO / "tests" / "probe" / "probe.yaml"

# processes per strategy for the conformance suite, and the options it runs with there;
# later strategies add their entry here. smddp-like runs 4 ranks as 2 "nodes" x 2, so its
# hierarchical allreduce is really exercised.
# Keys are test variants: a strategy name, or "<strategy>-keras" for a strategy that trains both
# frameworks, run there with the Keras probe.
STRATEGY_PROCS = {
    "single": 1,
    "ddp": 2,
    "smddp-like": 4,
    "fsdp": 2,
    "mirrored": 1,
    "mwms": 2,
    "horovod": 2,
    "horovod-keras": 2,
}
STRATEGY_REPLICAS = {**STRATEGY_PROCS, "mirrored": 2}  # mirrored: 2 logical CPU devices in one process
STRATEGY_OPTIONS = {
    "smddp-like": ["--trainer.strategy_options", "{local_world_size: 2}"],
    "mirrored": ["--trainer.strategy_options", "{devices: 2}"],
}
KERAS_PROBE_YAML = REPO / "tests" / "probe" / "keras_probe.yaml"
KERAS_STRATEGIES = {"mirrored", "mwms", "horovod-keras"}


def strategy_name(variant: str) -> str:
    return variant.removesuffix("-keras")


def run_unifit(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m unifit ARGS` in its own session; on timeout the whole group is killed and the test fails."""
    proc = start_unifit(*args, env=env)
    out, err = stop(proc, timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def probe_args(
    strategy: str,
    root: Path | str,
    *overrides: str,
    ckpt: str | None = None,
    callbacks: list[dict] | None = None,
    report_dir: Path | None = None,
) -> list[str]:
    report_dir = report_dir or Path(str(root)) / "reports"
    report = {"class_path": "tests.probe.probe.ProbeReport", "init_args": {"out_dir": str(report_dir)}}
    yaml_file = KERAS_PROBE_YAML if strategy in KERAS_STRATEGIES else PROBE_YAML
    args = [
        "launch",
        "--nproc-per-node",
        str(STRATEGY_PROCS[strategy]),
        "-c",
        str(yaml_file),
        "--trainer.strategy",
        strategy_name(strategy),
        "--trainer.root_dir",
        str(root),
        "--trainer.callbacks",
        json.dumps([report, *(callbacks or [])]),
        *STRATEGY_OPTIONS.get(strategy, []),
        *overrides,
    ]
    return args + (["--ckpt-path", ckpt] if ckpt else [])


def launch_probe(
    strategy: str,
    root: Path | str,
    *overrides: str,
    ckpt: str | None = None,
    timeout: float = 180,
    callbacks: list[dict] | None = None,
    report_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    return run_unifit(
        *probe_args(strategy, root, *overrides, ckpt=ckpt, callbacks=callbacks, report_dir=report_dir),
        timeout=timeout,
        env=env,
    )


def start_unifit(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `python -m unifit ARGS` in the background (own session; see stop())."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "unifit", *args],
        cwd=REPO,
        env=full_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    """Wait up to `timeout` for proc, then kill its whole session; returns (stdout, stderr)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(map(str, proc.args))} timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}"
        )
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reports(root: Path) -> list[dict]:
    files = sorted((root / "reports").glob("report_*.json"))
    return [json.loads(f.read_text()) for f in files]


def metrics_lines(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines() if line]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
