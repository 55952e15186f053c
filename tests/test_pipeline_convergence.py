"""LeNet-5 on scikit-learn's digits: pipelined, synchronous and hybrid training.

Settings come from sweeps over 5 seeds (see docs/pipeline.md, "Convergence"); each claim held
for every seed tried, and the tests run seed 0:

* With SGD lr 0.01, momentum 0.9, cosine decay over 8 epochs, 2-stage pipelined training ends
  within 1 point of synchronous training (largest gap seen: 0.56 points on 899 held-out
  digits).
* Where staleness does cost accuracy (lr 0.02, momentum 0.9, constant, 4 epochs: pipelined
  trails synchronous by 6 to 22 points), the hybrid run (pipelined for the first half) ends
  higher than the pipelined one (margins seen: 3 to 22 points). In the gentle setting above,
  hybrid and pipelined tie within noise (+-0.6 points), so "at least as high" is tested where
  it is a real effect rather than a coin toss.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from echopipe.data import load_digits
from echopipe.models import lenet5
from echopipe.pipeline import HybridSchedule, StalePipeline

BATCH, SEED = 32, 0


def _train(digits, mode: str, *, epochs: int, lr: float, cosine: bool) -> tuple[float, list[int]]:
    x_train, y_train, x_test, y_test = digits
    torch.manual_seed(SEED)
    model = lenet5(num_classes=10, in_channels=1)
    steps_per_epoch = (len(x_train) + BATCH - 1) // BATCH
    hybrid = HybridSchedule.from_fraction(0.5, epochs * steps_per_epoch)
    pipe = StalePipeline(
        model,
        balance=[2, 4],
        optimizer=lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9),
        scheduler=(lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs))
        if cosine
        else None,
        loss_fn=nn.functional.cross_entropy,
        pipelined=mode != "sync",
        hybrid=hybrid if mode == "hybrid" else None,
    )
    g = torch.Generator().manual_seed(SEED)
    for _ in range(epochs):
        perm = torch.randperm(len(x_train), generator=g)
        pipe.run_epoch(
            (x_train[perm[i : i + BATCH]], y_train[perm[i : i + BATCH]])
            for i in range(0, len(x_train), BATCH)
        )
    pipe.drain()
    assert pipe.steps_applied == epochs * steps_per_epoch
    assert pipe.samples_seen == epochs * len(x_train)
    staleness = pipe.staleness()
    accuracy = 100.0 * pipe.accuracy(x_test, y_test)
    pipe.close()
    return accuracy, staleness


@pytest.mark.slow
def test_pipelined_ends_within_one_point_of_synchronous() -> None:
    digits = load_digits(image_size=32, test_fraction=0.5, seed=0)
    sync, sync_staleness = _train(digits, "sync", epochs=8, lr=0.01, cosine=True)
    piped, piped_staleness = _train(digits, "pipelined", epochs=8, lr=0.01, cosine=True)
    assert sync_staleness == [0, 0] and piped_staleness == [2, 0]
    assert sync > 93.0, sync  # the model really learned the task
    assert abs(piped - sync) <= 1.0, (piped, sync)


@pytest.mark.slow
def test_hybrid_ends_at_least_as_high_as_pipelined() -> None:
    digits = load_digits(image_size=32, seed=0)
    piped, _ = _train(digits, "pipelined", epochs=4, lr=0.02, cosine=False)
    hybrid, hybrid_staleness = _train(digits, "hybrid", epochs=4, lr=0.02, cosine=False)
    assert hybrid_staleness == [0, 0]  # it did switch to synchronous training
    assert hybrid >= piped, (hybrid, piped)
