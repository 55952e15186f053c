"""The study-backed hybrid default: switch point and learning rate across the switch."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from echopipe.models import build_model
from echopipe.pipeline import HybridSchedule, StalePipeline
from echopipe.pipeline.schedule import DEFAULT_SWITCH_FRACTION, hybrid_lr_factor


def _cosine_lrs(epochs: int) -> list[float]:
    """Per-epoch rates of torch's own CosineAnnealingLR (base 1.0)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    out = []
    for _ in range(epochs):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_continue_is_torch_cosine_and_ignores_the_switch() -> None:
    got = [hybrid_lr_factor(e, 16, 4, "continue") for e in range(16)]
    assert got == pytest.approx(_cosine_lrs(16), abs=1e-12)


def test_restart_is_two_cosines_and_constant_holds_then_decays() -> None:
    restart = [hybrid_lr_factor(e, 16, 4, "restart") for e in range(16)]
    assert restart == pytest.approx(_cosine_lrs(4) + _cosine_lrs(12), abs=1e-12)
    constant = [hybrid_lr_factor(e, 16, 4, "constant") for e in range(16)]
    assert constant == pytest.approx([1.0] * 4 + _cosine_lrs(12), abs=1e-12)
    for switch in (None, 0, 16):  # no switch inside the run: every mode is the plain cosine
        for mode in ("continue", "restart", "constant"):
            assert [hybrid_lr_factor(e, 16, switch, mode) for e in range(16)] == pytest.approx(
                _cosine_lrs(16), abs=1e-12
            )
    with pytest.raises(ValueError, match="mode must be"):
        hybrid_lr_factor(0, 16, 4, "warm")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("epochs", "switch"), [(16, 4), (8, 2), (10, 2), (3, 1), (2, 1), (1, 0), (0, 0)]
)
def test_default_switch_is_a_quarter_of_the_epochs(epochs: int, switch: int) -> None:
    assert DEFAULT_SWITCH_FRACTION == 0.25
    assert HybridSchedule.default(epochs, 7).pipelined_steps == switch * 7
    with pytest.raises(ValueError, match="steps_per_epoch >= 1"):
        HybridSchedule.default(4, 0)


def test_default_hybrid_runs_pipelined_then_synchronous_with_the_rate_restarted() -> None:
    torch.manual_seed(0)
    model = build_model("lenet5", num_classes=10, in_channels=1)
    epochs, steps = 4, 3
    batches = [(torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))) for _ in range(steps)]
    factor = partial(hybrid_lr_factor, epochs=epochs, switch_epoch=1, mode="restart")
    seen = []
    with StalePipeline(
        model,
        balance=[1, 1, 2, 2],
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        scheduler=partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=factor),
        loss_fn=F.cross_entropy,
        hybrid=HybridSchedule.default(epochs, steps),
    ) as pipe:
        for _ in range(epochs):
            pipe.run_epoch(batches)
            pipe.drain()
            seen.append((pipe.staleness(), [o.param_groups[0]["lr"] for o in pipe.optimizers]))
        assert pipe.steps_applied == epochs * steps
    assert seen[0][0] == [6, 4, 2, 0]  # epoch 0 pipelined
    assert seen[1][0] == [0, 0, 0, 0]  # synchronous from epoch 1 on
    # After epoch 0 the rate restarts at the full 0.1 for the synchronous epochs.
    assert seen[0][1] == pytest.approx([0.1] * 4)
    assert seen[1][1] == pytest.approx([0.1 * hybrid_lr_factor(2, 4, 1)] * 4)
