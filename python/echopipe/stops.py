"""How the command line ends on Ctrl-C and SIGTERM: one line and status 130 or 143.

SIGTERM (torchrun and job schedulers stop a run with it) is raised as :class:`Terminated`, a
KeyboardInterrupt, so that both stops take the same path through the trainer's shutdown.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["Terminated", "on_sigterm", "quiet_teardown", "terminated"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is."""


def on_sigterm(signum: int, frame: object) -> None:
    """The SIGTERM handler while a command runs."""
    raise Terminated


def terminated(exc: BaseException) -> bool:
    """Whether the stop ``exc`` (or the Interrupted the trainer raised from it) was a SIGTERM."""
    return any(isinstance(e, Terminated) for e in (exc, exc.__context__, exc.__cause__))


def quiet_teardown() -> None:
    """Interpreter exit after the command (DALI's and torch's exit hooks) takes a second or
    two: Ctrl-C or SIGTERM then ends the process at once (130, 143), not with a traceback from
    an exit hook or the signal's default death."""
    sys.stdout.flush()
    sys.stderr.flush()
    for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        signal.signal(sig, lambda number, frame, status=status: os._exit(status))
