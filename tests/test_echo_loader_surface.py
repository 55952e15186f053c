"""EchoLoader's DataLoader surface: exact len(), attributes read and written through, sharding.

Real DataLoaders, samplers and datasets; samples are identified by value.
"""

from __future__ import annotations

import collections
import math
import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
)

from echopipe.torch import EchoLoader, FactorReplacedWarning, UnshardedLoaderError
from echopipe.torch.loader_state import LoaderStateError


class Ids(Dataset):
    """Sample i is (x = i, i); its length can change between epochs (``n`` is public)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((2,), float(i)), i


def epoch(el: EchoLoader) -> tuple[int, collections.Counter]:
    """Runs one epoch: (batches, copies per sample id), checking each row's data."""
    got: collections.Counter = collections.Counter()
    batches = 0
    for x, y in el:
        assert torch.equal(x, y.view(-1, 1).float().expand_as(x))
        got.update(y.tolist())
        batches += 1
    return batches, got


@pytest.mark.parametrize(
    ("n", "batch", "e", "drop_last"),
    [(103, 10, 1.0, False), (103, 10, 2.0, True), (103, 10, 1.37, False), (96, 16, 2.5, True),
     (7, 16, 3.0, False), (50, 8, 1.01, False)],
)  # fmt: skip
def test_len_is_the_exact_batch_count_of_every_epoch(n, batch, e, drop_last) -> None:
    data = DataLoader(Ids(n), batch_size=batch, shuffle=True, drop_last=drop_last)
    read = n - n % batch if drop_last else n
    with EchoLoader(data, e, seed=5) as el:
        for _ in range(2):
            length = len(el)
            batches, got = epoch(el)
            total = math.floor(e) * read + math.floor((e - math.floor(e)) * read + 0.5)
            assert batches == length == math.ceil(total / batch)
            assert sum(got.values()) == total and len(got) == read
            assert set(got.values()) <= {math.floor(e), math.ceil(e)}
            assert el.stats().delivered_batches_epoch == batches


def test_len_follows_the_distributed_sampler_share_and_set_epoch() -> None:
    data = Ids(45)
    sampler = DistributedSampler(data, num_replicas=4, rank=2, shuffle=True, seed=9)
    el = EchoLoader(DataLoader(data, batch_size=4, sampler=sampler, num_workers=2), 1.5)
    with el:
        assert el.sampler is sampler and el.dataset is data and el.num_workers == 2
        for ep in range(2):
            el.sampler.set_epoch(ep)  # through EchoLoader, as training programs call it
            share = list(sampler)
            assert len(el) == math.ceil(round(1.5 * len(share)) / 4) == 5  # 12 samples -> 18
            batches, got = epoch(el)
            assert batches == 5 and set(got) == set(share) and sum(got.values()) == 18
    other = DistributedSampler(data, num_replicas=4, rank=2, shuffle=True, seed=9)
    other.set_epoch(0)
    assert list(other) != share  # the two epochs' shares differed: set_epoch reached it


def test_len_through_batch_samplers_wrappers_and_iterable_datasets() -> None:
    data = Ids(30)
    batched = DataLoader(data, batch_sampler=BatchSampler(range(30), 8, drop_last=True))
    assert len(EchoLoader(batched, 2.0)) == 6 and EchoLoader(batched).batch_size == 8

    class Stream(IterableDataset):
        def __len__(self) -> int:
            return 21

        def __iter__(self):
            return (Ids(21)[i] for i in range(21))

    with EchoLoader(DataLoader(Stream(), batch_size=4), 2.0) as el:
        assert len(el) == 11 and epoch(el)[0] == 11

    class Wrapper:  # like timm's PrefetchLoader: same batches as .loader
        def __init__(self, loader: DataLoader) -> None:
            self.loader = loader

        def __len__(self) -> int:
            return len(self.loader)

        def __iter__(self):
            return iter(self.loader)

    with EchoLoader(Wrapper(DataLoader(data, batch_size=8)), 1.5) as el:
        assert el.batch_size == 8 and len(el) == 6 and epoch(el)[0] == 6


class Halves(Sampler):
    """A batch sampler of its own: batch sizes the DataLoader cannot know."""

    def __iter__(self):
        return iter([[0, 1, 2], [3]])

    def __len__(self) -> int:
        return 2


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: EchoLoader(DataLoader(Ids(8), batch_size=4), "auto"), "no fixed epoch length"),
        (lambda: EchoLoader(DataLoader(Ids(8), batch_sampler=Halves())), "samples per epoch"),
        (lambda: EchoLoader([(torch.zeros(4, 2), torch.zeros(4))]), "samples per epoch"),
    ],
)
def test_len_unknown_ahead_is_a_type_error_as_for_unsized_iterables(make, why) -> None:
    el = make()
    with pytest.raises(TypeError, match=why):
        len(el)
    el.close()


def test_a_changed_epoch_size_gets_a_new_exact_block_and_a_wrong_length_warns() -> None:
    data = Ids(40)
    with EchoLoader(DataLoader(data, batch_size=8, shuffle=True), 1.5) as el:
        assert (len(el), sum(epoch(el)[1].values())) == (8, 60)
        data.n = 56
        assert (len(el), sum(epoch(el)[1].values())) == (11, 84)

    class Liar(IterableDataset):  # says 20, yields 12
        def __len__(self) -> int:
            return 20

        def __iter__(self):
            return (Ids(12)[i] for i in range(12))

    with EchoLoader(DataLoader(Liar(), batch_size=4), 2.0) as el:
        assert len(el) == 10
        with pytest.warns(RuntimeWarning, match="yielded 12 samples in epoch 0, not the 20"):
            assert epoch(el)[0] == 6


class Prefetcher:
    """A wrapper with attributes of its own, some of them properties (timm's PrefetchLoader)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.flag = True
        self._private = "wrapper's"

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    @property
    def mixup_enabled(self) -> bool:
        return self.flag

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        self.flag = value

    def state_dict(self) -> str:
        return "the wrapper's state"


def test_public_attributes_read_and_write_through_but_own_names_stay() -> None:
    inner = DataLoader(Ids(16), batch_size=4, drop_last=True)
    wrapped = Prefetcher(inner)
    el = EchoLoader(wrapped, 2.0)
    assert el.loader is inner and el.dataset is inner.dataset and el.mixup_enabled is True
    el.mixup_enabled = False  # timm's train loop does this
    assert wrapped.flag is False and el.mixup_enabled is False
    el.note = "set through"
    assert wrapped.note == "set through" and "note" not in vars(el)
    del el.note
    assert not hasattr(wrapped, "note")
    assert "mixup_enabled" in dir(el) and "loader" in dir(el)
    # EchoLoader's own names are never the wrapped loader's
    assert isinstance(el.state_dict(), dict) and el.echo_factor == 2.0
    with pytest.raises(AttributeError):
        el._private  # noqa: B018
    with pytest.raises(AttributeError, match="have no attribute 'nothing'"):
        el.nothing  # noqa: B018
    with pytest.raises(AttributeError):
        el.batch_size = 8  # the output batch size is EchoLoader's own
    el.close()
    plain = EchoLoader(inner)
    assert (plain.drop_last, plain.num_workers, plain.batch_sampler) == (
        True, 0, inner.batch_sampler)  # fmt: skip
    with pytest.raises(ValueError, match="batch_sampler attribute should not be set"):
        plain.batch_sampler = None  # the DataLoader's own refusal, as without EchoLoader
    plain.close()


def _outcome(call: Any, error: type[Exception]) -> str:
    """``call()``'s error message, or "no error"."""
    try:
        call()
    except error as exc:
        return str(exc)
    return "no error"


def _rank(rank: int, store: str, out: str) -> None:
    data = Ids(30)
    # A mid-epoch state saved at world size 1 (a job of one process), before this one joins two.
    alone_sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    with EchoLoader(DataLoader(data, batch_size=4, sampler=alone_sampler), 2.0) as el:
        batches = iter(el)  # (kept: a dropped iterator ends its epoch)
        next(batches)
        alone = el.state_dict()
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=2, rank=rank)
    try:
        results = []
        plain = EchoLoader(DataLoader(data, batch_size=4, shuffle=True), 2.0)
        for call in (len, iter):
            results.append(_outcome(lambda c=call: c(plain), UnshardedLoaderError))
        plain.close()
        sampler = DistributedSampler(data, shuffle=True)
        with EchoLoader(DataLoader(data, batch_size=4, sampler=sampler), 2.0) as el:
            length = len(el)
            batches, got = epoch(el)
        results.append(f"{length} {batches} {dict(got) == dict.fromkeys(sampler, 2)}")
        # A mid-epoch state holds the saving rank's cached samples: only that rank takes it;
        # rank 0's holds every rank's, all of them having called state_dict() at that step.
        with EchoLoader(DataLoader(data, batch_size=4, sampler=sampler), 2.0) as el:
            batches = iter(el)
            next(batches)
            states: list[Any] = [None, None]
            dist.all_gather_object(states, el.state_dict())
        alone0 = {k: v for k, v in states[0].items() if k != "rank_states"}
        for state in (states[0], alone0):
            with EchoLoader(DataLoader(data, batch_size=4, sampler=sampler), 2.0) as el:
                results.append(_outcome(lambda s=state: el.load_state_dict(s), LoaderStateError))
        with EchoLoader(DataLoader(data, batch_size=4, sampler=sampler), 2.0) as el:
            results.append(_outcome(lambda: el.load_state_dict(alone), LoaderStateError))
        auto = EchoLoader(DataLoader(data, batch_size=4, sampler=sampler), "auto")
        results.append(_outcome(lambda: iter(auto), ValueError))
        results.append(_outcome(lambda: len(auto), ValueError))  # a progress bar asks first
        auto.close()
    finally:
        dist.destroy_process_group()
    # Back at world size 1 (the job came back with one process): rank 0's mid-epoch state.
    with EchoLoader(DataLoader(data, batch_size=4, sampler=alone_sampler), 2.0) as el:
        results.append(_outcome(lambda: el.load_state_dict(states[0]), LoaderStateError))
    with open(out, "w") as f:
        f.write("\n".join(results))


def test_several_processes_reading_the_whole_dataset_each_get_one_clear_error() -> None:
    """Also: a mid-epoch state of another world size (1 -> 2, 2 -> 1) is refused."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}") for r in range(2)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, store, outs[r])) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        for out in outs:
            with open(out) as f:
                got = f.read().split("\n")
            len_error, iter_error, sharded, gathered, rank0_state, alone, auto, auto_len, back = got
            assert len_error == iter_error
            assert "2 torch.distributed processes" in len_error and "RandomSampler" in len_error
            assert "DistributedSampler" in len_error
            assert sharded == "8 8 True"  # 15 samples per process, 30 copies, batches of 4
            assert gathered == "no error"
            if out == outs[0]:
                assert rank0_state == "no error"
            else:
                assert "saved by rank 0 of 2 processes mid-epoch" in rank0_state
                assert "this loader is rank 1 of 2" in rank0_state
            # A mid-epoch position is one shard's: another world size is refused (not skipped
            # in another sharding, which would lose some samples and repeat others).
            assert "saved mid-epoch at world size 1 (one process)" in alone, alone
            assert f"runs at world size 2 (rank {outs.index(out)} of 2)" in alone
            assert "saved mid-epoch at world size 2 (rank 0 of 2)" in back, back
            assert "runs at world size 1 (one process)" in back
            assert "load it at world size 2, or load a state saved between epochs" in back
            # "auto" would choose e per rank, and the ranks' step counts would differ.
            assert "echo_factor='auto'" in auto and "2 torch.distributed processes" in auto
            assert auto_len == auto


def test_a_state_of_another_num_replicas_is_refused_mid_epoch_and_taken_between_epochs() -> None:
    """DistributedSamplers of 2 and of 1 replica (built without torch.distributed, as a
    program that shards by hand does): a mid-epoch state of the other is refused naming both
    world sizes, and leaves the loader as it was; a state saved between epochs holds no
    position, and the next epoch reads the new world size's shard, every sample e times."""
    data = Ids(40)

    def make(replicas: int) -> EchoLoader:
        sampler = DistributedSampler(data, num_replicas=replicas, rank=0, shuffle=True, seed=3)
        return EchoLoader(DataLoader(data, batch_size=4, sampler=sampler), 2.0)

    mid = {}
    for replicas in (1, 2):
        with make(replicas) as el:
            batches = iter(el)  # (kept: a dropped iterator ends its epoch)
            next(batches)
            mid[replicas] = el.state_dict()
            assert mid[replicas]["mid_epoch"] and mid[replicas]["batches_done"] >= 1
    for was, now in ((2, 1), (1, 2)):
        with make(now) as el:
            with pytest.raises(LoaderStateError) as refused:
                el.load_state_dict(mid[was])
            told = "one process" if was == 1 else "rank 0 of 2"
            assert f"saved mid-epoch at world size {was} ({told})" in str(refused.value)
            assert f"runs at world size {now}" in str(refused.value)
            assert el.stats().epoch == 0
            _, got = epoch(el)  # as it was: a whole epoch of its own shard
            assert dict(got) == dict.fromkeys(el.sampler, 2)
    with make(2) as el:
        epoch(el)
        between = el.state_dict()
    assert not between["mid_epoch"]
    with make(1) as el:
        el.load_state_dict(between)
        _, got = epoch(el)
        assert dict(got) == dict.fromkeys(range(40), 2) and el.stats().epoch == 2


def test_an_iterator_dropped_before_its_first_batch_reads_nothing() -> None:
    class Counted(DataLoader):
        passes = 0

        def __iter__(self):
            Counted.passes += 1
            return super().__iter__()

    with EchoLoader(Counted(Ids(12), batch_size=4), 2.0) as el:
        iter(el)  # Lightning's "is it iterable?" check makes such an iterator
        assert (Counted.passes, el.stats().epoch) == (0, 0)
        assert epoch(el) == (6, dict.fromkeys(range(12), 2))
        assert (Counted.passes, el.stats().epoch) == (1, 1)


def test_a_dropped_iterator_keeps_a_restored_position_for_the_real_epoch() -> None:
    def make() -> EchoLoader:
        return EchoLoader(DataLoader(Ids(40), batch_size=8), 1.5, shuffle_buffer=16)

    with make() as el:
        it = iter(el)
        first = [next(it) for _ in range(3)]
        state = el.state_dict()
    with make() as el:
        el.load_state_dict(state)
        iter(el)  # e.g. Lightning's check: must not use up the restored position
        rest = list(el)
    got = collections.Counter(i for _, y in first + rest for i in y.tolist())
    assert sorted(got) == list(range(40)) and sum(got.values()) == 60  # 40 x 1.5, exactly
    assert len(first) + len(rest) == 8 == len(el)


class _ShortOfItsLength(IterableDataset):
    """Says 8 samples and yields 6."""

    def __iter__(self) -> Any:
        return (torch.tensor([float(i)]) for i in range(6))

    def __len__(self) -> int:
        return 8


def test_an_epoch_shorter_than_the_wrapped_length_warns_at_the_users_loop() -> None:
    loader = EchoLoader(DataLoader(_ShortOfItsLength(), batch_size=2), echo_factor=1.0)
    with pytest.warns(RuntimeWarning, match="yielded 6 samples in epoch 0, not the 8") as got:
        for _ in loader:  # the line the warning names
            pass
    assert [w.filename for w in got] == [__file__]


def test_a_loaded_state_of_another_echo_factor_says_it_replaces_the_loaders() -> None:
    data = DataLoader(list(range(8)), batch_size=2)
    saved = EchoLoader(data, echo_factor=1.5)
    for _ in saved:
        pass
    state = saved.state_dict()
    loader = EchoLoader(data, echo_factor=3.0)
    with pytest.warns(FactorReplacedWarning, match="echo_factor 1.5 replaces this loader's 3"):
        loader.load_state_dict(state)
    assert loader.echo_factor == 1.5  # the saved state wins, as an optimizer's saved lr does
    same = EchoLoader(data, echo_factor=1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(state)


def test_a_run_resumed_with_another_batch_size() -> None:
    """A state saved between epochs put its batch size over the wrapped loader's (output
    batches of 8 and ``len()`` 12 over a DataLoader of batches of 4); one saved mid-epoch
    skipped its count of batches at the new size (12 of 48 samples read twice, 4 copies)."""

    def data(size: int) -> DataLoader:
        return DataLoader(Ids(48), batch_size=size)

    with EchoLoader(data(8), 2.0) as first:
        assert sum(1 for _ in first) == 12
        between = first.state_dict()
        it = iter(first)
        seen = collections.Counter(i for _ in range(3) for i in next(it)[1].tolist())
        mid = first.state_dict()
    with EchoLoader(data(4), 2.0) as resumed:
        resumed.load_state_dict(between)
        assert resumed.batch_size == 4 and len(resumed) == 24
        got = collections.Counter()
        for _x, y in resumed:
            assert len(y) == 4
            got.update(y.tolist())
        assert got == {i: 2 for i in range(48)}
    with EchoLoader(data(4), 2.0) as other:
        with pytest.raises(LoaderStateError, match=r"after \d+ batches of 8 .* now hold 4"):
            other.load_state_dict(mid)
        assert other.batch_size == 4 and other.stats().epoch == 0  # left as it was
    with EchoLoader(data(8), 2.0) as resumed:
        resumed.load_state_dict(mid)
        seen.update(i for _x, y in resumed for i in y.tolist())
    assert seen == {i: 2 for i in range(48)}


def test_a_mid_epoch_state_of_an_epoch_of_other_samples_is_refused() -> None:
    """A folder that gained files between the crash and the restart: the resumed pass shuffles
    another epoch (the seeded order of 52 samples, not of 48), so the batches it skips as read
    are not the ones that were (11 samples missed, 11 read twice, without a word)."""

    def data(n: int) -> DataLoader:
        gen = torch.Generator().manual_seed(2)
        return DataLoader(Ids(n), batch_size=4, shuffle=True, generator=gen)

    with EchoLoader(data(48), 2.0) as first:
        it = iter(first)
        seen = collections.Counter(i for _ in range(3) for i in next(it)[1].tolist())
        state = first.state_dict()
    with EchoLoader(data(52), 2.0) as other:
        with pytest.raises(LoaderStateError, match=r"epoch of 48 samples .* now has 52"):
            other.load_state_dict(state)
        assert len(other) == 26 and other.stats().epoch == 0  # left as it was
    with EchoLoader(data(48), 2.0) as resumed:
        resumed.load_state_dict(state)
        seen.update(i for _x, y in resumed for i in y.tolist())
    assert seen == {i: 2 for i in range(48)}
    with EchoLoader(data(52), 2.0) as fresh:  # a state between epochs: any dataset
        fresh.load_state_dict(resumed.state_dict())
        assert len(fresh) == 26
