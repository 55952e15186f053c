"""The accuracy-aware bound on how much of a model runs stale (``max_stale_share``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from echopipe.models import build_model
from echopipe.pipeline import StalePipeline, partition_balance
from echopipe.pipeline.partition import check_stale_share, stale_share, stale_share_fits


def _lenet() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return build_model("lenet5", num_classes=10, in_channels=1)


def _param_counts(model: torch.nn.Sequential) -> list[int]:
    # Counted from the modules' own weight and bias tensors, not through the helper under test.
    counts = []
    for child in model.modules():
        if isinstance(child, torch.nn.Conv2d | torch.nn.Linear):
            counts.append(child.weight.numel() + child.bias.numel())
    return counts


def test_share_of_parameters_and_layers_in_the_stale_stages() -> None:
    model = _lenet()
    conv1, conv2, fc1, fc2, fc3 = _param_counts(model)
    total = conv1 + conv2 + fc1 + fc2 + fc3
    # Children: conv1, conv2, flatten, fc1, fc2, fc3; all but the last stage are stale.
    assert stale_share(model, [1, 5]) == pytest.approx(conv1 / total)
    assert stale_share(model, [1, 1, 1, 3]) == pytest.approx((conv1 + conv2) / total)
    assert stale_share(model, [1, 1, 2, 2]) == pytest.approx((conv1 + conv2 + fc1) / total)
    # Layers with parameters: 5; the flatten child has none and does not count.
    assert stale_share(model, [1, 1, 1, 3], by="layers") == pytest.approx(2 / 5)
    assert stale_share(model, [1, 1, 2, 2], by="layers") == pytest.approx(3 / 5)
    assert stale_share(model, [6]) == 0.0


def test_frozen_parameters_do_not_count() -> None:
    model = _lenet()
    for p in model[0].parameters():
        p.requires_grad_(False)
    assert stale_share(model, [1, 5]) == 0.0
    assert stale_share(model, [1, 5], by="layers") == 0.0


@pytest.mark.parametrize(
    ("stages", "bound", "expected"),
    [(2, 0.01, [1, 5]), (4, 0.05, [1, 1, 1, 3]), (2, 0.05, None)],
)
def test_partition_balance_respects_the_bound(stages: int, bound: float, expected) -> None:
    model = _lenet()
    x = torch.randn(32, 1, 32, 32)
    balance = partition_balance(model, x, stages, max_stale_share=bound, repeats=1)
    assert len(balance) == stages and sum(balance) == len(model)
    assert stale_share(model, balance) <= bound
    if expected is not None:  # the bound leaves exactly one split
        assert balance == expected


def test_bound_by_layers_on_resnet20() -> None:
    torch.manual_seed(0)
    model = build_model("resnet20", num_classes=10, in_channels=3, width=8)
    x = torch.randn(16, 3, 24, 24)
    balance = partition_balance(
        model, x, 3, max_stale_share=0.3, stale_share_by="layers", repeats=1
    )
    # 11 children have parameters; 0.3 of them is at most 3 stale layers.
    assert stale_share(model, balance, by="layers") <= 0.3
    assert sum(balance[:-1]) <= 3
    # Without the bound the time-balanced split puts about 8 of the 13 children in the stale
    # stages (the residual blocks cost about the same), so the bound is what changed it.
    free = partition_balance(model, x, 3, repeats=1)
    assert stale_share(model, free, by="layers") > 0.3


def test_bound_composes_with_memory_caps() -> None:
    model = _lenet()
    x = torch.randn(32, 1, 32, 32)
    balance = partition_balance(
        model, x, 2, memory_caps=[1 << 40, 1 << 40], max_stale_share=0.01, repeats=1
    )
    assert balance == [1, 5]


def test_unreachable_bound_names_the_smallest_share() -> None:
    model = _lenet()
    with pytest.raises(ValueError, match=r"cannot be met with 4 stages.*0\.042"):
        partition_balance(model, torch.randn(8, 1, 32, 32), 4, max_stale_share=0.01)


@pytest.mark.parametrize("bound", [-0.1, 1.5])
def test_bound_outside_zero_one_is_rejected(bound: float) -> None:
    with pytest.raises(ValueError, match="max_stale_share must be in"):
        stale_share_fits(_lenet(), 2, bound)


def test_bad_types_and_measures_are_rejected() -> None:
    with pytest.raises(TypeError, match="max_stale_share must be a number"):
        stale_share_fits(_lenet(), 2, "0.5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'params' or 'layers'"):
        stale_share(_lenet(), [1, 5], by="weights")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sums to 5"):
        stale_share(_lenet(), [1, 4])


def test_check_stale_share_on_explicit_balances() -> None:
    model = _lenet()
    check_stale_share(model, [1, 1, 1, 3], 0.05)
    with pytest.raises(ValueError, match=r"balance \[1, 1, 2, 2\] runs 0\.82"):
        check_stale_share(model, [1, 1, 2, 2], 0.5)


def test_stale_pipeline_applies_the_bound_and_trains() -> None:
    model = _lenet()
    x = torch.randn(16, 1, 32, 32)
    y = torch.randint(0, 10, (16,))
    with StalePipeline(
        model,
        balance="auto",
        num_stages=2,
        sample_input=x,
        max_stale_share=0.01,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
        loss_fn=F.cross_entropy,
    ) as pipe:
        assert pipe.balance == [1, 5]
        before = model[0][0].weight.detach().clone()
        for _ in range(4):
            pipe.train_step(x, y)
        pipe.drain()
        assert pipe.steps_applied == 4
        assert not torch.equal(before, model[0][0].weight)
    with pytest.raises(ValueError, match=r"above max_stale_share=0\.01"):
        StalePipeline(
            _lenet(),
            balance=[2, 4],
            max_stale_share=0.01,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
            loss_fn=F.cross_entropy,
        )


def test_bound_applies_with_the_cost_model_too() -> None:
    model = _lenet()
    x = torch.randn(32, 1, 32, 32)
    assert partition_balance(model, x, 4, max_stale_share=0.05, cost="model") == [1, 1, 1, 3]
    bounded = partition_balance(model, x, 2, max_stale_share=0.01, cost="model")
    assert bounded == [1, 5] and stale_share(model, bounded) <= 0.01
