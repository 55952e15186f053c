"""Two processes (torch.multiprocessing): one stage, two data-parallel replicas; replica 1's
``loss_fn`` raises at its second minibatch and its process stays up (a training loop that
catches the error to log it).

Usage: ``python dist_replica_timeout_worker.py OUTDIR PORT``. Both ranks pass ``timeout_s=2``
and a process group timeout of 120 s. Rank 0 writes what it raised to ``OUTDIR/rank0.txt`` and
then lets rank 1 end (an event, not a time).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline_support.models import make_batches, sgd, small_cnn
from pipeline_support.spawned_ranks import end_after_rank0, join_gloo, spawn_two_ranks


def run(rank: int, out: Path, port: int, rank0_done: Any) -> None:
    from echopipe.pipeline import DistributedStalePipeline

    join_gloo(rank, port, timeout_s=120)
    calls = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise ValueError("replica 1's loss failed")
        return torch.nn.functional.cross_entropy(output, target)

    pipe = DistributedStalePipeline(
        small_cnn(0), balance=[8], optimizer=sgd, loss_fn=loss_fn, timeout_s=2
    )
    try:
        for x, y in make_batches(4):
            pipe.train_step(x[3 * rank : 3 * rank + 3], y[3 * rank : 3 * rank + 3])
        pipe.drain()
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    end_after_rank0(rank, out, outcome, rank0_done, guard_s=300)


def main() -> None:
    spawn_two_ranks(run, with_event=True)


if __name__ == "__main__":
    main()
