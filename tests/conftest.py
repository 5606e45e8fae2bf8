"""Shared fixtures: a real S3 endpoint over HTTP on 127.0.0.1 (moto's server mode), and `unifit` run in
this process (cli)."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
import uuid

import pytest

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "unifit-test",
    "AWS_SECRET_ACCESS_KEY": "unifit-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Endpoint:
    """A moto S3 server that tests can stop and start again on the same port (state is kept)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server_cls = ThreadedMotoServer
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL_S3": self.url}

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server = self._server_cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(
            key=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=self.url,
        )


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """reference_run(case) -> the root of one uninterrupted 3-epoch probe run of that strategy row.

    Run once per session (once for all pytest-xdist workers) and shared, read-only, by the suites that compare
    against it (conformance checks, exact resume after preemption or a restart): each launch costs seconds,
    TensorFlow's ~10 s.
    """
    from filelock import FileLock

    from tests.helpers import _case, assert_ok, at_most, launch_probe

    roots = {}
    # on pytest-xdist workers, one directory for all of them: a run one worker made, the others read
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared

    def launched(case):
        root = shared / f"reference-{case.id}"
        with FileLock(f"{root}.lock"):
            if not (root / ".made").exists():
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir()
                assert_ok(launch_probe(case, root))
                (root / ".made").touch()
        roots[case.id] = root
        return root

    def run(case):
        case = _case(case)
        return roots[case.id] if case.id in roots else launched(case)

    def prefetch(cases) -> None:
        """The runs of `cases` not made yet, two at a time (one's start-up waits are the other's work); a failed
        one is tried again, and fails, where a test asks for it."""
        missing = {c.id: c for c in map(_case, cases) if c.id not in roots}
        at_most(2, [functools.partial(launched, c) for c in missing.values()])

    run.prefetch = prefetch
    return run


# The files that take longest, longest first (the "slowest files" section of a whole run, 2 cores): on several
# pytest-xdist workers (scripts/run_tests.sh) each takes whole files in this order, so the longest start first and
# the workers finish together instead of one running test_model_parallel.py alone at the end.
LONGEST_FIRST = (
    "test_model_parallel.py",
    "test_multihost.py",
    "test_ray.py",
    "test_soak.py",
    "test_zoo.py",
    "test_long_jobs.py",
    "test_parameter_server.py",
    "test_s3.py",
    "test_migrating.py",
    "test_sagemaker.py",
    "test_keras_zoo.py",
    "test_fsdp.py",
    "test_evaluation.py",
    "test_precision.py",
    "test_distributed_failures.py",
    "test_precision_keras.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: every worker sorts alike
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "PET_NPROC_PER_NODE",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "KUBEFLOW_TRAINER_STATUS_URL",
    "UNIFIT_RAY_TRAIN",
    "KUBERNETES_SERVICE_HOST",
)


@pytest.fixture
def clean_environment(monkeypatch):
    """No launcher or cluster variable inherited from whatever runs the tests."""
    for name in [*LAUNCHER_VARIABLES, *(n for n in os.environ if n.startswith(("SLURM_", "PET_")))]:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def s3_endpoint():
    os.environ.update(FAKE_CREDENTIALS)
    endpoint = S3Endpoint()
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint.url
    yield endpoint
    endpoint.stop()


@pytest.fixture
def bucket(s3_endpoint) -> str:
    """A fresh bucket name, created on the endpoint."""
    name = f"unifit-{uuid.uuid4().hex[:10]}"
    s3_endpoint.fs().mkdir(name)
    return name


@pytest.fixture(autouse=True)
def _unifit_logger_put_back():
    """main() gives the 'unifit' logger a handler on the sys.stderr of that moment (in a test: its
    capture, closed when the test ends) and stops its propagation. Put back after every test that
    called main() in this process (cli, test_plot, ...): otherwise each later unifit message fails
    with '--- Logging error ---' and a traceback on that test's stderr, and skips the root logger."""
    logger = logging.getLogger("unifit")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.propagate = propagate
    logger.setLevel(level)  # and so clears the loggers' cached levels


@pytest.fixture
def cli(capsys, monkeypatch):
    """`unifit ARGS` in this process: cli(*ARGS, env=...) calls unifit.cli.main.main(ARGS) and returns
    what helpers.run_unifit returns for a process (a CompletedProcess: exit code, stdout, stderr), in
    milliseconds instead of an interpreter start. For what main() answers before any process is
    started (bad input: one line, exit 2); what needs a real process (ranks, signals, a fresh
    interpreter) stays with run_unifit.

    Each call runs as in its own process, leaving nothing behind: the working directory is the
    repository (as for run_unifit), `env` is set for that call only, and what main() changes for the
    life of a process (the 'unifit' logger's handler on the stderr of that moment, os.environ,
    sys.path, the seeds, SIGTERM/SIGINT handlers) is put back after it. main() ends a launched rank
    with os._exit(): here that fails the test instead of ending pytest.
    """
    import random
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO
    from unifit.cli.main import main

    logger = logging.getLogger("unifit")
    pytest_pid = os.getpid()
    real_exit = os._exit

    def no_exit(code: int) -> None:
        if os.getpid() != pytest_pid:  # a forked child ends as it would
            real_exit(code)
        raise AssertionError(f"main() ended the process with os._exit({code}) (a launched rank): use run_unifit")

    monkeypatch.setattr(os, "_exit", no_exit)

    def run(*args: str, env: dict[str, str] | None = None, timeout: float | None = None):
        """timeout: accepted for run_unifit's signature; the test's own timeout applies."""
        saved_logger = (list(logger.handlers), logger.level, logger.propagate)
        saved_environ, saved_path, saved_cwd = dict(os.environ), list(sys.path), os.getcwd()
        saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        saved_random = random.getstate()
        torch = sys.modules.get("torch")
        saved_torch = torch.random.get_rng_state() if torch is not None else None
        capsys.readouterr()  # what the test printed before is not this command's output
        os.environ.update(env or {})
        os.chdir(REPO)
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        finally:
            out, err = capsys.readouterr()
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_environ)
            sys.path[:] = saved_path
            logger.handlers[:], logger.propagate = saved_logger[0], saved_logger[2]
            logger.setLevel(saved_logger[1])  # and so clears the loggers' cached levels
            for sig, handler in saved_signals.items():
                signal.signal(sig, handler)
            random.setstate(saved_random)
            if saved_torch is not None:
                torch.random.set_rng_state(saved_torch)
        return subprocess.CompletedProcess(["unifit", *args], code, out, err)

    return run


_seconds_per_file: dict[str, float] = {}
_idle_seconds: list[tuple[float, float, float, str]] = []  # (idle, wall, cpu, test): where the machine waited


def _timed(item, phase: str):
    """A phase's wall time and CPU time (this process's and every child's it reaped: launched ranks too), kept in
    the test's user_properties: they travel with its reports to the process that prints the summary (pytest-xdist's
    controller, when the suite runs on several workers)."""
    before = os.times()
    try:
        return (yield from _in_phase(item))
    finally:
        after = os.times()
        wall, cpu = after.elapsed - before.elapsed, sum(after[i] - before[i] for i in range(4))
        item.user_properties.append(("unifit_seconds", (phase, wall, cpu)))


_passed: set[str] = set()
_refused_in_call: set[str] = set()  # tests whose setup or call already failed with the launch guard's line


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and report.passed:
        _passed.add(report.nodeid)
    if report.when in ("setup", "call") and report.failed and "starts a process: mark it" in str(report.longrepr):
        _refused_in_call.add(report.nodeid)
    _seconds_per_file[report.nodeid.split("::", 1)[0]] = (
        _seconds_per_file.get(report.nodeid.split("::", 1)[0], 0.0) + report.duration
    )
    for name, value in report.user_properties:
        if name == "unifit_seconds" and value[0] == report.when:
            _, wall, cpu = value
            label = report.nodeid if report.when == "call" else f"{report.nodeid} ({report.when})"
            _idle_seconds.append((wall - cpu / (os.cpu_count() or 1), wall, cpu, label))
        if name == "unifit_launch_started" and report.when == "teardown":
            _launch_marked_started[report.nodeid] = value


def pytest_terminal_summary(terminalreporter) -> None:
    """The files that cost the most (setup, call and teardown together): where the CI budget goes; the tests
    that waited most; and the tests marked `launch` that passed without starting a process (nor using a
    fixture that did)."""
    idle = sorted(n for n, started in _launch_marked_started.items() if not started and n in _passed)
    if idle:
        terminalreporter.section("marked launch, started nothing (the in-process tier could run them)")
        for nodeid in idle:
            terminalreporter.write_line(nodeid)
    if len(_seconds_per_file) < 2:
        return
    terminalreporter.section("slowest files")
    for path, seconds in sorted(_seconds_per_file.items(), key=lambda item: -item[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
    # wall time the CPUs were not busy for the test (waits: rendezvous, timeouts, sleeps): what a cut there saves
    terminalreporter.section("most idle tests (wall - cpu / cores)")
    for idle, wall, cpu, nodeid in sorted(_idle_seconds, reverse=True)[:15]:
        terminalreporter.write_line(f"{idle:7.1f}s idle {wall:7.1f}s wall {cpu:7.1f}s cpu  {nodeid}")
    # every test's figures, for a look beyond the top 15: .pytest_cache/v/unifit/test_times
    cache = getattr(terminalreporter.config, "cache", None)  # absent under -p no:cacheprovider
    if cache is not None:
        cache.set("unifit/test_times", [{"test": n, "wall": w, "cpu": c, "idle": i} for i, w, c, n in _idle_seconds])


# --- the tiers: `launch` must be true ------------------------------------------------------------------

_LAUNCHER = re.compile(
    r"^(python[0-9.]*|pypy[0-9.]*|unifit|torchrun|horovodrun|mpirun|mpiexec|orterun|prterun|mkdocs)$"
)
# helper processes a library starts for itself, inside a test that is about something else
_LIBRARY_HELPERS = ("torch._inductor", "/torchinductor_")  # its compile workers, its ISA check (python -c)
_launch_state: dict = {"item": None, "refuse": False, "seen": [], "starts": 0}
_launch_marked_started: dict[str, bool] = {}
_launching_fixtures: set[str] = {"reference_run"}  # fixtures that start one (reference_run: at its first call)


def _launcher_in(argv) -> str | None:
    """The command line, when it starts a Python interpreter or a launcher (python, unifit, torchrun,
    horovodrun, mpirun, mkdocs, a console script): its program, or one its arguments name as a word of
    its own (ip netns exec ..., env ..., tmux ... bash -c '...'); flags (-I/usr/include/python3.11 of a
    compiler) are not programs."""
    words = [os.fsdecode(a) for a in (argv or ())]
    if any(helper in word for word in words for helper in _LIBRARY_HELPERS):
        return None
    tokens = words[:1] + [t.strip("'\"") for w in words[1:] for t in w.split()]
    for token in tokens:
        if token.startswith("-"):
            continue
        if token == sys.executable or _LAUNCHER.match(os.path.basename(token)) or _python_script(token):
            return " ".join(" ".join(words).split())[:160]  # one line
    return None


def _python_script(token: str) -> bool:
    """A console script (mlflow, lint-imports, sagemaker's train ...): an executable starting '#!...python'."""
    if not (token.startswith("/") and os.path.isfile(token) and os.access(token, os.X_OK)):
        return False
    try:
        with open(token, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def _check_start(argv) -> None:
    command = _launcher_in(argv)
    item = _launch_state["item"]
    if command is None or item is None:
        return
    _launch_marked_started[item.nodeid] = True
    _launch_state["starts"] += 1
    if _launch_state["refuse"]:
        message = f"starts a process: mark it @pytest.mark.launch ({command})"
        _launch_state["seen"].append(message)
        pytest.fail(message, pytrace=False)


def _install_launch_guard() -> None:
    """Every way this process starts a program goes through one of these three: subprocess's fork_exec
    (Popen), _posixsubprocess.fork_exec (multiprocessing's spawn and forkserver) and os.posix_spawn."""
    import _posixsubprocess
    import subprocess

    def guarded(real, argv_at: int):
        def start(*args, **kwargs):
            _check_start(args[argv_at])
            return real(*args, **kwargs)

        start.__wrapped__ = real
        return start

    subprocess._fork_exec = guarded(subprocess._fork_exec, 0)  # (args, executable_list, ...)
    _posixsubprocess.fork_exec = guarded(_posixsubprocess.fork_exec, 0)
    os.posix_spawn = guarded(os.posix_spawn, 1)  # (path, argv, env, ...)
    if hasattr(os, "posix_spawnp"):
        os.posix_spawnp = guarded(os.posix_spawnp, 1)


def pytest_configure(config) -> None:
    _install_launch_guard()


def _launch_guard_from(item) -> None:
    """From before the first fixture of the test (a module's or session's too) to after its last."""
    launch = item.get_closest_marker("launch") is not None
    _launch_state.update(item=item, refuse=not launch, seen=[])
    if launch:
        _launch_marked_started.setdefault(item.nodeid, False)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = _launch_state["starts"]
    try:
        return (yield)
    finally:
        if _launch_state["starts"] != before:
            _launching_fixtures.add(fixturedef.argname)


def _launch_guard_to(item) -> None:
    if item.nodeid in _launch_marked_started and _launching_fixtures.intersection(getattr(item, "fixturenames", ())):
        _launch_marked_started[item.nodeid] = True
    if item.nodeid in _launch_marked_started:  # to the summary, in this process or pytest-xdist's controller
        item.user_properties.append(("unifit_launch_started", _launch_marked_started[item.nodeid]))
    _launch_state.update(item=None, refuse=False)


@pytest.fixture(autouse=True)
def _launch_marker_is_true(request):
    """A test not marked `launch` fails, in one line, the moment it starts a Python interpreter or a
    launcher: `python`, `unifit`, `torchrun`, `horovodrun`, `mpirun`/`mpiexec`, `mkdocs` (run directly
    or through `ip netns exec`, `bash -c` ...; also multiprocessing's spawn, a fresh interpreter). So
    `pytest -m "not launch"` is truly the in-process tier, and cannot drift.

    What does not count: programs that are not an interpreter or launcher (a compiler torch.compile
    calls, `git`, `ip`, `uname`), fork() without exec (a DataLoader's workers, multiprocessing's fork:
    no interpreter start, no imports), threads (moto's S3 server runs in a thread), and helper
    processes a library starts for itself (torch.compile's inductor: its compile workers, and the
    `python -c` that checks a compiled vector-ISA library loads: _LIBRARY_HELPERS).
    The guard is installed once (pytest_configure) and checked from the test's setup (so a module- or
    session-scoped fixture it sets up is covered) to its teardown; a start refused in another thread,
    or caught by the code under test, still fails the test here, at its teardown. Tests marked
    `launch` that never start one are listed at the end of the run ("marked launch, started nothing").
    """
    yield
    seen = _launch_state["seen"]
    if seen and request.node.nodeid not in _refused_in_call:  # caught by the code, or in another thread
        pytest.fail(seen[0], pytrace=False)


# --- timeouts: a test's own limit fails that test alone -----------------------------------------------
#
# The limits, innermost first: every wait on a process a test started has its own timeout
# (helpers.stop: the whole process group is killed, the test fails naming the command, with its
# output); pytest-timeout's limit (a test's @pytest.mark.timeout, else `timeout` in pyproject) is a
# backstop above them (UNIFIT_TEST_TIMEOUT_SCALE=2 doubles every backstop, for a machine slower still).
#
# The backstop is pytest-timeout's `signal` method, with its timer run here (its two hooks below):
# pytest-timeout arms one SIGALRM for the whole test protocol (setup, call, teardown *and* the making
# and logging of their reports, as timeout_func_only is false), and its handler raises Failed wherever
# the main thread is. A test that failed near its limit (a launch's own timeout, with a long output to
# format) had the alarm land in pytest_runtest_makereport, outside any test phase: pytest stopped with
# INTERNALERROR, exit 3, and every later test was lost. Here the alarm raises only inside a phase
# (setup, call or teardown: pytest records it as that phase's failure, the run goes on); landing
# anywhere else (pytest making or printing a report, between phases) it waits and looks again every
# second. The `thread` method is no answer: it ends the whole pytest process (os._exit).

TIMEOUT_SCALE = float(os.environ.get("UNIFIT_TEST_TIMEOUT_SCALE", "1"))
_phase: dict = {"item": None}
PHASE_WAIT_LIMIT_S = 300  # pytest itself stuck that long outside any phase: a stack dump, then os._exit


def _in_phase(item):
    """The test's phase runs with the alarm allowed to fail it (see the timer below)."""
    _phase["item"] = item
    try:
        return (yield)
    finally:
        _phase["item"] = None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    _launch_guard_from(item)
    return (yield from _timed(item, "setup"))  # a module's fixtures (its shared launches) count in its first test


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item):
    return (yield from _timed(item, "call"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield from _in_phase(item))
    finally:
        _launch_guard_to(item)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    import signal
    import threading
    import time

    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own
    import pytest_timeout

    limit = settings.timeout * TIMEOUT_SCALE
    settings = settings._replace(timeout=limit)
    deadline = time.monotonic() + limit

    def handler(signum, frame):
        __tracebackhide__ = True
        if _phase["item"] is item:
            pytest_timeout.timeout_sigalrm(item, settings)  # dumps the stacks, raises Failed: Timeout
            return  # a debugger is attached
        if time.monotonic() - deadline > PHASE_WAIT_LIMIT_S:
            pytest_timeout.timeout_timer(item, settings)  # dumps the stacks, os._exit(1)
        signal.setitimer(signal.ITIMER_REAL, 1.0)  # not inside a phase of this test: look again soon

    previous = signal.signal(signal.SIGALRM, handler)

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)

    item.cancel_timeout = cancel
    signal.setitimer(signal.ITIMER_REAL, limit)
    return True
