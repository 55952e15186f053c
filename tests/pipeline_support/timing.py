"""Injected timings for the pipeline tests: a fake clock and layers that "take" set seconds.

The engines and the balance functions read seconds from a ``clock`` argument. These layers
advance a fake clock by a chosen amount in their forward and backward, so a test states how
long each layer takes and checks the decision taken from it, without measuring a machine.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn


class FakeClock:
    """Seconds that move only when :meth:`advance` is called, separately per thread (each stage
    worker of a ``StalePipeline`` has its own thread, and its busy time is its own work)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> float:
        return float(getattr(self._local, "now", 0.0))

    def advance(self, seconds: float) -> None:
        """Move the calling thread's clock forward by ``seconds``."""
        self._local.now = self() + seconds


class _Advance(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: FakeClock, backward_s: float) -> torch.Tensor:
        ctx.clock, ctx.backward_s = clock, backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.clock.advance(ctx.backward_s)
        return grad, None, None


class Timed(nn.Module):
    """Identity that takes ``forward_s`` on ``clock`` in forward and ``backward_s`` in the
    backward to its input (run only when its input needs a gradient)."""

    def __init__(self, clock: FakeClock, forward_s: float, backward_s: float = 0.0) -> None:
        super().__init__()
        self.clock, self.forward_s, self.backward_s = clock, forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.forward_s)
        if not x.requires_grad:
            return x.view_as(x)
        return _Advance.apply(x, self.clock, self.backward_s)
