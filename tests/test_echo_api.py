"""Tests of EchoCache as a power user drives it from threads of their own: the registry of
names that the DALI operators read, and what the cache hands back."""

from __future__ import annotations

import numpy as np
import pytest

echo = pytest.importorskip("echopipe.echo", reason="needs the native module echopipe._C")
from echopipe.native import core as _C  # noqa: E402

EchoCache = echo.EchoCache


def _small(name: str | None = None) -> echo.EchoCache:
    return EchoCache(capacity_bytes=1 << 16, capacity_samples=4, memory="pageable", name=name)


def test_an_unnamed_cache_never_takes_a_name_a_caller_chose() -> None:
    first = _small()
    number = int(first.name.removeprefix("echo-"))
    # Names that the next unnamed caches would have had, taken by the caller first (each cache,
    # named or not, used to consume one number).
    chosen = [_small(f"echo-{number + k}") for k in (2, 4, 6)]
    unnamed = [_small() for _ in range(3)]
    try:
        caches = [first, *chosen, *unnamed]
        assert len({c.name for c in caches}) == len(caches)
        for c in caches:  # each name finds its own cache, as a DALI operator looks it up
            assert _C.find_cache_handle(c.name) == c.handle
        for c in unnamed:
            c.close()
        for c in chosen:
            assert _C.find_cache_handle(c.name) == c.handle
    finally:
        for c in [first, *chosen, *unnamed]:
            c.close()


def test_a_negative_bit_view_is_stored_as_the_values_it_reads_as() -> None:
    torch = pytest.importorskip("torch")
    # The imaginary part of a conjugate is a view with the negative bit set; with one element
    # it is contiguous, so its raw bytes (+2, +4) would be read in place.
    views = [torch.tensor([1 + 2j]).conj().imag, torch.tensor(3 + 4j).conj().imag]
    assert all(v.is_neg() and v.is_contiguous() for v in views)
    with _small() as cache:
        cache.echo_factor = 1.0
        for v in views:
            cache.put(v)
            cache.put_batch(v.reshape(1, -1))
        cache.end_of_input()
        got = sorted(float(np.asarray(s.array).ravel()[0]) for s in cache)
        assert got == [-4.0, -4.0, -2.0, -2.0]
        out = torch.zeros(1, dtype=torch.complex64).conj().imag
        cache.reset_input()
        cache.put(np.float32(1.0))
        with pytest.raises(ValueError):
            cache.take_batch_into([out], timeout=10)
        assert [float(s.array) for s in cache.take(1, timeout=10)] == [1.0]
