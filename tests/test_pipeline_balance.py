"""Balancing outside the engines: functions that return a list of ints, decided from injected
timings (a fake clock that layers advance), never from a machine's measured speed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from echopipe.pipeline import (
    StalePipeline,
    balance_by_cost,
    balance_by_time,
    partition_balance,
    profile_layers,
)
from pipeline_support.models import sgd
from pipeline_support.timing import FakeClock, Timed


def _timed_model(clock: FakeClock, seconds: list[tuple[float, float]]) -> nn.Sequential:
    """Per entry: a timed identity, then a float64 linear layer (so every stage has weights)."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(Timed(clock, f, b), nn.Linear(4, 4).double()) for f, b in seconds]
    )


def test_profile_layers_reads_the_injected_clock() -> None:
    clock = FakeClock()
    model = _timed_model(clock, [(1.0, 2.0), (3.0, 0.5), (0.25, 0.25)])
    profiles = profile_layers(model, torch.randn(5, 4, dtype=torch.float64), clock=clock)
    assert [p.seconds for p in profiles] == [3.0, 3.5, 0.5]
    assert profiles[0].param_bytes == (16 + 4) * 8
    assert profiles[0].activation_bytes == 5 * 4 * 8


def test_balance_by_time_isolates_the_slow_layer() -> None:
    clock = FakeClock()
    model = _timed_model(clock, [(1, 0), (1, 0), (4, 0), (1, 0), (1, 0)])
    balance = balance_by_time(model, torch.randn(3, 4, dtype=torch.float64), 3, clock=clock)
    assert balance == [2, 1, 2]
    # The engine takes the list as it is.
    with StalePipeline(
        model, balance=balance, optimizer=sgd, loss_fn=nn.functional.mse_loss
    ) as pipe:
        assert pipe.balance == [2, 1, 2]


def test_balance_by_time_settles_close_calls_by_timing_whole_stages() -> None:
    """Per-layer times do not add up to a stage's: stage 0 computes no gradient of its input.

    Layer 0's backward to its input takes 3 s, which the per-layer profile counts (4, 1, 1, 1,
    so [1, 3] with a 4 s slowest stage beats [2, 2] with 5 s). As the first layer of stage 0 it
    never runs that backward, so timing the stages whole finds [2, 2] faster (slowest stage 2 s
    against [1, 3]'s 3 s), and that is the choice.
    """
    clock = FakeClock()
    x = torch.randn(3, 4, dtype=torch.float64)
    seconds = [(1.0, 3.0), (0.5, 0.5), (0.5, 0.5), (0.5, 0.5)]
    per_layer = [p.seconds for p in profile_layers(_timed_model(clock, seconds), x, clock=clock)]
    assert per_layer == [4.0, 1.0, 1.0, 1.0]
    assert balance_by_time(_timed_model(clock, seconds), x, 2, clock=clock) == [2, 2]


def test_balance_by_time_respects_memory_caps_and_stage_rules() -> None:
    clock = FakeClock()
    model = _timed_model(clock, [(1, 0), (1, 0), (4, 0), (1, 0), (1, 0)])
    x = torch.randn(3, 4, dtype=torch.float64)
    # A rule that keeps the last stage to its last layer, as a stale-share bound would.
    only_last = balance_by_time(
        model, x, 3, clock=clock, stage_fits=lambda k, a, b: k < 2 or a == 4
    )
    assert only_last == [2, 2, 1]
    per_layer = (16 + 4) * 8
    with pytest.raises(ValueError, match="memory caps"):
        balance_by_time(model, x, 2, clock=clock, memory_caps=[per_layer, per_layer])


def test_balance_functions_name_bad_requests() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    x = torch.randn(1, 2)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        balance_by_time(model, x, 0)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        balance_by_cost(model, x, 3)
    with pytest.raises(ValueError, match="memory_caps needs 2 entries"):
        balance_by_time(model, x, 2, memory_caps=[1])
    with pytest.raises(TypeError, match=r"balance_by_cost needs an nn\.Sequential"):
        balance_by_cost(nn.Linear(2, 2), x, 1)  # type: ignore[arg-type]


def test_balance_by_cost_is_what_auto_model_cost_chooses() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64),
        nn.Linear(64, 64),
        nn.Sequential(*[nn.Linear(64, 64) for _ in range(30)]),
        nn.Linear(64, 64),
        nn.Linear(64, 64),
    )
    x = torch.randn(256, 64)
    assert balance_by_cost(model, x, 3) == [2, 1, 2]
    assert partition_balance(model, x, 3, cost="model") == balance_by_cost(model, x, 3)
