"""The suite's own timeouts (tests/conftest.py): a test past its limit fails alone, the run goes on.

pytest-timeout's SIGALRM raised wherever the main thread was; landing in pytest's making of a failure's
report (a test that failed near its limit, with a long output to format on a loaded machine) it ended
the whole run: INTERNALERROR, exit 3, every later test lost."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.launch

SLOW_REPORT = """
import time

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    if call.excinfo is not None:
        time.sleep(2)  # formatting a long failure on a loaded machine
    return (yield)
"""

TESTS = """
import time

import pytest


@pytest.mark.timeout(2)
def test_fails_near_its_limit():
    time.sleep(1.5)
    assert False, "its own limit"


@pytest.mark.timeout(2)
def test_sleeps_past_its_limit():
    time.sleep(5)


@pytest.mark.timeout(2)
def test_hangs_in_teardown(request):
    request.addfinalizer(lambda: time.sleep(5))


def test_after_them():
    pass
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ours", [True, False], ids=["the-suites-timer", "pytest-timeouts-own"])
def test_a_timeout_fails_its_test_alone(tmp_path, ours):
    conftest = SLOW_REPORT
    if ours:
        conftest = f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom tests.conftest import *  # noqa\n" + conftest
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_limits.py").write_text(TESTS)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout_func_only=false",
            "test_limits.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
        env={"PATH": "/usr/bin:/bin", "UNIFIT_TEST_TIMEOUT_SCALE": "1"},
    )
    if not ours:  # what the suite had: the first slow report ends the run
        assert result.returncode == 3 and "INTERNALERROR" in result.stdout + result.stderr, result.stdout
        return
    assert result.returncode == 1, result.stdout + result.stderr
    assert "INTERNALERROR" not in result.stdout + result.stderr
    assert "2 failed, 2 passed, 1 error" in result.stdout, result.stdout
    assert "test_sleeps_past_its_limit - Failed: Timeout (>2.0s)" in result.stdout
    assert "ERROR test_limits.py::test_hangs_in_teardown - Failed: Timeout (>2.0s)" in result.stdout
