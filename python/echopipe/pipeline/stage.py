"""What one pipeline stage computes: forward, backward and the immediate weight update.

Both engines (threads in one process, and one rank per stage over torch.distributed) drive a
:class:`StageCore`; they differ only in how tensors reach it. The core implements the two
weight rules documented in ``docs/pipeline.md``:

* ``recompute=False`` (saved activations + live weights): forward runs through
  ``torch.func.functional_call`` with per-parameter aliases made by ``p.data``. An alias shares
  the parameter's storage but has its own version counter (``p.detach()`` would share the
  counter and trip autograd's check once the optimizer updates ``p`` in place). Backward
  therefore uses the activations saved at forward time, and wherever an op saved a weight
  tensor itself, the live weight as it is at backward time.
* ``recompute=True``: forward runs without a graph and keeps only the stage input; backward
  reruns the stage's forward with the live weights (running statistics untouched) and
  differentiates that.

In both, the stage's optimizer steps right after its backward, so the next op sees new weights.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from .modes import ModeSnapshot, check_modes

__all__ = [
    "AutocastState",
    "StageCore",
    "caller_autocast",
    "needs_metrics",
    "refuse_metric_schedulers",
]

GradHook = Callable[[list[torch.Tensor | None]], None]

AutocastState = tuple[tuple[str, torch.dtype], ...]
"""The autocast regions in effect: ``(device_type, dtype)`` of each enabled one."""


def caller_autocast() -> AutocastState:
    """The calling thread's enabled ``torch.autocast`` regions (CPU and CUDA).

    Autocast state is per thread; the stage threads re-enter what the caller had around
    ``train_step``, as ``nn.DataParallel`` does for its replica threads.
    """
    return tuple(
        (device_type, torch.get_autocast_dtype(device_type))
        for device_type in ("cpu", "cuda")
        if torch.is_autocast_enabled(device_type)
    )


def _autocast(state: AutocastState) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device_type, dtype in state:
        stack.enter_context(torch.autocast(device_type, dtype=dtype))
    return stack


@dataclass
class _InFlight:
    index: int
    leaf: torch.Tensor | None  # the stage input as a graph leaf (stages > 0)
    output: torch.Tensor | None  # stage output (or the loss on the last stage)
    aliases: list[torch.Tensor] = field(default_factory=list)
    trainable: tuple[bool, ...] = ()  # each parameter's requires_grad at forward time
    saved_input: torch.Tensor | None = None  # recompute mode
    saved_version: int | None = None  # its version counter when it is the tensor fed, not a copy
    target: torch.Tensor | None = None
    autocast: AutocastState = ()  # the forward's, for the recomputation
    modes: ModeSnapshot = ()  # the stages' module modes when it was fed, for the recomputation


def _check_loss(loss: object, needs_grad: bool = False) -> None:
    # The engine differentiates the loss and reports it as a float; a tuple or dict (a loss and
    # its metrics) would fail inside the engine on .detach(), a per-sample loss in the caller.
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"loss_fn returned a {type(loss).__name__}; it must return the loss alone, a "
            "tensor with one element (compute other figures from evaluate() outputs)"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must return the loss "
            "as one element (reduce per-sample losses, e.g. with .mean())"
        )
    if needs_grad and not loss.requires_grad:  # else the stage before fails, naming itself
        raise ValueError(
            "loss_fn returned a loss that needs no gradient (detached, or rebuilt from "
            ".item()), so nothing would train: return the loss computed from the output"
        )


def needs_metrics(scheduler: object) -> bool:
    """Whether ``scheduler`` steps on a metric (``ReduceLROnPlateau.step(metrics)``)."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def refuse_metric_schedulers(schedulers: Iterable[object]) -> None:
    """A ``TypeError`` saying how to step a ``ReduceLROnPlateau`` among ``schedulers``: stepped
    without its metric (by an epoch's end) it would fail, or in a stage thread fail the stage."""
    if any(needs_metrics(s) for s in schedulers):
        raise TypeError(
            "ReduceLROnPlateau steps on a metric: run_epoch(loader, step_schedulers=False), "
            "then pipe.step_schedulers(metric)"
        )


class StageCore:
    """Forward/backward/update of one stage, in the order the engine calls them.

    Args:
        index: stage index ``k`` (0 = input side).
        num_stages: ``K``.
        module: the stage's layers, already on ``device``.
        optimizer: this stage's optimizer (``None`` when the stage has no trainable weights).
        scheduler: optional LR scheduler stepped per update (``interval="step"``) or by the
            engine at epoch ends.
        loss_fn: ``loss_fn(output, target)``; used by the last stage only.
        recompute: choose the recompute rule instead of saved activations + live weights.
        grad_hook: called with the parameter gradients before the optimizer step (used for
            data-parallel all-reduce).
    """

    def __init__(
        self,
        index: int,
        num_stages: int,
        module: nn.Module,
        device: torch.device,
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        scheduler_interval: str,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        recompute: bool,
        grad_hook: GradHook | None = None,
    ) -> None:
        if needs_metrics(scheduler) and scheduler_interval == "step":
            raise TypeError(
                "ReduceLROnPlateau steps on a metric, not after every update: use "
                "scheduler_interval='epoch' and step_schedulers(metric) after each epoch"
            )
        self.index = index
        self.num_stages = num_stages
        self.module = module
        self.device = device
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scheduler_interval = scheduler_interval
        self.loss_fn = loss_fn
        self.recompute = recompute
        self.grad_hook = grad_hook
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # No optimizer holds these; one unfrozen later would silently never train.
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self.in_flight: deque[_InFlight] = deque()
        self.forwards_done = 0
        self.updates_applied = 0
        self.last_forward_index = -1
        self.last_backward_index = -1
        self.pending_scheduler_steps: deque[int] = deque()
        self.scheduler_steps = 0
        # Depth of the in-flight window: D+1 outputs kept, D = staleness of this stage.
        self.staleness = 0
        # Whether a forward (recompute mode) changed the input it was given in place; None
        # until one after the latest drain has run (modes, which may decide it, change then).
        self._changes_input: bool | None = None

    # ----------------------------------------------------------------------------------------
    def forward(
        self,
        index: int,
        x: torch.Tensor,
        target: torch.Tensor | None,
        autocast: AutocastState = (),
        modes: ModeSnapshot = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run forward of minibatch ``index``, under the ``autocast`` regions given (the
        caller's, which a stage thread does not inherit), checking that the stage's modules
        are in the train/eval ``modes`` the minibatch was fed with (when given).

        Returns ``(output, loss)``: the tensor to send downstream (detached), and on the last
        stage the detached loss.
        """
        self._refuse_unfrozen()
        check_modes(self.index, self.module, index, modes)
        # Freezing after construction (requires_grad_(False), while drained) is honoured as
        # without a pipeline: no gradient, so the optimizer skips the parameter.
        trainable = tuple(p.requires_grad for p in self.params)
        needs_input_grad = (not self.is_first) and x.is_floating_point()
        leaf: torch.Tensor | None = None
        if needs_input_grad:
            leaf = x.detach().requires_grad_(True)
            # A clone keeps in-place first layers (ReLU(inplace=True)) off the leaf and off the
            # sender's saved tensors.
            inp = leaf.clone()
        else:
            inp = x
        recompute_here = self.recompute and self.staleness > 0
        if recompute_here:
            if not self.in_flight:  # the first forward after a drain (or ever)
                self._changes_input = None
            # The recompute needs the input as it was: where there is no leaf clone (stage 0)
            # a layer changing its input in place (x.sub_(mean)) changes x itself, so a copy is
            # taken until a forward has left x's version counter as it was.
            copy = x.detach().clone() if inp is x and self._changes_input is not False else None
            version = x._version
            with torch.no_grad(), _autocast(autocast):
                out = self.module(inp)
            self._check_output(out)
            saved, saved_version = self._input_as_fed(index, x, copy, version)
            record = _InFlight(
                index, None, None, trainable=trainable, saved_input=saved,
                saved_version=saved_version, target=target, autocast=autocast, modes=modes,
            )  # fmt: skip
            self.in_flight.append(record)
            self.forwards_done += 1
            self.last_forward_index = index
            return out.detach(), None
        aliases = [p.data.requires_grad_(t) for p, t in zip(self.params, trainable, strict=True)]
        with torch.enable_grad(), _autocast(autocast):
            out = functional_call(
                self.module, dict(zip(self.param_names, aliases, strict=True)), (inp,)
            )
            loss = None
            if self.is_last:
                if self.loss_fn is None or target is None:
                    raise RuntimeError("the last stage needs loss_fn and a target")
                loss = self.loss_fn(out, target)
                _check_loss(loss, leaf is not None or any(trainable))
            else:
                self._check_output(out)
        record = _InFlight(
            index, leaf, loss if self.is_last else out, aliases, trainable, target=target
        )
        self.in_flight.append(record)
        self.forwards_done += 1
        self.last_forward_index = index
        # The last stage's output goes nowhere, and may be several heads (a tuple or a dict).
        sent = out.detach() if isinstance(out, torch.Tensor) else out
        return sent, (loss.detach() if loss is not None else None)

    def _input_as_fed(
        self, index: int, x: torch.Tensor, copy: torch.Tensor | None, version: int
    ) -> tuple[torch.Tensor, int | None]:
        """What the recompute of minibatch ``index`` starts from, after a forward given ``x``
        at version ``version`` (``copy``: a copy taken before it): ``x`` itself and its version
        where the forward left it, which the recompute checks, else the copy."""
        changed = x._version != version
        if copy is None:
            if changed:  # (only where x went to the layers: stages > 0 give them a clone)
                raise RuntimeError(
                    f"stage {self.index}: the input of minibatch {index} was changed in place "
                    "during its forward, by a layer (one that did not since the last drain) or "
                    "by a refill after train_step: the recompute needs the input as fed, so "
                    "change it out of place in the model, or feed a new tensor per minibatch"
                )
            return x.detach(), version
        self._changes_input = bool(self._changes_input) or changed
        return (copy, None) if changed else (x.detach(), version)

    def _refuse_unfrozen(self) -> None:
        for name, p in self._frozen:
            if p.requires_grad:
                raise ValueError(
                    f"stage {self.index}: parameter {name!r} was frozen (requires_grad=False) "
                    "when the pipeline was built, so no optimizer holds it: build the pipeline "
                    "with it trainable, then freeze it (requires_grad_(False), after drain()) "
                    "until it should train"
                )

    def _check_output(self, out: object) -> None:
        # Without this a tuple fails later inside the engine ("'tuple' object has no attribute
        # 'detach'"), which names neither the stage nor the rule.
        if not self.is_last and not isinstance(out, torch.Tensor):
            raise TypeError(
                f"stage {self.index} outputs a {type(out).__name__}, but the pipeline passes one "
                "tensor between stages: move the stage boundary to where the model carries a "
                "single tensor, or pack the values into one tensor"
            )

    # ----------------------------------------------------------------------------------------
    def backward(self, index: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of minibatch ``index`` (the oldest in flight), then update the weights.

        Returns the gradient with respect to the stage input (``None`` on the first stage).
        """
        record = self.in_flight.popleft()
        if record.index != index:
            raise RuntimeError(
                f"stage {self.index}: backward for minibatch {index} but the oldest in flight "
                f"is {record.index}"
            )
        if record.saved_input is not None:
            record = self._rebuild_graph(record)
        inputs: list[torch.Tensor] = []
        if record.leaf is not None:
            inputs.append(record.leaf)
        wanted = [i for i, t in enumerate(record.trainable) if t]
        inputs.extend(record.aliases[i] for i in wanted)
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        output = record.output
        if inputs and output is not None and output.requires_grad:
            if self.is_last:
                grads = list(torch.autograd.grad(output, inputs, allow_unused=True))
            else:
                if grad_output is None:
                    raise RuntimeError(f"stage {self.index} got no gradient for {index}")
                grads = list(torch.autograd.grad(output, inputs, grad_output, allow_unused=True))
        grad_input = grads[0] if record.leaf is not None else None
        param_grads: list[torch.Tensor | None] = [None] * len(self.params)
        for i, g in zip(wanted, grads[1:] if record.leaf is not None else grads, strict=True):
            param_grads[i] = g
        self._apply_update(param_grads)
        self.last_backward_index = index
        while self.pending_scheduler_steps and self.pending_scheduler_steps[0] <= index:
            self.pending_scheduler_steps.popleft()
            self.step_scheduler()
        return grad_input

    def _rebuild_graph(self, record: _InFlight) -> _InFlight:
        x = record.saved_input
        assert x is not None
        check_modes(self.index, self.module, record.index, record.modes)  # BN: batch or running
        if record.saved_version is not None and x._version != record.saved_version:
            raise RuntimeError(
                f"the input of minibatch {record.index} was modified in place after its forward, "
                f"before stage {self.index}'s recompute read it (a reused buffer?): the pipeline "
                "reads it later, so feed a new tensor per minibatch (or a .clone())"
            )
        leaf: torch.Tensor | None = None
        if not self.is_first and x.is_floating_point():
            leaf = x.detach().requires_grad_(True)
            inp = leaf.clone()
        else:
            inp = x
        # Running statistics were updated by the real forward; the recomputation must not
        # update them a second time, so it runs on throw-away copies of the buffers.
        buffers = {n: b.clone() for n, b in self.module.named_buffers()}
        with torch.enable_grad(), _autocast(record.autocast):
            aliases = [
                p.data.requires_grad_(t) for p, t in zip(self.params, record.trainable, strict=True)
            ]
            mapping: dict[str, torch.Tensor] = dict(zip(self.param_names, aliases, strict=True))
            mapping.update(buffers)
            out = functional_call(self.module, mapping, (inp,))
            if self.is_last:
                assert self.loss_fn is not None and record.target is not None
                out = self.loss_fn(out, record.target)
        return _InFlight(record.index, leaf, out, aliases, record.trainable, target=record.target)

    def _apply_update(self, param_grads: list[torch.Tensor | None]) -> None:
        # p.grad is set before the hook: torch's own tools (clip_grad_norm_, clip_grad_value_)
        # read and scale p.grad, and with it still None they would silently do nothing.
        computed = list(param_grads)
        for p, g in zip(self.params, computed, strict=True):
            p.grad = g
        if self.grad_hook is not None:
            self.grad_hook(param_grads)
            for p, g, new in zip(self.params, computed, param_grads, strict=True):
                if new is not g:  # an entry the hook replaced in the list wins
                    p.grad = new
        if self.optimizer is not None:
            self.optimizer.step()
        for p in self.params:
            p.grad = None
        self.updates_applied += 1
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.step_scheduler()

    def step_scheduler(self, metrics: float | None = None) -> None:
        """Step this stage's LR scheduler once (no-op without one), on ``metrics`` for a
        ``ReduceLROnPlateau`` (an epoch-based scheduler would take it for an epoch number)."""
        if self.scheduler is not None:
            if (metrics is not None) != needs_metrics(self.scheduler):
                raise TypeError(
                    f"{type(self.scheduler).__name__} steps "
                    + ("on a metric" if metrics is None else "without a metric")
                )
            self.scheduler.step(*(() if metrics is None else (metrics,)))  # type: ignore[arg-type]
        self.scheduler_steps += 1

    def schedule_scheduler_step(self) -> None:
        """Step the scheduler right after the update of the newest minibatch forwarded so far."""
        if self.last_backward_index >= self.last_forward_index:
            self.step_scheduler()
        else:
            self.pending_scheduler_steps.append(self.last_forward_index)
