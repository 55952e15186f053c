"""Two processes (torch.multiprocessing): a two-stage pipeline with ``recompute=True`` (stage 0,
with its batch norms, recomputes its forward at its backward) trains 3 minibatches; then each
rank switches its model to eval mode, as torchgpipe's evaluation loop does right after an
epoch, and drains.

Usage: ``python dist_modes_worker.py OUTDIR PORT``. Rank 0 writes what the drain raised to
``OUTDIR/rank0.txt``; rank 1, which may be left waiting for rank 0, ends when rank 0 has
written (an event, not a time).
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

    join_gloo(rank, port, timeout_s=60)
    model = small_cnn(0)
    pipe = DistributedStalePipeline(
        model, balance=[4, 4], optimizer=sgd, loss_fn=torch.nn.functional.cross_entropy,
        recompute=True, timeout_s=10,
    )  # fmt: skip
    outcome = "no error"
    try:
        for x, y in make_batches(3):
            pipe.train_step(x, y)
        model.eval()
        pipe.drain()
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    end_after_rank0(rank, out, outcome, rank0_done, guard_s=120)


def main() -> None:
    spawn_two_ranks(run, with_event=True)


if __name__ == "__main__":
    main()
