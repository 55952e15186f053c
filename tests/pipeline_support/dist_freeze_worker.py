"""torchrun worker: two data-parallel replicas of one stage, one layer frozen mid-run.

Usage: ``torchrun --nproc_per_node=2 dist_freeze_worker.py OUTDIR``. Trains 3 minibatches,
drains, freezes the first layer, trains 3 more, and writes the layer before and after.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from echopipe.pipeline import DistributedStalePipeline, init_distributed


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    init_distributed("gloo", timeout_s=120)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    pipe = DistributedStalePipeline(
        model,
        balance=[3],
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
        loss_fn=nn.functional.cross_entropy,
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(6):
        if step == 3:
            pipe.drain()
            model[0].requires_grad_(False)
            before = {k: v.clone() for k, v in model[0].state_dict().items()}
        x = torch.randn(4, 6, generator=g, dtype=torch.float64)
        pipe.train_step(x, torch.randint(0, 3, (4,), generator=g))
    pipe.drain()
    after = model[0].state_dict()
    torch.save({"before": before, "after": after}, out / f"rank{dist.get_rank()}.pt")
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
