"""EchoCache.take_batch_into: copies into the caller's buffers, checked before the draw, and
handed back when a drawn copy does not fit."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

echo = pytest.importorskip("echopipe.echo", reason="needs the native module echopipe._C")

EchoCache = echo.EchoCache


def _cache(**kw: object) -> echo.EchoCache:
    args = {"capacity_bytes": 1 << 20, "capacity_samples": 64, "echo_factor": 1.0, "seed": 2}
    args.update(kw)
    return EchoCache(**args)  # type: ignore[arg-type]


def test_rows_land_in_the_buffers_from_start_on() -> None:
    cache = _cache()
    images = np.arange(10 * 12, dtype=np.float32).reshape(10, 3, 4)
    labels = np.arange(10, dtype=np.int64) + 100
    cache.put_batch((images, labels))
    cache.end_of_input()
    out_images = torch.full((16, 3, 4), -1.0)
    out_labels = np.full(16, -1, dtype=np.int64)
    assert cache.take_batch_into([out_images, out_labels], 4, timeout=10, start=2) == 4
    got = cache.take_batch_into([out_images, out_labels], timeout=10, start=6)
    assert got == 6  # the rest: fewer than the 10 rows free
    assert cache.take_batch_into([out_images, out_labels], timeout=10) is None
    assert (out_labels[:2] == -1).all() and (out_labels[12:] == -1).all()
    rows = out_labels[2:12] - 100
    assert sorted(rows.tolist()) == list(range(10))
    np.testing.assert_array_equal(out_images[2:12].numpy(), images[rows])


def test_a_uint8_buffer_takes_any_field_of_that_size() -> None:
    cache = _cache()
    cache.put(np.array([1.5, -2.0], dtype=np.float64))
    out = np.zeros((1, 16), dtype=np.uint8)
    assert cache.take_batch_into([out], 1, timeout=10) == 1
    np.testing.assert_array_equal(out.view(np.float64)[0], [1.5, -2.0])


@pytest.mark.parametrize(
    ("out", "match"),
    [
        (lambda: [np.zeros((4, 8), np.uint8)[:, ::2]], "C-contiguous"),
        (lambda: [np.zeros((4, 4), np.uint8), np.zeros((3, 8), np.uint8)], "different numbers"),
        (lambda: [torch.zeros(4, 8).t()], "contiguous CPU tensor"),
        (lambda: [np.zeros((0, 8), np.uint8)], "no rows"),
        (lambda: [b"raw bytes"], "numpy array or torch tensor"),
        (lambda: [], "1..4 buffers"),
    ],
)
def test_bad_buffers_are_refused_before_anything_is_drawn(out: object, match: str) -> None:
    cache = _cache()
    cache.put(np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match=match):
        cache.take_batch_into(out(), 1, timeout=0)  # type: ignore[operator]
    assert cache.stats().emitted == 0
    readonly = np.zeros((2, 8), np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        cache.take_batch_into([readonly], 1, timeout=0)
    with pytest.raises(ValueError, match="do not fit"):
        cache.take_batch_into([np.zeros((2, 8), np.uint8)], 2, timeout=0, start=1)
    with pytest.raises(ValueError, match="start"):
        cache.take_batch_into([np.zeros((2, 8), np.uint8)], 1, timeout=0, start=2)
    assert cache.stats().emitted == 0


def test_a_copy_that_does_not_fit_is_handed_back() -> None:
    # The row size is only compared once copies are drawn: they must go back to the cache.
    cache = _cache(echo_factor=2.0)
    cache.put(np.zeros(8, np.uint8))
    cache.put(np.zeros(12, np.uint8))
    cache.end_of_input()
    taken = 0
    with pytest.raises(ValueError, match="bytes"):
        while True:  # some draw meets the 12-byte sample
            taken += cache.take_batch_into([np.zeros((4, 8), np.uint8)], 1, timeout=10) or 0
    assert cache.stats().emitted == taken  # the refused copy is not counted as emitted
    ids = []
    while got := cache.take(1, timeout=10):
        ids.extend(s.sample_id for s in got)
    assert taken + len(ids) == 4  # two copies each, none lost
    assert sorted(ids).count(1) == 2  # both copies of the 12-byte sample came later


def test_concurrent_takers_into_buffers_deliver_every_copy_once() -> None:
    cache = _cache(capacity_samples=256, echo_factor=3.0, min_fill=16)
    n = 500
    delivered: list[int] = []
    lock = threading.Lock()

    def produce() -> None:
        cache.put_batch(np.arange(n, dtype=np.int64))
        cache.end_of_input()

    def take() -> None:
        out = np.empty(7, dtype=np.int64)
        while (k := cache.take_batch_into([out], timeout=10)) is not None:
            with lock:
                delivered.extend(out[:k].tolist())

    threads = [threading.Thread(target=produce)] + [threading.Thread(target=take) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert sorted(delivered) == sorted(list(range(n)) * 3)


def test_echo_loader_batches_own_their_memory_and_keep_every_copy() -> None:
    # EchoLoader takes into fresh tensors per batch (several takes for one batch when its small
    # cache is full): kept batches must not change as later ones arrive, and a write to one
    # (the tensors are the caller's) must not reach the copies still to come.
    from echopipe.torch import EchoLoader

    n, batch = 96, 8
    images = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, 2, 3).contiguous()
    batches = [(images[i : i + batch], torch.arange(i, i + batch)) for i in range(0, n, batch)]
    kept = []
    with EchoLoader(batches, 3.0, shuffle_buffer=2 * batch, seed=4) as loader:
        for i, (x, y) in enumerate(loader):
            assert x.shape[1:] == (2, 3) and len(x) == len(y)
            kept.append((x, y, x.clone(), i % 2 == 1))
            if i % 2:
                x.fill_(-1.0)  # the caller's tensor: the copies still to come stay as they were
    labels = torch.cat([y for _, y, _, _ in kept])
    assert sorted(labels.tolist()) == sorted(list(range(n)) * 3)
    for x, y, snapshot, written in kept:
        assert torch.equal(snapshot[:, 0, 0], y.to(torch.float32))  # each row its own image
        assert (snapshot == snapshot[:, :1, :1]).all()
        if not written:
            assert torch.equal(x, snapshot)  # not reused by a later batch


def test_timeout_fires_for_a_strings_stream_while_a_later_epoch_waits() -> None:
    # A stream with strings takes without buffers. After an aborted epoch (its cache is gone,
    # the layout stays known), the next epoch's reader is stuck in the wrapped loader: the wait
    # for its first batch must still end with the TimeoutError.
    from echopipe.torch import EchoLoader

    release = threading.Event()

    class Source:
        epochs = 0

        def __iter__(self):
            Source.epochs += 1
            if Source.epochs == 1:
                for i in range(4):
                    yield torch.arange(4 * i, 4 * i + 4), [f"s{4 * i + j}" for j in range(4)]
            else:
                release.wait(30)  # never delivers

    el = EchoLoader(Source(), 2.0, timeout=0.5, close_timeout=0.5, shuffle_buffer=8)
    try:
        first = next(iter(el))
        assert len(first[0]) == 4 and all(s.startswith("s") for s in first[1])
        with (
            pytest.raises(TimeoutError, match=r"no batch within timeout=0\.5s"),
            pytest.warns(RuntimeWarning, match="did not return"),
        ):
            next(iter(el))  # the first iterator's epoch is aborted, the new one waits
    finally:
        release.set()
        el.close()
