"""Two processes (torch.multiprocessing): ``run_epoch`` given a loader without ``len()`` on
stage 0 (a generator), then the same epoch with ``steps=``, as a caller who catches the
``TypeError`` would retry it.

Usage: ``python dist_unsized_loader_worker.py OUTDIR PORT``. Each rank writes what the first
call raised and what the retry returned to ``OUTDIR/rank<r>.txt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline_support.models import make_batches, sgd, small_cnn
from pipeline_support.spawned_ranks import join_gloo, spawn_two_ranks


def run(rank: int, out: Path, port: int) -> None:
    from echopipe.pipeline import DistributedStalePipeline

    join_gloo(rank, port, timeout_s=120)
    pipe = DistributedStalePipeline(
        small_cnn(0), balance=[4, 4], optimizer=sgd,
        loss_fn=torch.nn.functional.cross_entropy, timeout_s=60,
    )  # fmt: skip
    batches = make_batches(3)
    lines = []
    try:
        pipe.run_epoch((b for b in batches) if pipe.is_first else None)
        lines.append("no error")
    except Exception as exc:
        lines.append(f"{type(exc).__name__}: {exc}")
    try:
        result = pipe.run_epoch((b for b in batches) if pipe.is_first else None, steps=3)
        lines.append(f"steps {result.steps}")
    except Exception as exc:
        lines.append(f"{type(exc).__name__}: {exc}")
    (out / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")
    os._exit(0)  # a rank left waiting by the other cannot shut its process group down


def main() -> None:
    spawn_two_ranks(run)


if __name__ == "__main__":
    main()
