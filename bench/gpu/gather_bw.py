"""Host-to-device gather bandwidth of the echo cache against plain cudaMemcpy from pinned memory.

On a CUDA machine (``bench/gpu/run.sh`` runs it), for each sample size:

* ``gather kernel``: ``echopipe._C.gather_to_device``: one kernel reads a batch of leased
  samples straight from the pinned, GPU-mapped cache arena (zero-copy over the bus) and writes
  them back to back into a device buffer. Timed with CUDA events around the launch only.
* ``gather + normalise``: ``gather_normalize_to_device`` on uint8 HWC images (CHW float out);
  bandwidth counts the bytes read from the host.
* ``cudaMemcpy (pinned)``: one ``cudaMemcpyAsync`` of the same number of bytes from a pinned
  torch tensor (``tensor.to('cuda', non_blocking=True)``): the physical limit of the link.
* ``take + gather``: the host side included (drawing the batch from the cache, then the
  kernel), as a training loop would pay it.

Copy paths of the DALI GPU echo source (``copy_paths`` rows, ``_C.copy_ranges``), each sample
written to its own place in the device batch as DALI's output holds it:

* ``scatter``: one ``gather_scatter`` launch for the whole batch (the source's default);
* ``batch``: ``cudaMemcpyBatchAsync`` (CUDA >= 12.8; ``null`` when not compiled in);
* ``each``: one ``cudaMemcpyAsync`` per sample (the fallback, ``ECHOPIPE_GPU_SOURCE_COPY=each``);
* the peer in the same run: for the pinned arena, one ``cudaMemcpyAsync`` of the same bytes
  from pinned memory (aim: scatter >= 0.85x); for the device arena (``memory="device"``), one
  device-to-device copy of the same bytes (aim: scatter >= 0.8x).

Each copy-path row is measured with destinations as a plain batch holds them (``aligned``: every
sample at a multiple of its size) and as DALI packs a ragged batch (``packed``: samples of
slightly different sizes back to back, so most start at an odd byte), the common case of the
DALI GPU source, whose kernel then stores through the shifted path of csrc/cuda/copy_range.h.
The 32 px rows use a batch of 4096 (12 MB) so that a launch's fixed cost does not dominate.

The gather and scatter kernels are timed twice: as Python calls them one after another (the
``gather_GBps`` and ``scatter_GBps`` figures, what a caller from Python gets; a call first turns
its lists of up to 4096 leases or pointers into the kernel's table, and where that takes longer
than the kernel the host paces the device), and queued behind a spin kernel so that the events
time the kernels back to back (``gather_device_GBps``, ``scatter_device_GBps``; ``null`` if the
spin ended before the calls were queued). The DALI GPU source builds its table in C++ from
DALI's own lists, so the second figure is the one its copy sees.

``<out>/gather_bw.json`` is rewritten after every row (bench/gpu/rowlog.py), the 224 px rows
first, so a run cut short keeps what it measured. Usage:
``python bench/gpu/gather_bw.py --out DIR [--quick]``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rowlog import RowLog


def _events_ms(fn: Any, iters: int, stream: torch.cuda.Stream) -> float:
    """Mean milliseconds of ``fn()`` on ``stream`` between two CUDA events."""
    for _ in range(3):
        fn()
    stream.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(iters):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / iters


def _device_ms(fn: Any, iters: int, stream: torch.cuda.Stream) -> float | None:
    """Mean milliseconds of ``fn()`` on ``stream`` with the host out of the figure, or ``None``.

    ``_events_ms`` paces the device by the host when a call's host side (argument conversion,
    lease bookkeeping) takes longer than its kernel. Here a spin kernel holds the stream while
    all ``iters`` calls are queued behind it, so the events time the kernels back to back. The
    spin lasts four times the measured queueing time; if the stream has still reached the start
    event before the last call was queued, the figure would not be the device's: ``None``."""
    for _ in range(3):
        fn()
    stream.synchronize()
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0
    stream.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(4 * host_s * iters * 2e9) + 2_000_000)  # cycles, ~2 GHz
    start.record(stream)
    for _ in range(iters):
        fn()
    end.record(stream)
    queued_ahead = not start.query()
    end.synchronize()
    return start.elapsed_time(end) / iters if queued_ahead else None


def measure(side: int, batch: int, iters: int) -> dict[str, Any]:
    from echopipe.echo import EchoCache
    from echopipe.native import core as _C

    sample_bytes = side * side * 3
    resident = max(2 * batch, 64)
    cache = EchoCache(
        capacity_bytes=resident * (sample_bytes + 4096) + (16 << 20),
        capacity_samples=resident,
        echo_factor=65535.0,  # the cache's maximum: tickets never run out in this benchmark
        memory="pinned",
        seed=0,
    )
    try:
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, size=(resident, side, side, 3), dtype=np.uint8)
        cache.put_batch(images)
        stream = torch.cuda.Stream()
        dst = torch.empty(batch * sample_bytes, dtype=torch.uint8, device="cuda")
        norm_dst = torch.empty((batch, 3, side, side), dtype=torch.float32, device="cuda")
        samples = cache.take(batch, timeout=10)
        leases = [s._lease for s in samples]
        handle = stream.cuda_stream

        def gather() -> None:
            _C.gather_to_device(leases, 0, dst.data_ptr(), handle)

        def gather_norm() -> None:
            _C.gather_normalize_to_device(
                leases,
                0,
                [123.7, 116.3, 103.5],
                [58.4, 57.1, 57.4],
                True,
                norm_dst.data_ptr(),
                handle,
            )

        pinned = torch.empty(batch * sample_bytes, dtype=torch.uint8).pin_memory()
        pinned.copy_(torch.from_numpy(images[:batch].reshape(-1)))

        def memcpy() -> None:
            with torch.cuda.stream(stream):
                dst.copy_(pinned, non_blocking=True)

        ms_gather = _events_ms(gather, iters, stream)
        ms_gather_device = _device_ms(gather, iters, stream)
        # Correctness of what was timed: the device batch equals the drawn samples.
        stream.synchronize()
        expected = np.concatenate([s.array.reshape(-1) for s in samples])
        correct = bool(np.array_equal(dst.cpu().numpy(), expected))
        ms_norm = _events_ms(gather_norm, iters, stream)
        ms_copy = _events_ms(memcpy, iters, stream)
        leases.clear()  # release the leased slots before the end-to-end loop
        samples.clear()

        # End to end: take (host) + gather (device), synchronised each batch.
        t0 = time.perf_counter()
        for _ in range(iters):
            got = cache.take(batch, timeout=10)
            _C.gather_to_device([s._lease for s in got], 0, dst.data_ptr(), handle)
            stream.synchronize()
            del got
        e2e_s = (time.perf_counter() - t0) / iters
    finally:
        cache.close()
    nbytes = batch * sample_bytes
    gbps = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
    return {
        "image": f"{side}x{side}x3 uint8",
        "sample_bytes": sample_bytes,
        "batch": batch,
        "batch_bytes": nbytes,
        "gather_GBps": gbps(ms_gather),
        "gather_device_GBps": gbps(ms_gather_device) if ms_gather_device else None,
        "gather_normalize_GBps": gbps(ms_norm),
        "memcpy_pinned_GBps": gbps(ms_copy),
        "take_plus_gather_GBps": nbytes / e2e_s / 1e9,
        "gather_vs_memcpy": ms_copy / ms_gather,
        "gather_matches_cpu": correct,
    }


def packed_sizes(sample_bytes: int, batch: int) -> list[int]:
    """Ragged sizes, as random crops give them: up to 45 bytes short of the full sample."""
    return [sample_bytes - 3 * (i % 16) for i in range(batch)]


def measure_paths(
    memory: str, side: int, batch: int, iters: int, packed: bool = False
) -> dict[str, Any]:
    """GB/s of the source's three copy paths from a ``memory`` arena, and of the peer copy;
    ``packed``: ragged samples written back to back (DALI's layout), else one per aligned slot."""
    from echopipe.echo import EchoCache
    from echopipe.native import core as _C

    sample_bytes = side * side * 3
    resident = max(2 * batch, 64)
    cache = EchoCache(
        capacity_bytes=resident * (sample_bytes + 4096) + (16 << 20),
        capacity_samples=resident,
        echo_factor=65535.0,
        memory=memory,
        seed=0,
    )
    try:
        rng = np.random.default_rng(1)
        images = rng.integers(0, 256, size=(resident, side, side, 3), dtype=np.uint8)
        cache.put_batch(images)
        stream = torch.cuda.Stream()
        sizes = packed_sizes(sample_bytes, batch) if packed else [sample_bytes] * batch
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if packed else None
        nbytes = int(sum(sizes))
        dst = torch.empty(batch * sample_bytes, dtype=torch.uint8, device="cuda")
        samples = cache.take(batch, timeout=10)
        src = [s._lease.device_ptr(0) for s in samples]
        if offsets is None:
            dsts = [dst.data_ptr() + i * sample_bytes for i in range(batch)]
        else:
            dsts = [dst.data_ptr() + int(o) for o in offsets]
        handle = stream.cuda_stream
        expected = np.concatenate(
            [images[s.sample_id].reshape(-1)[:n] for s, n in zip(samples, sizes, strict=True)]
        )

        def path(mode: str) -> tuple[float | None, bool]:
            if mode == "batch" and not _C.copy_batch_supported():
                return None, True
            dst.fill_(0)
            torch.cuda.synchronize()
            ms = _events_ms(lambda: _C.copy_ranges(mode, src, dsts, sizes, handle), iters, stream)
            stream.synchronize()
            got = dst[:nbytes].cpu().numpy() if packed else dst.cpu().numpy()
            return nbytes / (ms * 1e-3) / 1e9, bool(np.array_equal(got, expected))

        if memory == "device":
            peer_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        else:
            peer_src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()

        def peer() -> None:
            with torch.cuda.stream(stream):
                dst[:nbytes].copy_(peer_src[:nbytes], non_blocking=True)

        results = {mode: path(mode) for mode in ("gather", "batch", "each")}
        ms_device = _device_ms(
            lambda: _C.copy_ranges("gather", src, dsts, sizes, handle), iters, stream
        )
        peer_gbps = nbytes / (_events_ms(peer, iters, stream) * 1e-3) / 1e9
        samples.clear()
    finally:
        cache.close()
    scatter = results["gather"][0]
    return {
        "arena": memory,
        "destinations": "packed" if packed else "aligned",
        "unaligned_destinations": sum(1 for d in dsts if d % 16) if packed else 0,
        "image": f"{side}x{side}x3 uint8",
        "batch": batch,
        "batch_bytes": nbytes,
        "scatter_GBps": scatter,
        "memcpy_batch_GBps": results["batch"][0],
        "memcpy_each_GBps": results["each"][0],
        "peer": "device-to-device copy" if memory == "device" else "cudaMemcpyAsync from pinned",
        "peer_GBps": peer_gbps,
        "scatter_vs_peer": scatter / peer_gbps,
        "scatter_device_GBps": nbytes / (ms_device * 1e-3) / 1e9 if ms_device else None,
        "aim": 0.8 if memory == "device" else 0.85,
        "matches_cpu": all(ok for _, ok in results.values()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gather_bw: no CUDA device", file=sys.stderr)
        raise SystemExit(2)
    iters = 10 if args.quick else 50
    log = RowLog(
        args.out / "gather_bw.json",
        {
            "benchmark": "gpu_gather_bandwidth",
            "command": "python bench/gpu/gather_bw.py " + " ".join(argv or sys.argv[1:]),
            "machine": {
                "platform": platform.platform(),
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0),
                "cuda_runtime": torch.version.cuda,
            },
            "units": "GB/s (1e9 bytes/s) of host bytes moved to the device",
            "limit": "memcpy_pinned_GBps: cudaMemcpyAsync of the same bytes from pinned memory",
            "copy_paths": [],
        },
    )
    ok = True
    print(
        f"{'image':>16} {'batch MB':>9} {'gather':>8} {'+norm':>8} {'memcpy':>8} "
        f"{'take+g':>8} {'g/memcpy':>9} ok"
    )
    for side, batch in ((224, 256), (128, 256), (32, 4096)):
        r = measure(side, batch, iters)
        log.add(r)
        ok = ok and r["gather_matches_cpu"]
        print(
            f"{r['image']:>16} {r['batch_bytes'] / 1e6:9.1f} {r['gather_GBps']:8.1f} "
            f"{r['gather_normalize_GBps']:8.1f} {r['memcpy_pinned_GBps']:8.1f} "
            f"{r['take_plus_gather_GBps']:8.1f} {r['gather_vs_memcpy']:9.2f} "
            f"{r['gather_matches_cpu']}",
            flush=True,
        )
    print(
        f"\n{'arena':>7} {'dst':>8} {'image':>16} {'scatter':>8} {'batch':>8} {'each':>8} "
        f"{'peer':>8} {'s/peer':>7} {'aim':>5} ok"
    )
    fmt = lambda v: f"{v:8.1f}" if v is not None else f"{'-':>8}"  # noqa: E731
    for side, batch in ((224, 256), (32, 4096)):
        for memory in ("pinned", "device"):
            for packed in (True, False):
                r = measure_paths(memory, side, batch, iters, packed=packed)
                log.add(r, key="copy_paths")
                ok = ok and r["matches_cpu"]
                print(
                    f"{r['arena']:>7} {r['destinations']:>8} {r['image']:>16} "
                    f"{fmt(r['scatter_GBps'])} {fmt(r['memcpy_batch_GBps'])} "
                    f"{fmt(r['memcpy_each_GBps'])} {fmt(r['peer_GBps'])} "
                    f"{r['scatter_vs_peer']:7.2f} {r['aim']:5.2f} {r['matches_cpu']}",
                    flush=True,
                )
    payload = log.finish()
    if not ok:
        print("gather_bw: device batch differs from the CPU samples", file=sys.stderr)
        raise SystemExit(1)
    return payload


if __name__ == "__main__":
    main()
