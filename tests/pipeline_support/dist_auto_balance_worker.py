"""Two processes (torch.multiprocessing): ``balance="auto"`` with ``sample_input`` on rank 0
only (stage 0 alone holds data), then without one on rank 0 either.

Usage: ``python dist_auto_balance_worker.py OUTDIR PORT``. Each rank writes the balance it
adopted and what the second construction raised to ``OUTDIR/rank<r>.txt``.
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

    join_gloo(rank, port)
    sample = make_batches(1)[0][0] if rank == 0 else None
    lines = []
    for sample_input in (sample, None):
        try:
            pipe = DistributedStalePipeline(
                small_cnn(0), balance="auto", num_stages=2, sample_input=sample_input,
                optimizer=sgd, loss_fn=torch.nn.functional.cross_entropy, timeout_s=60,
            )  # fmt: skip
            lines.append(f"balance {pipe.balance}")
        except Exception as exc:
            lines.append(f"{type(exc).__name__}: {exc}")
    (out / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")
    os._exit(0)  # a rank left waiting by the other cannot shut its process group down


def main() -> None:
    spawn_two_ranks(run)


if __name__ == "__main__":
    main()
