"""A training program of the shape of pytorch/examples ``imagenet/main.py`` (a DataLoader with
worker processes, a small model, SGD, ``for i, (images, target) in enumerate(train_loader)``),
run as a child process by ``tests/test_echo_loader_shutdown.py`` to interrupt or kill it.

``python shutdown_program.py WRAP PERSISTENT END``: ``WRAP`` is ``echo`` (EchoLoader around the
DataLoader) or ``plain``; ``PERSISTENT`` is 0 or 1 (``persistent_workers``); ``END`` is how the
run ends: ``run`` (trains until a signal arrives), ``raise`` (the step raises ``ValueError`` at
step 3; the program catches it outside the loop and goes on), ``with`` (two epochs inside
``with EchoLoader(...)``, then more work after the block), ``timm`` (a loader with one iterator
for its whole life, as timm's MultiEpochsDataLoader: two epochs, ``close()``, then more work),
``timmrun`` (that loader, trained on until a signal arrives).
It prints ``workers PID PID`` once the loop runs and ``running`` at every step after that;
``closed`` where the END leaves the loader and goes on.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from echopipe.torch import EchoLoader

CLASSES = 4


class Images(Dataset):
    """Image i: a 3x8x8 tensor of i, target i % CLASSES; each read takes 2 ms (a JPEG decode)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.002)
        return torch.full((3, 8, 8), float(i % 7)), i % CLASSES


class RepeatingBatches:
    """A batch sampler that yields its inner sampler's batches for ever (a wrapped one ends)."""

    def __init__(self, batches: BatchSampler) -> None:
        self.sampler = batches  # the name timm's _RepeatSampler gives it

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        while True:
            yield from self.sampler


class OneIteratorLoader(DataLoader):
    """A DataLoader that makes its (multi-process) iterator once, in ``__init__``, over a batch
    sampler that never ends, and takes ``len(self)`` batches of it per epoch: the mechanics of
    timm's ``MultiEpochsDataLoader`` (its workers live as long as the loader)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # DataLoader refuses a new batch_sampler after its __init__; timm sets it the same way
        object.__setattr__(self, "batch_sampler", RepeatingBatches(self.batch_sampler))
        self.iterator = super().__iter__()

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self.iterator)


def worker_pids() -> list[int]:
    """Pids of this process's running children: its DataLoader workers."""
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                pids.append(int(entry))
    return sorted(pids)


def main() -> None:
    wrap, persistent, end = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    kind = OneIteratorLoader if end in ("timm", "timmrun") else DataLoader
    sampler = RandomSampler(Images(256))
    train_loader = kind(sampler.data_source, batch_size=16, sampler=sampler, num_workers=2,
                        pin_memory=False, persistent_workers=persistent)  # fmt: skip
    if wrap == "echo":
        train_loader = EchoLoader(train_loader, echo_factor=2.0)
    if end == "with":
        with train_loader as batches:
            for _epoch in range(2):
                train(batches, model, criterion, optimizer, end)
        print("closed", flush=True)
        go_on()
    epochs = 2 if end == "timm" else 10**6
    try:
        for _epoch in range(epochs):
            train(train_loader, model, criterion, optimizer, end)
    except ValueError:  # the step's failure: the program goes on (to evaluate, to save)
        print("closed", flush=True)
        go_on()
    if end == "timm":
        train_loader.close()
        print("closed", flush=True)
        go_on()


def train(train_loader, model, criterion, optimizer, end: str) -> None:
    model.train()
    for i, (images, target) in enumerate(train_loader):
        if i == 0:
            print("workers", *worker_pids(), flush=True)
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if end == "raise" and i == 3:
            raise ValueError("a step failed")
        print("running", flush=True)
        time.sleep(0.01)


def go_on() -> None:
    """After the loader is closed: the program goes on (the parent checks the workers, then
    ends it)."""
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
