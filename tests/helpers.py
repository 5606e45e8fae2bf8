"""Run unifit commands in subprocesses with a hard timeout that kills every process they started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
PROBE_YAML = REPO / "tests" / "probe" / "probe.yaml"
KERAS_PROBE_YAML = REPO / "tests" / "probe" / "keras_probe.yaml"


@dataclass(frozen=True)
class StrategyCase:
    """One row of the strategy matrix: a strategy, the framework it trains there, how it is launched.

    The suites that run every strategy (conformance, long jobs, soak) parametrise over STRATEGIES,
    the others pick rows by id (strategy_params("ddp", "horovod"), STRATEGY["mwms"]): a new strategy
    is one more row. smddp-like runs 4 ranks as 2 "nodes" x 2, so its hierarchical allreduce is really
    exercised; mirrored runs 2 logical CPU devices in one process.
    """

    id: str  # the pytest id and the name tests use: the strategy, or "<strategy>-keras" for a strategy
    # that trains both frameworks, run there with the Keras probe
    strategy: str  # --trainer.strategy
    framework: str  # "torch" or "keras": the probe (and soak experiment) it trains
    nproc: int  # processes `unifit launch --nproc-per-node` starts
    strategy_options: str = ""  # its trainer.strategy_options on one host, if any
    replicas_per_process: int = 1  # mirrored: one per logical CPU device

    @property
    def replicas(self) -> int:
        return self.nproc * self.replicas_per_process

    @property
    def options(self) -> tuple[str, ...]:
        """The flags it runs with on one host."""
        return ("--trainer.strategy_options", self.strategy_options) if self.strategy_options else ()

    @property
    def probe_yaml(self) -> Path:
        return KERAS_PROBE_YAML if self.framework == "keras" else PROBE_YAML


STRATEGIES: tuple[StrategyCase, ...] = (
    StrategyCase("single", "single", "torch", 1),
    StrategyCase("ddp", "ddp", "torch", 2),
    StrategyCase("smddp-like", "smddp-like", "torch", 4, "{local_world_size: 2}"),
    StrategyCase("fsdp", "fsdp", "torch", 2),
    StrategyCase("mirrored", "mirrored", "keras", 1, "{devices: 2}", replicas_per_process=2),
    StrategyCase("mwms", "mwms", "keras", 2),
    StrategyCase("horovod", "horovod", "torch", 2),
    StrategyCase("horovod-keras", "horovod", "keras", 2),
)
STRATEGY = {case.id: case for case in STRATEGIES}


def strategy_params(*ids: str) -> list:
    """pytest parameters (one StrategyCase each, under its id): the rows named, in that order, or every row."""
    import pytest

    return [pytest.param(STRATEGY[i], id=i) for i in ids or STRATEGY]


# views of the table for the suites that look one row up by its id
STRATEGY_PROCS = {case.id: case.nproc for case in STRATEGIES}
STRATEGY_REPLICAS = {case.id: case.replicas for case in STRATEGIES}
STRATEGY_OPTIONS = {case.id: list(case.options) for case in STRATEGIES if case.options}
KERAS_STRATEGIES = {case.id for case in STRATEGIES if case.framework == "keras"}


def strategy_name(variant: str) -> str:
    return STRATEGY[variant].strategy


def _case(strategy: str | StrategyCase) -> StrategyCase:
    return strategy if isinstance(strategy, StrategyCase) else STRATEGY[strategy]


def run_unifit(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m unifit ARGS` in its own session; on timeout the whole group is killed and the test fails."""
    proc = start_unifit(*args, env=env)
    out, err = stop(proc, timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def probe_args(
    strategy: str | StrategyCase,
    root: Path | str,
    *overrides: str,
    ckpt: str | None = None,
    callbacks: list[dict] | None = None,
    report_dir: Path | None = None,
) -> list[str]:
    report_dir = report_dir or Path(str(root)) / "reports"
    report = {"class_path": "tests.probe.callbacks.ProbeReport", "init_args": {"out_dir": str(report_dir)}}
    case = _case(strategy)
    args = [
        "launch",
        "--nproc-per-node",
        str(case.nproc),
        "-c",
        str(case.probe_yaml),
        "--trainer.strategy",
        case.strategy,
        "--trainer.root_dir",
        str(root),
        "--trainer.callbacks",
        json.dumps([report, *(callbacks or [])]),
        *case.options,
        *overrides,
    ]
    return args + (["--ckpt-path", ckpt] if ckpt else [])


def launch_probe(
    strategy: str | StrategyCase,
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
    return start_python("-m", "unifit", *args, env=env)


def start_python(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `python ARGS` in the repository, in the background (own session; see stop())."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, *args],
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
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the group still holds the pipes
            out, err = "(not read: a process outside its group kept the pipes open)", ""
        raise AssertionError(
            f"{' '.join(map(str, proc.args))} timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}"
        )
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_together(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[subprocess.CompletedProcess]:
    """`python -m unifit ARGS` once per (ARGS, env), all at once (the ranks of one job); every process group is
    killed in the end, whatever happens."""
    procs = []
    try:
        for args, env in commands:
            procs.append(start_unifit(*args, env=env))
        results = []
        for proc in procs:
            out, err = stop(proc, timeout=timeout)  # kills the process's group when it is done or late
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return results
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def at_most(at_once: int, jobs: list[Callable[[], T]]) -> list[T | BaseException]:
    """Each job (a function that starts and ends its own processes) run with at most `at_once` running at any
    time; their results in order, an exception in a job's place. Independent launches of one module overlap so,
    one's waits (rendezvous, a TensorFlow process on one core) being another's work on this 2-core machine."""
    from concurrent.futures import ThreadPoolExecutor

    def outcome(job: Callable[[], T]) -> T | BaseException:
        try:
            return job()
        except Exception as exc:  # the test that reads this job's result fails with it
            return exc

    with ThreadPoolExecutor(max_workers=at_once) as pool:
        return list(pool.map(outcome, jobs))


def selected_params(request: Any, argname: str, test: str | None = None) -> list:
    """The values parameter `argname` takes in the session's selected items of the requesting test file (of its
    function `test` only, if given): a run of one case (-k ddp) starts no other case's launches."""
    values = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.path != request.path or not callspec or argname not in callspec.params:
            continue
        if (test is None or getattr(item, "originalname", None) == test) and callspec.params[argname] not in values:
            values.append(callspec.params[argname])
    return values


def run_at_most(
    at_once: int, commands: list[tuple[list[str], dict[str, str]]], timeout: float
) -> list[subprocess.CompletedProcess]:
    """`python ARGS` once per (ARGS, env), at most `at_once` at a time (see at_most), each killed with its group
    when it ends or at its timeout (a late one's result has exit -9 and says so)."""

    def job(args: list[str], env: dict[str, str]) -> Callable[[], subprocess.CompletedProcess]:
        def run() -> subprocess.CompletedProcess:
            proc = start_python(*args, env=env)
            try:
                out, err = stop(proc, timeout=timeout)
            except AssertionError as exc:
                return subprocess.CompletedProcess(proc.args, -9, "", str(exc))
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

        return run

    results = at_most(at_once, [job(args, env) for args, env in commands])
    return [
        r if isinstance(r, subprocess.CompletedProcess) else subprocess.CompletedProcess(args, -1, "", repr(r))
        for r, (args, _) in zip(results, commands, strict=True)
    ]


def reports(root: Path) -> list[dict]:
    files = sorted((root / "reports").glob("report_*.json"))
    return [json.loads(f.read_text()) for f in files]


def metrics_lines(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines() if line]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def lightning_trainer(**options: Any) -> Any:
    """Lightning's own Trainer, quiet, on one CPU process: the reference unifit's runs are compared with."""
    import lightning as L

    quiet = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**quiet, **options})
