"""Tests of EchoCache as a power user drives it from threads of their own: the registry of
names that the DALI operators read, and what the cache hands back."""

from __future__ import annotations

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
