"""Small float64 models and data shared by the pipeline tests and the torchrun worker."""

from __future__ import annotations

import torch
from torch import nn

BALANCES = {1: [8], 2: [4, 4], 3: [3, 3, 2], 4: [2, 2, 2, 2]}


def small_cnn(seed: int = 0) -> nn.Sequential:
    """8 children: convs, batch norms, an in-place ReLU, pooling, linear layers (float64)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True)),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 16),
        nn.Tanh(),
        nn.Linear(16, 5),
    )
    return model.double()


def make_batches(n: int, seed: int = 1, batch: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, 2, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (batch,), generator=g),
        )
        for _ in range(n)
    ]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


loss_fn = nn.functional.cross_entropy


CLIP = 0.05  # below the gradients' norms here, so the clip changes every update
PLATEAU_METRICS = (1.0, 2.0)  # the second is worse: with patience 0 the LR halves once


def clip_hook(norms: list[tuple[int, float]]):
    """A ``grad_hook`` clipping each stage's gradients to ``CLIP`` (``clip_grad_norm_`` on the
    parameters, as a training loop does after backward), noting (stage, norm before)."""

    def hook(stage: int, params: list[nn.Parameter], grads: list) -> None:
        norms.append((stage, float(torch.nn.utils.clip_grad_norm_(params, CLIP))))

    return hook


def plateau(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
