"""What a person sees in a real terminal: `unifit fit` and `unifit launch` (torchrun, horovodrun,
TF_CONFIG workers) run in a detached tmux pane of a fixed size, captured while they train.

On screen there must be at most one progress bar at any time (rank 0's; none from the other
ranks), one at least while an epoch runs, every epoch's summary line kept (not overwritten by a
bar, not sharing its line with anything), and no bar left at the end. Under horovodrun the ranks'
output goes through pipes that horovodrun prefixes (`[0]<stdout>:`), so before `unifit launch`
named its terminal to the ranks (UNIFIT_TTY) no bar was shown there at all.

The launches run side by side (one tmux server per test run, one pane each), so the module costs
about as long as its slowest launch rather than the sum. Skipped when tmux is not installed.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import PROBE_YAML, REPO
from unifit.loop.callback import Callback

WIDTH, HEIGHT = 200, 50
EPOCHS = 2
BAR = re.compile(r"epoch \d+/\d+:\s+\d+%\|")
SUMMARY = re.compile(r"epoch (\d+)/(\d+)  step \d+  ")

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux); terminal checks skipped"
)


class Pace(Callback):
    """Slows every step on every rank (in step), so an epoch lasts long enough to see its bar."""

    def __init__(self, seconds: float = 0.2) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        time.sleep(self.seconds)


def _unifit(*args: str) -> list[str]:
    pace = {"class_path": "tests.test_terminal.Pace", "init_args": {"seconds": 0.25}}
    return [
        sys.executable,
        "-m",
        "unifit",
        *args,
        "--trainer.max_epochs",
        str(EPOCHS),
        "--trainer.batch_size",
        "4",
        "--trainer.progress_bar",
        "true",
        "--trainer.tensorboard.enabled",
        "false",
        "--trainer.checkpoint.enabled",
        "false",
        "--trainer.callbacks",
        json.dumps([pace]),
    ]


def _launch(strategy: str, yaml: Path) -> list[str]:
    return _unifit("launch", "--nproc-per-node", "2", "-c", str(yaml), "--trainer.strategy", strategy)


# name: (command, shell text after it); "| cat" stands for CI, a log, `| tee`: no bar there
SCENARIOS = {
    "fit-single": (_unifit("fit", "-c", str(PROBE_YAML), "--trainer.strategy", "single"), ""),
    "ddp-torchrun": (_launch("ddp", PROBE_YAML), ""),
    "horovod-horovodrun": (_launch("horovod", PROBE_YAML), ""),
    "ddp-piped": (_launch("ddp", PROBE_YAML), "2>&1 | cat"),
}
NEEDS = {"horovod-horovodrun": "horovod.runner"}
TIMEOUT_S = 240


class Panes:
    """One private tmux server (its own socket), one detached pane per scenario, started at once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / f"tmux-{uuid.uuid4().hex[:8]}.sock"  # not in /tmp/tmux-UID: tmux leaves its socket behind
        self.started: dict[str, float] = {}
        self.frames: dict[str, list[list[str]]] = {}
        self.done: dict[str, list[str]] = {}

    def tmux(self, *args: str, check: bool = True) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TMUX"}  # a tmux of our own, even inside one
        return subprocess.run(
            ["tmux", "-S", str(self.socket), "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=20,
            env=env,
        ).stdout

    def start(self, name: str, command: list[str], tail: str = "") -> None:
        root = self.root / name
        env = {
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "TERM": "xterm-256color",
            "COLUMNS": None,
            "LINES": None,
            "UNIFIT_TTY": None,
            "UNIFIT_TTY_HOST": None,
            "UNIFIT_TTY_STDOUT": None,
        }
        exports = " ".join(f"unset {k};" if v is None else f"export {k}={shlex.quote(v)};" for k, v in env.items())
        run = shlex.join([*command, "--trainer.root_dir", str(root)])
        # the pipe's exit status is unifit's, not cat's
        shell = f"cd {shlex.quote(str(REPO))}; set -o pipefail; {exports} {run} {tail}; echo __EXIT=$?__; sleep 600"
        self.tmux("new-session", "-d", "-s", name, "-x", str(WIDTH), "-y", str(HEIGHT), "bash", "-c", shell)
        self.started[name] = time.monotonic()
        self.frames[name] = []

    def capture(self, name: str, history: bool = False) -> list[str]:
        """The screen (or all the pane printed); -J joins lines the terminal wrapped."""
        out = self.tmux("capture-pane", "-p", "-J", *(["-S", "-"] if history else []), "-t", name)
        return [line.rstrip() for line in out.rstrip("\n").split("\n")]

    def poll(self) -> None:
        """One snapshot of every pane still running."""
        for name in self.started:
            if name in self.done:
                continue
            screen = self.capture(name)
            self.frames[name].append(screen)
            if any("__EXIT=" in line for line in screen) or time.monotonic() - self.started[name] > TIMEOUT_S:
                self.done[name] = self.capture(name, history=True)

    def wait(self, name: str) -> tuple[list[list[str]], list[str]]:
        while name not in self.done:
            self.poll()
            time.sleep(0.25)
        return self.frames[name], self.done[name]

    def close(self) -> None:
        self.tmux("kill-server", check=False)  # every pane's processes get SIGHUP
        self.socket.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def panes(request, tmp_path_factory):
    """Every scenario this run selected, started side by side (the slowest one sets the pace)."""
    wanted = [
        item.callspec.params["scenario"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    p = Panes(tmp_path_factory.mktemp("terminal"))
    try:
        for name in dict.fromkeys(wanted):
            if _missing(name) is None:
                p.start(name, *SCENARIOS[name])
        yield p
    finally:
        p.close()


def _missing(name: str) -> str | None:
    import importlib.util

    module = NEEDS.get(name)
    try:
        return None if module is None or importlib.util.find_spec(module) is not None else module
    except ModuleNotFoundError:
        return module


@pytest.mark.launch
@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_one_bar_on_rank_zero_and_every_epoch_line_kept(panes, scenario):
    if (module := _missing(scenario)) is not None:
        pytest.skip(f"{module} is not installed")
    frames, final = panes.wait(scenario)
    shown = "\n".join(final)
    assert any("__EXIT=0__" in line for line in final), f"{scenario} did not end with exit 0:\n{shown}"

    # while training: never two bars on screen, one at least once; a bar alone on its line
    bars = [[line for line in screen if BAR.search(line)] for screen in frames]
    if scenario.endswith("-piped"):
        assert not any(bars), f"{scenario}: a bar, though stderr is a pipe:\n" + "\n".join(frames[-1])
    else:
        assert any(bars), f"{scenario}: no progress bar seen in {len(frames)} captures; the end:\n{shown}"
    several = [screen for screen, b in zip(frames, bars) if len(b) > 1]
    assert not several, f"{scenario}: several bars on one screen:\n" + "\n".join(several[0])
    for line in (line for b in bars for line in b):
        assert BAR.match(line) and line.count("epoch ") == 1, f"{scenario}: bar shares its line: {line!r}"

    # at the end: each epoch's summary once, on a line of its own, the final line, no bar left
    summaries = [line for line in final if SUMMARY.search(line)]
    assert [SUMMARY.match(line).groups() for line in summaries] == [
        (str(e), str(EPOCHS)) for e in range(1, EPOCHS + 1)
    ], shown
    assert all(line.count("epoch ") == 1 and "%|" not in line for line in summaries), shown
    assert sum(line.startswith("final metrics: ") for line in final) == 1, shown
    assert sum(line.startswith("unifit: strategy ") for line in final) == 1, shown
    assert not any(BAR.search(line) for line in final), f"{scenario}: a bar left on screen:\n{shown}"


@pytest.mark.timeout(60)
def test_launchers_name_their_terminal_only_when_stderr_is_one(monkeypatch):
    from unifit.strategies.launchers import base

    monkeypatch.delenv("UNIFIT_TTY", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    stale = {"UNIFIT_TTY": "/dev/pts/99", "UNIFIT_TTY_HOST": "h", "UNIFIT_TTY_STDOUT": "1", "A": "b"}
    # `| tee`, CI, logs: nothing, and nothing stale (TensorFlow's start-up lines quieted, as always)
    assert base.rank_environment(stale) == {"A": "b", "TF_CPP_MIN_LOG_LEVEL": "2"}
    assert base.rank_environment({"UNIFIT_TTY": "0"})["UNIFIT_TTY"] == "0"  # the user's own choice stays
    assert base.rank_environment({"TF_CPP_MIN_LOG_LEVEL": "0"})["TF_CPP_MIN_LOG_LEVEL"] == "0"
    # each rank its share of the host's cores (torchrun would set 1 and print a banner); the user's value stays
    shared = base.rank_environment({}, ranks_per_node=2)["OMP_NUM_THREADS"]
    assert shared == str(base.threads_per_rank(2)) and int(shared) >= 1
    assert base.rank_environment({"OMP_NUM_THREADS": "7"}, ranks_per_node=2)["OMP_NUM_THREADS"] == "7"

    master, slave = os.openpty()
    try:
        with os.fdopen(os.dup(slave), "w") as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            env = base.rank_environment({})
            assert env["UNIFIT_TTY"] == os.ttyname(slave) and "UNIFIT_TTY_STDOUT" not in env
            monkeypatch.setattr(sys, "stdout", tty)
            assert base.rank_environment({})["UNIFIT_TTY_STDOUT"] == "1"
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.timeout(60)
def test_rank_zero_draws_on_the_named_terminal_only_on_its_host(monkeypatch):
    import socket

    from unifit.callbacks import progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a launcher's pipe
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    master, slave = os.openpty()
    try:
        device = os.ttyname(slave)
        monkeypatch.setenv("UNIFIT_TTY", device)
        monkeypatch.setenv("UNIFIT_TTY_HOST", "another-host")
        assert not progress.ProgressBar.wanted(True) and progress.line_stream() is sys.stdout
        monkeypatch.setenv("UNIFIT_TTY_HOST", socket.gethostname())
        assert progress.ProgressBar.wanted(True) and not progress.ProgressBar.wanted(False)
        assert progress.line_stream() is sys.stdout  # the launcher's stdout is not that terminal
        monkeypatch.setenv("UNIFIT_TTY_STDOUT", "1")
        stream = progress.bar_stream()
        assert stream is not None and stream is progress.line_stream() and os.isatty(stream.fileno())
        print("epoch 1/1  step 1  x=1", file=stream, flush=True)
        assert b"epoch 1/1" in os.read(master, 1000)
        monkeypatch.setenv("UNIFIT_TTY", "0")
        assert not progress.ProgressBar.wanted(True)
    finally:
        if (opened := progress._devices.pop(os.ttyname(slave), None)) is not None:
            opened.close()
        os.close(master)
        os.close(slave)
