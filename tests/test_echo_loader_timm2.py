"""A ``MultiEpochsDataLoader``-shaped loader (timm: one iterator made in ``__init__`` over a batch
sampler that repeats for ever, ``len()`` batches of it per pass) left early with a ``break``: the
EchoLoader's reader had read ahead of the batches delivered, and those batches' copies not yet
delivered are not in the shared stream any more, where the plain loader's next pass starts with
them. The next pass warns once, naming the loader's stream (keeping them is not done)."""

from __future__ import annotations

import collections
import warnings

import pytest
from torch.utils.data import DataLoader

from echopipe.torch import EchoLoader

N = 48


class Repeating:
    """timm's ``_RepeatSampler``: the inner batch sampler's batches for ever."""

    def __init__(self, batches) -> None:
        self.sampler = batches

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        while True:
            yield from self.sampler


class MultiEpochs(DataLoader):
    """timm's ``MultiEpochsDataLoader`` mechanics."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "batch_sampler", Repeating(self.batch_sampler))
        self.iterator = super().__iter__()

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self.iterator)


def test_the_plain_loader_continues_its_stream_after_a_break() -> None:
    """What the warning is about: the plain loader's next pass starts where the break left."""
    dl = MultiEpochs(list(range(N)), batch_size=8, num_workers=2, timeout=60)
    first = next(iter(dl)).tolist()
    again = [b.tolist() for b in dl]
    assert first == list(range(8)) and again[0] == list(range(8, 16))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_after_a_break_warns_once_that_read_ahead_copies_were_lost(workers) -> None:
    dl = MultiEpochs(list(range(N)), batch_size=8, num_workers=workers,
                     timeout=60 if workers else 0)  # fmt: skip
    with EchoLoader(dl, 2.0, shuffle_buffer=16) as el:
        for _batch in el:
            break
        with pytest.warns(RuntimeWarning, match=r"MultiEpochs\.iterator") as caught:
            warnings.simplefilter("always")
            assert sum(len(b) for b in el) == 2 * N  # the next pass, whole
        assert sum("one stream it keeps" in str(w.message) for w in caught) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per loader
            for _batch in el:
                break
            assert sum(len(b) for b in el) == 2 * N


@pytest.mark.parametrize("persistent", [False, True])
def test_a_dataloader_left_early_does_not_warn_of_a_stream(persistent) -> None:
    """A ``DataLoader``'s next ``iter()`` starts a new pass of its sampler: nothing to warn."""
    dl = DataLoader(list(range(N)), batch_size=8, num_workers=2, persistent_workers=persistent,
                    timeout=60)  # fmt: skip
    with EchoLoader(dl, 2.0, shuffle_buffer=16) as el, warnings.catch_warnings():
        warnings.simplefilter("error")
        for _batch in el:
            break
        assert collections.Counter(v for b in el for v in b.tolist()) == {i: 2 for i in range(N)}
