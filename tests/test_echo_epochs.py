"""Exact per-epoch copy totals of the native echo cache (``EchoCache(epoch_size=N)``)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

echo = pytest.importorskip("echopipe.echo", reason="needs the native module echopipe._C")
from echopipe.echo import EchoCache, copies_per_epoch  # noqa: E402


def _run_epoch(cache: EchoCache, ids: range) -> Counter[int]:
    """Puts ``ids`` as one input stream, drains it, and counts the copies of each id."""
    for i in ids:
        cache.put(np.array([i], dtype=np.int64))
    cache.end_of_input()
    seen: Counter[int] = Counter()
    while (batch := cache.take_batch(16, timeout=10)) is not None and len(batch):
        seen.update(int(v) for v in batch.fields[0].reshape(-1))
    cache.reset_input()
    return seen


@pytest.mark.parametrize("e", [1.0, 1.25, 1.5, 2.0, 2.3, 3.7])
@pytest.mark.parametrize("n", [1, 7, 20, 101])
def test_every_epoch_emits_the_exact_total(e: float, n: int) -> None:
    cache = EchoCache(1 << 20, 4096, echo_factor=e, seed=5, epoch_size=n)
    for epoch in range(3):
        seen = _run_epoch(cache, range(epoch * 1000, epoch * 1000 + n))
        assert sum(seen.values()) == copies_per_epoch(e, n)
        assert set(seen) == set(range(epoch * 1000, epoch * 1000 + n))
        assert set(seen.values()) <= {int(np.floor(e)), int(np.ceil(e))}


def test_the_extra_copies_go_to_other_samples_each_epoch() -> None:
    n = 200
    cache = EchoCache(1 << 20, 4096, echo_factor=1.5, seed=1, epoch_size=n)
    chosen = []
    for _ in range(3):
        seen = _run_epoch(cache, range(n))
        chosen.append({i for i, k in seen.items() if k == 2})
        assert len(chosen[-1]) == n // 2
    assert chosen[0] != chosen[1] and chosen[1] != chosen[2]


def test_blocks_repeat_within_one_long_stream() -> None:
    n = 10
    cache = EchoCache(1 << 20, 4096, echo_factor=1.3, seed=2, epoch_size=n)
    seen = _run_epoch(cache, range(4 * n))
    for block in range(4):
        ids = range(block * n, (block + 1) * n)
        assert sum(seen[i] for i in ids) == copies_per_epoch(1.3, n)


def test_a_restored_cache_keeps_the_epoch_total() -> None:
    """The block start is state: a cache restored mid-epoch finishes the epoch exactly."""
    n, e = 30, 1.6
    first = EchoCache(1 << 20, 4096, echo_factor=e, seed=9, epoch_size=n)
    _run_epoch(first, range(n))  # one full epoch, so the next block starts at sample id n
    for i in range(12):
        first.put(np.array([i], dtype=np.int64))
    state = first.state_dict()
    second = EchoCache(1 << 20, 4096, echo_factor=e, seed=9, epoch_size=n)
    second.load_state_dict(state)
    seen = _run_epoch(second, range(12, n))
    assert sum(seen.values()) == copies_per_epoch(e, n)


def test_batch_mode_counts_units() -> None:
    n_units, batch = 9, 4
    cache = EchoCache(1 << 20, 4096, echo_factor=1.5, mode="batch", batch_size=batch, seed=3,
                      epoch_size=n_units)  # fmt: skip
    seen = _run_epoch(cache, range(n_units * batch))
    assert sum(seen.values()) == copies_per_epoch(1.5, n_units) * batch


@pytest.mark.parametrize("bad", [-1, 2**40 + 1, 1.5, True])
def test_a_bad_epoch_size_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="epoch_size"):
        EchoCache(1 << 20, 64, echo_factor=2.0, epoch_size=bad)  # type: ignore[arg-type]


def test_copies_per_epoch_rounds_half_up() -> None:
    assert copies_per_epoch(1.5, 1) == 2
    assert copies_per_epoch(1.5, 3) == 5  # 1.5 extra copies round up to 2
    assert copies_per_epoch(2.0, 7) == 14
    assert copies_per_epoch(1.25, 6) == 8  # 1.5 -> 2
