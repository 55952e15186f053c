"""Tests of EchoCache as a power user drives it from threads of their own: the registry of
names that the DALI operators read, and what the cache hands back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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


# The main thread waits inside the cache with no timeout; a helper thread sends it SIGINT once
# the wait has begun. If the interrupt were held back, the helper closes the cache after a long
# grace (the interrupt then surfaces as the call returns) and counts the call as forced.
_CTRL_C_PROGRAM = """
import os, signal, threading, time
import numpy as np
from echopipe.echo import EchoCache

forced = []

def interrupt(cache, blocked):
    while not blocked(cache.stats()):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
    if not answered.wait(20):
        forced.append(name)
        cache.close()

for name in ("take", "take_batch", "take_batch_into", "put", "put_batch", "wait_for_room"):
    cache = EchoCache(1 << 16, 2, echo_factor=1.0, memory="pageable")
    if name.startswith("take"):
        blocked = lambda s: s.takes_waited >= 1
    else:
        cache.put_batch(np.arange(2))
        blocked = lambda s: s.producers_waiting >= 1
    call = {
        "take": lambda: cache.take(1),
        "take_batch": lambda: cache.take_batch(1),
        "take_batch_into": lambda: cache.take_batch_into([np.zeros(1, np.int64)]),
        "put": lambda: cache.put(np.int64(2)),
        "put_batch": lambda: cache.put_batch(np.arange(3)),
        "wait_for_room": lambda: cache.wait_for_room(1, timeout=3600),
    }[name]
    answered = threading.Event()
    helper = threading.Thread(target=interrupt, args=(cache, blocked))
    helper.start()
    try:
        call()
        print(name, "returned")
    except BaseException as exc:
        print(name, type(exc).__name__)
    answered.set()
    helper.join()
    cache.close()
print("forced", len(forced))
"""


def test_ctrl_c_ends_a_main_thread_wait_without_a_timeout() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CTRL_C_PROGRAM)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ended = dict(line.split() for line in proc.stdout.splitlines())
    names = ["take", "take_batch", "take_batch_into", "put", "put_batch", "wait_for_room"]
    assert ended == {**{name: "KeyboardInterrupt" for name in names}, "forced": "0"}


def test_a_take_of_more_copies_than_memory_holds_names_n() -> None:
    n = 1 << 50
    with _small() as cache:
        for take in (cache.take, cache.take_batch):
            with pytest.raises(MemoryError) as info:
                take(n, timeout=0)
            assert f"n={n}" in str(info.value)
        cache.put(np.int64(5))
        assert [int(s.array) for s in cache.take(1, timeout=10)] == [5]
