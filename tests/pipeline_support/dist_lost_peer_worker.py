"""Two processes (torch.multiprocessing, no torchrun): rank 1 is killed with SIGKILL.

Usage: ``python dist_lost_peer_worker.py OUTDIR``. Both ranks build a 2-stage
:class:`DistributedStalePipeline` over Gloo; rank 1 then kills itself with SIGKILL (no
exception, no cleanup, as the OOM killer does it) and rank 0 trains. No launcher stops rank 0,
so it writes what it raised to ``OUTDIR/rank0.txt``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline_support.models import make_batches, sgd, small_cnn
from pipeline_support.spawned_ranks import join_gloo, spawn_two_ranks


def run(rank: int, out: Path, port: int) -> None:
    from echopipe.pipeline import DistributedStalePipeline

    join_gloo(rank, port)
    pipe = DistributedStalePipeline(
        small_cnn(0), balance=[4, 4], optimizer=sgd,
        loss_fn=torch.nn.functional.cross_entropy, timeout_s=60,
    )  # fmt: skip
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for x, y in make_batches(6):
            pipe.train_step(x, y)
        pipe.drain()
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    (out / "rank0.txt").write_text(outcome + "\n")
    os._exit(0)  # the process group cannot shut down cleanly without its peer


def main() -> None:
    spawn_two_ranks(run)


if __name__ == "__main__":
    main()
