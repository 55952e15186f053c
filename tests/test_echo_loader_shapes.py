"""EchoLoader over batch samplers whose batches change size or shape within an epoch.

A timm-like ``ScheduledBatchSampler`` (multi-scale training, batch-size schedules) yields each
step's indices with the size it wants: here ``(index, image side)`` pairs that the dataset
reads at that side. Example echoing mixes the samples of different input batches in one output
batch, so:

* a sample shape that changes within an epoch cannot be stacked again: refused with one
  ``ShapeChangeError`` line naming the batch sampler and what to do (it named neither);
* a shape that changes between epochs (``set_epoch``) is echoed at each epoch's shape;
* batch sizes that vary with one sample shape are echoed, each sample ``e`` times, in output
  batches of one size: ``batch_size=``, else the first input batch's; a later input batch
  larger than that is warned about (it was silent: a schedule starting at 2 samples gave
  batches of 2 all epoch).

Sample i is filled with i and labelled i, so every delivered row names its sample. Each case
runs without and with DataLoader worker processes.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from echopipe.torch import EchoLoader, LayoutError, ShapeChangeError

N, E = 24, 2


class ScaledSet(Dataset):
    """Sample i read at the side its batch asks for: key ``(i, side)``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        i, side = key
        return torch.full((3, side, side), float(i)), i


class ScheduledBatchSampler(Sampler):
    """Step k of an epoch takes ``plan[epoch][k % len]`` = (batch size, side), in order."""

    def __init__(self, plans: list[list[tuple[int, int]]]) -> None:
        self.plans, self.epoch = plans, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        plan = self.plans[self.epoch % len(self.plans)]
        start, step = 0, 0
        while start < N:
            size, side = plan[step % len(plan)]
            yield [(i, side) for i in range(start, min(start + size, N))]
            start, step = start + size, step + 1

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _loader(plans, workers: int, **kw) -> EchoLoader:
    sampler = ScheduledBatchSampler(plans)
    dl = DataLoader(ScaledSet(), batch_sampler=sampler, num_workers=workers)
    return EchoLoader(dl, echo_factor=E, seed=1, timeout=60, **kw)


def _epoch(loader: EchoLoader) -> tuple[list[tuple[int, ...]], Counter[int]]:
    """(output shapes, copies per sample), checking that each row holds its own sample."""
    shapes, copies = [], Counter()
    for images, labels in loader:
        assert torch.equal(images.flatten(1).amin(1), labels.float())
        assert torch.equal(images.flatten(1).amax(1), labels.float())
        shapes.append(tuple(images.shape))
        copies.update(labels.tolist())
    return shapes, copies


@pytest.mark.parametrize("workers", [0, 2])
def test_a_multi_scale_schedule_within_an_epoch_is_refused_naming_the_sampler(workers) -> None:
    """Steps alternate between sides 8 and 12: batch 1 changes the sample shape."""
    with _loader([[(4, 8), (4, 12)]], workers) as loader, pytest.raises(ShapeChangeError) as caught:
        _epoch(loader)
    message = str(caught.value)
    assert isinstance(caught.value, LayoutError) and "\n" not in message
    assert message.startswith("EchoLoader: batch 1 of epoch 0: field batch[0] changed from ")
    assert "float32[3, 8, 8] to tensor float32[3, 12, 12]" in message
    assert "batch_sampler ScheduledBatchSampler" in message
    assert "fixed shape" in message and "between epochs" in message


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shape_changed_between_epochs_is_echoed_at_each_epochs_shape(workers) -> None:
    """Progressive resizing: side 8 in even epochs, 12 in odd ones (the sampler's set_epoch,
    reached through EchoLoader); each epoch every sample twice, at that epoch's side."""
    with _loader([[(4, 8)], [(4, 12)]], workers) as loader:
        for epoch in range(3):
            loader.batch_sampler.set_epoch(epoch)
            shapes, copies = _epoch(loader)
            side = 8 if epoch % 2 == 0 else 12
            assert shapes == [(4, 3, side, side)] * (E * N // 4)
            assert copies == dict.fromkeys(range(N), E)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 5])
def test_batch_sizes_that_vary_with_one_shape_are_echoed(workers, batch_size) -> None:
    """Batches of 2, 6, 3 and 9 samples: every sample twice per epoch, in batches of
    ``batch_size`` (else the first batch's, 2, said once in a RuntimeWarning naming the
    sampler); the last output batch holds the rest."""
    size = batch_size or 2
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with _loader([[(2, 8), (6, 8), (3, 8), (9, 8)]], workers, batch_size=batch_size) as el:
            for _ in range(2):
                shapes, copies = _epoch(el)
                assert copies == dict.fromkeys(range(N), E)
                full, rest = divmod(E * N, size)
                assert [s[0] for s in shapes] == [size] * full + [rest] * (rest > 0)
    ours = [str(w.message) for w in warned if issubclass(w.category, RuntimeWarning)]
    if batch_size is not None:
        assert ours == []
        return
    assert len(ours) == 2  # once per epoch: the second batch already differs
    assert "batch_sampler ScheduledBatchSampler gives batches of different sizes" in ours[0]
    assert "2 samples in the first, 6 in batch 1 of epoch 0" in ours[0]
    assert "pass batch_size=" in ours[0] and "\n" not in ours[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_smaller_batches_after_the_first_are_not_warned_about(workers) -> None:
    """Batches of 5, 3 and 5 (24 samples: 5, 3, 5, 3, 5, 3): the output size, 5, is the
    largest (as a short last batch, or an iterable dataset's worker's last batch, leaves it)."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with _loader([[(5, 8), (3, 8)]], workers) as loader:
            shapes, copies = _epoch(loader)
    assert copies == dict.fromkeys(range(N), E)
    assert [s[0] for s in shapes] == [5] * 9 + [3]
    assert [w for w in warned if issubclass(w.category, RuntimeWarning)] == []
