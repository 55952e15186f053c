"""DALI on the GPU: mixed (nvJPEG) decode -> echo -> GPU augmentation, in training images/s.

Runs only where NVIDIA DALI and the echopipe DALI plugin are importable (``bench/gpu/run.sh``
puts ``.gpu/site`` on ``PYTHONPATH`` when it exists). Rows, all on the synthetic JPEG set at
ImageNet size (sides 256-512 px, 224 px crops), the headline first:

* ``plain DALI``: reader -> mixed decode -> random-resized-crop -> normalise (no echo);
* ``upstream alone``: reader -> mixed decode, nothing after it (the rate e multiplies);
* ``downstream alone``: the echo graph with e = 10000 from a warm cache (the upstream idles),
  the ceiling the echo rows can reach;
* ``echopipe e=2 / 4 / 1``: the same graph as plain DALI with the echo point after decode
  (:func:`echopipe.dali.builders.imagenet_train_pipeline`, ``decode_device="mixed"``); the cache
  is ``memory="auto"``, which for a mixed decode is the device arena. Each has its ``ideal``,
  min(e * upstream alone, downstream alone), and ``vs_ideal``;
* ``echopipe e=2 pinned``: the pinned, GPU-mapped host arena instead (the source's one scatter
  launch per batch reads it over the bus);
* ``echopipe e=2 each``: the device arena with the source's per-sample ``cudaMemcpyAsync``
  fallback (``ECHOPIPE_GPU_SOURCE_COPY=each``) instead of one scatter launch per batch.

No read delay: this measures the GPU path's own throughput (and the cost of the echo hop). Both
sides pay the same per step: the echo rows copy each batch into CUDA torch tensors
(EchoIterator) and read ``info`` back to the host; the plain row goes through DALI's own
``DALIGenericIterator`` (the same copy into torch) and reads its labels back to the host.
``<out>/dali_gpu.json`` is rewritten after every row (bench/gpu/rowlog.py), so a run cut short
keeps the rows it measured; a failing row is recorded with its error and the others go on.
Usage: ``python bench/gpu/dali_gpu.py --out DIR [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from rowlog import RowLog


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


def upstream_rate(data: Path, batch: int, threads: int, seconds: float) -> dict[str, float]:
    """Reader -> mixed decode alone, outputs left on the GPU."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0, seed=0)
    def decode() -> Any:
        jpegs, _ = fn.readers.file(file_root=str(data / "train"), random_shuffle=True)
        return fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    for _ in range(3):
        pipe.run()
    torch.cuda.synchronize()
    images = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pipe.run()
        images += batch
    torch.cuda.synchronize()
    rate_ = images / (time.perf_counter() - start)
    del pipe
    return {"images_per_s": rate_, "echo_ratio": 1.0}


# (row name, echo factor or None for plain DALI, arena, source copy path); headline rows first.
ROWS: list[tuple[str, float | None, str, str]] = [
    ("plain DALI", None, "auto", "gather"),
    ("upstream alone", None, "auto", "gather"),
    ("downstream alone", 10_000.0, "auto", "gather"),
    ("echopipe e=2", 2.0, "auto", "gather"),
    ("echopipe e=4", 4.0, "auto", "gather"),
    ("echopipe e=1", 1.0, "auto", "gather"),
    ("echopipe e=2 pinned", 2.0, "pinned", "gather"),
    ("echopipe e=2 each", 2.0, "auto", "each"),
]


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

    per_class = 50 if args.quick else 100
    data = ensure_synthetic_imagenet(
        args.data_dir, classes=10, per_class=per_class, size=(256, 512), val_per_class=1
    )
    seconds = 2.5 if args.quick else 10.0
    log = RowLog(
        args.out / "dali_gpu.json",
        {
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
                "seconds_per_row": seconds,
                "images": f"synthetic JPEGs, 10 classes x {per_class}, sides 256-512 px",
                "graph": "file reader -> mixed decode -> [echo] -> random resized crop -> "
                "crop_mirror_normalize (GPU)",
                "per_step_copies": "batch into torch CUDA tensors + one small array to the host, "
                "on both sides (DALIGenericIterator for plain DALI, EchoIterator for echopipe)",
                "ideal": "min(e * upstream alone, downstream alone)",
            },
        },
    )
    measured: dict[str, float] = {}
    for name, echo, memory, copy in ROWS:
        # Read when the GPU echo source is built (the pipeline's first batch).
        os.environ["ECHOPIPE_GPU_SOURCE_COPY"] = copy
        try:
            if name == "upstream alone":
                r, arena = upstream_rate(data, args.batch_size, args.threads, seconds), None
            else:
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
        except Exception as exc:  # recorded in the JSON and in the exit status
            traceback.print_exc()
            log.add({"row": name, "images_per_s": None, "error": f"{type(exc).__name__}: {exc}"})
            continue
        measured[name] = r["images_per_s"]
        r.update(row=name, echo_factor=echo, arena=arena)
        r["source_copy"] = None if echo is None else copy
        plain = measured.get("plain DALI")
        r["vs_plain"] = r["images_per_s"] / plain if plain else None
        up, down = measured.get("upstream alone"), measured.get("downstream alone")
        if echo is not None and name != "downstream alone" and up and down:
            r["ideal"] = min(echo * up, down)
            r["vs_ideal"] = r["images_per_s"] / r["ideal"]
        log.add(r)
        ideal = f"  {r['vs_ideal']:.2f}x ideal" if "vs_ideal" in r else ""
        print(
            f"{name:>20}: {r['images_per_s']:9.0f} images/s  echo ratio {r['echo_ratio']:.2f}"
            f"{ideal}",
            flush=True,
        )
    return log.finish()


if __name__ == "__main__":
    raise SystemExit(1 if any("error" in r for r in main()["rows"]) else 0)
