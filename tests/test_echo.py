"""Tests of echopipe.echo.EchoCache with real threads against the native cache."""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

echo = pytest.importorskip("echopipe.echo", reason="needs the native module echopipe._C")
from echopipe.native import core as _C  # noqa: E402

EchoCache = echo.EchoCache


def _drain(cache: echo.EchoCache, n: int = 64) -> list[int]:
    ids: list[int] = []
    while True:
        got = cache.take(n, timeout=10)
        if not got:
            return ids
        ids.extend(s.sample_id for s in got)


@pytest.mark.parametrize("e", [1.0, 2.0, 3.5])
def test_stress_exact_accounting_4x4_threads(e: float) -> None:
    n_samples, producers, consumers, chunk = 200_000, 4, 4, 2_000
    cache = EchoCache(
        capacity_bytes=8 << 20, capacity_samples=8192, echo_factor=e, min_fill=1024, seed=3
    )
    keys = np.arange(n_samples, dtype=np.int64)
    payload = (keys[:, None] * 7 + np.arange(8)).astype(np.int32)  # checks the data, not just ids
    counts = np.zeros(n_samples, dtype=np.int64)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        try:
            for start in range(p * chunk, n_samples, producers * chunk):
                stop = min(start + chunk, n_samples)
                assert cache.put_batch((keys[start:stop], payload[start:stop])) == stop - start
        except BaseException as exc:
            errors.append(exc)

    def consume(c: int) -> None:
        try:
            while True:
                batch = cache.take_batch(16 + 16 * c, timeout=30)
                if batch is None:
                    return
                got = batch.fields[0]
                np.testing.assert_array_equal(batch.fields[1], got[:, None] * 7 + np.arange(8))
                with lock:
                    np.add.at(counts, got, 1)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    threads += [threading.Thread(target=consume, args=(c,)) for c in range(consumers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads[:producers]:
        t.join()
    cache.end_of_input()
    for t in threads[producers:]:
        t.join()
    secs = time.perf_counter() - t0
    assert not errors, errors
    stats = cache.stats()
    print(f"e={e}: {counts.sum()} copies of {n_samples} samples in {secs:.2f}s")
    lo, hi = math.floor(e), math.ceil(e)
    assert counts.min() >= lo and counts.max() <= hi  # none lost, none extra
    assert stats.fresh_in == n_samples
    assert stats.emitted == counts.sum()
    hist = np.bincount(counts, minlength=len(stats.emit_histogram))
    assert list(hist[: len(stats.emit_histogram)]) == stats.emit_histogram
    assert stats.resident == 0 and stats.bytes_used == 0
    if hi != lo:  # ceil(e) copies with probability frac(e)
        assert abs(np.mean(counts == hi) - (e - lo)) < 0.01
    cache.close()


def test_shuffle_quality_buffer_much_larger_than_batch() -> None:
    n, buffer, batch = 20_000, 4096, 32
    cache = EchoCache(
        capacity_bytes=4 << 20, capacity_samples=buffer, echo_factor=2.0, min_fill=buffer // 2
    )
    out: list[int] = []
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            b = cache.take_batch(batch, timeout=30)
            if b is None:
                return
            out.extend(int(i) for i in b.fields[0])

    t = threading.Thread(target=consume)
    t.start()
    cache.put_batch(np.arange(n, dtype=np.int64))
    cache.end_of_input()
    t.join()
    ids = np.asarray(out)
    assert len(ids) == 2 * n
    adjacent = float(np.mean(ids[1:] == ids[:-1]))
    in_batch_dups = np.mean(
        [len(set(ids[i : i + batch])) < batch for i in range(0, len(ids) - batch, batch)]
    )
    stats = cache.stats()
    print(
        f"adjacent duplicates {adjacent:.5f}, batches with a duplicate {in_batch_dups:.3f}, "
        f"mean reuse distance {stats.mean_reuse_distance:.0f}"
    )
    # Random draws among >= 2048 residents: P(adjacent copy) ~ 1/2048; FIFO echo would be 0.5.
    assert adjacent < 0.005
    assert in_batch_dups < 0.3
    # A copy comes back after ~ the resident count of draws, far beyond one batch.
    assert stats.mean_reuse_distance > 500
    # Output order is shuffled, not FIFO: ids are far from sorted.
    assert abs(np.corrcoef(np.arange(1000), ids[2000:3000])[0, 1]) < 0.9
    assert np.mean(np.diff(ids[:2000]) < 0) > 0.3


def test_variable_sizes_views_and_gather() -> None:
    rng = np.random.default_rng(0)
    images = [
        rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in rng.integers(4, 40, (50, 2))
    ]
    with EchoCache(capacity_bytes=1 << 20, capacity_samples=64, echo_factor=1.0) as cache:
        for i, img in enumerate(images):
            cache.put((img, np.int64(i)))
        got = cache.take(10)
        for s in got:
            label = int(s[1])
            assert s[1].shape == ()
            np.testing.assert_array_equal(s[0], images[label])
        batch = cache.take_batch(10)
        assert batch is not None and batch.offsets[0] is not None
        assert batch.fields[1].shape == (10,) and batch.offsets[1] is None
        for i in range(10):
            np.testing.assert_array_equal(batch.sample(i, 0), images[int(batch.fields[1][i])])


def test_back_pressure_put_blocks_until_space() -> None:
    cache = EchoCache(capacity_bytes=1 << 16, capacity_samples=4, echo_factor=1.0)
    for i in range(4):
        cache.put(np.int64(i))
    with pytest.raises(TimeoutError, match=r"timeout=0\.1"):
        cache.put(np.int64(99), timeout=0.1)
    done = threading.Event()

    def blocked_put() -> None:
        cache.put(np.int64(4), timeout=10)
        done.set()

    t = threading.Thread(target=blocked_put)
    t.start()
    assert not done.wait(0.2)  # still full
    taken = cache.take(1)
    assert not done.wait(0.1)  # the taken copy still holds its slot
    del taken
    gc.collect()
    assert done.wait(5)  # dropping the view freed the slot
    t.join()
    assert cache.stats().puts_blocked >= 2
    cache.close()


def _until(condition) -> None:  # type: ignore[no-untyped-def]
    """Polls a state condition (a counter the cache keeps), failing after 10 s."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.001)


def test_close_wakes_blocked_put_and_take() -> None:
    full = EchoCache(capacity_bytes=1 << 16, capacity_samples=1, echo_factor=1.0)
    full.put(np.int64(0))
    empty = EchoCache(capacity_bytes=1 << 16, capacity_samples=4, echo_factor=1.0)
    raised: dict[str, type] = {}

    def run(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
        except Exception as exc:
            raised[name] = type(exc)

    threads = [
        threading.Thread(target=run, args=("put", lambda: full.put(np.int64(1)))),
        threading.Thread(target=run, args=("take", lambda: empty.take(1))),
    ]
    for t in threads:
        t.start()
    # Both calls are blocked (no timeout: only close() can end them).
    _until(lambda: full.stats().puts_blocked == 1 and empty.stats().takes_waited == 1)
    assert not raised
    full.close()
    empty.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert raised == {"put": echo.CacheClosedError, "take": echo.CacheClosedError}
    full.close()  # idempotent
    with pytest.raises(echo.CacheClosedError):
        full.take(1, timeout=0)


def test_drain_after_end_of_input_and_reset() -> None:
    cache = EchoCache(capacity_bytes=1 << 16, capacity_samples=64, echo_factor=2.0, min_fill=50)
    for i in range(10):
        cache.put(np.int64(i))
    with pytest.raises(TimeoutError):
        cache.take(4, timeout=0.05)  # warm-up: 10 < min_fill
    cache.end_of_input()
    with pytest.raises(echo.InputEndedError):
        cache.put(np.int64(0))
    batches = []
    while True:
        got = cache.take(4, timeout=5)
        if not got:
            break
        batches.append(sorted(int(s.array) for s in got))
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4]
    assert sorted(x for b in batches for x in b) == sorted(list(range(10)) * 2)
    assert cache.take(4) == [] and list(cache) == []
    cache.reset_input()
    cache.put(np.int64(5))
    cache.end_of_input()
    assert [int(s.array) for s in cache] == [5, 5]


def test_draws_probe_only_the_used_slots_after_a_full_cache_drained() -> None:
    # A cache filled once and drained: the next epoch's few samples sit in the lowest slots, and
    # the slots draws probe come back down to them with the first put (stats().probe_slots),
    # instead of staying at the whole capacity, where nearly every probe would miss.
    cache = EchoCache(capacity_bytes=1 << 20, capacity_samples=4096, echo_factor=2.0)
    cache.put_batch(np.arange(4096, dtype=np.int64).reshape(4096, 1))
    assert cache.stats().probe_slots == 4096
    cache.end_of_input()
    while cache.take_batch(256) is not None:
        pass
    cache.reset_input()
    cache.put_batch(np.arange(3, dtype=np.int64).reshape(3, 1))
    assert cache.stats().probe_slots == 3
    cache.end_of_input()
    assert sorted(int(s.array[0]) for s in cache) == [0, 0, 1, 1, 2, 2]


def test_batch_mode_returns_whole_batches_in_put_order() -> None:
    cache = EchoCache(
        capacity_bytes=1 << 16, capacity_samples=32, echo_factor=2.0, mode="batch", batch_size=4
    )
    with pytest.raises(ValueError, match="got 3"):
        cache.take(3)
    cache.put_batch(np.arange(10, dtype=np.int64))
    cache.end_of_input()
    seen = []
    while got := cache.take(4, timeout=5):
        vals = [int(s.array) for s in got]
        assert vals == list(range(vals[0], vals[0] + len(vals)))
        assert [s.index_in_batch for s in got] == list(range(len(vals)))
        seen.extend(vals)
    assert sorted(seen) == sorted(list(range(10)) * 2)


def test_state_dict_round_trip_gives_same_stream() -> None:
    kw = dict(capacity_bytes=1 << 20, capacity_samples=256, echo_factor=2.5, seed=11)
    a = EchoCache(**kw)
    a.put_batch(np.arange(100, dtype=np.int64))
    for _ in range(5):
        a.take(8)
    state = a.state_dict()
    b = EchoCache(**kw)
    b.load_state_dict(state)
    assert b.stats().tickets_left == a.stats().tickets_left
    for c in (a, b):
        c.put_batch(np.arange(100, 130, dtype=np.int64))
        c.end_of_input()
    assert [int(s.array) for s in a] == [int(s.array) for s in b]
    with pytest.raises(ValueError, match="empty cache"):
        b.load_state_dict(state)
    # The factor is runtime state: a cache created with another e adopts the saved one.
    other = EchoCache(**{**kw, "echo_factor": 3.0})
    other.load_state_dict(state)
    assert other.echo_factor == 2.5
    with pytest.raises(ValueError, match="magic"):
        EchoCache(**kw).load_state_dict(b"not a state")


def test_bad_input_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"0\.5"):
        EchoCache(echo_factor=0.5)
    with pytest.raises(ValueError, match="'fifo'"):
        EchoCache(mode="fifo")
    with pytest.raises(ValueError, match="min_fill=99"):
        EchoCache(capacity_samples=8, min_fill=99)
    cache = EchoCache(capacity_bytes=4096, capacity_samples=8)
    assert cache.refused_sample is None
    with pytest.raises(echo.SampleTooLargeError, match=r"8192 bytes.*capacity_bytes=4096") as e:
        cache.put(np.zeros(8192, np.uint8))
    assert (e.value.sample_bytes, e.value.capacity_bytes) == (8192, 4096)
    assert isinstance(e.value, ValueError) and isinstance(e.value, echo.EchoCacheError)
    # What a DALI sink's refusal leaves on the cache: the same typed error.
    assert cache.refused_sample is not None and cache.refused_sample.sample_bytes == 8192
    with pytest.raises(ValueError, match="complex64"):
        cache.put(np.zeros(4, np.complex64))
    with pytest.raises(ValueError, match="-1"):
        cache.take(-1)
    with pytest.raises(ValueError, match="timeout"):
        cache.take(1, timeout=-2)
    with pytest.raises(ValueError, match="already exists"):
        EchoCache(name=cache.name)


def test_zero_copy_views_numpy_and_torch() -> None:
    torch = pytest.importorskip("torch")
    cache = EchoCache(capacity_bytes=1 << 20, capacity_samples=8, echo_factor=2.0)
    cache.put(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    cache.put(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    cache.end_of_input()
    got = cache.take(4)
    by_id: dict[int, list] = {}
    for s in got:
        by_id.setdefault(s.sample_id, []).append(s)
    a0, a1 = (s.array for s in by_id[0])
    assert np.shares_memory(a0, a1)  # both copies view the same slot
    assert not a0.flags.writeable
    np.testing.assert_array_equal(a0, np.arange(12, dtype=np.float32).reshape(3, 4))
    t = by_id[0][0].torch()
    assert t.data_ptr() != a0.__array_interface__["data"][0]  # a copy: torch cannot be read-only
    np.testing.assert_array_equal(t.numpy(), a0)
    bf = by_id[1][0].torch()
    assert bf.dtype == torch.bfloat16 and bf.tolist() == [1.5, -2.0]


def test_writes_never_reach_the_copies_still_to_be_echoed() -> None:
    pytest.importorskip("torch")
    cache = EchoCache(1 << 16, 8, echo_factor=3, memory="pageable")
    cache.put(np.full(16, 100, np.uint8))
    cache.end_of_input()
    first = cache.take(1)[0]
    with pytest.raises(ValueError, match="read-only"):
        first.array[0] = 1
    with pytest.raises(ValueError, match="WRITEABLE"):
        first.array.setflags(write=True)  # the base does not own the memory: cannot be unlocked
    first.torch().sub_(50)  # in place on the tensor it got
    (second,) = cache.take(1)
    assert int(second.array[0]) == 100 and int(second.torch()[0]) == 100
    batch = cache.take_batch(1)  # gathered copies are the caller's own, writable arrays
    assert batch is not None and batch.fields[0].flags.writeable and batch.fields[0][0, 0] == 100


def test_views_outlive_the_closed_cache() -> None:
    cache = EchoCache(capacity_bytes=1 << 16, capacity_samples=4, echo_factor=1.0)
    name = cache.name
    assert _C.find_cache_handle(name) == cache.handle
    cache.put(np.arange(5, dtype=np.int32))
    view = cache.take(1)[0].array
    cache.close()
    assert _C.find_cache_handle(name) is None
    del cache
    gc.collect()
    np.testing.assert_array_equal(view, np.arange(5))


def test_same_seed_same_stream() -> None:
    def stream(seed: int) -> list[int]:
        c = EchoCache(capacity_bytes=1 << 20, capacity_samples=512, echo_factor=1.7, seed=seed)
        out = []
        for i in range(200):
            c.put(np.int64(i), timeout=5)  # one thread: 200 samples never fill 512 slots
            if i >= 32:
                out.extend(int(s.array) for s in c.take(1, timeout=5))
        c.end_of_input()
        out.extend(int(s.array) for s in c)
        return out

    assert stream(5) == stream(5)
    assert stream(5) != stream(6)


def test_gather_to_device_needs_a_mapped_cache() -> None:
    cache = EchoCache(capacity_bytes=1 << 16, capacity_samples=4, memory="pageable")
    cache.put(np.zeros(16, np.uint8))
    leases = [s._lease for s in cache.take(1)]
    with pytest.raises(RuntimeError, match=r"pinned|without CUDA"):
        _C.gather_to_device(leases, 0, 0, 0)
    if not _C.cuda_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            EchoCache(memory="pinned")


def test_set_echo_factor_applies_to_later_samples() -> None:
    cache = EchoCache(capacity_bytes=1 << 20, capacity_samples=512, echo_factor=2.0, seed=1)
    assert cache.echo_factor == 2.0
    cache.put_batch(np.arange(0, 50, dtype=np.int64))
    cache.echo_factor = 3
    assert cache.echo_factor == 3.0
    cache.put_batch(np.arange(50, 100, dtype=np.int64))
    cache.echo_factor = 1.5
    cache.put_batch(np.arange(100, 400, dtype=np.int64))
    for bad in (0.5, float("nan"), float("inf"), "x", True):
        with pytest.raises(ValueError, match="echo_factor"):
            cache.echo_factor = bad
    assert cache.echo_factor == 1.5
    cache.end_of_input()
    seen: dict[int, int] = {}
    tickets: dict[int, int] = {}
    for s in cache:
        key = int(s.array)
        seen[key] = seen.get(key, 0) + 1
        tickets[key] = s.tickets
    del s  # the last copy's lease, so that every slot can retire
    assert all(seen[k] == 2 == tickets[k] for k in range(50))
    assert all(seen[k] == 3 == tickets[k] for k in range(50, 100))
    late = [seen[k] for k in range(100, 400)]
    assert set(late) == {1, 2} and late == [tickets[k] for k in range(100, 400)]
    assert 0.35 < late.count(2) / len(late) < 0.65
    st = cache.stats()
    assert st.emitted == sum(seen.values()) and st.retired == 400 and st.resident == 0


def test_gather_to_device_checks_its_arguments_before_touching_cuda() -> None:
    import torch

    cache = EchoCache(capacity_bytes=1 << 20, capacity_samples=16, memory="pageable")
    for i in range(4):
        cache.put((np.full((4, 5, 3), i, np.uint8), np.int64(i)))
    samples = cache.take(4)
    ok = torch.empty(4 * 60, dtype=torch.uint8)
    with pytest.raises(ValueError, match="device 'cpu'"):
        cache.gather_to_device(samples, 0, ok)
    with pytest.raises(ValueError, match="device 'cpu'"):
        cache.gather_to_device(samples, 0, torch.empty(4, 3, 4, 5), normalize=([0] * 3, [1] * 3),
                               layout="CHW")  # fmt: skip
    with pytest.raises(TypeError, match="ndarray"):
        cache.gather_to_device(samples, 0, np.empty(240, np.uint8))
    with pytest.raises(TypeError, match=r"samples\[1\]"):
        cache.gather_to_device([samples[0], "x"], 0, ok)
    with pytest.raises(ValueError, match="empty"):
        cache.gather_to_device([], 0, ok)
    with pytest.raises(ValueError, match="field=2"):
        cache.gather_to_device(samples, 2, ok)
    with pytest.raises(ValueError, match=r"dtype torch\.float32"):
        cache.gather_to_device(samples, 0, torch.empty(240))
    with pytest.raises(ValueError, match="239 elements"):
        cache.gather_to_device(samples, 0, torch.empty(239, dtype=torch.uint8))
    with pytest.raises(ValueError, match="layout"):
        cache.gather_to_device(samples, 0, ok, layout="NCHW")
    with pytest.raises(ValueError, match=r"CHW.*normalize"):
        cache.gather_to_device(samples, 0, ok, layout="CHW")
    with pytest.raises(ValueError, match="uint8 HWC"):
        cache.gather_to_device(samples, 1, torch.empty(4), normalize=([0], [1]))
    with pytest.raises(ValueError, match="per channel"):
        cache.gather_to_device(samples, 0, torch.empty(4, 4, 5, 3), normalize=([0], [1]))
    with pytest.raises(ValueError, match="non-zero std"):
        cache.gather_to_device(samples, 0, torch.empty(4, 4, 5, 3), normalize=([0] * 3, [0] * 3))
    with pytest.raises(ValueError, match=r"\(4, 3, 4, 5\)"):
        cache.gather_to_device(samples, 0, torch.empty(4, 4, 5, 3), normalize=([0] * 3, [1] * 3),
                               layout="CHW")  # fmt: skip
    with pytest.raises(ValueError, match="normalize must be"):
        cache.gather_to_device(samples, 0, torch.empty(4, 4, 5, 3), normalize=(1, 2))
    cache.close()


def test_native_bench_driver_accounts_for_every_copy() -> None:
    # bench/echo_cache.py's driver: 2 producers, 2 consumers (batches released together with
    # release_leases), e = 2 -> exactly two copies per fresh sample, nothing left behind. It is
    # built only in a checkout (ECHOPIPE_BUILD_BENCH=ON), never shipped in the package.
    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    try:
        import echo_cache
    finally:
        sys.path.remove(str(bench))
    driver = echo_cache.load_driver()
    if driver is None:
        pytest.skip(echo_cache.unavailable() or "")
    assert not [name for name in dir(_C) if "bench" in name]
    for min_fill in (64, 512):  # the two warm-ups of the suite: 4 batches, half the arena
        r = driver.put_take(4096, 3000, 2, 2, 2.0, 4 << 20, 16, min_fill)
        assert r["fresh"] == 3000 and r["copies"] == 6000
        assert r["bytes_out"] == 6000 * 4096 and r["seconds"] > 0
    m = driver.memcpy(4096, 100, 2, 1 << 20, 16)
    assert m["bytes"] == 100 * 4096 and m["seconds"] > 0
    b = driver.balanced_copies(4096, 3000, 2.0, 4 << 20, 16, 512)
    assert b["bytes"] == 9000 * 4096 and b["seconds"] > 0


_EXIT_PRELUDE = """
import sys, threading, time
import numpy as np
from echopipe.echo import CacheClosedError, EchoCache
cache = EchoCache(1 << 16, 8, echo_factor=2, memory="pageable")
def until(condition):
    # Waits for a state the cache counts (a thread inside a call), failing after 30 s.
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the threads never got inside the cache"
        time.sleep(0.001)
"""

_EXIT_CASES = {
    # Daemon threads looping in take/put with short timeouts: exit must not abort (rc 134).
    "daemon_polling": """
looping = threading.Barrier(6)
def takes():
    looping.wait()
    while True:
        try:
            cache.take(4, timeout=0.05)
        except Exception:
            pass
def puts():
    looping.wait()
    while True:
        try:
            cache.put(np.zeros(16, np.uint8), timeout=0.05)
        except Exception:
            pass
for _ in range(4):
    threading.Thread(target=takes, daemon=True).start()
threading.Thread(target=puts, daemon=True).start()
looping.wait()
until(lambda: cache.stats().emitted >= 16)  # puts and takes are both going round
""",
    # A daemon thread blocked in take() with no timeout when the main thread ends.
    "daemon_blocked": """
threading.Thread(target=lambda: cache.take(1), daemon=True).start()
until(lambda: cache.stats().takes_waited == 1)
""",
    # Non-daemon threads blocked in take() and put() with no timeout: Python joins them at exit,
    # so the cache must be closed (and they woken) before that join.
    "non_daemon_blocked": """
full = EchoCache(1 << 16, 1, echo_factor=1, memory="pageable")
full.put(np.zeros(4, np.uint8))
def wait(fn):
    try:
        fn()
    except CacheClosedError:
        print("woken", flush=True)
threading.Thread(target=wait, args=(lambda: cache.take(1),)).start()
threading.Thread(target=wait, args=(lambda: full.put(np.zeros(4, np.uint8)),)).start()
until(lambda: cache.stats().takes_waited == 1 and full.stats().puts_blocked == 1)
""",
}


@pytest.mark.parametrize("case", sorted(_EXIT_CASES))
def test_interpreter_exit_with_threads_inside_the_cache(case: str) -> None:
    code = textwrap.dedent(_EXIT_PRELUDE) + textwrap.dedent(_EXIT_CASES[case]) + "print('end')\n"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    print(f"{case}: rc={proc.returncode} after {elapsed:.2f}s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    assert proc.stdout.splitlines()[0] == "end"
    if case == "non_daemon_blocked":
        assert proc.stdout.count("woken") == 2


def test_batch_path_moves_whole_batches() -> None:
    cache = EchoCache(capacity_bytes=1 << 22, capacity_samples=512, echo_factor=2.0, seed=2)
    images = np.arange(300 * 48, dtype=np.uint8).reshape(300, 4, 4, 3)
    labels = np.arange(300, dtype=np.int64)
    assert cache.put_batch((images, labels)) == 300
    cache.end_of_input()
    seen = np.zeros(300, np.int64)
    while (batch := cache.take_batch(64, timeout=5)) is not None:
        img, lab = batch.fields
        assert img.shape[1:] == (4, 4, 3) and batch.offsets == [None, None]
        np.testing.assert_array_equal(img, images[lab])  # fields of one sample stay together
        np.testing.assert_array_equal(batch.sample_ids, lab)
        assert batch.shapes[0] == ((4, 4, 3), ()) and len(batch.shapes) == len(lab)
        np.add.at(seen, lab, 1)
    assert (seen == 2).all()
    st = cache.stats()
    assert st.emitted == 600 and st.resident == 0 and st.retired == 300
    with pytest.raises(ValueError, match="common first dimension"):
        cache.put_batch((images[:3], labels[:2]))


def test_put_batch_stops_at_close_and_reports_rows_done() -> None:
    cache = EchoCache(capacity_bytes=1 << 16, capacity_samples=100, echo_factor=1.0)
    rows = np.zeros((150, 8), np.uint8)
    result: dict[str, object] = {}

    def put() -> None:
        try:
            cache.put_batch(rows)
        except echo.CacheClosedError as exc:
            result["done"] = exc.rows_put

    t = threading.Thread(target=put)
    t.start()
    _until(lambda: cache.stats().puts_blocked == 1)  # 100 rows fit, the 101st blocks
    cache.close()
    t.join(5)
    assert result == {"done": 100}


def test_wait_for_room_quota_and_layouts_live_in_the_cache() -> None:
    cache = EchoCache(capacity_bytes=1 << 16, capacity_samples=8, echo_factor=1.0, min_fill=8)
    cache.put_batch(np.arange(6, dtype=np.int64))
    cache.wait_for_room(2, timeout=0)
    with pytest.raises(TimeoutError, match="room for 3"):
        cache.wait_for_room(3, timeout=0.05)
    with pytest.raises(ValueError, match="capacity_samples=8"):
        cache.wait_for_room(9)
    done = threading.Event()

    def wait() -> None:
        cache.wait_for_room(3, timeout=10)
        done.set()

    t = threading.Thread(target=wait)
    t.start()
    # The waiter counts as a blocked producer, so the min_fill warm-up does not block this take.
    taken = cache.take(1, timeout=5)
    del taken
    gc.collect()
    assert done.wait(5)
    t.join()
    assert cache.quota == -1
    cache.quota = 2
    assert cache.quota == 2
    cache.layouts = ["HWC", ""]
    assert cache.layouts == ["HWC", ""]
    assert _C.find_cache(cache.name).layouts == ["HWC", ""]  # one registry, seen by the plugin
    cache.end_of_input()
    with pytest.raises(echo.InputEndedError):
        cache.wait_for_room(1)
    cache.close()
    with pytest.raises(echo.CacheClosedError):
        cache.wait_for_room(1)


def test_batch_mode_state_round_trip_with_an_open_batch() -> None:
    kw = dict(capacity_bytes=1 << 20, capacity_samples=64, echo_factor=2.0, seed=4, mode="batch",
              batch_size=4)  # fmt: skip
    a = EchoCache(**kw)
    a.put_batch(np.arange(10, dtype=np.int64))  # two whole batches and an open one of 2
    a.take(4)
    b = EchoCache(**kw)
    b.load_state_dict(a.state_dict())
    for c in (a, b):
        c.put_batch(np.arange(10, 14, dtype=np.int64))
        c.end_of_input()
    assert [int(s.array) for s in a] == [int(s.array) for s in b]
    corrupt = bytearray(a.state_dict())
    corrupt[-3] ^= 0xFF  # the high-water mark
    fresh = EchoCache(**kw)
    with pytest.raises(ValueError, match="corrupt"):
        fresh.load_state_dict(bytes(corrupt))
    assert fresh.stats().resident == 0


def test_errors_are_one_hierarchy_and_a_bad_state_is_typed() -> None:
    for cls in (echo.CacheClosedError, echo.InputEndedError, echo.SampleTooLargeError,
                echo.CacheStateError):  # fmt: skip
        assert issubclass(cls, echo.EchoCacheError)
    cache = EchoCache(capacity_bytes=4096, capacity_samples=8)
    with pytest.raises(echo.CacheStateError, match="magic"):
        cache.load_state_dict(b"not a cache state at all")
    cache.put(np.int64(1))
    with pytest.raises(echo.CacheStateError, match="empty cache"):
        cache.load_state_dict(cache.state_dict())
    assert cache.stats().fresh_in == 1  # unchanged
    cache.close()
    with pytest.raises(echo.CacheClosedError):
        cache.put(np.int64(2))


@pytest.mark.parametrize("mode", ["example", "batch"])
def test_take_batch_that_raises_after_its_claim_loses_nothing(mode: str) -> None:
    # A batch of samples with different dtypes cannot be gathered into one array per field; the
    # error comes after the copies were drawn, and they must go back to the cache.
    batch = 2 if mode == "batch" else None
    cache = EchoCache(
        capacity_bytes=1 << 16, capacity_samples=8, echo_factor=1.0, mode=mode, batch_size=batch
    )
    cache.put(np.zeros(3, np.uint8))
    cache.put(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="mixes dtypes"):
        cache.take_batch(2, timeout=0)
    st = cache.stats()
    assert (st.emitted, st.tickets_left) == (0, 2 if mode == "example" else 1)
    cache.end_of_input()
    delivered = _drain(cache, n=2)
    assert sorted(delivered) == [0, 1]  # each exactly once: its one ticket
    st = cache.stats()
    assert (st.emitted, st.retired, st.resident) == (2, 2, 0)
    assert cache.take_batch(2, timeout=0) is None


def test_take_batch_hands_back_under_concurrent_takers() -> None:
    # Two samples of another dtype among many: takers that draw one of them raise and hand the
    # batch back; the others gather. In the end every copy was delivered exactly once.
    cache = EchoCache(capacity_bytes=1 << 20, capacity_samples=512, echo_factor=2.0, seed=1)
    cache.put_batch(np.arange(200, dtype=np.int64))
    cache.put(np.float64(-1.0))
    cache.put(np.float64(-2.0))
    cache.end_of_input()
    delivered: list[int] = []
    raised = [0]
    lock = threading.Lock()

    def taker() -> None:
        while True:
            try:
                got = cache.take_batch(4, timeout=10)
            except ValueError:
                with lock:
                    raised[0] += 1
                got_one = cache.take(1, timeout=10)  # what a caller falls back to
                with lock:
                    delivered.extend(s.sample_id for s in got_one)
                continue
            if got is None:
                return
            with lock:
                delivered.extend(int(i) for i in got.sample_ids)

    threads = [threading.Thread(target=taker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert raised[0] > 0
    assert sorted(delivered) == sorted(list(range(202)) * 2)
    assert cache.stats().emitted == len(delivered) == 404


def _as_open_unit(blob: bytes, capacity: int) -> bytes:
    """The state of a cache holding one published unit, with that unit's members moved to the
    open (still filling) unit: the layout of echo_state.cc's header (magic, version, factor,
    mode, batch size, capacity, 8 counters, the histogram), the unit count, the unit (tickets
    left and total, last emission, members), the open flag, then the free list."""
    import struct

    head = 8 + 4 + 8 + 1 + 8 + 4 + 8 * 8
    (bins,) = struct.unpack_from("<I", blob, head)
    units_at = head + 4 + 8 * bins
    assert struct.unpack_from("<I", blob, units_at) == (1,)
    for free in range(capacity + 1):  # the open flag (0) sits before the free list's count
        at = len(blob) - 4 - 4 * free - 4
        if struct.unpack_from("<I", blob, at) == (free,) and blob[at - 1] == 0:
            break
    members = blob[units_at + 4 + 16 : at - 1]
    return blob[:units_at] + struct.pack("<I", 0) + b"\x01" + members + blob[at:]


@pytest.mark.parametrize("mode", ["example", "batch"])
def test_a_state_whose_open_unit_could_never_close_is_refused(mode: str) -> None:
    """A batch is closed the moment it is full, and example mode has no open unit: a state
    that says otherwise (crafted) would make every later put join one unit that takes hand
    out more copies than asked for, past the end of the caller's buffer."""
    kw = dict(capacity_bytes=1 << 16, capacity_samples=16, echo_factor=1.0, seed=1, mode=mode,
              batch_size=2 if mode == "batch" else None)  # fmt: skip
    source = EchoCache(**kw)
    source.put_batch(np.array([[0], [10]] if mode == "batch" else [[5]], dtype=np.int64))
    crafted = _as_open_unit(source.state_dict(), 16)
    target = EchoCache(**kw)
    with pytest.raises(echo.CacheStateError, match="corrupt"):
        target.load_state_dict(crafted)
    assert target.stats().resident == 0


def test_top_up_gives_the_samples_in_the_cache_a_raised_factor() -> None:
    """After the factor rose, the samples put at the lower one (held ones too) get its
    tickets: each is emitted as often as the ones put after, with copy indices 0 .. e - 1."""
    with EchoCache(capacity_bytes=1 << 20, capacity_samples=64, echo_factor=1.0) as cache:
        for i in range(10):
            cache.put(np.int64(i))
        held = cache.take(3)
        assert [s.tickets for s in held] == [1, 1, 1]
        assert cache.top_up() == 0
        cache.echo_factor = 3.0
        assert cache.top_up() == 20  # 2 more for each of the 10
        assert cache.top_up() == 0
        assert [s.tickets for s in held] == [3, 3, 3]
        copies = {int(s[0]): [s.emission] for s in held}
        del held
        cache.echo_factor = 2.0
        assert cache.top_up() == 0  # never lowered
        for i in range(10, 12):
            cache.put(np.int64(i))
        cache.end_of_input()
        while got := cache.take(1, timeout=5):
            for s in got:
                copies.setdefault(int(s[0]), []).append(s.emission)
        assert {k: sorted(v) for k, v in copies.items()} == {
            **{k: [0, 1, 2] for k in range(10)},
            10: [0, 1],
            11: [0, 1],
        }
