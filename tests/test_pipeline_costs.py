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
