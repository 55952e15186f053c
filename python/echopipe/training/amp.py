"""Mixed precision for the pipeline stages: per-block autocast, and fp16 loss scaling.

Autocast state is per thread and every stage runs in its own thread, so :class:`Autocast` enters
it inside each block. bfloat16 keeps float32's exponent range and needs no scaling; float16 does:
:class:`LossScaler` follows ``torch.amp.GradScaler``'s rule (scale the loss, unscale the
gradients, skip an update whose gradients overflowed and halve the scale, double it after a run
of good updates) across stages that update at different times. Each minibatch's gradients are
unscaled by the scale its loss was multiplied with (a queue per stage, in minibatch order), and
a stage whose gradients overflowed skips its own update: in PPL-SGD every stage steps on its own.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["AMP_DTYPES", "Autocast", "LossScaler", "scaler_note"]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``--amp`` values and the autocast dtype of each."""


class Autocast(nn.Module):
    """Runs the wrapped block under ``torch.autocast`` in ``dtype`` on the input's device."""

    def __init__(self, block: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.block = block
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The block's own device: with --devices cpu,cuda:0 each stage autocasts its own way.
        with torch.autocast(x.device.type, dtype=self.dtype):
            out = self.block(x)
        return out.float() if out.is_floating_point() else out


class LossScaler:
    """Dynamic loss scaling for float16 training in a stale-weight pipeline.

    Args:
        num_stages: the pipeline's stages (one gradient queue each).
        init_scale, growth_factor, backoff_factor, growth_interval: as in
            ``torch.amp.GradScaler``.

    Use :meth:`wrap_loss` as the pipeline's ``loss_fn`` and :meth:`grad_hook` as (the last part
    of) its ``grad_hook``. The reported loss keeps its unscaled value.
    """

    def __init__(self, num_stages: int, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:  # fmt: skip
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_updates = 0
        self.skipped = 0
        self._pending: list[collections.deque[float]] = [
            collections.deque() for _ in range(num_stages)
        ]
        self._lock = threading.Lock()

    def wrap_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` whose gradient is scaled and whose value is not."""

        def scaled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(output, target)
            with self._lock:
                s = self.scale
                for queue in self._pending:
                    queue.append(s)
            # Value: loss exactly (the second term is 0); gradient: s times the loss's.
            return loss + (s - 1.0) * (loss - loss.detach())

        return scaled

    def grad_hook(self, stage: int, params: list[nn.Parameter],
                  grads: list[torch.Tensor | None]) -> None:  # fmt: skip
        """Unscale stage ``stage``'s gradients, or drop them all (no update) on an overflow."""
        s = self._pending[stage].popleft()
        finite = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        if finite:
            for i, g in enumerate(grads):
                if g is not None:
                    grads[i] = g / s
        else:
            # A parameter without a gradient is left alone by torch's optimizers: no momentum,
            # no weight decay, so this is a skipped update.
            grads[:] = [None] * len(grads)
        with self._lock:
            if not finite:
                self.skipped += 1
                if s == self.scale:  # one backoff per scale, however many stages overflowed
                    self.scale *= self.backoff_factor
                    self.good_updates = 0
            elif stage == len(self._pending) - 1:
                self.good_updates += 1
                if self.good_updates >= self.growth_interval:
                    self.scale *= self.growth_factor
                    self.good_updates = 0

    def state_dict(self) -> dict[str, Any]:
        """Scale and counters (nothing is in flight in a checkpoint)."""
        return {"scale": self.scale, "good_updates": self.good_updates, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.good_updates = int(state["good_updates"])
        self.skipped = int(state["skipped"])


def chain_hooks(*hooks: Callable[..., None] | None) -> Callable[..., None] | None:
    """One grad hook calling ``hooks`` in order (``None`` entries are left out)."""
    present = [h for h in hooks if h is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def hook(stage: int, params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
        for h in present:
            h(stage, params, grads)

    return hook


def scaler_note(scaler: LossScaler | None) -> list[str]:
    """The summary's line about fp16 loss scaling (none without a scaler)."""
    if scaler is None:
        return []
    return [
        f"amp: fp16, loss scale {scaler.scale:g}; {scaler.skipped} stage update(s) skipped on a "
        "gradient overflow"
    ]
