"""More training programs around EchoLoader: timm's training loader (``drop_last``, persistent
workers, ``worker_init_fn``) with the in-loop ``Mixup`` and BatchNorm, an ImageFolder-like
dataset of real JPEGs whose file names are not valid UTF-8, a webdataset-like iterable dataset.

Written in this file in the shape of timm's ``create_loader``/``train_one_epoch`` (timm has no
build for the CPU torch used here). Samples are identified by value.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import random
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from echopipe.torch import EchoLoader


class Images(Dataset):
    """Image i is a 3x4x4 tensor filled with i, its target i % 10."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((3, 4, 4), float(i)), i % 10


def _worker_init(worker_id: int, worker_seeding: str = "all") -> None:
    assert get_worker_info().id == worker_id


def create_loader(dataset: Dataset, batch_size: int, is_training: bool) -> DataLoader:
    """timm's create_loader without the prefetcher: drop_last for training, persistent workers."""
    init = functools.partial(_worker_init, worker_seeding="all")
    return DataLoader(dataset, batch_size=batch_size, shuffle=is_training, num_workers=2,
                      drop_last=is_training, persistent_workers=True, prefetch_factor=2,
                      worker_init_fn=init)  # fmt: skip


class Mixup:
    """timm's Mixup in the train loop (``mixup_fn(input, target)``): pairs row i with row -1-i,
    so it needs an even batch, which timm's drop_last gives."""

    def __call__(self, x: torch.Tensor, target: torch.Tensor):
        assert len(x) % 2 == 0, "Batch size should be even when using this"
        one_hot = nn.functional.one_hot(target, 10).float()
        return x.mul(0.7).add_(x.flip(0).mul_(0.3)), one_hot * 0.7 + one_hot.flip(0) * 0.3


@pytest.mark.parametrize("e", [1.3, 1.177, 2.0])  # short last batches of 13 and 1 rows, none
def test_a_drop_last_training_loader_gets_only_full_batches_for_mixup_and_batchnorm(e) -> None:
    loader = EchoLoader(create_loader(Images(100), 16, True), echo_factor=e)  # 96 read
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 10), nn.BatchNorm1d(10))
    optimizer = torch.optim.SGD(model.parameters(), 0.01)
    steps = len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, epochs=2, steps_per_epoch=steps)
    mixup_fn, seen, states = Mixup(), [], []
    copies = math.floor(e) * 96 + math.floor((e - math.floor(e)) * 96 + 0.5)
    with loader, warnings.catch_warnings():
        warnings.simplefilter("error")  # no state leaves copies out, no len() was off
        for _epoch in range(2):
            ids: collections.Counter = collections.Counter()
            for batch_idx, (input, target) in enumerate(loader):
                assert torch.equal(input[:, 0, 0, 0].long() % 10, target)
                ids.update(input[:, 0, 0, 0].long().tolist())
                input, target = mixup_fn(input, target)
                loss = torch.sum(-target * torch.log_softmax(model(input), -1), -1).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sched.step()  # raises past epochs * steps_per_epoch
                if batch_idx == steps - 1:  # the last step: timm's recovery checkpoint
                    states.append(loader.state_dict())
            seen.append(ids)
    assert steps == copies // 16
    for ids in seen:  # every batch full; the dropped one's copies (fewer than 16) are missing
        assert sum(ids.values()) == 16 * steps > copies - 16 and max(ids.values()) <= math.ceil(e)
    # The state after the last full batch is the one after the epoch: a resume starts the next.
    assert [(s["epoch"], s["mid_epoch"]) for s in states] == [(1, False), (2, False)]


def _jpeg(path: bytes, value: int) -> None:
    Image.fromarray(np.full((6, 5, 3), value, dtype=np.uint8)).save(path, format="JPEG")


class Folder(Dataset):
    """ImageFolder's shape: file names from ``os.listdir`` of a ``str`` folder, so a name that
    is not valid UTF-8 on disk comes with lone surrogates (``surrogateescape``)."""

    def __init__(self, root: str) -> None:
        self.paths = sorted(os.path.join(root, name) for name in os.listdir(root))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        with Image.open(self.paths[i]) as im:
            image = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
        return image, i, self.paths[i]


def test_file_names_that_are_not_utf8_come_back_as_os_listdir_gave_them(tmp_path) -> None:
    root = os.fsencode(tmp_path)
    for i in range(12):
        name = b"img_%d\xff\xfe.jpg" % i if i % 3 == 0 else "img_%d_é.jpg".encode() % i
        _jpeg(os.path.join(root, name), 20 * i)
    dataset = Folder(str(tmp_path))
    assert any("\udcff" in p for p in dataset.paths)  # the surrogates the test is about
    got: collections.Counter = collections.Counter()
    with EchoLoader(DataLoader(dataset, batch_size=4, num_workers=2), 2.0, timeout=60) as el:
        for images, index, paths in el:
            for image, i, path in zip(images, index.tolist(), paths, strict=True):
                assert path == dataset.paths[i] and os.path.exists(path)
                assert torch.equal(image, dataset[i][0])
                got[path] += 1
    assert got == {p: 2 for p in dataset.paths}


class Shards(IterableDataset):
    """webdataset's shape: shards split over the DataLoader's workers, dict samples with a
    ``__key__`` string; ``len()`` is the whole epoch's samples."""

    def __init__(self, n: int, shards: int) -> None:
        self.n, self.shards = n, shards

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for shard in range(first, self.shards, step):
            for i in range(shard, self.n, self.shards):
                yield {"jpg": torch.full((3, 4, 4), i, dtype=torch.uint8), "cls": i % 7,
                       "__key__": f"{i:06d}"}  # fmt: skip


def test_a_sharded_iterable_dataset_of_dict_samples_is_echoed_exactly() -> None:
    loader = DataLoader(Shards(53, 4), batch_size=8, num_workers=2)
    with EchoLoader(loader, 1.5) as el:
        for _epoch in range(2):
            steps, got, step = len(el), collections.Counter(), 0
            for batch in el:
                step += 1
                ids = batch["jpg"][:, 0, 0, 0].long()
                assert [int(k) for k in batch["__key__"]] == ids.tolist()
                assert torch.equal(batch["cls"], ids % 7)
                got.update(ids.tolist())
            assert step == steps == math.ceil(80 / 8)  # 53 + round(26.5) copies
            assert sorted(got) == list(range(53)) and sum(got.values()) == 80
            assert set(got.values()) == {1, 2}


class ShuffledShards(Shards):
    """``Shards`` shuffled in each worker with Python's ``random``, which torch seeds per worker
    from the DataLoader's base seed (webdataset's ``.shuffle()`` draws from such an RNG)."""

    def __iter__(self):
        samples = list(super().__iter__())
        random.shuffle(samples)
        yield from samples


def test_a_worker_shuffled_iterable_dataset_resumed_mid_epoch_rereads_its_order() -> None:
    """The workers' seeds come from the DataLoader's ``generator``, a draw per pass: a resumed
    process's generator started at its seed, i.e. at epoch 0's shuffle, and resuming epoch 1
    skipped other samples than the ones read (6 of 30 missed, 6 delivered 4 times)."""

    def data() -> DataLoader:
        return DataLoader(ShuffledShards(30, 6), batch_size=4, num_workers=2, timeout=60,
                          generator=torch.Generator().manual_seed(5))  # fmt: skip

    seen: collections.Counter = collections.Counter()
    with EchoLoader(data(), 2.0) as el:
        assert sum(len(b["cls"]) for b in el) == 60  # epoch 0
        for i, batch in enumerate(el):
            seen.update(batch["jpg"][:, 0, 0, 0].tolist())
            if i == 4:
                state = el.state_dict()
                break
    assert state["mid_epoch"] and state["order_rng"] is not None
    with EchoLoader(data(), 2.0) as el:
        el.load_state_dict(state)
        for batch in el:
            seen.update(batch["jpg"][:, 0, 0, 0].tolist())
    assert sorted(seen) == list(range(30)) and set(seen.values()) == {2}
