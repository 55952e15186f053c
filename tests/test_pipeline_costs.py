"""What StalePipeline does per minibatch beyond the training itself, counted (not timed): the
train/eval modes it reads, and the copies of stage 0's input it keeps for a recompute."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from echopipe.pipeline import PipelineError, StalePipeline

loss_fn = nn.functional.cross_entropy


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (4,), generator=g),
        )
        for _ in range(n)
    ]


class _ModeReads(nn.Module):
    """An identity that notes which thread reads its ``training`` flag, each time."""

    def __init__(self) -> None:
        object.__setattr__(self, "readers", [])  # before Module.__init__ sets training
        super().__init__()

    @property  # type: ignore[override]
    def training(self) -> bool:
        self.readers.append(threading.current_thread().name)  # list.append: thread-safe
        return self._mode

    @training.setter
    def training(self, mode: bool) -> None:
        object.__setattr__(self, "_mode", mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _counted_model() -> tuple[nn.Sequential, list[_ModeReads]]:
    torch.manual_seed(0)
    probes = [_ModeReads(), _ModeReads()]
    model = nn.Sequential(
        nn.Linear(6, 8), probes[0], nn.Tanh(), nn.Linear(8, 8), probes[1], nn.Tanh(),
        nn.Linear(8, 3),
    ).double()  # fmt: skip
    return model, probes


@pytest.mark.parametrize("recompute", [False, True])
def test_modes_are_read_once_per_forward_and_once_per_drain_by_the_caller(
    recompute: bool, one_thread
) -> None:
    """Each train_step walked every module of every stage in the caller's thread, on top of
    each stage's own walk at its forward (and recompute): two reads of each module's mode per
    minibatch, now one (the caller reads them once per drain, the modes it feeds with)."""
    model, probes = _counted_model()
    steps = 8
    with StalePipeline(
        model, balance=[3, 4], optimizer=_sgd, loss_fn=loss_fn, recompute=recompute
    ) as pipe:
        for _ in range(2):
            pipe.run_epoch(_batches(steps))
            pipe.drain()
    caller = threading.current_thread().name
    for stage, probe in enumerate(probes):
        by_caller = probe.readers.count(caller)
        by_stage = probe.readers.count(f"echopipe-stage-{stage}")
        assert by_caller == 2, probe.readers  # one per epoch: each started after a drain
        # Stage 0 (staleness 2) reads the modes again at each recompute; stage 1 never
        # recomputes.
        assert by_stage == 2 * steps * (2 if recompute and stage == 0 else 1)
        assert len(probe.readers) == by_caller + by_stage


class _Gate(nn.Module):
    """Holds the forward of its ``hold``-th call until ``opened`` is set."""

    def __init__(self, hold: int) -> None:
        super().__init__()
        self.hold, self.calls = hold, 0
        self.reached, self.opened = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.hold:
            self.reached.set()
            self.opened.wait()
        return x


def test_a_mode_switched_while_minibatches_are_in_flight_fails_whichever_forwards_ran(
    one_thread,
) -> None:
    """A switch after every in-flight forward had run, before the next train_step, trained
    that minibatch in the new mode with nothing said (the same switch a moment earlier
    failed): a minibatch fed before the next drain is fed with the modes after the last one."""
    torch.manual_seed(0)
    gate = _Gate(hold=2)  # stage 1 holds minibatch 1's forward: minibatch 0's has run
    dropout = nn.Dropout(0.0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), dropout, gate, nn.Linear(8, 3)).double()
    batches = _batches(2)
    with StalePipeline(model, balance=[2, 3], optimizer=_sgd, loss_fn=loss_fn) as pipe:
        pipe.train_step(*batches[0])
        try:
            pipe.train_step(*batches[1])
            assert gate.reached.wait(timeout=60)
            dropout.eval()  # stage 1 has forwarded minibatch 0 and runs minibatch 1's now
            with pytest.raises(PipelineError) as info:
                pipe.train_step(*_batches(3)[2])
                gate.opened.set()
                pipe.drain()
        finally:
            gate.opened.set()
    assert info.value.stage == 1
    assert "minibatch 2" in str(info.value)


class _InputSeen(nn.Module):
    """An identity that notes the storage of each input it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.untyped_storage().data_ptr())
        return x


def _seen_model(first: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(first, nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def test_recompute_on_stage_0_reads_the_input_as_fed_without_a_copy(one_thread) -> None:
    """Stage 0 kept a copy of every input in flight for its recompute (D_0 + 1 of them: 3 here
    at K = 2, 7 at K = 4), also when its layers leave the input as it is, which the input's
    version counter shows."""
    batches = _batches(6)
    fed = {x.untyped_storage().data_ptr() for x, _ in batches}
    results = []
    for recompute in (False, True):
        probe = _InputSeen()
        model = _seen_model(probe)
        with StalePipeline(
            model, balance=[2, 2], optimizer=_sgd, loss_fn=loss_fn, recompute=recompute
        ) as pipe:
            pipe.run_epoch(batches, drain=True)
        assert len(probe.seen) == len(batches) * (2 if recompute else 1)
        copies = [p for p in probe.seen if p not in fed]
        assert len(copies) * batches[0][0].nbytes == 0, "bytes of copies the stage read"
        results.append(list(model.parameters()))
    for a, b in zip(*results, strict=True):  # stage 0's weight gradient needs no weight
        assert torch.equal(a, b)


def test_an_input_refilled_before_its_recompute_is_named(one_thread) -> None:
    """Without a copy, stage 0's recompute reads the input the caller fed; a buffer refilled
    after its forward is named (as one refilled before it is) instead of trained on."""
    gate = _Gate(hold=1)  # stage 1 holds minibatch 0's forward: stage 0's has run
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), gate, nn.Linear(8, 3)).double()
    (x, y), *rest = _batches(4)
    with StalePipeline(
        model, balance=[2, 2], optimizer=_sgd, loss_fn=loss_fn, recompute=True
    ) as pipe:
        try:
            pipe.train_step(x, y)
            assert gate.reached.wait(timeout=60)
            x.add_(1.0)  # the loop refills its buffer
        finally:
            gate.opened.set()
        with pytest.raises(PipelineError) as info:
            for batch in rest:
                pipe.train_step(*batch)
            pipe.drain()
    assert info.value.stage == 0
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "the input of minibatch 0" in str(info.value)


class _DoubleInPlaceWhenTraining(nn.Module):
    """Doubles its input, in place in training mode only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0) if self.training else x * 2.0


def test_an_in_place_first_layer_is_seen_again_after_each_drain(one_thread) -> None:
    """Whether stage 0 changes its input in place may depend on its modes, which change while
    drained: the stage looks again at the first forward after each drain, so the recompute
    still starts from the input as fed once the layer turns in place."""
    results = []
    for recompute in (False, True):
        layer = _DoubleInPlaceWhenTraining()
        model = _seen_model(layer)
        with StalePipeline(
            model, balance=[2, 2], optimizer=_sgd, loss_fn=loss_fn, recompute=recompute
        ) as pipe:
            for training in (False, True, False, True):
                layer.train(training)
                pipe.run_epoch([(x.clone(), y) for x, y in _batches(5)], drain=True)
        results.append(list(model.parameters()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


class _InPlaceOnCall(nn.Module):
    """Changes its input in place on its ``call``-th call only."""

    def __init__(self, call: int) -> None:
        super().__init__()
        self.call, self.calls = call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mul_(2.0) if self.calls == self.call else x * 2.0


def test_a_first_layer_that_turns_in_place_between_drains_is_named(one_thread) -> None:
    """Stage 0 keeps no copy once a forward left its input as fed; a later forward that
    changes it in place leaves the recompute without the input as fed, so it fails naming
    the stage and the minibatch instead of recomputing from the changed values."""
    model = _seen_model(_InPlaceOnCall(call=3))
    with (
        StalePipeline(
            model, balance=[2, 2], optimizer=_sgd, loss_fn=loss_fn, recompute=True
        ) as pipe,
        pytest.raises(PipelineError) as info,
    ):
        pipe.run_epoch([(x.clone(), y) for x, y in _batches(5)], drain=True)
    assert info.value.stage == 0
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "minibatch 2" in str(info.value) and "in place" in str(info.value)
