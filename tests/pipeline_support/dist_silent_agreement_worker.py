"""Two processes (torch.multiprocessing): a two-stage pipeline trains and drains, then rank 0
calls a collective method that the ranks agree in (``step_schedulers`` with a metric, or
``save_checkpoint``) with ``timeout_s=2``, while rank 1 never calls it: it blocks on an event,
or its process exits.

Usage: ``python dist_silent_agreement_worker.py OUTDIR PORT CALL FAULT`` (CALL:
``step_schedulers`` or ``save_checkpoint``; FAULT: ``blocks`` or ``exits``). Rank 0 writes the
seconds it waited and what it raised to ``OUTDIR/rank0.txt``, then lets a blocked rank 1 end
(an event, not a time). The process group's own timeout is 60 s, so a wait it alone bounds
shows as Gloo's error after that long, not as a hang.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline_support.models import make_batches, plateau, sgd, small_cnn
from pipeline_support.spawned_ranks import join_gloo, spawn_two_ranks


def run(rank: int, out: Path, port: int, rank0_done: Any, *, call: str, fault: str) -> None:
    from echopipe.pipeline import DistributedStalePipeline

    join_gloo(rank, port, timeout_s=60)
    pipe = DistributedStalePipeline(
        small_cnn(0), balance=[4, 4], optimizer=sgd, scheduler=plateau,
        loss_fn=torch.nn.functional.cross_entropy, timeout_s=2,
    )  # fmt: skip
    for x, y in make_batches(3):
        pipe.train_step(x, y)
    pipe.drain()
    if rank == 1:
        if fault == "exits":
            os._exit(0)
        rank0_done.wait(timeout=120)  # a guard against a hang, not a bound on speed
        os._exit(0)
    start = time.monotonic()
    try:
        if call == "step_schedulers":
            pipe.step_schedulers(0.5)  # a rank of another stage may pass the metric too
        else:
            pipe.save_checkpoint(out / "ck")
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    (out / "rank0.txt").write_text(f"{time.monotonic() - start}\n{outcome}\n")
    rank0_done.set()
    os._exit(0)  # the process group cannot shut down cleanly after a failed collective


def main() -> None:
    call, fault = sys.argv[3], sys.argv[4]
    spawn_two_ranks(functools.partial(run, call=call, fault=fault), with_event=True)


if __name__ == "__main__":
    main()
