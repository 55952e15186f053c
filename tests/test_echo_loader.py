"""echopipe.torch.EchoLoader with real DataLoaders (worker processes), real threads, real cache."""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from echopipe.echo import EchoConfigError
from echopipe.echo.config import MAX_CAPACITY_SAMPLES, MAX_SEED, MIN_CAPACITY_BYTES
from echopipe.torch import EchoLoader, FactorReplacedWarning, LayoutError, LoaderError, reader


class Indexed(Dataset):
    """Sample i is (x = i repeated, i, the worker's pid); optionally slow or failing."""

    def __init__(self, n: int, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.n, self.delay, self.fail_at = n, delay, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise ValueError(f"sample {i} is corrupt")
        if self.delay:
            time.sleep(self.delay)
        return torch.full((3, 5), float(i)), i, os.getpid()


def loader(n: int = 200, batch: int = 16, workers: int = 2, **kw) -> DataLoader:
    return DataLoader(Indexed(n, **{k: kw.pop(k) for k in ("delay", "fail_at") if k in kw}),
                      batch_size=batch, num_workers=workers, **kw)  # fmt: skip


def counts(batches) -> collections.Counter:
    """Copies delivered per sample id, checking that every row still carries its own data."""
    got: collections.Counter = collections.Counter()
    for x, y, _pid in batches:
        assert x.dtype == torch.float32 and x.shape[1:] == (3, 5)
        assert torch.equal(x, y.view(-1, 1, 1).float().expand_as(x))
        got.update(y.tolist())
    return got


def gone(pid: int, within: float = 10.0) -> bool:
    """True once ``pid`` no longer runs (exited, or a zombie left to its new parent)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("e", [2.5, 1.0])
def test_every_fresh_sample_is_delivered_floor_or_ceil_e_times(e: float) -> None:
    with EchoLoader(loader(200, 16), e, seed=3) as el:
        length = len(el)
        batches = list(el)
        got = counts(batches)
        stats = el.stats()
    assert sorted(got) == list(range(200))
    assert set(got.values()) <= {math.floor(e), math.ceil(e)}
    total = sum(got.values())
    assert total == {2.5: 500, 1.0: 200}[e]  # exact per epoch: half of them get the third copy
    assert len(batches) == length
    assert stats.fresh_samples == 200 and stats.fresh_batches == 13  # 12 full + 1 of 8
    assert stats.delivered_samples == total and stats.delivered_batches == len(batches)
    assert len(batches) == math.ceil(total / 16)
    assert all(len(b[1]) == 16 for b in batches[:-1])
    assert stats.cache is not None and stats.cache.emitted == total
    if e == 1.0:
        assert total == 200 and [int(b[1][0]) for b in batches[:3]] != [0, 16, 32]  # shuffled


def test_epochs_repeat_with_exact_counts_and_labels_kept() -> None:
    with EchoLoader(loader(64, 8), 3.0) as el:
        for epoch in range(2):
            got = counts(el)
            assert got == {i: 3 for i in range(64)}
            s = el.stats()
            assert (s.epoch, s.delivered_samples_epoch, s.fresh_samples) == (
                epoch + 1, 192, 64 * (epoch + 1))  # fmt: skip


def test_a_trainer_slower_than_the_readers_put_timeout_loses_nothing(monkeypatch) -> None:
    """The trainer is the bottleneck (e >= R) and holds its batch longer than one of the reader's
    bounded waits for space: each timed-out put is retried with the rows it had not put yet."""
    monkeypatch.setattr(reader, "POLL_S", 0.001)  # every wait on the full cache times out
    batches = [(torch.full((8, 4), i, dtype=torch.uint8), torch.arange(8) + 8 * i)
               for i in range(12)]  # fmt: skip
    with EchoLoader(batches, 2.0, seed=1, shuffle_buffer=16) as el:
        it = iter(el)
        first = [next(it)]
        deadline = time.monotonic() + 20
        # The first batch is held: the reader fills the cache and its puts time out, again and
        # again (waiting on the counter; the deadline only ends a reader that died).
        while el.stats().cache.puts_blocked < 5 and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.002)
        delivered = first + list(it)  # a reader that failed raises its error here
        stats = el.stats()
    assert stats.cache is not None and stats.cache.puts_blocked >= 5
    labels = collections.Counter(torch.cat([y for _, y in delivered]).tolist())
    assert labels == {i: 2 for i in range(96)}
    assert all(torch.equal(x, (y // 8).to(torch.uint8).view(-1, 1).expand_as(x))
               for x, y in delivered)  # fmt: skip
    assert stats.fresh_samples == 96 and stats.delivered_samples == 192


class Pair(NamedTuple):
    image: torch.Tensor
    mask: np.ndarray


def test_batch_structures_dtypes_and_strings_survive() -> None:
    def batch(k: int) -> dict:
        ids = torch.arange(4 * k, 4 * k + 4)
        return {
            "pair": Pair(ids.view(4, 1, 1).expand(4, 2, 3).to(torch.bfloat16),
                         np.stack([np.full((2,), i % 2 == 0) for i in ids.tolist()])),
            "meta": (ids, ids.double() / 2, [f"img_{i}.jpg" for i in ids.tolist()]),
            "flags": [ids % 3 == 0, ids.to(torch.int16)],
        }  # fmt: skip

    source = [batch(k) for k in range(6)]
    with EchoLoader(source, 2.0, shuffle_buffer=8) as el:
        out = list(el)
    assert len(out) == 12
    seen: collections.Counter = collections.Counter()
    for b in out:
        assert isinstance(b, dict) and list(b) == ["pair", "meta", "flags"]
        assert isinstance(b["pair"], Pair) and isinstance(b["meta"], tuple)
        assert isinstance(b["flags"], list)
        ids = b["meta"][0]
        assert ids.dtype == torch.int64 and b["meta"][1].dtype == torch.float64
        assert b["pair"].image.dtype == torch.bfloat16 and b["pair"].image.shape == (4, 2, 3)
        assert torch.equal(b["pair"].image[:, 0, 0].long(), ids)
        assert b["pair"].mask.dtype == np.bool_ and b["pair"].mask.shape == (4, 2)
        assert (b["pair"].mask[:, 0] == (ids.numpy() % 2 == 0)).all()
        assert b["meta"][2] == [f"img_{i}.jpg" for i in ids.tolist()]
        assert torch.equal(b["meta"][1], ids.double() / 2)
        assert b["flags"][0].dtype == torch.bool and torch.equal(b["flags"][0], ids % 3 == 0)
        assert b["flags"][1].dtype == torch.int16
        seen.update(ids.tolist())
    assert seen == {i: 2 for i in range(24)}


def test_batches_without_strings_keep_every_dtype_and_the_structure() -> None:
    """The per-batch fast paths (match on the way in, views on the way out), many batches;
    a conjugate view and a tensor that requires grad take torch's own path in."""

    def batch(k: int) -> dict:
        ids = torch.arange(4 * k, 4 * k + 4)
        return {
            "pair": Pair(ids.view(4, 1, 1).expand(4, 2, 3).to(torch.bfloat16),
                         np.stack([np.full((2,), i % 2 == 0) for i in ids.tolist()])),
            "z": ((ids.to(torch.complex64) * 1j).conj(), (ids.double() / 2).requires_grad_()),
            "flags": [ids % 3 == 0, ids.to(torch.int16), ids.to(torch.uint8).view(4, 1, 1)],
        }  # fmt: skip

    source = [batch(k) for k in range(10)]
    with EchoLoader(source, 2.0, shuffle_buffer=8) as el:
        out = list(el)
    seen: collections.Counter = collections.Counter()
    for b in out:
        assert list(b) == ["pair", "z", "flags"] and isinstance(b["pair"], Pair)
        ids = b["z"][1].mul(2).long()
        assert b["pair"].image.dtype == torch.bfloat16 and b["pair"].image.shape == (4, 2, 3)
        assert torch.equal(b["pair"].image[:, 1, 2].long(), ids)
        assert isinstance(b["pair"].mask, np.ndarray) and b["pair"].mask.dtype == np.bool_
        assert (b["pair"].mask[:, 1] == (ids.numpy() % 2 == 0)).all()
        assert b["z"][0].dtype == torch.complex64 and torch.equal(b["z"][0], ids * -1j)
        assert isinstance(b["flags"], list) and torch.equal(b["flags"][0], ids % 3 == 0)
        assert b["flags"][1].dtype == torch.int16 and torch.equal(b["flags"][1].long(), ids)
        assert b["flags"][2].shape == (4, 1, 1) and b["flags"][2].dtype == torch.uint8
        assert torch.equal(b["flags"][2].view(-1).long(), ids)
        seen.update(ids.tolist())
    assert seen == {i: 2 for i in range(40)}


def test_more_than_four_leaves_share_one_field() -> None:
    source = [tuple(torch.arange(4 * k, 4 * k + 4) * (j + 1) for j in range(6)) for k in range(4)]
    with EchoLoader(source, 1.0) as el:
        for b in el:
            assert isinstance(b, tuple) and len(b) == 6
            for j in range(6):
                assert torch.equal(b[j], b[0] * (j + 1))


def test_one_sample_batches_of_a_shared_field_keep_their_dtypes() -> None:
    # Leaves of different widths packed into one field: a 1-row slice of it has the field's row
    # stride, which a dtype view refuses unless the slice is copied out.
    def batch(k: int) -> dict:
        return {"img": torch.full((1, 3), k, dtype=torch.uint8), "y": torch.tensor([k]),
                "w": torch.tensor([k / 2], dtype=torch.float32), "ok": torch.tensor([True]),
                "a": np.array([[k, k]], dtype=np.int32), "path": [f"img{k}.png"]}  # fmt: skip

    with EchoLoader([batch(k) for k in range(5)], 1.0, batch_size=1) as el:
        got = list(el)
    assert len(got) == 5
    for b in got:
        k = int(b["y"])
        assert b["y"].dtype == torch.int64 and b["w"].dtype == torch.float32
        assert float(b["w"]) == k / 2 and bool(b["ok"]) and b["path"] == [f"img{k}.png"]
        assert b["a"].dtype == np.int32 and b["a"].tolist() == [[k, k]]
        assert b["img"].tolist() == [[k, k, k]]


def test_resume_mid_epoch_delivers_the_remaining_copies_exactly() -> None:
    first: list = []
    el = EchoLoader(loader(160, 16, shuffle=False), 2.0, seed=1)
    it = iter(el)
    for _ in range(7):
        first.append(next(it))
    state = el.state_dict()
    el.close()
    assert state["mid_epoch"] and state["delivered_batches_epoch"] == 7
    el2 = EchoLoader(loader(160, 16, shuffle=False), 2.0, seed=1)
    el2.load_state_dict(state)
    rest = list(el2)
    stats = el2.stats()
    el2.close()
    got = counts(first) + counts(rest)
    assert got == {i: 2 for i in range(160)}
    assert stats.delivered_samples_epoch == 320 and stats.fresh_samples_epoch == 160
    assert stats.epoch == 1 and stats.fresh_batches == 10


def test_snapshots_taken_while_the_reader_runs_each_resume_exactly() -> None:
    # The reader keeps putting while the consumer snapshots: each snapshot must match the
    # reader's position, so that every resume completes every sample's copies.
    snapshots = []
    delivered: list = []
    with EchoLoader(loader(192, 8, shuffle=False), 2.5, seed=4, shuffle_buffer=32) as el:
        for i, batch in enumerate(el):
            delivered.append(batch)
            if i in (2, 9, 17, 30):
                snapshots.append((el.state_dict(), list(delivered)))
    for state, before in snapshots:
        with EchoLoader(loader(192, 8, shuffle=False, workers=0), 2.5, seed=4,
                        shuffle_buffer=32) as el:  # fmt: skip
            el.load_state_dict(state)
            got = counts(before) + counts(el)
        assert sorted(got) == list(range(192)), state["batches_done"]
        assert set(got.values()) <= {2, 3} and sum(got.values()) == 480  # 192 * 2.5, resumed
        assert el.stats().delivered_samples_epoch == sum(got.values())


def test_state_between_epochs_and_mismatched_stream() -> None:
    with EchoLoader(loader(32, 8, workers=0), 2.0) as el:
        list(el)
        state = el.state_dict()
    assert not state["mid_epoch"] and state["epoch"] == 1
    with EchoLoader(loader(32, 8, workers=0), 2.0) as el:
        el.load_state_dict(state)
        assert counts(el) == {i: 2 for i in range(32)}
        assert el.stats().epoch == 2 and el.stats().delivered_samples == 128
    other = [(torch.zeros(8, 2), torch.zeros(8))] * 4
    with EchoLoader(other, 2.0) as el:  # between epochs: a fresh epoch may bring a new layout
        el.load_state_dict(state)
        assert sum(len(y) for _x, y in el) == 64
    with EchoLoader(loader(32, 8, workers=0), 2.0, shuffle_buffer=16) as el:
        for _batch in el:
            mid = el.state_dict()  # a resumed epoch must match the samples it continues
            break
    assert mid["mid_epoch"]
    with EchoLoader(other, 2.0) as el:
        el.load_state_dict(mid)
        with pytest.raises(LayoutError, match="differ from the saved state"):
            list(el)
    with pytest.raises(ValueError, match="different echo_factor mode"):
        EchoLoader(other, "auto").load_state_dict(state)
    with pytest.raises(ValueError, match="not an EchoLoader state"):
        EchoLoader(other).load_state_dict({"version": 99})


def test_loader_error_names_the_batch_and_ends_the_workers() -> None:
    el = EchoLoader(loader(200, 8, fail_at=37), 2.0, timeout=60)
    pids: set[int] = set()
    t0 = time.monotonic()
    with pytest.raises(LoaderError, match=r"batch 4 of epoch 0: ValueError: .*sample 37") as info:
        for _x, _y, pid in el:
            pids.update(pid.tolist())
    assert time.monotonic() - t0 < 30
    assert isinstance(info.value.__cause__, ValueError)
    assert pids and all(gone(p) for p in pids)
    assert counts([]) == {}  # the loader stays usable: a new epoch starts over
    with pytest.raises(LoaderError, match="batch 4"):
        list(el)
    el.close()


def _unwarned(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    # torch warns that strided nested tensors are a prototype and quantized ones deprecated
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return make()


_NESTED = _unwarned(lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]))
_QUANTIZED = _unwarned(lambda: torch.quantize_per_tensor(torch.zeros(4, 2), 0.5, 3, torch.quint8))


@pytest.mark.parametrize(
    ("batches", "message"),
    [
        (
            [(torch.zeros(4, 3),), (torch.zeros(4, 5),)],
            r"batch 1 of epoch 0: field batch\[0\] "
            r"changed from tensor float32\[3\] to tensor float32\[5\].*fixed shape",
        ),
        ([{"x": torch.zeros(4), "lam": 0.5}], r"batch 0 .*field batch\['lam'\] is a float"),
        ([(torch.zeros(4), [None] * 4)], r"batch 0 .*field batch\[1\] is a list of 4 None"),
        (  # None is a field of every batch, not one that some batches fill
            [{"x": torch.zeros(4), "m": None}, {"x": torch.zeros(4), "m": torch.zeros(4)}],
            r"batch 1 .*the batch structure changed",
        ),
        ([(torch.zeros(4), torch.tensor(1.0))], r"field batch\[1\] is a scalar"),
        ([(torch.zeros(4), torch.zeros(3))], r"field batch\[1\] has 3 rows .* 4 samples"),
        ([(torch.zeros(4), ["a", "b"])], r"field batch\[1\] has 2 strings for 4 samples"),
        ([(np.array(["a"] * 4),)], r"numpy dtype <U1"),
        ([{"y": 3}], r"batch\['y'\] is a int"),
        # later batches are checked too (the fast path of every batch after the first)
        (
            [(torch.zeros(4, 3),), (torch.zeros(4, 3, dtype=torch.float64),)],
            r"batch 1 .*field batch\[0\] changed from tensor float32\[3\] to tensor float64\[3\]",
        ),
        (
            [(np.zeros((4, 2), np.float32),), (np.zeros((4, 2), np.float64),)],
            r"batch 1 .*field batch\[0\] changed from numpy <f4\[2\] to numpy <f8\[2\]",
        ),
        (
            [
                {"a": torch.zeros(4), "b": torch.zeros(4)},
                {"b": torch.zeros(4), "a": torch.zeros(4)},
            ],
            r"batch 1 .*the batch structure changed",
        ),
        (
            [(torch.zeros(4), torch.zeros(4)), (torch.zeros(4), torch.zeros(3))],
            r"batch 1 .*field batch\[1\] has 3 rows .* 4 samples",
        ),
        (
            [(torch.zeros(4), ["a"] * 4), (torch.zeros(4), ["a"] * 3)],
            r"batch 1 .*field batch\[1\] has 3 strings for 4 samples",
        ),
        (
            [(torch.zeros(4, 2),), (torch.zeros(4, 2).to_sparse(),)],
            r"batch 1 .*field batch\[0\] is a torch.sparse_coo tensor",
        ),
        # tensors whose rows are not plain bytes (a quantized one would lose its scale)
        ([(torch.zeros(4, 2, device="meta"),)], r"batch 0 .*field batch\[0\] is a meta tensor"),
        (
            [(torch.zeros(4, 2),), (torch.zeros(4, 2, device="meta"),)],
            r"batch 1 .*field batch\[0\] is a meta tensor",
        ),
        ([{"x": _NESTED}], r"batch 0 .*field batch\['x'\] is a nested tensor"),
        ([(_QUANTIZED,)], r"batch 0 .*field batch\[0\] is a quantized tensor"),
    ],
)
def test_bad_batches_get_one_clear_error(batches: list, message: str) -> None:
    with EchoLoader(batches, 2.0, timeout=30) as el, pytest.raises(LayoutError, match=message):
        list(el)


class _Images(Dataset):
    """Image ``i`` is a 3x2x2 tensor of the value ``i``."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 2, 2), float(i))


@pytest.mark.parametrize(
    "collate", [list, lambda rows: next(zip(*[(x, 0) for x in rows], strict=True))]
)
def test_a_batch_of_per_sample_tensors_is_refused_not_echoed_mixed_up(collate: Any) -> None:
    # A list of 4 images of 3 channels reads as 4 fields of 3 rows: without the DataLoader's
    # batch size to hold it against, each "sample" came out as channels of different images.
    loader = DataLoader(_Images(), batch_size=4, collate_fn=collate)
    message = r"batch 0 .*fields have 3 rows, but the wrapped DataLoader's batch 0 holds 4"
    with EchoLoader(loader, 2.0, timeout=30) as el, pytest.raises(LayoutError, match=message):
        list(el)
    # The short last batch of a pass is expected, with or without drop_last.
    for drop in (False, True):
        with EchoLoader(DataLoader(_Images(), batch_size=3, drop_last=drop), 2.0) as el:
            values = sorted(float(v) for b in el for v in b[:, 0, 0, 0])
        assert values == sorted(2 * list(range(6 if drop else 8)))


def _read_four(el: EchoLoader) -> set[int]:
    pids: set[int] = set()
    for i, (_x, _y, pid) in enumerate(el):
        pids.update(pid.tolist())
        if i == 3:
            break  # drops the iterator mid-epoch
    return pids


def test_closing_mid_epoch_ends_reader_and_workers() -> None:
    threads_before = threading.active_count()
    el = EchoLoader(loader(400, 8, delay=0.005), 2.0)
    it = iter(el)
    pids = {p for _ in range(4) for p in next(it)[2].tolist()}
    el.close()
    assert pids and all(gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    el = EchoLoader(loader(400, 8, delay=0.005), 2.0)
    it = iter(el)
    pids = {p for _ in range(4) for p in next(it)[2].tolist()}
    del it, el  # no close(): dropping the last references ends the epoch and the workers
    assert pids and all(gone(p) for p in pids)
    with EchoLoader(loader(400, 8, delay=0.005), 2.0) as el:
        pids = _read_four(el)  # break: the epoch ends, the loader stays usable
        assert pids and all(gone(p) for p in pids)
        pids = _read_four(el)
    assert pids and all(gone(p) for p in pids)
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads_before


def test_persistent_workers_survive_epochs_and_an_early_break() -> None:
    dl = loader(96, 8, persistent_workers=True)
    with EchoLoader(dl, 2.0) as el:
        first = counts(el)
        _read_four(el)  # an epoch left early: the DataLoader keeps its workers
        again = counts(el)
    assert first == again == {i: 2 for i in range(96)}
    # close() (here the with block's) ends the workers the DataLoader kept between epochs.
    pids = set(_read_four(EchoLoader(dl, 2.0)))
    assert dl._iterator is not None and pids  # persistent: kept after the epoch left early
    with EchoLoader(dl, 2.0) as el:
        pids = _read_four(el)
    assert pids and all(gone(p) for p in pids)
    assert counts(EchoLoader(dl, 2.0)) == {i: 2 for i in range(96)}  # made anew when needed


def test_waking_leaves_a_persistent_iterator_with_running_workers_alone() -> None:
    # A wake message sent just after the reader left next() stays in the queue of an iterator
    # the DataLoader keeps; arriving after the next iter()'s worker replies, it made that pass
    # raise KeyError: None. Such an iterator is woken only once a worker died.
    from echopipe.torch import workers

    dl = loader(96, 8, persistent_workers=True)
    it = iter(dl)
    next(it)
    woken = workers.wake(it)
    assert len(list(it)) == 11  # the rest of the pass, nothing in its queue but results
    assert woken is False
    it = iter(dl)  # the kept iterator, reset
    next(it)
    for w in it._workers:
        w.terminate()
        w.join(10)
    assert workers.wake(it) is True  # its workers died: the reader must not wait 5 s
    dl._iterator._shutdown_workers()


def test_a_state_taken_after_an_epoch_left_early_says_what_it_leaves_out() -> None:
    el = EchoLoader(loader(64, 8, workers=0), 2.0)
    try:
        for step, _batch in enumerate(el):
            if step == 4:
                raise KeyboardInterrupt  # the usual Ctrl-C: the state is saved in the handler
    except KeyboardInterrupt:
        with pytest.warns(RuntimeWarning, match=r"epoch 0 was ended after 5 batches, before its "
                          r"last copies were delivered.*inside the loop"):  # fmt: skip
            state = el.state_dict()
    assert state["epoch"] == 1 and not state["mid_epoch"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, _batch in enumerate(el):
            if step == 2:
                assert el.state_dict()["mid_epoch"]  # inside the loop: the position, no warning
        el.state_dict()  # an epoch read to its end leaves nothing out
        batches = len(el)
        for step, _batch in enumerate(el):
            if step == batches - 1:
                break  # after the last batch: nothing was left
        el.state_dict()
    el.close()


def test_wait_times_out_and_close_does_not_hang() -> None:
    release = threading.Event()

    def stuck():
        yield torch.zeros(4, 2)
        release.wait(30)  # a reader that never delivers the rest

    el = EchoLoader(stuck(), 2.0, timeout=0.5, close_timeout=0.5, shuffle_buffer=64)
    t0 = time.monotonic()
    # The timeout ends the epoch; its reader is stuck in the wrapped loader, which is reported.
    with (
        pytest.raises(TimeoutError, match=r"no batch within timeout=0\.5s"),
        pytest.warns(RuntimeWarning, match=r"did not return within 0\.5s"),
    ):
        list(el)
    assert time.monotonic() - t0 < 5
    el.close()
    release.set()
    with pytest.raises(RuntimeError, match="closed"):
        iter(el)


def test_auto_changes_e_in_place_while_running() -> None:
    el = EchoLoader(loader(480, 8, delay=0.004), "auto", echo_interval=4, echo_max=4.0)
    with el:
        got = counts(el)
        stats = el.stats()
    factors = [e for _, e in stats.echo_history]
    assert factors[0] == 1.0 and max(factors) > 1.0, stats.echo_history
    assert sorted(got) == list(range(480))
    assert sum(got.values()) == stats.delivered_samples == stats.cache.emitted
    assert max(got.values()) <= math.ceil(max(factors))


def test_argument_errors_name_the_value() -> None:
    with pytest.raises(
        EchoConfigError, match=r"echo_factor must be a finite number in \[1, 65535\]"
    ):
        EchoLoader([], 0.5)
    with pytest.raises(EchoConfigError, match=r"echo_max must be a finite number in \[1, 65535\]"):
        EchoLoader([], "auto", echo_max=1e9)
    with pytest.raises(EchoConfigError, match="capacity_bytes must be an integer in"):
        EchoLoader([], capacity_bytes=MIN_CAPACITY_BYTES - 1)
    with pytest.raises(EchoConfigError, match="shuffle_buffer must be an integer in"):
        EchoLoader([], shuffle_buffer=MAX_CAPACITY_SAMPLES + 1)
    with pytest.raises(ValueError, match="or 'auto', got 'fast'"):
        EchoLoader([], "fast")
    with pytest.raises(ValueError, match="shuffle_buffer must be an integer >= 1, got 0"):
        EchoLoader([], shuffle_buffer=0)
    with pytest.raises(TypeError, match="must be iterable"):
        EchoLoader(3)
    with (
        EchoLoader([(torch.zeros(8),)], shuffle_buffer=8) as el,
        pytest.raises(LayoutError, match="shuffle_buffer=8 holds fewer than two batches"),
    ):
        list(el)
    if not torch.cuda.is_available():
        with pytest.warns(RuntimeWarning, match="CUDA is not available"):
            EchoLoader([], pin_memory=True).close()


def test_a_seed_past_the_cores_is_named_when_made_and_the_largest_round_trips() -> None:
    with pytest.raises(EchoConfigError, match=rf"^seed must be an integer in \[0, {MAX_SEED}\]"):
        EchoLoader([], seed=MAX_SEED + 1)  # not pybind's signature dump at the first batch
    with EchoLoader([(torch.arange(8.0),)] * 2, 2.0, seed=MAX_SEED, shuffle_buffer=16) as el:
        assert len(list(el)) == 4
        state = el.state_dict()
    with EchoLoader([(torch.arange(8.0),)] * 2, 2.0, seed=MAX_SEED, shuffle_buffer=16) as el:
        el.load_state_dict(state)  # a state saved with the largest seed loads


def test_a_device_torch_cannot_use_is_named_when_the_loader_is_made() -> None:
    with pytest.raises(ValueError, match=r"^device must be a device such as .*, got 'nope'$"):
        EchoLoader([], device="nope")
    with pytest.raises(TypeError, match=r"^device must be a torch.device or a str, got 2\.0$"):
        EchoLoader([], device=2.0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Without CUDA every CUDA device is refused; with it, one past the devices torch sees.
    for device in ("cuda", "cuda:0", torch.device("cuda", 99))[0 if count == 0 else 2 :]:
        with pytest.raises(ValueError) as caught:
            EchoLoader([], device=device)
        assert str(caught.value).startswith(f"device={device!r} needs CUDA device ")


def test_a_batch_size_whose_default_buffer_no_cache_holds_is_named() -> None:
    big = MAX_CAPACITY_SAMPLES // 4 + 1
    with (
        EchoLoader([(torch.zeros(4, 2),)], batch_size=big) as el,
        pytest.raises(LayoutError, match=rf"batch_size={big} is too large: its default shuffle_"),
    ):
        list(el)  # not the cache's "capacity_samples must be in ..."


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_batches_come_pinned_and_on_the_gpu() -> None:
    with EchoLoader(loader(64, 8), 2.0, device="cuda") as el:
        for x, y, _ in el:
            assert x.is_cuda and y.is_cuda
            assert torch.equal(x.cpu(), y.cpu().view(-1, 1, 1).float().expand_as(x.cpu()))


def test_interpreter_exit_mid_epoch_is_clean(tmp_path) -> None:
    script = tmp_path / "exit_mid_epoch.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_echo_loader import loader
        from echopipe.torch import EchoLoader
        el = EchoLoader(loader(4000, 8, delay=0.002), 2.0)
        it = iter(el)
        pids = set()
        for _ in range(3):
            pids.update(next(it)[2].tolist())
        print(" ".join(map(str, sorted(pids))), flush=True)
        # exits with the reader, the workers and the iterator still alive
    """)
    )
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 30
    pids = [int(p) for p in done.stdout.split()]
    assert pids and all(gone(p) for p in pids)
    assert "Traceback" not in done.stderr, done.stderr


class Gated:
    """Batches of ``batch`` consecutive ids as float tensors; one chosen read of one chosen
    epoch waits for ``gate`` first (a slow read held by the test), then yields or raises."""

    def __init__(self, n: int, batch: int, hold: tuple[int, int] | None = None,
                 fail: bool = False) -> None:  # fmt: skip
        self.n, self.batch_size, self.hold, self.fail = n, batch, hold, fail
        self.gate, self.held, self.epoch = threading.Event(), threading.Event(), 0

    def __len__(self) -> int:
        return self.n // self.batch_size

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        for i in range(len(self)):
            if self.hold == (epoch, i):
                self.held.set()
                assert self.gate.wait(60), "the test never opened the gate"
                if self.fail:
                    raise OSError("read timed out")
            yield torch.arange(i * self.batch_size, (i + 1) * self.batch_size, dtype=torch.float32)


def copies(batches) -> collections.Counter:
    return collections.Counter(int(v) for b in batches for v in b.tolist())


def test_a_resumed_epoch_saved_again_before_its_reader_catches_up_keeps_the_partial_batch() -> None:
    """Saved mid-batch (rows of batch k already in the cache), resumed, and saved again while
    the resumed reader is still re-reading the batches before k: the second state keeps those
    rows, so resuming it puts none of them twice."""
    first = EchoLoader(Gated(64, 8), 2.0, shuffle_buffer=20)
    it = iter(first)
    got = [next(it)]
    deadline = time.monotonic() + 20
    while first.stats().cache.puts_blocked < 1 and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.002)
    s1 = first.state_dict()
    first.close()
    # The set-up: the reader stopped inside a batch after at least two whole ones.
    assert s1["rows_in_flight"] > 0 and s1["batches_done"] >= 2
    source = Gated(64, 8, hold=(0, 1))  # the resumed reader's second re-read waits
    second = EchoLoader(source, 2.0, shuffle_buffer=20)
    second.load_state_dict(s1)
    it = iter(second)
    got.append(next(it))  # from the restored cache, while the reader waits at batch 1
    assert source.held.wait(20)
    s2 = second.state_dict()
    source.gate.set()
    second.close()
    assert (s2["batches_done"], s2["rows_in_flight"]) == (s1["batches_done"], s1["rows_in_flight"])
    third = EchoLoader(Gated(64, 8), 2.0, shuffle_buffer=20)
    third.load_state_dict(s2)
    got += list(third)
    assert copies(got) == {i: 2 for i in range(64)}


def test_state_saved_before_the_first_batch_of_a_restored_epoch_is_the_restored_one() -> None:
    first = EchoLoader(Gated(64, 8), 2.0)
    it = iter(first)
    got = [next(it) for _ in range(5)]
    s1 = first.state_dict()
    first.close()
    second = EchoLoader(Gated(64, 8), 2.0)
    second.load_state_dict(s1)
    s2 = second.state_dict()  # a checkpoint written at restart, before the first step
    second.close()
    keys = ("mid_epoch", "batches_done", "rows_in_flight", "fresh_samples_epoch",
            "delivered_batches_epoch", "delivered_samples_epoch", "echo_history")  # fmt: skip
    assert {k: s2[k] for k in keys} == {k: s1[k] for k in keys} and s2["cache"] == s1["cache"]
    third = EchoLoader(Gated(64, 8), 2.0)
    third.load_state_dict(s2)
    got += list(third)
    assert copies(got) == {i: 2 for i in range(64)}


def test_a_reader_left_behind_by_close_does_not_end_the_next_epoch() -> None:
    """Epoch 0 is ended while its reader is inside a read that outlasts close_timeout; that read
    fails later, during epoch 1, which still gets every sample."""
    source = Gated(40, 4, hold=(0, 1), fail=True)
    el = EchoLoader(source, 1.0, shuffle_buffer=8, close_timeout=0.05)
    it = iter(el)
    got = [next(it)]
    assert source.held.wait(20)
    with pytest.warns(RuntimeWarning, match="did not return within"):
        it = iter(el)  # ends epoch 0; its reader stays behind in the held read
    got = [next(it)]
    zombie = [t for t in threading.enumerate() if t.name == "echopipe-echoloader-0"]
    source.gate.set()  # the left-behind read fails now, while epoch 1 runs
    for t in zombie:
        t.join(20)
    got += list(it)
    el.close()
    assert copies(got) == {i: 1 for i in range(40)}


def test_echo_history_steps_count_each_batch_once_between_epochs_and_after_a_restore() -> None:
    el = EchoLoader(Gated(64, 8), 2.0)
    assert len(list(el)) == 16
    el.set_echo_factor(3.0)  # a per-epoch schedule, between epochs
    it = iter(el)
    next(it), next(it)
    el.set_echo_factor(2.5)
    state = el.state_dict()
    el.close()
    assert state["echo_history"] == [[0, 2.0], [16, 3.0], [18, 2.5]]
    restored = EchoLoader(Gated(64, 8), 2.0)
    with pytest.warns(FactorReplacedWarning, match="echo_factor 2.5 replaces this loader's 2"):
        restored.load_state_dict(state)
    restored.set_echo_factor(2.0)  # before the restored epoch's first batch
    again = restored.state_dict()
    restored.close()
    assert again["echo_history"] == [[0, 2.0], [16, 3.0], [18, 2.5], [18, 2.0]]
    EchoLoader(Gated(64, 8), 2.0).load_state_dict(again)  # accepted: steps never go back


def test_a_state_takes_every_buffer_the_loader_takes() -> None:
    """A state's cache may hold as many slots as the constructor accepts (MAX_CAPACITY_SAMPLES):
    a loader with shuffle_buffer=5_000_000 saved mid-epoch states its own load refused, the
    state's bound being 2**22."""
    from echopipe.torch import loader_state as ls
    from echopipe.torch import passes

    data = [(torch.arange(4), torch.arange(4))] * 3
    with EchoLoader(data, 2.0) as el:
        batches = iter(el)
        next(batches)
        state = el.state_dict()
    assert state["mid_epoch"] and state["cache_config"] is not None
    state["cache_config"]["capacity_samples"] = MAX_CAPACITY_SAMPLES
    clean = ls.check_loader_state(
        state, version=ls.STATE_VERSION, counts=passes.COUNTS, auto=False, memory_bytes=1 << 40
    )
    assert clean["cache_config"]["capacity_samples"] == MAX_CAPACITY_SAMPLES


def test_an_auto_rise_gives_the_samples_in_the_cache_its_tickets(monkeypatch) -> None:
    """Tickets are fixed when a sample is put: without a top-up, the samples in the cache at
    ``"auto"``'s first decision (the warm-up's, put at e = 1) were each used once, and the steps
    after it waited for the reader. The controller decides e = 4 at its first observation here
    (injected: what the loader does with a decision is under test, not the timing)."""
    from echopipe.echo.controller import EchoController
    from echopipe.torch import arguments

    class DecidesFour(EchoController):
        def observe(self, t_up: float, t_down: float, step: int, t_aug: float = 0.0) -> float:
            self.factor = 4.0
            return self.factor

    monkeypatch.setattr(arguments, "EchoController", DecidesFour)
    data = [(torch.arange(i * 8, i * 8 + 8),) for i in range(40)]  # 320 samples, batches of 8
    with EchoLoader(data, "auto", shuffle_buffer=256, echo_max=4.0, seed=3) as el:
        got: collections.Counter = collections.Counter()
        for (ids,) in el:
            got.update(ids.tolist())
        history = el.stats().echo_history
    assert history[:2] == [(0, 1.0), (1, 4.0)], history
    assert sorted(got) == list(range(320))
    assert set(got.values()) <= {1, 4}
    once = sum(n == 1 for n in got.values())
    # The batch drawn before the decision; a chunk being put at that moment may keep e = 1
    # (EchoCache.top_up). Without the top-up: every sample the cache held then, about 250.
    assert 8 <= once <= 8 + 64, once
