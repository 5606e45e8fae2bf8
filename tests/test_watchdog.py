"""The collective watchdog ends a process stuck in a guarded call, and only then."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.launch

SCRIPT = textwrap.dedent("""
    import sys, time
    from unifit.strategies.watchdog import CollectiveWatchdog
    dog = CollectiveWatchdog(timeout_s=0.5, prefix="unifit: error (rank 1): ")
    with dog.guard("quick all_reduce"):
        time.sleep(0.1)
    with dog.guard("outer step"):
        with dog.guard("inner"):  # the outermost guard times the whole wait
            time.sleep(0.1)
    time.sleep(1.0)  # unguarded time never counts
    print("survived", flush=True)
    with dog.guard(sys.argv[1]):
        time.sleep(float(sys.argv[2]))
    print("finished", flush=True)
""")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seconds, stuck", [(3.0, True), (0.1, False)])
def test_watchdog_ends_only_a_stuck_process(seconds, stuck):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, "barrier 'x' on rank 1", str(seconds)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert "survived" in result.stdout
    if stuck:
        assert result.returncode == 1 and "finished" not in result.stdout
        assert result.stderr.strip() == (
            "unifit: error (rank 1): barrier 'x' on rank 1 did not finish within trainer.collective_timeout_s=0.5s; "
            "another rank failed, or did not join it (every rank must call the same collectives, e.g. do not call "
            "save_checkpoint inside 'if rank == 0')"
        )
    else:
        assert result.returncode == 0 and "finished" in result.stdout, result.stderr
