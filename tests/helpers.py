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

# processes per strategy for the conformance suite; later strategies add their entry here
STRATEGY_PROCS = {"single": 1, "ddp": 2}


def run_unifit(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m unifit ARGS` in its own session; on timeout the whole group is killed and the test fails."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "unifit", *args], cwd=REPO, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"unifit {' '.join(args)} timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing it started may outlive the test
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def launch_probe(strategy: str, root: Path, *overrides: str, ckpt: str | None = None,
                 timeout: float = 180) -> subprocess.CompletedProcess:
    args = ["launch", "--nproc-per-node", str(STRATEGY_PROCS[strategy]), "-c", str(PROBE_YAML),
            "--trainer.strategy", strategy, "--trainer.root_dir", str(root),
            "--trainer.callbacks", json.dumps([{"class_path": "tests.probe.probe.ProbeReport",
                                                "init_args": {"out_dir": str(root / "reports")}}]),
            *overrides]
    if ckpt:
        args += ["--ckpt-path", ckpt]
    return run_unifit(*args, timeout=timeout)


def reports(root: Path) -> list[dict]:
    files = sorted((root / "reports").glob("report_*.json"))
    return [json.loads(f.read_text()) for f in files]


def metrics_lines(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines() if line]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
