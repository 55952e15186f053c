"""Echo cache throughput: native put->take(+gather) against memcpy and a pure-Python buffer.

For sample sizes 4 KB, 150 KB and 600 KB, with 1 and 2 threads per side and e = 2, it measures in
one run:

* ``cache``: the native driver ``_bench_native.put_take`` (producer threads ``put`` from a 64 MB
  source pool, consumer threads ``take(batch)`` and gather each batch into one buffer), over an
  arena several times the last-level cache. Per fresh sample the cache path moves its bytes once
  in (put copies) and e times out (gather copies): (1 + e) / e bytes per copy handed out.
* ``memcpy`` (the physical limit): memcpy of exactly those bytes (fresh * size in + copies * size
  out, from an arena-sized region into a batch buffer) by as many threads as the cache run uses
  (producers + consumers). ``ratio_vs_memcpy`` = memcpy time / cache time for the same bytes
  (1.0 = the cache costs nothing beyond its copies); each row keeps the median of ``--rounds``
  back-to-back cache + memcpy rounds. ``memcpy_out_only`` (the copy-out alone,
  the consumers' share) is recorded too.
* ``python``: a pure-Python shuffle buffer (list + random swap-pop, numpy copies in and out), the
  peer, single thread, same e and buffer size, reading fresh samples from the same 64 MB pool;
* ``api``: the Python API path (one thread ``put()`` per sample, one ``take_batch``), for scale.

Prints a table and writes ``<results-dir>/echo_cache.json`` (the convention of
``bench/benchutil.py``). ``--quick`` finishes in < 30 s.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from echopipe import _bench_native
from echopipe.echo import EchoCache

try:
    from . import benchutil as bu
except ImportError:  # run as a script: bench/ is sys.path[0]
    import benchutil as bu

SIZES = {"4KB": 4 << 10, "150KB": 150 << 10, "600KB": 600 << 10}


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
    """Seconds and copies for the Python API: one put() thread, one take_batch() consumer."""
    cache = EchoCache(
        capacity_bytes=capacity,
        capacity_samples=max(capacity // max(sample_bytes, 64), 1),
        echo_factor=2.0,
        memory="pageable",
    )
    pool = source_pool(sample_bytes)
    copies = 0

    def produce() -> None:
        for k in range(n_fresh):
            cache.put(pool[k % len(pool)])
        cache.end_of_input()

    t0 = time.perf_counter()
    th = threading.Thread(target=produce)
    th.start()
    while (b := cache.take_batch(batch, timeout=60)) is not None:
        copies += len(b)
    th.join()
    secs = time.perf_counter() - t0
    cache.close()
    return secs, copies


def main(argv: list[str] | None = None) -> int:
    ap = bu.bench_parser("echo_cache", __doc__, "small working set, < 30 s")
    ap.add_argument("--echo", type=float, default=2.0, help="echo factor e (default 2)")
    ap.add_argument("--batch", type=int, default=64, help="samples per take (default 64)")
    ap.add_argument(
        "--rounds", type=int, default=None, help="cache+memcpy rounds per row (default 3, quick 1)"
    )
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    run = bu.BenchRun.start("echo_cache", args, argv)

    llc = llc_bytes()
    arena = (256 << 20) if args.quick else max(3 * llc, 512 << 20)
    rows = []
    for label, size in SIZES.items():
        extent = (size + 63) // 64 * 64
        cap_samples = arena // extent
        # Several passes over the arena so the steady state dominates the warm-up.
        n_fresh = max(int(cap_samples * (1.5 if args.quick else 3)), 2000)
        n_fresh = min(n_fresh, (2 << 30) // size if args.quick else (12 << 30) // size)
        per_threads: dict[int, dict[str, float]] = {}
        for threads in (1, 2):
            # The shared VM's speed drifts between seconds: the cache and its memcpy limit are
            # measured back to back in each round, and the round with the median ratio is kept.
            trials = []
            for _ in range(args.rounds):
                r = _bench_native.put_take(
                    size, n_fresh, threads, threads, args.echo, arena, args.batch
                )
                moved = int(r["fresh"]) + int(r["copies"])  # samples copied in + copied out
                m = _bench_native.memcpy(size, moved, 2 * threads, arena, args.batch)
                out_only = _bench_native.memcpy(size, int(r["copies"]), threads, arena, args.batch)
                trials.append((m["seconds"] / r["seconds"], r, m, out_only, moved))
            trials.sort(key=lambda trial: trial[0])
            _, r, m, out_only, moved = trials[len(trials) // 2]
            cache_rate = r["copies"] / r["seconds"]
            per_threads[threads] = {
                "rounds_ratio_vs_memcpy": [round(trial[0], 3) for trial in trials],
                "cache_samples_s": cache_rate,
                "cache_GBps_out": r["bytes_out"] / r["seconds"] / 1e9,
                "cache_GBps_moved": moved * size / r["seconds"] / 1e9,
                "memcpy_GBps": m["bytes"] / m["seconds"] / 1e9,
                "memcpy_limit_samples_s": r["copies"] / m["seconds"],
                "ratio_vs_memcpy": m["seconds"] / r["seconds"],
                "memcpy_out_only_samples_s": r["copies"] / out_only["seconds"],
                "ratio_vs_memcpy_out_only": out_only["seconds"] / r["seconds"],
                "fresh": r["fresh"],
                "copies": r["copies"],
                "seconds": r["seconds"],
                "puts_blocked": r["puts_blocked"],
                "takes_waited": r["takes_waited"],
                "mean_reuse_distance": r["mean_reuse_distance"],
            }
        # Peer and API path: fewer samples (they are slow), same buffer size and e.
        py_fresh = min(n_fresh, max(2000, int((0.4 if args.quick else 1.5) * 2e8 / size)))
        py_buffer = min(cap_samples, max(py_fresh // 2, 1))
        py_secs = python_buffer(size, py_fresh, py_buffer, args.echo, args.batch)
        py_rate = py_fresh * args.echo / py_secs
        api_secs, api_copies = api_path(size, py_fresh, arena, args.batch)
        rows.append(
            {
                "size": label,
                "sample_bytes": size,
                "arena_bytes": arena,
                "capacity_samples": cap_samples,
                "threads": per_threads,
                "python_buffer_samples_s": py_rate,
                "python_buffer_fresh": py_fresh,
                "python_buffer_size": py_buffer,
                "api_samples_s": api_copies / api_secs,
            }
        )

    print(f"arena {arena >> 20} MB (LLC {llc >> 20} MB), e={args.echo}, batch={args.batch}")
    table = []
    ratios: dict[str, Any] = {}
    for row in rows:
        py = row["python_buffer_samples_s"]
        one = row["threads"][1]["cache_samples_s"]
        for t, f in row["threads"].items():
            table.append(
                [row["size"], t, f["cache_samples_s"], f["cache_GBps_moved"], f["memcpy_GBps"],
                 f["ratio_vs_memcpy"], f["ratio_vs_memcpy_out_only"], py,
                 f["cache_samples_s"] / py, row["api_samples_s"]]
            )  # fmt: skip
            key = f"{row['size']}_{t}t"
            ratios[f"{key}_vs_memcpy_same_bytes"] = f["ratio_vs_memcpy"]
            ratios[f"{key}_vs_memcpy_out_only"] = f["ratio_vs_memcpy_out_only"]
            ratios[f"{key}_vs_python_buffer"] = f["cache_samples_s"] / py
        ratios[f"{row['size']}_2t_vs_1t"] = row["threads"][2]["cache_samples_s"] / one
    print(
        bu.format_table(
            ["size", "thr/side", "cache/s", "cache GB/s (in+out)", "memcpy GB/s",
             "vs memcpy", "vs memcpy (out only)", "python/s", "vs python", "api/s"],
            table,
        )
    )  # fmt: skip
    cores = run.machine.get("cpu_count") or 1
    big = [(r["size"], t) for r in rows if r["size"] != "4KB" for t in (1, 2)]
    worst_mem = min(ratios[f"{s}_{t}t_vs_memcpy_same_bytes"] for s, t in big)
    worst_py, py_size, py_threads = min(
        (ratios[f"{r['size']}_{t}t_vs_python_buffer"], r["size"], t) for r in rows for t in (1, 2)
    )
    py_reason = f"worst: {py_size}, {py_threads} thread(s) per side"
    mem_key = f"{py_size}_{py_threads}t_vs_memcpy_same_bytes"
    if worst_py < 3 and mem_key in ratios:
        # cache/memcpy over cache/python = python/memcpy: how near the copy limit Python already is.
        python_vs_memcpy = ratios[mem_key] / worst_py
        py_reason += (
            f"; there the Python buffer already moves the same bytes at {python_vs_memcpy:.2f}x "
            f"memcpy speed and the cache at {ratios[mem_key]:.2f}x: 3x the Python buffer would be "
            f"{3 * python_vs_memcpy:.2f}x memcpy"
        )
        if 3 * python_vs_memcpy > 1:
            py_reason += ", faster than the copy limit"
    worst_scale = min(ratios[f"{r['size']}_2t_vs_1t"] for r in rows)
    scale_reason = (
        f"2 threads per side are 4 busy threads on {cores} CPU(s): no headroom to scale"
        if cores < 4
        else ""
    )
    claims = [
        bu.claim(
            "cache put->take at 150/600 KB vs memcpy of the same bytes (in + out)",
            ">= 0.7x", round(worst_mem, 3), worst_mem >= 0.7,
            "worst of 150/600 KB x 1/2 threads per side",
        ),
        bu.claim(
            "cache vs pure-Python shuffle buffer, every size", ">= 3x", round(worst_py, 2),
            worst_py >= 3, py_reason,
        ),
        bu.claim(
            "2 threads per side vs 1", ">= 1.5x", round(worst_scale, 2), worst_scale >= 1.5,
            scale_reason or "worst size",
        ),
    ]  # fmt: skip
    figures = {"rows": rows}
    config = {
        "echo_factor": args.echo,
        "batch": args.batch,
        "rounds": args.rounds,
        "arena_bytes": arena,
        "llc_bytes": llc,
        "sizes": SIZES,
    }
    run.finish(figures=figures, ratios=ratios, claims=claims, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
