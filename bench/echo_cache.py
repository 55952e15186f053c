"""Echo cache throughput: native put->take(+gather) against memcpy and a pure-Python buffer.

For sample sizes 4 KB, 150 KB and 600 KB, with 1 and 2 threads per side and e = 2, it measures in
one run:

* ``cache``: the native driver ``_C._bench_put_take`` (producer threads ``put`` from a 64 MB
  source pool, consumer threads ``take(batch)`` and gather each batch into one buffer), over an
  arena several times the last-level cache;
* ``memcpy``: the same copy-out bytes by the same number of threads (the physical limit of the
  consumers' work; the cache also copies every fresh sample in once);
* ``python``: a pure-Python shuffle buffer (list + random swap-pop, numpy copies in and out), the
  peer, single thread, same e and buffer size;
* ``api``: the Python API path (one thread ``put()`` per sample, one ``take_batch``), for scale.

Prints a table and writes bench/results/echo_cache.json. ``--quick`` finishes in < 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from echopipe._native import _C
from echopipe.echo import EchoCache

SIZES = {"4KB": 4 << 10, "150KB": 150 << 10, "600KB": 600 << 10}
RESULTS = Path(__file__).resolve().parent / "results" / "echo_cache.json"


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


def python_buffer(sample_bytes: int, n_fresh: int, buffer: int, e: float, batch: int) -> float:
    """Seconds for a list + swap-pop shuffle buffer to emit every copy of n_fresh samples."""
    pool = np.random.default_rng(0).integers(0, 255, (64, sample_bytes), dtype=np.uint8)
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
        buf.append([pool[k % 64].copy(), lo + (rng.random() < frac)])
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
    pool = np.random.default_rng(0).integers(0, 255, (64, sample_bytes), dtype=np.uint8)
    copies = 0

    def produce() -> None:
        for k in range(n_fresh):
            cache.put(pool[k % 64])
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


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "llc_bytes": llc_bytes(),
    }
    for pkg in ("torch", "nvidia-dali-cuda130"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
    except OSError:
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small working set, < 30 s")
    ap.add_argument("--echo", type=float, default=2.0, help="echo factor e (default 2)")
    ap.add_argument("--batch", type=int, default=64, help="samples per take (default 64)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

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
            r = _C._bench_put_take(size, n_fresh, threads, threads, args.echo, arena, args.batch)
            m = _C._bench_memcpy(size, int(r["copies"]), threads, arena, args.batch)
            cache_rate = r["copies"] / r["seconds"]
            memcpy_rate = r["copies"] / m["seconds"]
            per_threads[threads] = {
                "cache_samples_s": cache_rate,
                "cache_GBps": r["bytes_out"] / r["seconds"] / 1e9,
                "memcpy_samples_s": memcpy_rate,
                "memcpy_GBps": m["bytes"] / m["seconds"] / 1e9,
                "ratio_vs_memcpy": cache_rate / memcpy_rate,
                "fresh": r["fresh"],
                "copies": r["copies"],
                "seconds": r["seconds"],
                "puts_blocked": r["puts_blocked"],
                "mean_reuse_distance": r["mean_reuse_distance"],
            }
        # Peer and API path: fewer samples (they are slow), same buffer size and e.
        py_fresh = min(n_fresh, max(2000, int((0.4 if args.quick else 1.5) * 2e8 / size)))
        py_buffer = min(cap_samples, max(py_fresh // 2, 1))
        py_secs = python_buffer(size, py_fresh, py_buffer, args.echo, args.batch)
        py_rate = py_fresh * args.echo / py_secs
        api_secs, api_copies = api_path(size, py_fresh, arena, args.batch)
        api_rate = api_copies / api_secs
        row = {
            "size": label,
            "sample_bytes": size,
            "arena_bytes": arena,
            "capacity_samples": cap_samples,
            "threads": per_threads,
            "python_buffer_samples_s": py_rate,
            "python_buffer_fresh": py_fresh,
            "python_buffer_size": py_buffer,
            "api_samples_s": api_rate,
            "ratio_1t_vs_python": per_threads[1]["cache_samples_s"] / py_rate,
            "ratio_2t_vs_1t": per_threads[2]["cache_samples_s"] / per_threads[1]["cache_samples_s"],
        }
        rows.append(row)

    head = (
        f"{'size':>6} {'thr':>3} {'cache/s':>10} {'GB/s':>6} {'memcpy GB/s':>11} "
        f"{'vs memcpy':>9} {'python/s':>9} {'vs python':>9} {'api/s':>9}"
    )
    print(f"arena {arena >> 20} MB (LLC {llc >> 20} MB), e={args.echo}, batch={args.batch}")
    print(head)
    for row in rows:
        for t, f in row["threads"].items():
            print(
                f"{row['size']:>6} {t:>3} {f['cache_samples_s']:>10.0f} {f['cache_GBps']:>6.2f} "
                f"{f['memcpy_GBps']:>11.2f} {f['ratio_vs_memcpy']:>9.2f} "
                f"{row['python_buffer_samples_s']:>9.0f} "
                f"{f['cache_samples_s'] / row['python_buffer_samples_s']:>9.1f} "
                f"{row['api_samples_s']:>9.0f}"
            )
    aims = {
        "cache_vs_memcpy_ge_0.7_at_150KB_600KB": all(
            r["threads"][t]["ratio_vs_memcpy"] >= 0.7
            for r in rows
            if r["size"] != "4KB"
            for t in (1, 2)
        ),
        "cache_vs_python_ge_3_all_sizes": all(
            r["threads"][t]["cache_samples_s"] >= 3 * r["python_buffer_samples_s"]
            for r in rows
            for t in (1, 2)
        ),
        "two_threads_ge_1.5x_one": all(r["ratio_2t_vs_1t"] >= 1.5 for r in rows),
    }
    for k, v in aims.items():
        print(f"aim {k}: {'met' if v else 'NOT met'}")
    result = {
        "benchmark": "echo_cache",
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine(),
        "settings": {"echo_factor": args.echo, "batch": args.batch, "quick": args.quick},
        "results": rows,
        "aims": aims,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
