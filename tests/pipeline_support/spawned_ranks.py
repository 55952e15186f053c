"""What the two-process pipeline workers (started by a test as ``python WORKER OUTDIR PORT``)
share: two spawned ranks, each running ``run(rank, out, port[, event])``. The event, when asked
for, lets one rank tell the other it has written its outcome (an event, not a time)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def spawn_two_ranks(run: Callable[..., Any], with_event: bool = False) -> None:
    """Runs ``run`` on ranks 0 and 1 in spawned processes, with the command line's OUTDIR and
    PORT (and one shared event when ``with_event``), and waits for both."""
    out, port = Path(sys.argv[1]), int(sys.argv[2])
    ctx = mp.get_context("spawn")
    extra = (ctx.Event(),) if with_event else ()
    procs = [ctx.Process(target=run, args=(rank, out, port, *extra)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
