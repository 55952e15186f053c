"""Throughput of stale-weight pipelined training against its peers, all measured in one run.

Rows (samples/s of full training steps: forward, backward, optimizer step):

* ``sequential, 1 thread``: one process, one intra-op thread, plain SGD loop (the 1-device run).
* ``sequential, all threads``: one process using every core through intra-op threads.
* ``stale pipeline K=2 / K=4 (threads)``: :class:`echopipe.pipeline.StalePipeline`, one worker
  thread per stage, the cores divided among the stages.
* ``stale pipeline K=2 (2 Gloo procs)``: :class:`echopipe.pipeline.DistributedStalePipeline`.
* ``torch pipelining GPipe / 1F1B K=2``: ``torch.distributed.pipelining`` with the same stages,
  one Gloo process per stage, ``--microbatches`` microbatches.
* ``--cuda-only`` (what ``bench/gpu/run.sh`` runs; only these rows, no CPU row spends device
  time first): sequential on one GPU against the stale pipeline with both stages on one GPU
  (separate streams), and on two GPUs when present, with a larger model (see ``run_cuda``).

The multi-process rows of one K share one spawned Gloo group (stale, then GPipe, then 1F1B), so
process start-up is paid once per K. Prints a table and writes ``<results-dir>/pipeline.json``
(the convention of ``bench/benchutil.py``). ``--quick`` (K=2 rows only, 10 measured steps) keeps
it under ~40 s on 2 cores. Run: ``python bench/pipeline.py [--quick] [--results-dir DIR]``.

**Allocator.** With glibc's default malloc settings, the 4 MiB activations of this model cross
the dynamic mmap threshold and are handed back to the kernel and page-faulted in again on
every step: 10-18k minor faults per step in the 1-thread run on the development machine, which
cost it 40 % of its speed, and a different amount on each pipeline worker (each thread has its
own arena), so rows and the per-layer profile behind ``balance`` measured the allocator rather
than the model. Run as a script, the benchmark therefore re-executes itself once with
``MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=32 MiB MALLOC_TRIM_THRESHOLD_=1 GiB`` (the
spawned Gloo ranks inherit them), so every row runs with the same allocator and no page faults.
``--default-malloc`` keeps glibc's defaults; the JSON records which one ran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

import benchutil as bu
from echopipe.pipeline import (
    DistributedStalePipeline,
    StalePipeline,
    partition_balance,
)

DIST_KINDS = ("stale", "gpipe", "1f1b")
TUNED_MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}
"""glibc reads these at process start; they keep freed activations in the heap for reuse."""
"""Multi-process rows, run in this order inside one process group per K."""


def bench_cnn(width: int = 16, num_classes: int = 10) -> nn.Sequential:
    """An 8-conv CNN for 32x32 RGB, 11 children (one per conv block)."""

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU())

    w = width
    torch.manual_seed(0)
    return nn.Sequential(
        block(3, w), block(w, w), block(w, w), block(w, w),
        nn.MaxPool2d(2),
        block(w, 2 * w), block(2 * w, 2 * w), block(2 * w, 2 * w), block(2 * w, 2 * w),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        nn.Linear(2 * w, num_classes),
    )  # fmt: skip


def make_data(batch: int, n: int, side: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(batch, 3, side, side, generator=g),
            torch.randint(0, 10, (batch,), generator=g),
        )
        for _ in range(n)
    ]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


loss_fn = nn.functional.cross_entropy


# Single-process rows ----------------------------------------------------------------------------
def run_sequential(args: argparse.Namespace, threads: int, device: str = "cpu") -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = bench_cnn(args.width).to(device)
        opt = sgd(list(model.parameters()))
        data = make_data(args.batch, 1, args.image_size)
        x, y = data[0][0].to(device), data[0][1].to(device)

        def step() -> None:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            step()
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if device != "cpu":
            torch.cuda.synchronize()
        return args.steps * args.batch / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)


def run_stale_threads(
    args: argparse.Namespace, balance: Sequence[int], devices: Sequence[str]
) -> float:
    model = bench_cnn(args.width)
    x, y = make_data(args.batch, 1, args.image_size)[0]
    cuda = devices[0].startswith("cuda")
    if cuda:  # resident, as in the sequential row: neither row pays a host copy per step
        x, y = x.to(devices[0]), y.to(devices[-1])
    with StalePipeline(
        model, balance=list(balance), devices=list(devices), optimizer=sgd, loss_fn=loss_fn
    ) as pipe:
        for _ in range(args.warmup):
            pipe.train_step(x, y)
        if cuda:
            pipe.drain()
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            pipe.train_step(x, y)
        # Count only finished work: the measured minibatches are all applied after the drain,
        # and on CUDA the queued kernels have run after the synchronize.
        pipe.drain()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        assert pipe.steps_applied == args.warmup + args.steps
    return args.steps * args.batch / elapsed


# Multi-process rows -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dist_worker(
    rank: int, world: int, port: int, kinds: Sequence[str], cfg: dict[str, Any], out_dir: str
) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(cfg["threads"])
    # A peer that fails on one rank must not leave the other blocked forever.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg["timeout_s"])
    )
    results: dict[str, Any] = {}
    try:
        for kind in kinds:
            try:
                results[kind] = {"seconds": _dist_run(rank, world, kind, cfg)}
            except Exception as exc:  # a peer that cannot run here is reported, not hidden
                results[kind] = {"error": repr(exc)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _dist_run(rank: int, world: int, kind: str, cfg: dict[str, Any]) -> float:
    import torch.distributed as dist

    model = bench_cnn(cfg["width"])
    x, y = make_data(cfg["batch"], 1)[0]
    balance = cfg["balance"]
    if kind == "stale":
        pipe = DistributedStalePipeline(model, balance=balance, optimizer=sgd, loss_fn=loss_fn)

        def step() -> None:
            pipe.train_step(x, y)

        def finish() -> None:
            pipe.drain()
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        start = sum(balance[:rank])
        stage_module = nn.Sequential(*list(model.children())[start : start + balance[rank]])
        stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
        schedule_cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        schedule = schedule_cls(stage, cfg["microbatches"], loss_fn=loss_fn)
        opt = sgd(list(stage_module.parameters()))

        def step() -> None:
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def finish() -> None:
            pass

    for _ in range(cfg["warmup"]):
        step()
    finish()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    finish()
    dist.barrier()
    return time.perf_counter() - t0


def run_distributed(
    args: argparse.Namespace, balance: Sequence[int], kinds: Sequence[str] = DIST_KINDS
) -> dict[str, float | str]:
    """Samples/s of each kind (or the error text), all in one spawned group of len(balance)."""
    world = len(balance)
    cfg = {
        "width": args.width,
        "batch": args.batch,
        "balance": list(balance),
        "warmup": args.warmup,
        "steps": args.steps,
        "microbatches": args.microbatches,
        "threads": max(1, (os.cpu_count() or 1) // world),
        "timeout_s": 120,
    }
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _dist_worker,
            args=(world, _free_port(), list(kinds), cfg, out_dir),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    out: dict[str, float | str] = {}
    for kind in kinds:
        errors = [r[kind]["error"] for r in per_rank if "error" in r[kind]]
        if errors:
            out[kind] = "; ".join(errors)
        else:  # the slowest rank bounds the pipeline
            seconds = max(r[kind]["seconds"] for r in per_rank)
            out[kind] = args.steps * args.batch / seconds
    return out


# CUDA rows ----------------------------------------------------------------------------------------
CUDA_MIN_STEPS = 100


def run_cuda(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--cuda-only``: sequential vs the stale K=2 pipeline on two streams of one GPU (and on
    two GPUs when present), nothing on the CPU first.

    The defaults (width 128, batch 256: every conv a few hundred microseconds, so launches are
    not what is timed; at least 100 measured steps; the rows alternate over 3 rounds and each
    reports its median round) make the figure one of the GPU, not of Python or the launch
    queue. Both rows keep the batch resident on the device. Writes
    ``<results-dir>/pipeline.json`` (default ``bench/results/gpu/``); a failed row fails.
    """
    if not torch.cuda.is_available():
        print("--cuda-only needs a CUDA device; torch sees none", file=sys.stderr)
        return 1
    args.batch = args.batch or 256
    args.width = args.width or 128
    args.steps = max(args.steps or CUDA_MIN_STEPS, CUDA_MIN_STEPS)
    args.warmup = args.warmup or 10
    if args.results_dir is None:
        args.results_dir = bu.default_results_dir() / ("quick" if args.quick else "") / "gpu"
    run = bu.BenchRun.start("pipeline", args, argv)
    gpus = torch.cuda.device_count()
    model = bench_cnn(args.width)
    sample = make_data(args.batch, 1, args.image_size)[0][0].to("cuda:0")
    balance = partition_balance(
        model.to("cuda:0"), sample, 2, devices=["cuda:0", "cuda:0"], repeats=3
    )
    del model, sample
    one, two = "CUDA stale pipeline K=2, 1 GPU (2 streams)", "CUDA stale pipeline K=2, 2 GPUs"
    rows_fns: list[tuple[str, Any]] = [
        ("CUDA sequential, 1 GPU", lambda: run_sequential(args, 1, "cuda:0")),
        (one, lambda: run_stale_threads(args, balance, ["cuda:0", "cuda:0"])),
    ]
    if gpus >= 2:
        rows_fns.append((two, lambda: run_stale_threads(args, balance, ["cuda:0", "cuda:1"])))
    rows = _median_rounds(rows_fns, args.rounds, run)
    by_name = {r["name"]: r["samples_per_s"] for r in rows}
    seq = by_name["CUDA sequential, 1 GPU"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    # Two streams of one GPU share its SMs: overlap can hide launch and copy gaps only, so this
    # is reported, not held to an aim (the overlap itself is proven in tests/test_gpu.py).
    ratios = {"CUDA_K2_1gpu_over_sequential": ratio(by_name.get(one), seq)}
    if gpus >= 2:
        ratios["CUDA_K2_2gpus_over_sequential"] = ratio(by_name.get(two), seq)
    claims = [
        bu.claim(
            "stale K=2 on two streams of one GPU vs one stream", "reported",
            ratios["CUDA_K2_1gpu_over_sequential"], None, "two streams share one GPU's SMs",
        )
    ]  # fmt: skip
    print(bu.format_table(["configuration", "samples/s", "rounds"], [
        [r["name"], r["samples_per_s"], r.get("rounds")] for r in rows
    ]))  # fmt: skip
    run.finish(
        figures={"rows": rows},
        ratios=ratios,
        claims=claims,
        config={
            "model": f"8-conv CNN width {args.width}, {args.image_size}px x3, 11 children",
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "balance_K2": balance,
            "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
            "data": "one random batch resident on the first stage's device",
        },
    )
    failed = [r["name"] for r in rows if r.get("error")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _median_rounds(fns: list[tuple[str, Any]], rounds: int, run: Any) -> list[dict[str, Any]]:
    """Runs the rows in alternating rounds; each row reports its median round (or its errors)."""
    values: dict[str, list[float | str]] = {name: [] for name, _ in fns}
    for _ in range(rounds):
        for name, fn in fns:
            try:
                values[name].append(fn())
            except Exception as exc:  # reported in the row; a failed CUDA row fails the run
                values[name].append(repr(exc))
    rows = []
    for name, _ in fns:
        numbers = sorted(v for v in values[name] if not isinstance(v, str))
        errors = [v for v in values[name] if isinstance(v, str)]
        row: dict[str, Any] = {"name": name, "rounds": [round(v, 1) for v in numbers]}
        if errors:
            row.update(samples_per_s=None, error="; ".join(errors))
        else:
            row["samples_per_s"] = round(numbers[len(numbers) // 2], 1)
        rows.append(row)
        print(f"  {name:<44} {row['samples_per_s']}  [{run.elapsed():.0f} s]", flush=True)
    return rows


def figures_table(figures: dict[str, Any]) -> str:
    """Samples/s per configuration as markdown. ``main`` prints it and ``readme_tables.py``
    writes it into bench/README.md from the JSON, so the table there is the one the run printed.
    """
    rows = [
        [r["name"], r.get("balance"),
         f"{r['samples_per_s']:,.0f}" if r["samples_per_s"] is not None else r.get("error"),
         f"{r['x_1thread']:.2f}" if r.get("x_1thread") is not None else None]
        for r in figures["rows"]
    ]  # fmt: skip
    return bu.format_table(["configuration", "balance", "samples/s", "x 1 thread"], rows)


# Driver -----------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the table, writes ``pipeline.json``; 0 unless it errs."""
    parser = bu.bench_parser("pipeline", __doc__, "K=2 rows only, 10 measured steps (< 40 s)")
    parser.add_argument("--batch", type=int, default=None, help="default 64 (CUDA rows: 256)")
    parser.add_argument("--width", type=int, default=None, help="default 16 (CUDA rows: 128)")
    parser.add_argument("--steps", type=int, default=None, help="measured minibatches per row")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of the single-process rows"
    )
    parser.add_argument("--image-size", type=int, default=32, help="side of the random images")
    parser.add_argument(
        "--cuda-only",
        action="store_true",
        help="only the CUDA rows (sequential vs stale K=2 on streams of one GPU, and on two GPUs "
        "when present), with a model big enough not to be launch-bound: see run_cuda",
    )
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's default malloc settings (see the module docstring)",
    )
    args = parser.parse_args(None if argv is None else list(argv))
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.cuda_only:
        return run_cuda(args, argv)
    args.batch = args.batch or 64
    args.width = args.width or 16
    run = bu.BenchRun.start("pipeline", args, argv)
    if args.steps is None:
        args.steps = 10 if args.quick else 60
    if args.warmup is None:
        args.warmup = 2 if args.quick else 8

    cores = os.cpu_count() or 1
    model = bench_cnn(args.width)
    sample = make_data(args.batch, 1)[0][0]
    balance2 = partition_balance(model, sample, 2, repeats=3)
    balance4 = None if args.quick else partition_balance(model, sample, 4, repeats=3)
    rows: list[dict[str, Any]] = []
    mb = args.microbatches
    names = {
        "stale": "stale pipeline K={k} ({k} Gloo procs)",
        "gpipe": f"torch pipelining GPipe K={{k}} ({mb} mb)",
        "1f1b": f"torch pipelining 1F1B K={{k}} ({mb} mb)",
    }

    def record(name: str, value: float | str, **meta: Any) -> None:
        if isinstance(value, str):
            rows.append({"name": name, "samples_per_s": None, "error": value, **meta})
        else:
            rows.append({"name": name, "samples_per_s": round(value, 1), **meta})
        print(f"  {name:<44} {rows[-1]['samples_per_s']}  [{run.elapsed():.0f} s]", flush=True)

    def add(name: str, fn: Any, **meta: Any) -> None:
        try:
            value = fn()
        except Exception as exc:  # a peer that cannot run here is reported, not hidden
            value = repr(exc)
        record(name, value, **meta)

    def add_distributed(k: int, balance: list[int]) -> None:
        try:
            got = run_distributed(args, balance)
        except Exception as exc:
            got = {kind: repr(exc) for kind in DIST_KINDS}
        for kind in DIST_KINDS:
            record(names[kind].format(k=k), got[kind], balance=balance)

    print(f"balance K=2 {balance2}, K=4 {balance4}, batch {args.batch}, {cores} cores")
    # The host's speed drifts by tens of percent between seconds on the shared development VM,
    # so the single-process rows run in alternating rounds and each reports its median round.
    local: list[tuple[str, Any, dict[str, Any]]] = [
        ("sequential, 1 thread", lambda: run_sequential(args, 1), {"threads": 1}),
        (
            f"sequential, all {cores} threads",
            lambda: run_sequential(args, cores),
            {"threads": cores},
        ),
        (
            "stale pipeline K=2 (threads)",
            lambda: run_stale_threads(args, balance2, ["cpu"] * 2),
            {"balance": balance2},
        ),
    ]
    if balance4 is not None:
        local.append(
            (
                "stale pipeline K=4 (threads)",
                lambda: run_stale_threads(args, balance4, ["cpu"] * 4),
                {"balance": balance4},
            )
        )
    per_round: dict[str, list[float | str]] = {name: [] for name, _, _ in local}
    for _ in range(args.rounds):
        for name, fn, _ in local:
            try:
                per_round[name].append(fn())
            except Exception as exc:  # a peer that cannot run here is reported, not hidden
                per_round[name].append(repr(exc))
    for name, _, meta in local:
        values = per_round[name]
        numbers = sorted(v for v in values if not isinstance(v, str))
        errors = [v for v in values if isinstance(v, str)]
        value: float | str = numbers[len(numbers) // 2] if not errors else "; ".join(errors)
        record(name, value, rounds=[round(v, 1) for v in numbers], **meta)
    add_distributed(2, balance2)
    if balance4 is not None:
        add_distributed(4, balance4)
    by_name = {r["name"]: r["samples_per_s"] for r in rows}
    base = by_name["sequential, 1 thread"]
    k2 = by_name["stale pipeline K=2 (threads)"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    gpipe = by_name.get(names["gpipe"].format(k=2))
    f1b = by_name.get(names["1f1b"].format(k=2))
    ratios = {
        "K2_over_1thread": ratio(k2, base),
        "K2_over_all_threads": ratio(k2, by_name[f"sequential, all {cores} threads"]),
        "K2_over_gpipe": ratio(k2, gpipe),
        "K2_over_1f1b": ratio(k2, f1b),
        # The physical limit of a K=2 split over 2 equal cores is 2x the 1-thread run.
        "K2_fraction_of_ideal_2x": ratio(k2, 2 * base) if base else None,
    }
    for row in rows:
        row["x_1thread"] = ratio(row["samples_per_s"], base)

    def aim_claim(text: str, key: str, aim: float, peer: str) -> dict[str, Any]:
        value = ratios[key]
        if value is None:
            return bu.claim(text, f">= {aim}x", None, None, f"{peer} row did not run")
        met = value >= aim
        reason = (
            f"{value:.2f}x {peer}"
            if met
            else f"{value:.2f}x {peer}, below {aim}x ({cores} shared CPU cores, not devices)"
        )
        return bu.claim(text, f">= {aim}x", value, met, reason)

    claims = [
        aim_claim("stale K=2 (threads) vs the 1-device run", "K2_over_1thread", 1.8, "1 thread"),
        aim_claim("stale K=2 (threads) vs GPipe K=2", "K2_over_gpipe", 1.2, "GPipe"),
        aim_claim("stale K=2 (threads) vs 1F1B K=2", "K2_over_1f1b", 1.2, "1F1B"),
    ]
    print()
    print(figures_table({"rows": rows}))
    print()
    print(bu.format_table(["ratio", "value"], list(ratios.items())))
    run.finish(
        figures={"rows": rows},
        ratios=ratios,
        claims=claims,
        config={
            "model": f"8-conv CNN width {args.width}, 32x32x3, 11 children",
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "microbatches": args.microbatches,
            "rounds_single_process": args.rounds,
            "optimizer": "SGD lr 0.01 momentum 0.9",
            "balance_K2": balance2,
            "balance_K4": balance4,
            "limit": "K=2 over 2 equal cores: 2x the 1-thread run",
            "malloc_env": {k: os.environ.get(k) for k in TUNED_MALLOC_ENV},
        },
    )
    return 0


def _reexec_with_tuned_malloc() -> None:
    """Restart this script once with :data:`TUNED_MALLOC_ENV` unless asked not to."""
    if "--default-malloc" in sys.argv[1:] or all(
        os.environ.get(k) == v for k, v in TUNED_MALLOC_ENV.items()
    ):
        return
    os.environ.update(TUNED_MALLOC_ENV)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.argv])


if __name__ == "__main__":
    _reexec_with_tuned_malloc()
    sys.exit(main())
