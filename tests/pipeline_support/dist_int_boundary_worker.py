"""torchrun worker: integer tensors between two stages (token ids into an embedding).

Usage: ``torchrun --nproc_per_node=2 dist_int_boundary_worker.py OUTDIR``. Stage 0 maps ids and
has no weights; stage 1 starts with an ``nn.Embedding``, so its input has no gradient to send
back. Each rank writes what it raised to ``OUTDIR/rank<r>.txt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from echopipe.pipeline import DistributedStalePipeline


class Remap(nn.Module):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids % 7


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(Remap(), nn.Embedding(7, 4), nn.Flatten(), nn.Linear(12, 3))
    pipe = DistributedStalePipeline(
        model, balance=[1, 3], optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=nn.functional.cross_entropy, timeout_s=5,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(4):
            pipe.train_step(torch.randint(0, 50, (5, 3), generator=g), torch.randint(0, 3, (5,)))
        pipe.drain()
        outcome = "no error"
    except Exception as exc:  # rank 0 sees its neighbour go (a closed connection or a timeout)
        outcome = f"{type(exc).__name__}: {exc}"
    (out / f"rank{dist.get_rank()}.txt").write_text(outcome + "\n")


if __name__ == "__main__":
    main()
