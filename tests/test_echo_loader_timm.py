"""timm-shaped programs around EchoLoader, part 2: the loader pieces of timm's ``create_loader``
and ``train.py``, written here with the same mechanics (timm has no build for the CPU torch
used here): a ``PrefetchLoader``-like wrapper outside and inside EchoLoader with a collate that
mixes while ``mixup_enabled`` (switched off at ``mixup_off_epoch`` through the outermost
loader), ``fast_collate`` (uint8 NCHW built from numpy samples, int64 targets), a
``RepeatAugSampler``-like sampler, ``set_epoch`` and ``dataset.transform`` written through
EchoLoader between epochs, ``--epoch-repeats``-style iterable datasets, and a
``MultiEpochsDataLoader``-like loader with persistent workers.

Samples are identified by value: picture i is filled with i (channel 0 keeps it).
"""

from __future__ import annotations

import collections
import functools
import math
import multiprocessing as mp
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from echopipe.echo import copies_per_epoch
from echopipe.torch import EchoLoader, LayoutError

CLASSES = 5
MEAN, STD = 0.5 * 255, 0.25 * 255


class Pictures(Dataset):
    """Picture i: a uint8 CHW numpy array filled with i (timm's ``ToNumpy`` output), target
    i % CLASSES; ``transform`` maps the array, ``set_epoch`` records the epochs."""

    def __init__(self, n: int) -> None:
        self.n, self.transform, self.epochs = n, None, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image = np.full((3, 4, 4), i, dtype=np.uint8)
        if self.transform is not None:
            image = self.transform(image)
        return image, i % CLASSES

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class Grow:
    """A transform to a larger square size (progressive resizing), nearest neighbour."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: np.ndarray) -> np.ndarray:
        k = self.size // image.shape[1]
        return image.repeat(k, axis=1).repeat(k, axis=2)


def fast_collate(batch):
    """fast_collate's shape: one uint8 NCHW tensor filled from numpy samples, int64 targets."""
    targets = torch.tensor([b[1] for b in batch], dtype=torch.int64)
    tensor = torch.zeros((len(batch), *batch[0][0].shape), dtype=torch.uint8)
    for i, (image, _) in enumerate(batch):
        tensor[i] += torch.from_numpy(image)
    return tensor, targets


class MixupCollate:
    """FastCollateMixup's shape: fast_collate, then, while ``mixup_enabled``, row i mixed with
    row B-1-i (channel 1, lam 0.7) and soft targets; float targets either way. A mixed row's
    channel 2 is 255, so that the test can tell."""

    lam = 0.7

    def __init__(self) -> None:
        self.mixup_enabled = True

    def __call__(self, batch):
        images, labels = fast_collate(batch)
        one_hot = nn.functional.one_hot(labels, CLASSES).float()
        if not self.mixup_enabled:
            return images, one_hot
        mixed = images[:, 1].float() * self.lam + images.flip(0)[:, 1].float() * (1 - self.lam)
        images[:, 1], images[:, 2] = mixed.round().to(torch.uint8), 255
        return images, one_hot * self.lam + one_hot.flip(0) * (1 - self.lam)


class Prefetcher:
    """PrefetchLoader's shape: runs one batch ahead of its caller, moves to the device and
    normalises uint8 to float; ``len``, ``sampler``, ``batch_sampler``, ``dataset`` and
    ``mixup_enabled`` (its collate's) are its loader's."""

    def __init__(self, loader, device: str = "cpu") -> None:
        self.loader, self.device = loader, torch.device(device)
        self.mean = torch.full((1, 3, 1, 1), MEAN, device=device)
        self.std = torch.full((1, 3, 1, 1), STD, device=device)

    def __iter__(self):
        ahead = None
        for images, target in self.loader:
            images = images.to(self.device, non_blocking=True)
            images = images.float().sub_(self.mean).div_(self.std)
            if ahead is not None:
                yield ahead
            ahead = images, target.to(self.device, non_blocking=True)
        if ahead is not None:
            yield ahead

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def mixup_enabled(self) -> bool:
        collate = self.loader.collate_fn
        return isinstance(collate, MixupCollate) and collate.mixup_enabled

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        if isinstance(self.loader.collate_fn, MixupCollate):
            self.loader.collate_fn.mixup_enabled = value


class _Forever:
    """A batch sampler that starts its sampler's next pass as soon as one ends."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        while True:
            yield from self.sampler


class MultiEpochs(DataLoader):
    """MultiEpochsDataLoader's shape: one iterator for the loader's life (its workers too),
    over a batch sampler that never ends; a pass takes ``len()`` batches from it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._DataLoader__initialized = False  # DataLoader refuses a new batch_sampler after
        self.batch_sampler = _Forever(self.batch_sampler)
        self._DataLoader__initialized = True
        self.iterator = super().__iter__()

    def __len__(self) -> int:
        return len(self.batch_sampler.sampler)

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self.iterator)


class RepeatAug(Sampler):
    """RepeatAugSampler's shape: each index of an epoch-seeded permutation 3 times in a row,
    dealt round-robin over the ranks, ``ceil(n / ranks)`` per rank (``selected_round=0``)."""

    def __init__(self, dataset, num_replicas: int, rank: int, num_repeats: int = 3) -> None:
        self.n, self.num_replicas, self.rank = len(dataset), num_replicas, rank
        self.num_repeats, self.epoch = num_repeats, 0
        self.total = math.ceil(self.n * num_repeats / num_replicas) * num_replicas
        self.selected = math.ceil(self.n / num_replicas)

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        order = order.repeat_interleave(self.num_repeats).tolist()
        order += order[: self.total - len(order)]
        return iter(order[self.rank : self.total : self.num_replicas][: self.selected])

    def __len__(self) -> int:
        return self.selected

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def _worker_init(worker_id: int, worker_seeding: str = "all") -> None:
    np.random.seed(get_worker_info().seed % (2**32 - 1))


def create_loader(dataset, *, workers=0, persistent=False, collate_fn=fast_collate,
                  sampler=None, multi_epochs=False, prefetcher=True):  # fmt: skip
    """create_loader's training loader: drop_last, worker seeding, optional prefetcher."""
    cls = MultiEpochs if multi_epochs else DataLoader
    init = functools.partial(_worker_init, worker_seeding="all") if workers else None
    shuffle = sampler is None and not isinstance(dataset, IterableDataset)
    loader = cls(dataset, batch_size=4, shuffle=shuffle, sampler=sampler,
                 num_workers=workers, collate_fn=collate_fn, drop_last=True,
                 persistent_workers=persistent, worker_init_fn=init)  # fmt: skip
    return Prefetcher(loader) if prefetcher else loader


def _set_loader_epoch(loader, epoch: int) -> None:
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)
    if hasattr(loader.batch_sampler, "set_epoch"):
        loader.batch_sampler.set_epoch(epoch)
    elif hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)


def _ids(images: torch.Tensor) -> torch.Tensor:
    """Channel 0 of each row (the picture's id), undoing the prefetcher's normalisation."""
    x = images[:, 0, 0, 0]
    return (x.float() * STD + MEAN).round().long() if x.is_floating_point() else x.long()


def train_one_epoch(epoch, model, loader, optimizer, accum_steps, mixup_off_epoch):
    """train_one_epoch's loader calls: mixup off through the loader, the accumulation
    arithmetic from ``len(loader)``; returns the updates and (ids, mixed) per step."""
    if mixup_off_epoch and epoch >= mixup_off_epoch and loader.mixup_enabled:
        loader.mixup_enabled = False
    last_accum_steps = len(loader) % accum_steps
    updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps
    steps, updates = [], []
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(loader):
        need_update = batch_idx == last_batch_idx or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps
        ids = _ids(input)
        assert torch.all(target[torch.arange(len(ids)), ids % CLASSES] >= MixupCollate.lam)
        mixed = (input[:, 2, 0, 0] * STD + MEAN).round() == 255
        steps.append((ids.tolist(), mixed.tolist()))
        (nn.functional.cross_entropy(model(input), target) / accum_steps).backward()
        if need_update:
            optimizer.step()
            optimizer.zero_grad()
            num_updates += 1
            updates.append(num_updates)
    return updates, steps


@pytest.mark.parametrize(
    ("form", "workers", "persistent"),
    [("echo_outer", 0, False), ("echo_outer", 2, False), ("prefetcher_outer", 0, False),
     ("prefetcher_outer", 2, False), ("echo_outer", 2, True), ("plain", 2, True)],
)  # fmt: skip
def test_mixup_off_epoch_through_the_outermost_loader(form, workers, persistent) -> None:
    dataset, collate, e = Pictures(40), MixupCollate(), 1.5
    loader = create_loader(dataset, workers=workers, persistent=persistent, collate_fn=collate)
    if form == "echo_outer":  # EchoLoader wraps the prefetcher
        loader = EchoLoader(loader, echo_factor=e)
    elif form == "prefetcher_outer":  # the prefetcher reads EchoLoader
        loader.loader = EchoLoader(loader.loader, echo_factor=e)
    e = 1.0 if form == "plain" else e
    accum = 4
    updates_per_epoch = (len(loader) + accum - 1) // accum  # the scheduler's, before iter()
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), 0.01)
    epochs = []
    for epoch in range(2):
        _set_loader_epoch(loader, epoch)
        epochs.append(train_one_epoch(epoch, model, loader, optimizer, accum, 1))
    echo = loader if form == "echo_outer" else loader.loader
    if form != "plain":
        echo.close()
    copies = copies_per_epoch(e, 40)  # 40 rows read: drop_last drops nothing
    assert updates_per_epoch == math.ceil(copies / 4 / accum)
    assert epochs[0][0] + epochs[1][0] == list(range(1, 2 * updates_per_epoch + 1))
    assert dataset.epochs == [0, 1] and loader.mixup_enabled is False
    assert collate.mixup_enabled is False  # the write reached the collate in this process
    for epoch, (_updates, steps) in enumerate(epochs):
        assert len(steps) == copies // 4
        got = collections.Counter(i for ids, _ in steps for i in ids)
        assert sorted(got) == list(range(40)) and set(got.values()) <= {math.floor(e), math.ceil(e)}
        mixed = {m for _, flags in steps for m in flags}
        # persistent workers keep the collate they started with, with EchoLoader or without
        assert mixed == ({True} if epoch == 0 or persistent else {False})


@pytest.mark.parametrize("workers", [0, 2])
def test_fast_collate_uint8_batches_are_echoed_exactly(workers) -> None:
    loader = DataLoader(Pictures(30), batch_size=4, shuffle=True, num_workers=workers,
                        collate_fn=fast_collate)  # fmt: skip
    with EchoLoader(loader, 2.5) as el:
        assert len(el) == math.ceil(75 / 4)
        got, steps = collections.Counter(), 0
        for images, targets in el:
            steps += 1
            assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, 4, 4)
            ids = images[:, 0, 0, 0].long()
            assert torch.equal(images, ids.to(torch.uint8).view(-1, 1, 1, 1).expand_as(images))
            assert targets.dtype == torch.int64 and torch.equal(targets, ids % CLASSES)
            got.update(ids.tolist())
    assert steps == 19 and sorted(got) == list(range(30)) and sum(got.values()) == 75
    assert set(got.values()) == {2, 3}


@pytest.mark.parametrize(("e", "rank"), [(2.0, 0), (1.5, 1)])
def test_repeated_augmentation_sampler_copies_and_len(e, rank) -> None:
    dataset = Pictures(22)
    sampler = RepeatAug(dataset, num_replicas=2, rank=rank)  # 11 of 66 rows, 8 kept (drop_last)
    with EchoLoader(create_loader(dataset, sampler=sampler), echo_factor=e) as loader:
        for epoch in range(2):
            _set_loader_epoch(loader, epoch)
            steps, got = len(loader), collections.Counter()
            for images, _target in loader:
                got.update(_ids(images).tolist())
            reference = RepeatAug(dataset, 2, rank)
            reference.set_epoch(epoch)
            rows = collections.Counter(list(reference)[:8])
            assert sampler.epoch == epoch and steps == copies_per_epoch(e, 8) // 4
            assert sum(got.values()) == 4 * steps and set(got) <= set(rows)
            for i, n in rows.items():  # each row read gets floor(e) or ceil(e) copies
                assert math.floor(e) * n <= got[i] <= math.ceil(e) * n


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_set_through_echoloader_between_epochs(workers) -> None:
    dataset = Pictures(24)
    with EchoLoader(create_loader(dataset, workers=workers), echo_factor=2.0) as loader:
        for size in (4, 8, 4):  # progressive resizing, then back
            loader.dataset.transform = Grow(size)
            steps, got = len(loader), collections.Counter()
            for images, _target in loader:
                assert tuple(images.shape[1:]) == (3, size, size)
                got.update(_ids(images).tolist())
            assert steps == 12 and got == {i: 2 for i in range(24)}


class Repeats(IterableDataset):
    """timm's streaming readers with ``--epoch-repeats``: each worker yields ``repeats * n``
    split over the workers, rounded up to whole batches, cycling through its shard in an
    order seeded by the epoch, a shared value that persistent workers see."""

    def __init__(self, n: int, repeats: float, batch_size: int, num_workers: int) -> None:
        self.n, self.repeats = n, repeats
        self.batch_size, self.num_workers = batch_size, num_workers
        self.epoch = mp.Value("i", 0)

    def per_worker(self) -> int:
        count = math.ceil(max(1.0, self.repeats) * self.n / max(self.num_workers, 1))
        return math.ceil(count / self.batch_size) * self.batch_size

    def __len__(self) -> int:
        return self.per_worker() * max(self.num_workers, 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch.value = epoch

    def ids(self, worker: int, workers: int, epoch: int) -> list[int]:
        shard = list(range(worker, self.n, workers))
        random.Random(100 * epoch + worker).shuffle(shard)
        return [shard[k % len(shard)] for k in range(self.per_worker())]

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in self.ids(worker, workers, self.epoch.value):
            yield np.full((3, 4, 4), i, dtype=np.uint8), i % CLASSES


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, True)])
def test_epoch_repeats_of_an_iterable_dataset(workers, persistent) -> None:
    dataset, e = Repeats(20, 1.5, 4, workers), 1.5  # 32 (2 workers) or 32 (0) rows an epoch
    loader = EchoLoader(create_loader(dataset, workers=workers, persistent=persistent), e)
    with loader, warnings.catch_warnings():
        warnings.simplefilter("error")  # no "len() was off"
        for epoch in range(2):
            _set_loader_epoch(loader, epoch)
            steps, got = len(loader), collections.Counter()
            for images, _target in loader:
                got.update(_ids(images).tolist())
            rows = collections.Counter(
                i for w in range(max(workers, 1)) for i in dataset.ids(w, max(workers, 1), epoch)
            )
            assert steps == copies_per_epoch(e, 32) // 4 and sum(got.values()) == 4 * steps
            assert set(got) <= set(rows)
            for i, n in rows.items():
                assert math.floor(e) * n <= got[i] <= math.ceil(e) * n


def test_multi_epochs_loader_with_persistent_workers() -> None:
    inner = create_loader(Pictures(26), workers=2, persistent=True, multi_epochs=True)
    loader = EchoLoader(inner, echo_factor=2.5)
    for epoch in range(3):
        _set_loader_epoch(loader, epoch)
        steps, got, count = len(loader), collections.Counter(), 0
        for images, _target in loader:
            count += 1
            got.update(_ids(images).tolist())
        assert steps == count == copies_per_epoch(2.5, 24) // 4  # 24 of 26 read: drop_last
        assert len(got) == 24 and set(got.values()) <= {2, 3} and sum(got.values()) == 60
    workers = inner.loader.iterator._workers
    loader.close()  # ends the workers of the iterator the loader keeps for its life
    for w in workers:
        w.join(10)
    assert not any(w.is_alive() for w in workers)


class HardWhenOff(MixupCollate):
    """A collate that mixes into soft float targets and, once off, returns fast_collate's
    int64 labels (torchvision's MixUp in a collate does): the targets' dtype and shape change
    between epochs."""

    def __call__(self, batch):
        return super().__call__(batch) if self.mixup_enabled else fast_collate(batch)


def test_mixup_off_that_changes_the_targets_and_a_resume_after_a_new_size() -> None:
    dataset, collate = Pictures(16), HardWhenOff()
    order = SequentialSampler(dataset)  # a resume re-reads the epoch in the same order
    inner = create_loader(dataset, collate_fn=collate, sampler=order, prefetcher=False)
    with EchoLoader(inner, echo_factor=2.0, shuffle_buffer=8) as loader:
        list(loader)
        loader.collate_fn.mixup_enabled = False  # (a DataLoader has no mixup_enabled)
        loader.dataset.transform = Grow(8)
        state = None
        for step, (images, target) in enumerate(loader):
            assert target.dtype == torch.int64 and tuple(images.shape[1:]) == (3, 8, 8)
            if step == 2:
                state = loader.state_dict()  # mid-epoch, in the new layout
    assert state is not None and state["mid_epoch"]
    again = create_loader(dataset, collate_fn=collate, sampler=order, prefetcher=False)
    resumed = EchoLoader(again, 2.0,
                         shuffle_buffer=8)  # fmt: skip
    with resumed:
        resumed.load_state_dict(state)
        rest = [len(images) for images, target in resumed]
    assert len(rest) == 8 - 3 and sum(rest) == 32 - 12


def test_multi_epochs_loader_without_drop_last_after_an_epoch_left_early() -> None:
    # Its passes come from one stream of batches: after a pass left early the next starts
    # mid-way, so its short batch (2 of 10 rows) comes mid-pass, which a DataLoader takes.
    inner = MultiEpochs(Pictures(10), batch_size=4, shuffle=False, drop_last=False)
    with EchoLoader(inner, echo_factor=1.0, shuffle_buffer=8) as loader:
        for _ in loader:
            break
        with pytest.warns(RuntimeWarning, match="one stream it keeps"):  # read-ahead lost
            got = collections.Counter(i for images, _ in loader for i in _ids(images).tolist())
    assert sum(got.values()) == 10  # a pass: len() batches of the stream


class TwoViews(Pictures):
    """AugMixDataset's shape (timm's ``--aug-splits 2``): each sample is a tuple of views."""

    def __getitem__(self, i: int):
        image, target = super().__getitem__(i)
        return (image, image.copy()), target


def split_collate(batch):
    """fast_collate of tuple samples: view j of sample i goes to row i + j * len(batch)."""
    views = len(batch[0][0])
    tensor = torch.zeros((len(batch) * views, *batch[0][0][0].shape), dtype=torch.uint8)
    targets = torch.zeros(len(batch) * views, dtype=torch.int64)
    for i, (images, target) in enumerate(batch):
        for j, image in enumerate(images):
            tensor[i + j * len(batch)] += torch.from_numpy(image)
            targets[i + j * len(batch)] = target
    return tensor, targets


def test_aug_split_batches_are_refused_naming_the_views() -> None:
    # Rows of one sample's views must stay in one batch at i, i + B...: no row can be echoed
    # alone, so EchoLoader refuses them, and its message names this case, not only lists.
    loader = create_loader(TwoViews(16), collate_fn=split_collate, prefetcher=False)
    with EchoLoader(loader, echo_factor=2.0) as el, pytest.raises(LayoutError) as info:
        next(iter(el))
    assert "8 rows" in str(info.value) and "augmentation splits" in str(info.value)
