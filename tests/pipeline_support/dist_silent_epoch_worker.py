"""Two processes (torch.multiprocessing): rank 1 builds its stage but never calls
``run_epoch``, and its process stays up; rank 0 starts an epoch with ``timeout_s=2``.

Usage: ``python dist_silent_epoch_worker.py OUTDIR PORT``. Rank 0 writes what it raised to
``OUTDIR/rank0.txt`` and then lets rank 1 end (an event, not a time).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline_support.models import make_batches, sgd, small_cnn
from pipeline_support.spawned_ranks import join_gloo, spawn_two_ranks


def run(rank: int, out: Path, port: int, rank0_done: Any) -> None:
    from echopipe.pipeline import DistributedStalePipeline

    join_gloo(rank, port, timeout_s=120)
    pipe = DistributedStalePipeline(
        small_cnn(0), balance=[4, 4], optimizer=sgd,
        loss_fn=torch.nn.functional.cross_entropy, timeout_s=2,
    )  # fmt: skip
    if rank == 0:
        try:
            pipe.run_epoch(make_batches(3))
            outcome = "no error"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        (out / "rank0.txt").write_text(outcome + "\n")
        rank0_done.set()
    else:
        rank0_done.wait(timeout=60)  # a guard against a hang, not a bound on speed
    os._exit(0)  # the process group cannot shut down cleanly after a timed-out collective


def main() -> None:
    spawn_two_ranks(run, with_event=True)


if __name__ == "__main__":
    main()
