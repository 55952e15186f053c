"""Two processes (torch.multiprocessing): one stage, two data-parallel replicas; the checkpoint
goes to a folder that does not exist, so replica 0's write fails and replica 1 writes nothing.

Usage: ``python dist_save_fails_worker.py OUTDIR PORT``. Each rank writes what the failed save
raised, and whether a save to ``OUTDIR`` then works, to ``OUTDIR/rank<r>.txt``. Rank 0 ends
once rank 1 has written its outcome (an event, not a time).
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


def run(rank: int, out: Path, port: int, rank1_done: Any) -> None:
    from echopipe.pipeline import DistributedStalePipeline

    join_gloo(rank, port, timeout_s=120)
    pipe = DistributedStalePipeline(
        small_cnn(0), balance=[8], optimizer=sgd, loss_fn=torch.nn.functional.cross_entropy
    )
    for x, y in make_batches(2):
        pipe.train_step(x[3 * rank : 3 * rank + 3], y[3 * rank : 3 * rank + 3])
    lines = []
    try:
        pipe.save_checkpoint(out / "missing" / "ck")
        lines.append("no error")
    except Exception as exc:
        lines.append(f"{type(exc).__name__}: {exc}")
    try:
        pipe.save_checkpoint(out / "ck")
        lines.append("saved")
    except Exception as exc:
        lines.append(f"{type(exc).__name__}: {exc}")
    (out / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")
    if rank == 1:
        rank1_done.set()
    else:
        rank1_done.wait(timeout=60)  # a guard against a hang, not a bound on speed
    os._exit(0)  # a rank left waiting by the other cannot shut its process group down


def main() -> None:
    spawn_two_ranks(run, with_event=True)


if __name__ == "__main__":
    main()
