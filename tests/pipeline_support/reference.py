"""A plain single-threaded simulator of the stale-weight schedule, tick by tick.

It shares no code with ``echopipe.pipeline``: it walks the global tick schedule ("at tick ``t``
stage ``k`` runs forward of minibatch ``t-k``, then backward of minibatch ``t-(2K-2-k)``") for
one segment of minibatches from an empty pipeline to an empty pipeline, using the documented
weight rules:

* saved activations + live weights: forward through ``functional_call`` with ``p.data``
  aliases, backward by ``torch.autograd.grad`` on the saved graph;
* recompute: forward without a graph, backward reruns forward with the live weights on
  copies of the buffers.

Synchronous segments are ordinary SGD: whole forward, ``loss.backward()``, every optimizer steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

Batch = tuple[torch.Tensor, torch.Tensor]


class ReferencePipeline:
    def __init__(
        self,
        stages: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer | None],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        recompute: bool = False,
        schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler | None] | None = None,
    ) -> None:
        self.stages = list(stages)
        self.optimizers = list(optimizers)
        self.loss_fn = loss_fn
        self.recompute = recompute
        self.schedulers = list(schedulers) if schedulers is not None else [None] * len(stages)
        self.next_index = 0
        self.log: list[tuple[int, str, int, int]] = []  # (tick, op, stage, minibatch)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def _params(self, k: int) -> tuple[list[str], list[nn.Parameter]]:
        named = [(n, p) for n, p in self.stages[k].named_parameters() if p.requires_grad]
        return [n for n, _ in named], [p for _, p in named]

    def _update(self, k: int, params: list[nn.Parameter], grads: Sequence[torch.Tensor | None]):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if self.optimizers[k] is not None:
            self.optimizers[k].step()
        for p in params:
            p.grad = None

    def run_pipelined(
        self, batches: Sequence[Batch], scheduler_after: set[int] | None = None
    ) -> list[float]:
        """One segment: fill, steady state and drain for ``batches``; returns their losses."""
        K = self.num_stages
        n = len(batches)
        base = self.next_index
        scheduler_after = scheduler_after or set()
        staleness = [2 * (K - 1 - k) for k in range(K)]
        acts: dict[tuple[int, int], torch.Tensor] = {}
        grads_in: dict[tuple[int, int], torch.Tensor | None] = {}
        saved: dict[tuple[int, int], tuple] = {}
        losses: dict[int, float] = {}
        for t in range(n + 2 * K - 2):
            produced_acts: dict[tuple[int, int], torch.Tensor] = {}
            produced_grads: dict[tuple[int, int], torch.Tensor | None] = {}
            for k in range(K):
                m = t - k
                if 0 <= m < n:
                    self.log.append((t, "fwd", k, base + m))
                    x = batches[m][0] if k == 0 else acts.pop((k - 1, m))
                    out, record = self._forward(k, x, batches[m][1])
                    saved[(k, m)] = record
                    if k == K - 1:
                        losses[m] = float(out)
                    else:
                        produced_acts[(k, m)] = out
                m = t - k - staleness[k]
                if 0 <= m < n:
                    self.log.append((t, "bwd", k, base + m))
                    g = None if k == K - 1 else grads_in.pop((k + 1, m))
                    produced_grads[(k, m)] = self._backward(k, saved.pop((k, m)), g, batches[m][1])
                    if base + m in scheduler_after and self.schedulers[k] is not None:
                        self.schedulers[k].step()
            # Values produced at tick t are consumed at tick t+1 only.
            acts.update(produced_acts)
            grads_in.update(produced_grads)
        assert not saved and not acts
        self.next_index += n
        return [losses[m] for m in range(n)]

    @staticmethod
    def _stage_input(k: int, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(leaf receiving the input gradient, the input the stage computes on)."""
        if k == 0:
            return None, x
        leaf = x.detach().requires_grad_(True)
        return leaf, leaf.clone()

    def _forward(self, k: int, x: torch.Tensor, target: torch.Tensor):
        stage = self.stages[k]
        last = k == self.num_stages - 1
        stale = 2 * (self.num_stages - 1 - k) > 0
        leaf, inp = self._stage_input(k, x)
        if self.recompute and stale:
            with torch.no_grad():
                out = stage(inp)
            return out.detach(), ("recompute", x.detach())
        names, params = self._params(k)
        aliases = [p.data.requires_grad_(True) for p in params]
        out = functional_call(stage, dict(zip(names, aliases, strict=True)), (inp,))
        if last:
            loss = self.loss_fn(out, target)
            return loss.detach(), ("saved", leaf, loss, aliases)
        return out.detach(), ("saved", leaf, out, aliases)

    def _backward(self, k: int, record: tuple, grad_out, target):
        stage = self.stages[k]
        last = k == self.num_stages - 1
        names, params = self._params(k)
        if record[0] == "recompute":
            leaf, inp = self._stage_input(k, record[1])
            mapping = dict(zip(names, params, strict=True))
            mapping.update({n: b.clone() for n, b in stage.named_buffers()})
            out = functional_call(stage, mapping, (inp,))
            if last:
                out = self.loss_fn(out, target)
            variables = params
        else:
            _, leaf, out, variables = record
        inputs = ([leaf] if leaf is not None else []) + list(variables)
        if last:
            grads = torch.autograd.grad(out, inputs, allow_unused=True)
        else:
            grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        grad_input = grads[0] if leaf is not None else None
        self._update(k, params, grads[1:] if leaf is not None else grads)
        return grad_input

    def run_sync(self, batches: Sequence[Batch], scheduler_after: set[int] | None = None):
        """Ordinary SGD on the stages: one minibatch at a time, all stages updated after it."""
        losses = []
        for x, y in batches:
            h = x
            for stage in self.stages:
                h = stage(h)
            loss = self.loss_fn(h, y)
            loss.backward()
            for opt in self.optimizers:
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            if scheduler_after and self.next_index in scheduler_after:
                for s in self.schedulers:
                    if s is not None:
                        s.step()
            self.next_index += 1
            losses.append(float(loss.detach()))
        return losses
