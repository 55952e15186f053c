"""Training programs of the shape of pytorch/examples ``imagenet/main.py`` and timm ``train.py``
run an epoch with a 2-line EchoLoader wrap and are otherwise unchanged.

torchvision and timm have no build for the CPU torch used here, so the programs are written in
this file (not copied) and make the same calls on the train loader as the public ones:
``ProgressMeter(len(train_loader))``, ``train_sampler.set_epoch(epoch)``, ``updates_per_epoch =
len(loader_train)``, ``_set_loader_epoch`` reading ``loader.dataset``/``batch_sampler``/
``sampler``, ``loader.mixup_enabled`` read and set, a ``create_loader`` that returns a
``PrefetchLoader``-like wrapper iterating (input, target) on its own. Samples are identified by
value: what the model sees, and the labels the loss sees, are checked per epoch.
"""

from __future__ import annotations

import collections
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from echopipe.torch import EchoLoader

CLASSES = 5


class Images(Dataset):
    """Image i is a 3x4x4 tensor filled with i, its target i % CLASSES; records set_epoch."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((3, 4, 4), float(i)), i % CLASSES

    def set_epoch(self, epoch: int) -> None:  # timm's datasets have it; _set_loader_epoch calls
        self.epochs.append(epoch)


class Seen(nn.Module):
    """First layer of the test's model: records which images each step trained on."""

    def __init__(self, decode=lambda x: x) -> None:
        super().__init__()
        self.decode = decode
        self.batches: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append([round(v) for v in self.decode(x[:, 0, 0, 0]).tolist()])
        return x.flatten(1)


class Targets(nn.CrossEntropyLoss):
    """The loss, recording the targets of each step (to check them against the images)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[int]] = []

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.batches.append(target.tolist())
        return super().forward(output, target)


def tiny_model(decode=lambda x: x) -> nn.Sequential:
    return nn.Sequential(Seen(decode), nn.Linear(48, CLASSES))


def per_epoch(model: nn.Sequential, loss: Targets, steps: list[int]) -> list[collections.Counter]:
    """Copies of each image per epoch, after checking every target against its image."""
    seen: list[int] = []
    for ids, targets in zip(model[0].batches, loss.batches, strict=True):
        assert [i % CLASSES for i in ids] == targets
        seen.append(ids)
    out, start = [], 0
    for n in steps:
        out.append(collections.Counter(i for ids in seen[start : start + n] for i in ids))
        start += n
    return out


# ---- a program of the shape of pytorch/examples imagenet/main.py ----
class ProgressMeter:
    def __init__(self, num_batches: int, prefix: str = "") -> None:
        self.num_batches, self.prefix, self.shown = num_batches, prefix, 0

    def display(self, batch: int) -> None:
        self.shown = batch
        print(f"{self.prefix}[{batch}/{self.num_batches}]")


def examples_train(train_loader, model, criterion, optimizer, epoch) -> ProgressMeter:
    progress = ProgressMeter(len(train_loader), prefix=f"Epoch: [{epoch}]")
    model.train()
    for i, (images, target) in enumerate(train_loader):
        images = images.to("cpu", non_blocking=True)
        target = target.to("cpu", non_blocking=True)
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        progress.display(i + 1)
    return progress


def examples_main(dataset, model, criterion, distributed, workers, echo_factor):
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    train_sampler = DistributedSampler(dataset) if distributed else None
    train_loader = DataLoader(
        dataset, batch_size=8, shuffle=(train_sampler is None),
        num_workers=workers, pin_memory=True, sampler=train_sampler)  # fmt: skip
    if echo_factor is not None:  # the 2-line wrap (with `from echopipe.torch import EchoLoader`)
        train_loader = EchoLoader(train_loader, echo_factor=echo_factor)
    progress = []
    for epoch in range(2):
        if distributed:
            train_sampler.set_epoch(epoch)
        progress.append(examples_train(train_loader, model, criterion, optimizer, epoch))
    return progress, train_loader


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")  # pin_memory=True, no GPU here
@pytest.mark.parametrize(
    ("echo_factor", "distributed", "workers"), [(None, False, 0), (2.0, False, 2), (1.5, True, 0)]
)
def test_pytorch_examples_shaped_program(echo_factor, distributed, workers) -> None:
    dataset, model, loss = Images(53), tiny_model(), Targets()
    with tempfile.TemporaryDirectory() as tmp:
        if distributed:  # a world of one process: DistributedSampler(dataset) as in the program
            store = f"file://{os.path.join(tmp, 'store')}"
            dist.init_process_group("gloo", init_method=store, world_size=1, rank=0)
        try:
            progress, loader = examples_main(dataset, model, loss, distributed, workers,
                                             echo_factor)  # fmt: skip
        finally:
            if distributed:
                dist.destroy_process_group()
    steps = [p.num_batches for p in progress]
    assert [p.shown for p in progress] == steps  # the progress total is the steps run
    assert len(model[0].batches) == sum(steps)
    e = echo_factor or 1.0
    copies = math.floor(e) * 53 + math.floor((e - math.floor(e)) * 53 + 0.5)
    assert steps == [math.ceil(copies / 8)] * 2
    for got in per_epoch(model, loss, steps):
        assert sorted(got) == list(range(53)) and sum(got.values()) == copies
        assert set(got.values()) <= {math.floor(e), math.ceil(e)}
    if distributed:
        assert loader.sampler.epoch == 1  # set_epoch reached the sampler the loader reads
    if echo_factor is not None:
        loader.close()


# ---- a program of the shape of timm train.py with create_loader and its PrefetchLoader ----
class MixupCollate:
    """A collate with a ``mixup_enabled`` switch, like timm's FastCollateMixup; it marks the
    images of batches it mixed (+1000) so the test can tell."""

    def __init__(self) -> None:
        self.mixup_enabled = True

    def __call__(self, batch):
        images = torch.stack([b[0] for b in batch]) + (1000.0 if self.mixup_enabled else 0.0)
        return images, torch.tensor([b[1] for b in batch])


class Prefetcher:
    """timm's PrefetchLoader's shape: normalizes, iterates (input, target) on its own, and has
    ``loader``, ``sampler``, ``batch_sampler``, ``dataset`` and ``mixup_enabled``."""

    mean, std = 0.5, 0.25

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __iter__(self):
        for images, target in self.loader:
            yield images.float().sub_(self.mean).div_(self.std), target

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


def create_loader(dataset, batch_size, is_training, num_workers, distributed, collate_fn):
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1) if distributed else None
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=sampler is None and is_training,
                        num_workers=num_workers, sampler=sampler, collate_fn=collate_fn,
                        drop_last=is_training)  # fmt: skip
    return Prefetcher(loader)


def _set_loader_epoch(loader, epoch: int) -> None:
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)
    if hasattr(loader.batch_sampler, "set_epoch"):
        loader.batch_sampler.set_epoch(epoch)
    elif hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, accum_steps, mixup_off_epoch,
                    updates):  # fmt: skip
    if mixup_off_epoch and epoch >= mixup_off_epoch and loader.mixup_enabled:
        loader.mixup_enabled = False
    last_accum_steps = len(loader) % accum_steps
    updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps
        (loss_fn(model(input), target) / accum_steps).backward()
        if need_update:
            optimizer.step()
            optimizer.zero_grad()
            num_updates += 1
            updates.append((epoch, batch_idx, num_updates))


def timm_main(dataset, model, loss_fn, distributed, workers, echo_factor, inside):
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    loader_train = create_loader(dataset, 8, True, workers, distributed, MixupCollate())
    if echo_factor is not None and not inside:  # the 2-line wrap (with the import)
        loader_train = EchoLoader(loader_train, echo_factor=echo_factor)
    elif echo_factor is not None:  # or inside the prefetcher: echo before its device copy
        loader_train.loader = EchoLoader(loader_train.loader, echo_factor=echo_factor)
    accum = 3
    updates_per_epoch = (len(loader_train) + accum - 1) // accum
    updates: list = []
    for epoch in range(2):
        _set_loader_epoch(loader_train, epoch)
        train_one_epoch(epoch, model, loader_train, optimizer, loss_fn, accum, 1, updates)
    return loader_train, updates_per_epoch, updates


@pytest.mark.parametrize(
    ("echo_factor", "distributed", "workers", "inside"),
    [(None, False, 2, False), (2.0, False, 2, False), (2.5, True, 0, False), (1.5, True, 0, True)],
)
def test_timm_shaped_program(echo_factor, distributed, workers, inside) -> None:
    dataset, loss = Images(58), Targets()
    model = tiny_model(decode=lambda x: x * Prefetcher.std + Prefetcher.mean)
    loader, updates_per_epoch, updates = timm_main(dataset, model, loss, distributed, workers,
                                                   echo_factor, inside)  # fmt: skip
    # every update the scheduler counted, the last one of each epoch at updates_per_epoch
    assert [u[2] for u in updates] == list(range(1, 2 * updates_per_epoch + 1))
    steps = [1 + max(u[1] for u in updates if u[0] == ep) for ep in range(2)]
    assert len(model[0].batches) == sum(steps)
    e = echo_factor or 1.0
    share = [DistributedSampler(dataset, num_replicas=2, rank=1) for _ in range(2)]
    for ep, s in enumerate(share):
        s.set_epoch(ep)
    read = [list(s)[:24] if distributed else list(range(56)) for s in share]  # drop_last
    copies = math.floor(e) * len(read[0])
    copies += math.floor((e - math.floor(e)) * len(read[0]) + 0.5)
    # drop_last (a training loader): EchoLoader drops its own short last batch too, every batch
    # is full (timm's Mixup asserts an even batch size, BatchNorm needs more than one row)
    assert steps == [copies // 8] * 2 and updates_per_epoch == math.ceil(steps[0] / 3)
    assert all(len(ids) == 8 for ids in model[0].batches)
    assert dataset.epochs == [0, 1]  # _set_loader_epoch reached the dataset
    assert loader.mixup_enabled is False and loader.loader.collate_fn.mixup_enabled is False
    first, rest = model[0].batches[: steps[0]], model[0].batches[steps[0] :]
    assert all(i >= 1000 for ids in first for i in ids)  # mixed in epoch 0
    assert all(i < 1000 for ids in rest for i in ids)  # mixup off from epoch 1 on
    model[0].batches = [[i % 1000 for i in ids] for ids in model[0].batches]
    for ep, got in enumerate(per_epoch(model, loss, steps)):
        # drop_last: a RandomSampler drops 2 of 58, the DistributedSampler's share 5 of 29
        # the dropped batch's copies (fewer than 8) are missing, as DataLoader drops samples
        assert sum(got.values()) == 8 * steps[ep] > copies - 8
        assert set(got) <= set(read[ep]) if distributed else len(got) <= 56
        assert len(got) > len(read[ep]) - 8 and max(got.values()) <= math.ceil(e)
        assert sum(math.floor(e) - v for v in got.values() if v < math.floor(e)) < 8
    if echo_factor is not None:
        (loader.loader if inside else loader).close()
