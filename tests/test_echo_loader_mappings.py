"""Batch containers and layouts through EchoLoader with a real DataLoader (worker processes):
the echoed batches keep a ``defaultdict``'s class and ``default_factory``, an ``OrderedDict``'s
class and key order, a namedtuple's class, as the plain DataLoader's batches have them; a state
saved between epochs resumes into an epoch of another layout."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from echopipe.torch import EchoLoader

N = 24


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class Counts(collections.defaultdict):
    """A defaultdict subclass: its class comes back too."""


def rows(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([torch.full((2,), float(i)) for i in ids]), torch.tensor(ids)


def defaultdict_list(ids: list[int]) -> Any:
    batch = collections.defaultdict(list)
    batch["x"], batch["y"] = rows(ids)
    return batch


def defaultdict_lambda(ids: list[int]) -> Any:
    batch = Counts(lambda: -1)  # a new factory per batch: still one layout
    batch["x"], batch["y"] = rows(ids)
    return batch


def ordered(ids: list[int]) -> Any:
    x, y = rows(ids)
    return collections.OrderedDict(y=y, x=x)  # key order not sorted


def named(ids: list[int]) -> Any:
    return Pair(*rows(ids))


@dataclasses.dataclass
class Rows:
    x: torch.Tensor
    y: torch.Tensor


def as_dataclass(ids: list[int]) -> Any:
    return Rows(*rows(ids))


class Encoding(collections.UserDict):
    """A Hugging Face ``BatchEncoding``-like mapping: a ``UserDict`` with a ``.to()``."""

    def to(self, device: Any) -> Encoding:
        return Encoding({k: v.to(device) for k, v in self.items()})


def encoding(ids: list[int]) -> Any:
    x, y = rows(ids)
    return Encoding(x=x, y=y)


def fields(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, tuple | Rows):
        return batch.x, batch.y
    return batch["x"], batch["y"]


@pytest.mark.parametrize("collate", [defaultdict_list, defaultdict_lambda, ordered, named])
def test_containers_round_trip_as_the_plain_dataloader_gives_them(collate: Callable) -> None:
    # a lambda factory cannot be pickled back from a worker process (the plain DataLoader's too)
    workers = 0 if collate is defaultdict_lambda else 2
    dl = DataLoader(list(range(N)), batch_size=4, num_workers=workers, collate_fn=collate,
                    timeout=60 if workers else 0)  # fmt: skip
    plain = next(iter(dl))
    got: collections.Counter = collections.Counter()
    with EchoLoader(dl, 2.0, shuffle_buffer=8) as el:
        for _epoch in range(2):
            for batch in el:
                assert type(batch) is type(plain)
                if isinstance(plain, dict):
                    assert list(batch) == list(plain)
                if isinstance(plain, collections.defaultdict):
                    assert batch.default_factory() == plain.default_factory()
                    assert batch["missing"] == plain.default_factory()  # the factory works
                    del batch["missing"]
                x, y = fields(batch)
                assert torch.equal(x, y.view(-1, 1).float().expand_as(x))
                got.update(y.tolist())
    assert got == {i: 4 for i in range(N)}


@pytest.mark.parametrize("collate", [defaultdict_list, ordered, named, as_dataclass, encoding])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_containers_moved_to_the_device_keep_their_class_and_every_tensor_moves(
    collate: Callable, device: str
) -> None:
    """``device=`` moved the tensors of plain dicts, tuples and lists only: an ``OrderedDict``
    or ``defaultdict`` came back as a plain dict (its factory lost), and a dataclass's or a
    ``UserDict``'s (a ``BatchEncoding``'s) tensors stayed on the host. ``meta`` is the device
    other than the CPU that torch has here: a tensor left behind stays a CPU one."""
    dl = DataLoader(list(range(N)), batch_size=4, collate_fn=collate)
    plain = next(iter(dl))
    with EchoLoader(dl, 2.0, shuffle_buffer=8, device=device) as el:
        batches = list(el)
    assert len(batches) == 2 * N // 4
    for batch in batches:
        assert type(batch) is type(plain)
        if isinstance(plain, collections.abc.Mapping):
            assert list(batch) == list(plain)
        if isinstance(plain, collections.defaultdict):
            assert batch["missing"] == []
        assert all(t.device.type == device for t in fields(batch))
    if device == "cpu":
        got = collections.Counter(i for b in batches for i in fields(b)[1].tolist())
        assert got == {i: 2 for i in range(N)}


class Resized(Dataset):
    """Sample i: an image of i at ``size`` (a transform set between epochs changes it), i."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, self.size, self.size), float(i)), i


def test_a_state_saved_between_epochs_resumes_into_a_new_layout() -> None:
    """Progressive resizing with a checkpoint at each epoch's end: the state holds no samples,
    so the resumed run's next epoch, at the new image size, is a fresh epoch as it is without a
    resume (it was refused: "the batches differ from the saved state")."""
    dl = DataLoader(Resized(N, 8), batch_size=4, num_workers=2, timeout=60)
    with EchoLoader(dl, 2.0, shuffle_buffer=8) as el:
        assert sum(len(y) for _x, y in el) == 2 * N
        state = el.state_dict()
    assert not state["mid_epoch"]
    dl = DataLoader(Resized(N, 12), batch_size=4, num_workers=2, timeout=60)
    with EchoLoader(dl, 2.0, shuffle_buffer=8) as el:
        el.load_state_dict(state)
        got: collections.Counter = collections.Counter()
        for x, y in el:
            assert x.shape[1:] == (3, 12, 12)
            assert torch.equal(x, y.view(-1, 1, 1, 1).float().expand_as(x))
            got.update(y.tolist())
        assert got == {i: 2 for i in range(N)}
        assert el.stats().epoch == 2
        again = el.state_dict()
    assert again["layout"] != state["layout"]  # the new epoch's layout is the one saved
