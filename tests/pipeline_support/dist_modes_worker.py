"""Two processes (torch.multiprocessing): a two-stage pipeline with ``recompute=True`` (stage 0,
with its batch norms, recomputes its forward at its backward) trains 3 minibatches; then each
rank switches its model to eval mode, as torchgpipe's evaluation loop does right after an
epoch, and drains.

Usage: ``python dist_modes_worker.py OUTDIR PORT``. Rank 0 writes what the drain raised to
``OUTDIR/rank0.txt``; rank 1, which may be left waiting for rank 0, ends when rank 0 has
written (an event, not a time).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline_support.models import make_batches, sgd, small_cnn
from pipeline_support.spawned_ranks import spawn_two_ranks


def run(rank: int, out: Path, port: int, rank0_done: Any) -> None:
    from echopipe.pipeline import DistributedStalePipeline

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
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
    if rank == 0:
        (out / "rank0.txt").write_text(outcome + "\n")
        rank0_done.set()
    else:
        rank0_done.wait(timeout=120)  # a guard against a hang, not a bound on speed
    os._exit(0)  # a rank left waiting by the other cannot shut its process group down


def main() -> None:
    spawn_two_ranks(run, with_event=True)


if __name__ == "__main__":
    main()
