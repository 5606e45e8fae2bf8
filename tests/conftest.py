"""Shared fixtures: a real S3 endpoint over HTTP on 127.0.0.1 (moto's server mode), and `unifit` run in
this process (cli)."""

from __future__ import annotations

import logging
import os
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

    Run once per session and shared, read-only, by the suites that compare against it (conformance
    checks, exact resume after preemption or a restart): each launch costs seconds, TensorFlow's ~10 s.
    """
    from tests.helpers import _case, assert_ok, launch_probe

    roots = {}

    def run(case):
        case = _case(case)
        if case.id not in roots:
            root = tmp_path_factory.mktemp(f"reference-{case.id}")
            assert_ok(launch_probe(case, root))
            roots[case.id] = root
        return roots[case.id]

    return run


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


def pytest_runtest_logreport(report) -> None:
    _seconds_per_file[report.nodeid.split("::", 1)[0]] = (
        _seconds_per_file.get(report.nodeid.split("::", 1)[0], 0.0) + report.duration
    )


def pytest_terminal_summary(terminalreporter) -> None:
    """The files that cost the most (setup, call and teardown together): where the CI budget goes."""
    if len(_seconds_per_file) < 2:
        return
    terminalreporter.section("slowest files")
    for path, seconds in sorted(_seconds_per_file.items(), key=lambda item: -item[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
