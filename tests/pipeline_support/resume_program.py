"""Trains the first half of :func:`resume_batches` and saves a checkpoint; the test process
loads it into a pipeline of its own (``python resume_program.py PATH``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from echopipe.pipeline import StalePipeline

HALF = 6


def resume_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16)]
    layers += [nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers).double()


def resume_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(16, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (16,), generator=g),
        )
        for _ in range(2 * HALF)
    ]


def resume_pipeline(model: nn.Sequential) -> StalePipeline:
    """Momentum, weight decay and a per-step cosine schedule: state beyond the weights."""
    return StalePipeline(
        model,
        balance=[2, 3, 2],
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
        scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 2 * HALF),
        scheduler_interval="step",
        loss_fn=nn.functional.cross_entropy,
    )


if __name__ == "__main__":
    with resume_pipeline(resume_model()) as pipe:
        for x, y in resume_batches()[:HALF]:
            pipe.train_step(x, y)
        pipe.save_checkpoint(sys.argv[1])
