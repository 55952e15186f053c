"""DALI on the GPU: mixed (nvJPEG) decode -> echo -> GPU augmentation, in training images/s.

Runs only where NVIDIA DALI and the echopipe DALI plugin are importable (``bench/gpu/run.sh``
puts ``.gpu/site`` on ``PYTHONPATH`` when it exists). Rows, all on the synthetic JPEG set:

* ``plain DALI``: reader -> mixed decode -> random-resized-crop -> normalise (no echo);
* ``echopipe e=1 / 2 / 4``: the same graph with the echo point after decode
  (:func:`echopipe.dali.builders.imagenet_train_pipeline`, ``decode_device="mixed"``); the cache
  is ``memory="auto"``, which for a mixed decode is the device arena;
* ``echopipe e=2 pinned``: the pinned, GPU-mapped host arena instead (the source's one scatter
  launch per batch reads it over the bus);
* ``echopipe e=2 each``: the device arena with the source's per-sample ``cudaMemcpyAsync``
  fallback (``ECHOPIPE_GPU_SOURCE_COPY=each``) instead of one scatter launch per batch.

No read delay: this measures the GPU path's own throughput (and the cost of the echo hop). Both
sides pay the same per step: the echo rows copy each batch into CUDA torch tensors
(EchoIterator) and read ``info`` back to the host; the plain row goes through DALI's own
``DALIGenericIterator`` (the same copy into torch) and reads its labels back to the host.
Writes ``<out>/dali_gpu.json``.
Usage: ``python bench/gpu/dali_gpu.py --out DIR [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch


def plain_rate(pipe: Any, seconds: float) -> dict[str, float]:
    """Plain DALI through DALI's own torch iterator, paying what the echo rows pay per step:
    each batch copied into torch tensors, and one small array read back to the host (the echo
    rows read ``info``; this row reads the labels)."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    stream = iter(DALIGenericIterator(pipe, ["data", "label"]))

    def step() -> int:
        batch = next(stream)[0]
        batch["label"].cpu()
        return int(batch["data"].shape[0])

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    images = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        images += step()
    torch.cuda.synchronize()
    return {"images_per_s": images / (time.perf_counter() - start), "echo_ratio": 1.0}


def rate(pipe: Any, seconds: float) -> dict[str, float]:
    """echopipe: through :class:`EchoIterator`, each batch copied into a CUDA torch tensor."""
    from echopipe.dali import EchoIterator

    with EchoIterator(pipe, ["data", "label"], steps_per_epoch=10**9) as it:
        stream = iter(it)
        for _ in range(5):
            next(stream)
        torch.cuda.synchronize()
        images = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            batch = next(stream)
            images += int(batch[0]["data"].shape[0])
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        stats = it.stats
    return {"images_per_s": images / elapsed, "echo_ratio": stats.echo_ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "echopipe-gpu-data",
        help="where the synthetic JPEGs are made (kept out of --out: the results must stay small)",
    )
    args = p.parse_args(argv)
    from nvidia import dali

    from echopipe.dali.builders import imagenet_train_pipeline
    from echopipe.data import ensure_synthetic_imagenet

    data = ensure_synthetic_imagenet(
        args.data_dir, classes=10, per_class=100, size=(256, 512), val_per_class=1
    )
    seconds = 4.0 if args.quick else 10.0
    rows = []
    specs = [(None, "auto", "gather", "plain DALI")]
    specs += [(e, "auto", "gather", f"echopipe e={e:g}") for e in (1.0, 2.0, 4.0)]
    specs += [
        (2.0, "pinned", "gather", "echopipe e=2 pinned"),
        (2.0, "auto", "each", "echopipe e=2 each"),
    ]
    for echo, memory, copy, name in specs:
        # Read when the GPU echo source is built (the pipeline's first batch).
        os.environ["ECHOPIPE_GPU_SOURCE_COPY"] = copy
        # One failing row must not cost the others: its error is recorded and the run goes on.
        try:
            pipe = imagenet_train_pipeline(
                data,
                batch_size=args.batch_size,
                image_size=args.image_size,
                echo_factor=echo,
                decode_device="mixed",
                device_id=0,
                num_threads=args.threads,
                upstream_threads=args.threads,
                seed=0,
                random_area=(0.08, 1.0),
                cache_bytes=2 << 30,
                **({} if echo is None else {"memory": memory}),
            )
            arena = None if echo is None else pipe.cache.memory_kind
            r = plain_rate(pipe, seconds) if echo is None else rate(pipe, seconds)
            del pipe
        except Exception as exc:  # reported in the JSON and in the exit status
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"
            rows.append({"row": name, "images_per_s": None, "error": error})
            continue
        r["row"] = name
        r["arena"], r["source_copy"] = arena, (None if echo is None else copy)
        rows.append(r)
        print(
            f"{r['row']:>16}: {r['images_per_s']:9.0f} images/s  echo ratio {r['echo_ratio']:.2f}",
            flush=True,
        )
    base = rows[0]["images_per_s"]
    for r in rows:
        r["vs_plain"] = r["images_per_s"] / base if (base and r["images_per_s"]) else None
    payload = {
        "benchmark": "dali_gpu",
        "command": "python bench/gpu/dali_gpu.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "dali": dali.__version__,
            "torch": torch.__version__,
        },
        "setup": {
            "batch_size": args.batch_size,
            "image_size": args.image_size,
            "threads": args.threads,
            "images": "synthetic JPEGs, sides 256-512 px",
            "graph": "file reader -> mixed decode -> [echo] -> random resized crop -> "
            "crop_mirror_normalize (GPU)",
            "per_step_copies": "batch into torch CUDA tensors + one small array to the host, "
            "on both sides (DALIGenericIterator for plain DALI, EchoIterator for echopipe)",
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dali_gpu.json").write_text(json.dumps(payload, indent=1))
    return payload


if __name__ == "__main__":
    raise SystemExit(1 if any("error" in r for r in main()["rows"]) else 0)
