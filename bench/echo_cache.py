"""Echo cache throughput: native put->take(+gather) against memcpy and a pure-Python buffer.

For sample sizes 4 KB, 150 KB and 600 KB and e = 2, it measures in one run:

* ``cache``: the native driver ``_bench_native.put_take`` (producer threads ``put`` from
  a 64 MB source pool, consumer threads ``take(batch)`` and gather each batch into one buffer),
  over an arena several times the last-level cache. Per fresh sample the cache path moves its
  bytes once in (put copies) and e times out (gather copies). With 1 and 2 threads per side,
  each after two warm-ups (``min_fill``, :data:`WARMUPS`): half the arena (the ``threads``
  rows, as recorded before), after which the cache stays full and takes draw from the whole
  arena; and the pipelines' default shuffle buffer of 4 batches (the ``default`` rows), where
  takes start at once and keep pace with the puts, so they mostly draw samples put a moment
  before, still in the caches.
* ``memcpy`` (the physical limit): memcpy of exactly those bytes (fresh * size in + copies * size
  out, from an arena-sized region into a batch buffer) by as many threads as the cache run uses
  (producers + consumers). Every round pairs one cache run with one memcpy run, back to back in
  alternating order (``bu.paired_ratios``), so the VM's drift between seconds hits both sides of
  a pair alike. ``ratio_vs_memcpy`` is the median over the rounds of the paired ratios (cache
  GB/s / memcpy GB/s for the same bytes; 1.0 = the cache costs nothing beyond its copies), with
  their interquartile range, worst round, every round's ratio and the 1-minute load average
  before each pair.
* the limits of one thread per side (1+1 rows, with a core per thread): memcpy of the
  consumer's share (e of every 1 + e bytes) by one thread, read in order and from random
  positions as takes read; both copies at once with no cache; and the same copies split evenly
  over both threads (:func:`layout_limit`), each against the baseline.
* ``python``: a pure-Python shuffle buffer (list + random swap-pop, numpy copies in and out), the
  peer, single thread, same e and buffer size, reading fresh samples from the same 64 MB pool;
* ``api``: the Python batch API (one thread ``put_batch`` of ``--batch`` rows, one thread
  ``take_batch(--batch)``), against the pure-Python buffer and against memcpy of the same bytes
  by two threads (paired round by round, as above).

The native driver is not part of the installed package: build it once in the checkout with
:data:`BUILD_COMMAND` (into ``build/bench/``, where :func:`load_driver` finds it).

The issue's aims (met / not met) are checked at the end. Prints a table and writes
``<results-dir>/echo_cache.json`` (the convention of ``bench/benchutil.py``). ``--quick``
finishes in < 60 s.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

import benchutil as bu
from echopipe.echo import EchoCache
from echopipe.echo.config import DEFAULT_SHUFFLE_BATCHES

# Where the driver is built (ECHOPIPE_BUILD_BENCH=ON; never installed, so never in the wheel).
DRIVER_DIR = Path(__file__).resolve().parents[1] / "build" / "bench"
BUILD_COMMAND = (
    "cmake -S . -B build/bench -DECHOPIPE_BUILD_BENCH=ON -DECHOPIPE_BUILD_DALI=OFF "
    '-DECHOPIPE_BUILD_CUDA=OFF -DPython_EXECUTABLE="$(command -v python)" '
    '-Dpybind11_DIR="$(python -m pybind11 --cmakedir)" '
    "&& cmake --build build/bench --target _bench_native"
)


def load_driver() -> ModuleType | None:
    """The native driver module from :data:`DRIVER_DIR`, or None when it was not built.

    Loaded after ``echopipe._C`` (imported above), so it binds to the core library the process
    already holds (one registry, one allocator) rather than the build folder's copy."""
    if "_bench_native" in sys.modules:
        return sys.modules["_bench_native"]
    found = sorted(DRIVER_DIR.glob("_bench_native*.so"))
    if not found:
        return None
    loader = importlib.machinery.ExtensionFileLoader("_bench_native", str(found[0]))
    spec = importlib.util.spec_from_file_location("_bench_native", found[0], loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules["_bench_native"] = module
    return module


def unavailable() -> str | None:
    """Why this suite cannot run here (the native driver is not built), or None."""
    if load_driver() is None:
        return f"needs the native driver, which is not built; in the checkout run: {BUILD_COMMAND}"
    return None


SIZES = {"4KB": 4 << 10, "150KB": 150 << 10, "600KB": 600 << 10}
# The warm-ups (min_fill) of the two regimes, as the rows and the table name them.
WARMUPS = {"threads": "half the arena", "default": f"{DEFAULT_SHUFFLE_BATCHES} batches"}


def llc_bytes() -> int:
    """Largest cache size reported for cpu0 (falls back to 32 MB)."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in base.glob("index*"):
        try:
            text = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * mult)
    return best or 32 << 20


def source_pool(sample_bytes: int) -> np.ndarray:
    """The samples producers copy from: a 64 MB pool, as in the native driver, so every path
    reads its fresh samples from the same (larger than L2) working set."""
    rows = max(1, (64 << 20) // sample_bytes)
    return np.random.default_rng(0).integers(0, 255, (rows, sample_bytes), dtype=np.uint8)


def python_buffer(sample_bytes: int, n_fresh: int, buffer: int, e: float, batch: int) -> float:
    """Seconds for a list + swap-pop shuffle buffer to emit every copy of n_fresh samples."""
    pool = source_pool(sample_bytes)
    rng = random.Random(0)
    buf: list[list[Any]] = []
    lo, frac = int(e), e - int(e)
    out: list[np.ndarray] = []
    t0 = time.perf_counter()

    def emit() -> None:
        i = rng.randrange(len(buf))
        entry = buf[i]
        out.append(entry[0].copy())
        entry[1] -= 1
        if entry[1] == 0:
            buf[i] = buf[-1]
            buf.pop()
        if len(out) == batch:
            out.clear()

    for k in range(n_fresh):
        buf.append([pool[k % len(pool)].copy(), lo + (rng.random() < frac)])
        while len(buf) >= buffer:
            emit()
    while buf:
        emit()
    return time.perf_counter() - t0


def api_path(sample_bytes: int, n_fresh: int, capacity: int, batch: int) -> tuple[float, int]:
    """Seconds and copies for the Python batch API: put_batch() thread, take_batch() consumer."""
    slots = max(capacity // ((sample_bytes + 63) // 64 * 64), 1)
    cache = EchoCache(
        capacity_bytes=capacity, capacity_samples=slots, echo_factor=2.0, memory="pageable"
    )
    pool = source_pool(sample_bytes)
    # Fault the whole arena in, as a long-running job would have (the native driver does the
    # same): its samples fill it once, the pool's rows over and over.
    for start in range(0, slots, len(pool)):
        cache.put_batch(pool[: min(len(pool), slots - start)])
    cache.end_of_input()
    while cache.take_batch(batch) is not None:
        pass
    cache.reset_input()
    copies = 0

    def produce() -> None:
        k = 0
        while k < n_fresh:
            i = k % len(pool)
            rows = min(batch, n_fresh - k, len(pool) - i)
            cache.put_batch(pool[i : i + rows])
            k += rows
        cache.end_of_input()

    before = cache.stats().emitted
    t0 = time.perf_counter()
    th = threading.Thread(target=produce)
    th.start()
    while (b := cache.take_batch(batch, timeout=60)) is not None:
        copies += len(b)
    th.join()
    secs = time.perf_counter() - t0
    assert cache.stats().emitted - before == copies
    cache.close()
    return secs, copies


def native_rows(
    driver: ModuleType, size: int, n_fresh: int, threads: int, arena: int, args: Any, fill: int
) -> dict[str, Any]:
    """Cache and memcpy rounds, interleaved, for one size, thread count and warm-up."""
    # The shared VM's speed drifts between seconds: each round pairs a cache run with memcpy of
    # the same bytes (bu.paired_ratios alternates which goes first); the ratio of every pair is
    # kept, and the median and spread of those ratios summarise the row.
    moved = n_fresh + round(n_fresh * args.echo)  # samples copied in + copied out
    runs: list[dict[str, Any]] = []

    def cache() -> float:
        r = driver.put_take(size, n_fresh, threads, threads, args.echo, arena, args.batch, fill)
        runs.append(r)
        return (int(r["fresh"]) + int(r["copies"])) * size / r["seconds"]

    def memcpy() -> float:
        m = driver.memcpy(size, moved, 2 * threads, arena, args.batch)
        return m["bytes"] / m["seconds"]

    pairs = bu.paired_ratios(args.rounds, memcpy, cache)
    mid = sorted(range(len(runs)), key=lambda i: pairs["round_ratios"][i])[len(runs) // 2]
    r = runs[mid]
    return {
        "min_fill": fill,
        "pairs_vs_memcpy": pairs,
        "ratio_vs_memcpy": pairs["median_ratio"],
        "iqr_ratio_vs_memcpy": pairs["iqr_ratio"],
        "worst_ratio_vs_memcpy": pairs["min_ratio"],
        "cache_samples_s": r["copies"] / r["seconds"],
        "cache_GBps_moved": pairs["round_measured_rates"][mid] / 1e9,
        "memcpy_GBps": pairs["round_baseline_rates"][mid] / 1e9,
        "fresh": r["fresh"],
        "copies": r["copies"],
        "seconds": r["seconds"],
        "puts_blocked": r["puts_blocked"],
        "put_blocked_seconds": r["put_blocked_seconds"],
        "takes_waited": r["takes_waited"],
        "take_wait_seconds": r["take_wait_seconds"],
        "mean_reuse_distance": r["mean_reuse_distance"],
    }


def layout_limit(
    driver: ModuleType,
    size: int,
    n_fresh: int,
    arena: int,
    args: Any,
    row: dict[str, Any],
    names: tuple[str, ...] = ("layout", "random_read", "bare_copies", "balanced"),
) -> dict[str, Any]:
    """The best ``ratio_vs_memcpy`` one thread per side allows, measured, for a row (``names``
    picks the limits; those that read at random positions apply to a full cache, whose takes
    read samples spread over the whole arena).

    Producers only copy in (1 per fresh sample) and consumers only copy out (e per fresh
    sample), so with a core per thread the consumer sets the pace: at e = 2 it copies 2 of
    every 3 bytes, where the memcpy baseline spreads all of them evenly over the same number of
    threads. The layout's limit is memcpy of the consumer's share by one thread alone, against
    the baseline; the random-read limit is the same with every sample read from a uniformly
    drawn position of the region, as takes read them (the baseline reads in order). The
    bare-copies limit is both copies at once with no cache around them (one thread puts into
    consecutive extents of an arena of the same size, one gathers from random ones): an arena
    larger than the LLC makes every put write through to memory, which the baseline, reading
    into a batch buffer that stays cached, does not; the two sides share the memory bandwidth.
    The balanced limit is the same copies split evenly over the two threads after the row's
    warm-up (the putting thread joins the copying out when its own copies are done): what one
    thread per side reaches when neither ever idles and nothing but the copies costs time.
    """
    copies = round(n_fresh * args.echo)
    moved = (n_fresh + copies) * size
    base = statistics.median(row["pairs_vs_memcpy"]["round_baseline_rates"])
    fill = row["min_fill"]
    runs = {
        "layout": lambda: driver.memcpy(size, copies, 1, arena, args.batch, False),
        "random_read": lambda: driver.memcpy(size, copies, 1, arena, args.batch, True),
        "bare_copies": lambda: driver.bare_copies(size, n_fresh, args.echo, arena, args.batch),
        "balanced": lambda: driver.balanced_copies(
            size, n_fresh, args.echo, arena, args.batch, fill
        ),
    }  # each over `moved` bytes of the cache's run: memcpy of its copies out, or all its copies
    limits = {
        name: statistics.median(moved / runs[name]()["seconds"] for _ in range(3)) / base
        for name in names
    }
    ratio = row["ratio_vs_memcpy"]
    out: dict[str, Any] = {}
    for name, limit in limits.items():
        out[f"{name}_limit_vs_memcpy"] = limit
        out[f"ratio_vs_{name}_limit"] = ratio / limit
    return out


def api_rows(driver: ModuleType, size: int, py_fresh: int, arena: int, args: Any) -> dict[str, Any]:
    """The Python batch API, paired round by round with memcpy of the same bytes by 2 threads."""
    copies: list[int] = []

    def api() -> float:
        secs, n = api_path(size, py_fresh, arena, args.batch)
        copies.append(n)
        return (py_fresh + n) * size / secs

    def memcpy() -> float:
        m = driver.memcpy(size, py_fresh + round(py_fresh * args.echo), 2, arena, args.batch)
        return m["bytes"] / m["seconds"]

    pairs = bu.paired_ratios(args.rounds, memcpy, api)
    measured = zip(pairs["round_measured_rates"], copies, strict=True)
    rates = sorted(rate / size * c / (py_fresh + c) for rate, c in measured)
    return {
        "api_samples_s": rates[len(rates) // 2],
        "api_pairs_vs_memcpy": pairs,
        "api_ratio_vs_memcpy": pairs["median_ratio"],
        "api_iqr_ratio_vs_memcpy": pairs["iqr_ratio"],
        "api_worst_ratio_vs_memcpy": pairs["min_ratio"],
    }


def check_aims(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's aims, each met or not met, from this run's ratios, for both warm-ups."""
    small = rows["4KB"]
    big = [rows[label] for label in ("150KB", "600KB")]
    api_vs_py = small["api_samples_s"] / small["python_buffer_samples_s"]
    api_150 = rows["150KB"]["api_ratio_vs_memcpy"]

    def of_limit(row: dict[str, Any]) -> str:
        parts = [
            ("this layout's limit (one thread copies e of every 1 + e bytes)", "layout"),
            ("with its reads at random positions, as takes read", "random_read"),
            ("both copies at once with no cache (puts write through to memory)", "bare_copies"),
            ("the same copies split evenly over both threads, nothing else", "balanced"),
        ]
        return "".join(
            f"; {what} {row[f'{name}_limit_vs_memcpy']:.3f}x, of which this is "
            f"{row[f'ratio_vs_{name}_limit']:.2f}"
            for what, name in parts
            if f"{name}_limit_vs_memcpy" in row
        )

    claims = []
    for regime, what in (("threads", "cache kept full"), ("default", "warm-up of 4 batches")):
        one = small[regime][1]
        worst_big = min((row[regime][1] for row in big), key=lambda r: r["ratio_vs_memcpy"])
        median_big = worst_big["ratio_vs_memcpy"]
        worst = min(row[regime][1]["worst_ratio_vs_memcpy"] for row in big)
        scale = small[regime][2]["cache_samples_s"] / one["cache_samples_s"]
        claims += [
            bu.claim(f"put->take at 4 KB, 1+1 threads, {what}, vs memcpy of the same bytes",
                     ">= 0.5x", round(one["ratio_vs_memcpy"], 3), one["ratio_vs_memcpy"] >= 0.5,
                     "median of paired rounds" + of_limit(one)),
            bu.claim(f"put->take at 150 KB and 600 KB, 1+1 threads, {what}, vs memcpy, median "
                     "of paired rounds", ">= 0.85x", round(median_big, 3), median_big >= 0.85,
                     "worse of the two sizes" + of_limit(worst_big)),
            bu.claim(f"put->take at 150 KB and 600 KB, 1+1 threads, {what}, vs memcpy, worst "
                     "round", ">= 0.75x", round(worst, 3), worst >= 0.75, "worse of the two sizes"),
            bu.claim(f"2+2 threads vs 1+1 at 4 KB, {what}", ">= 1.0x", round(scale, 3),
                     scale >= 1.0, "no collapse under contention"),
        ]  # fmt: skip
    return [
        *claims,
        bu.claim("Python batch API at 4 KB vs the pure-Python buffer", ">= 5x",
                 round(api_vs_py, 2), api_vs_py >= 5, "put_batch/take_batch, one thread each"),
        bu.claim("Python batch API at 150 KB vs memcpy of the same bytes", ">= 0.7x",
                 round(api_150, 3), api_150 >= 0.7, "median of paired rounds"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = bu.bench_parser("echo_cache", __doc__, "small working set, < 60 s")
    ap.add_argument("--echo", type=float, default=2.0, help="echo factor e (default 2)")
    ap.add_argument("--batch", type=int, default=64, help="samples per take (default 64)")
    ap.add_argument(
        "--rounds", type=int, default=None, help="paired rounds per row (default 7, quick 3)"
    )
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    driver = load_driver()
    if driver is None:
        print(f"echo_cache: {unavailable()}", file=sys.stderr)
        return 1
    run = bu.BenchRun.start("echo_cache", args, argv)

    llc = llc_bytes()
    arena = (256 << 20) if args.quick else max(3 * llc, 512 << 20)
    rows: dict[str, dict[str, Any]] = {}
    for label, size in SIZES.items():
        extent = (size + 63) // 64 * 64
        cap_samples = arena // extent
        # Several passes over the arena so the steady state dominates the warm-up.
        n_fresh = max(int(cap_samples * (1.5 if args.quick else 3)), 2000)
        n_fresh = min(n_fresh, (2 << 30) // size if args.quick else (12 << 30) // size)
        # Two warm-ups (WARMUPS). Half the arena ("threads", as recorded before): the cache
        # then stays full, and takes draw from the whole arena. The pipelines' default, a
        # shuffle buffer of 4 batches ("default"): takes start at once and keep pace with the
        # puts, so they mostly draw samples put a moment before.
        fills = {"threads": cap_samples // 2, "default": DEFAULT_SHUFFLE_BATCHES * args.batch}
        regimes = {
            regime: {t: native_rows(driver, size, n_fresh, t, arena, args, fill) for t in (1, 2)}
            for regime, fill in fills.items()
        }
        if (os.cpu_count() or 1) >= 2:  # a core per thread, else the scheduler balances them
            full = regimes["threads"][1]
            full.update(layout_limit(driver, size, n_fresh, arena, args, full))
            # Takes that keep pace with the puts read samples put a moment before, not spread
            # over the arena: of the limits, only the consumer's share read in order applies.
            one = regimes["default"][1]
            one.update(layout_limit(driver, size, n_fresh, arena, args, one, ("layout",)))
        # Peer and API path: fewer samples (the peer is slow), same buffer size and e.
        py_fresh = min(n_fresh, max(2000, int((0.4 if args.quick else 1.5) * 2e8 / size)))
        py_buffer = min(cap_samples, max(py_fresh // 2, 1))
        py_secs = python_buffer(size, py_fresh, py_buffer, args.echo, args.batch)
        rows[label] = {
            "sample_bytes": size,
            "arena_bytes": arena,
            "capacity_samples": cap_samples,
            **regimes,
            "python_buffer_samples_s": py_fresh * args.echo / py_secs,
            "python_buffer_fresh": py_fresh,
            "python_buffer_size": py_buffer,
            **api_rows(driver, size, py_fresh, arena, args),
        }

    print(f"arena {arena >> 20} MB (LLC {llc >> 20} MB), e={args.echo}, batch={args.batch}")
    table = []
    ratios: dict[str, Any] = {}
    for label, row in rows.items():
        runs = [
            (f"{t}t{suffix}", WARMUPS[regime], f)
            for regime, suffix in (("threads", ""), ("default", "_default_fill"))
            for t, f in row[regime].items()
        ]
        for key, fill, f in runs:
            table.append(
                [label, key[0], fill, f["cache_samples_s"], f["cache_GBps_moved"],
                 f["memcpy_GBps"], f["ratio_vs_memcpy"], f["iqr_ratio_vs_memcpy"],
                 f["worst_ratio_vs_memcpy"], f.get("layout_limit_vs_memcpy"),
                 f.get("random_read_limit_vs_memcpy"), f.get("balanced_limit_vs_memcpy"),
                 row["python_buffer_samples_s"], row["api_samples_s"],
                 row["api_ratio_vs_memcpy"]]
            )  # fmt: skip
            ratios[f"{label}_{key}_vs_memcpy_same_bytes"] = f["ratio_vs_memcpy"]
            ratios[f"{label}_{key}_vs_memcpy_worst_round"] = f["worst_ratio_vs_memcpy"]
            ratios[f"{label}_{key}_vs_memcpy_iqr"] = f["iqr_ratio_vs_memcpy"]
            for name in ("layout", "random_read", "bare_copies", "balanced"):
                if f"{name}_limit_vs_memcpy" in f:
                    ratios[f"{label}_{key}_{name}_limit_vs_memcpy"] = f[f"{name}_limit_vs_memcpy"]
                    ratios[f"{label}_{key}_vs_{name}_limit"] = f[f"ratio_vs_{name}_limit"]
        for regime, suffix in (("threads", ""), ("default", "_default_fill")):
            ratios[f"{label}_2t_vs_1t{suffix}"] = (
                row[regime][2]["cache_samples_s"] / row[regime][1]["cache_samples_s"]
            )
        ratios[f"{label}_api_vs_python_buffer"] = (
            row["api_samples_s"] / row["python_buffer_samples_s"]
        )
        ratios[f"{label}_api_vs_memcpy_same_bytes"] = row["api_ratio_vs_memcpy"]
    print(
        bu.format_table(
            ["size", "thr/side", "warm-up", "cache/s", "cache GB/s (in+out)", "memcpy GB/s",
             "vs memcpy (median pair)", "IQR", "vs memcpy (worst)", "layout limit",
             "random-read limit", "balanced limit", "python/s", "api/s", "api vs memcpy"],
            table,
        )
    )  # fmt: skip
    config = {
        "echo_factor": args.echo,
        "batch": args.batch,
        "rounds": args.rounds,
        "arena_bytes": arena,
        "llc_bytes": llc,
        "min_fill": WARMUPS,
        "sizes": SIZES,
    }
    figures = {"rows": [{"size": label, **row} for label, row in rows.items()]}
    run.finish(figures=figures, ratios=ratios, claims=check_aims(rows), config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
