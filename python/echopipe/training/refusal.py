"""A resume refused under torchrun stays refused over the job's restarts.

torchrun restarts a failed worker group up to ``--max-restarts`` times whatever made it fail;
no exit status of a worker tells it not to. A resume refused for its checkpoints (another world
size, a damaged or crafted file, an option that may not change) is not transient: every
attempt would read the checkpoints again and print the same refusal on every rank. So rank 0
records the refusal in the job's store, which torchrun's agent keeps over restarts (the
process groups use it under a prefix of each attempt:
:func:`echopipe.pipeline.dist_setup.attempt_store`), and a restarted attempt that finds it
ends at once, before it joins the process group or reads a file: rank 0 says the same line,
and the other ranks wait, silent, for torchrun to stop them (so that rank 0 is not stopped
before it said it).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from typing import Any

from .options import TrainError

__all__ = ["RecordedRefusal", "end_if_refused", "record_refusal"]

KEY = "echopipe/refused"  # not under an attempt's prefix: every attempt of the job sees it
# How long the other ranks of a refused attempt wait for torchrun to stop them.
QUIET_WAIT_S = 60.0


class RecordedRefusal(TrainError):
    """A restarted attempt of a torchrun job whose resume an earlier attempt refused.

    ``exit_code`` is the refusal's own; ``quiet`` is set on the ranks that leave the saying to
    rank 0."""

    def __init__(self, line: str, exit_code: int, quiet: bool) -> None:
        super().__init__(line)
        self.exit_code = exit_code
        self.quiet = quiet


def _job_store(timeout_s: float) -> Any | None:
    """The torchrun agent's store of this job, or None outside such a job or when it cannot
    be reached (the record is a shortcut: joining the job then says what is wrong)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
    except (KeyError, ValueError, RuntimeError):  # (DistNetworkError, DistStoreError)
        return None


def record_refusal(exc: BaseException, timeout_s: float) -> None:
    """Keep rank 0's refusal of the resume (``exc``, with its exit status) for the job's later
    attempts; nothing outside a torchrun job with an agent store."""
    store = _job_store(min(timeout_s, 30.0))
    if store is None:
        return
    status = exc.exit_code if isinstance(exc, TrainError) else 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    with contextlib.suppress(RuntimeError):  # (the store went: the refusal is said anyway)
        store.set(KEY, json.dumps({"line": str(exc), "status": status, "attempt": attempt}))


def end_if_refused(timeout_s: float) -> None:
    """Raise :class:`RecordedRefusal` when an earlier attempt of this torchrun job refused its
    resume: on rank 0 at once, on the others after ``QUIET_WAIT_S`` unless torchrun stops them
    first (its SIGTERM ends them silently: only rank 0 prints an interrupt)."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return  # (a new job's store holds no refusal)
    store = _job_store(min(timeout_s, 30.0))
    try:
        found = json.loads(store.get(KEY)) if store is not None and store.check([KEY]) else None
        line, status, attempt = str(found["line"]), int(found["status"]), found["attempt"]
    except (RuntimeError, ValueError, KeyError, TypeError):  # none, or not echopipe's record
        return
    line = f"{line} (refused by attempt {attempt} of this torchrun job; a restart cannot change it)"
    quiet = os.environ.get("RANK", "0") != "0"
    if quiet:
        time.sleep(min(timeout_s, QUIET_WAIT_S))
    raise RecordedRefusal(line, status, quiet)
