"""A small float32 model, data and loop trained under bfloat16 autocast, shared by the threaded
test and its torchrun worker (tests/pipeline_support/dist_amp_worker.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

BALANCE = [2, 3]


def amp_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def amp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)
    ]


def amp_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def train_under_bf16(
    pipe: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], first: bool
) -> None:
    """Every ``train_step`` under bfloat16 autocast, the final drain outside it."""
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if first:
                pipe.train_step(x, y)
            else:
                pipe.train_step()
    pipe.drain()
