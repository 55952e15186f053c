"""A per-test timeout for ``bench/gpu/run.sh``'s pytest steps, with no dependency to install.

Loaded with ``-p pytest_step_timeout`` (``bench/gpu`` on ``PYTHONPATH``). For each test:

* after ``ECHOPIPE_TEST_TIMEOUT_S`` seconds (default 60) a ``SIGALRM`` raises
  :class:`TestTimeout` in the test, which then fails like any other and the run goes on, so the
  JUnit XML is still written at the end;
* if the test cannot be interrupted (the main thread is inside a C call, e.g. waiting for a
  hung kernel), ``faulthandler`` dumps every thread's stack ``ECHOPIPE_TEST_HARD_GRACE_S``
  (default 10) seconds later (into the file ``ECHOPIPE_TEST_STACKS``, else stderr) and ends
  the process;
* every test's start and result are appended, one line each, to the file named by
  ``ECHOPIPE_TEST_PROGRESS`` as they happen, so even a process ended that way leaves a record of
  which tests passed and which one hung (``run.sh`` then reruns the rest without it).

Progress lines: ``start<TAB>nodeid`` and ``<when><TAB><outcome><TAB>nodeid<TAB>seconds``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest

# Seconds between the soft timeout and ending the process (a test can set it lower).
HARD_GRACE_S = float(os.environ.get("ECHOPIPE_TEST_HARD_GRACE_S", "10"))


class TestTimeout(Exception):
    """A test ran past its per-test timeout."""

    __test__ = False  # not a test class, despite the name


def _limit_s() -> float:
    raw = os.environ.get("ECHOPIPE_TEST_TIMEOUT_S", "60")
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"ECHOPIPE_TEST_TIMEOUT_S must be seconds, got {raw!r}") from None
    if value <= 0:
        raise pytest.UsageError(f"ECHOPIPE_TEST_TIMEOUT_S must be > 0, got {raw!r}")
    return value


def _progress(line: str) -> None:
    path = os.environ.get("ECHOPIPE_TEST_PROGRESS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def pytest_configure(config: pytest.Config) -> None:
    config._echopipe_timeout_s = _limit_s()  # type: ignore[attr-defined]
    # pytest captures fd 2 while a test runs, and that capture is lost when the process is
    # ended: the stacks go to their own file.
    path = os.environ.get("ECHOPIPE_TEST_STACKS")
    config._echopipe_stacks = open(path, "a") if path else sys.stderr  # type: ignore[attr-defined]  # noqa: SIM115


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    limit = item.config._echopipe_timeout_s  # type: ignore[attr-defined]
    _progress(f"start\t{item.nodeid}")

    def on_alarm(signum: int, frame: Any) -> None:
        raise TestTimeout(f"{item.nodeid} ran past its {limit:g} s per-test timeout")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    stacks = item.config._echopipe_stacks  # type: ignore[attr-defined]
    faulthandler.dump_traceback_later(limit + HARD_GRACE_S, exit=True, file=stacks)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        _progress(f"{report.when}\t{report.outcome}\t{report.nodeid}\t{report.duration:.2f}")
