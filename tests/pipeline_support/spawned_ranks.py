"""What the two-process pipeline workers (started by a test as ``python WORKER OUTDIR PORT``)
share: two spawned ranks, each running ``run(rank, out, port[, event])``. The event, when asked
for, lets one rank tell the other it has written its outcome (an event, not a time)."""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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


def join_gloo(rank: int, port: int, timeout_s: float | None = None) -> None:
    """One torch thread (two ranks share the 2 cores), then this rank's place in the two-rank
    gloo group on ``port`` (``timeout_s``: the group's own timeout, torch's default if None)."""
    torch.set_num_threads(1)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, **timeout
    )


def end_after_rank0(rank: int, out: Path, outcome: str, rank0_done: Any, guard_s: float) -> None:
    """Rank 0 writes ``outcome`` to ``OUTDIR/rank0.txt`` and lets rank 1 go; rank 1, which rank
    0's failure may have left waiting, ends once it has (``guard_s`` only guards against a hang,
    it bounds no speed). Both leave with ``os._exit``: a group whose collective timed out or
    failed cannot shut down cleanly."""
    if rank == 0:
        (out / "rank0.txt").write_text(outcome + "\n")
        rank0_done.set()
    else:
        rank0_done.wait(timeout=guard_s)
    os._exit(0)
