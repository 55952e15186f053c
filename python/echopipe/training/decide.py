"""The ``auto`` choices of a run, each taken on a measurement and recorded with its reason.

``--stages auto`` pipelines only where a short timed run shows the stale pipeline faster than
one stage, which on the CPU is timed with one thread and with all threads
(:mod:`.cpu_choice`, which also says when replicas would be faster); ``--balance auto``
splits by the blocks' measured forward times (or, with ``--deterministic``, by the cost model of
:mod:`echopipe.pipeline.cost_model`: FLOPs and bytes from the shapes, which do not depend on
timing).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .config import TrainConfig
from .cpu_choice import CpuTrial, choose_cpu_setting

__all__ = [
    "balance_by_parameters",
    "balance_by_weights",
    "block_seconds",
    "choose_split",
    "measure_copy_bytes_per_s",
    "measure_step_seconds",
    "steady_step_seconds",
]

_WARMUP_STEPS = 2
# A step is timed as the slope between two windows, each from a drained pipeline to a drained
# pipeline: T(n) = L + n * step, where L is the fill and drain of the stages (about K - 1 stage
# times). One window of 4 steps read L / 4 as step time: the 2-stage pipeline's step came out
# 1.2x its steady value, which both slowed `--stages auto` against one stage and lowered the
# R that `--echo auto` starts from (docs/design.md, "`--echo auto`").
_SHORT_STEPS = 2
_LONG_STEPS = 8


def steady_step_seconds(short_s: float, long_s: float, stages: int) -> float:
    """Seconds per step of a full pipeline from two windows of :data:`_SHORT_STEPS` and
    :data:`_LONG_STEPS` steps, each timed from a drained pipeline to a drained one.

    The slope between them drops the fill and drain both windows share. It is clamped to what
    the long window allows: at most its mean (no fill at all), at least its mean with the fill
    and drain taken as ``stages - 1`` whole steps (the most they can be), so a window disturbed
    by load cannot give a negative or an absurd step.
    """
    slope = (long_s - short_s) / (_LONG_STEPS - _SHORT_STEPS)
    lowest = long_s / (_LONG_STEPS + max(stages - 1, 0))
    return min(max(slope, lowest), long_s / _LONG_STEPS)


def measure_step_seconds(
    model: nn.Sequential,
    sample: torch.Tensor,
    balance: list[int],
    devices: list[str],
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per training step of a copy of ``model`` split by ``balance``, in the steady
    state of its pipeline (:func:`steady_step_seconds`).

    Random labels, plain SGD; the copy is thrown away, so the real model is untouched.
    ``clock`` is read at the start and end of each timed window (a test can inject it).
    """
    from ..pipeline import StalePipeline

    probe = copy.deepcopy(model)
    target = torch.randint(0, 2, (sample.shape[0],))
    pipe = StalePipeline(
        probe,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
        loss_fn=nn.CrossEntropyLoss(),
        balance=balance,
        devices=devices[: len(balance)],
    )

    def window(steps: int) -> float:
        t0 = clock()
        for _ in range(steps):
            pipe.train_step(sample, target)
        pipe.drain()
        return clock() - t0

    try:
        for _ in range(_WARMUP_STEPS):
            pipe.train_step(sample, target)
        pipe.drain()
        short_s = window(_SHORT_STEPS)
        return steady_step_seconds(short_s, window(_LONG_STEPS), len(balance))
    finally:
        pipe.close()


def measure_copy_bytes_per_s(nbytes: int, repeats: int = 3) -> float:
    """Memory-copy rate of a tensor of ``nbytes`` (the best of ``repeats`` copies)."""
    src = torch.ones(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / max(best, 1e-9)


def choose_split(
    cfg: TrainConfig,
    model: nn.Sequential,
    sample: torch.Tensor,
    default: int,
    devices: list[str],
    decisions: list[str],
    timings: dict[str, float] | None = None,
) -> list[int]:
    """The balance (blocks per stage; its length is the number of stages).

    ``--balance`` when given. Otherwise the stage count is ``--stages``, one per GPU, or, with
    ``--stages auto`` on one device, 2 only when a timed run of the 2-stage pipeline beats one
    stage (on the CPU: the faster of one thread and all threads); the split is profiled
    (modelled with ``--deterministic``). ``timings`` receives what the trial measured of the
    chosen setting: ``step_s`` (seconds per step) and, where one thread won, ``threads`` = 1.
    """
    if isinstance(cfg.balance, list):
        return list(cfg.balance)
    if isinstance(cfg.stages, int):
        return _split(cfg, model, sample, cfg.stages, devices, decisions)
    if any(d.startswith("cuda") for d in devices) and len(set(devices)) > 1:
        decisions.append(f"stages: {default}, one per GPU ({', '.join(sorted(set(devices)))})")
        return _split(cfg, model, sample, default, devices, decisions)
    if cfg.deterministic:
        decisions.append("stages: 1 (--deterministic: no timing-based choice)")
        return [len(model)]
    two = _split(cfg, model, sample, 2, devices, [])
    t1 = measure_step_seconds(model, sample, [len(model)], devices)
    t2 = measure_step_seconds(model, sample, two, devices)
    if all(d == "cpu" for d in devices) and torch.get_num_threads() > 1:
        return _cpu_choice(model, sample, two, devices, (t1, t2), decisions, timings)
    if timings is not None:
        timings["step_s"] = min(t1, t2)
    speed = (
        f"{t1 / t2:.2f}x the speed of one stage with all threads ({1000 * t2:.0f} vs "
        f"{1000 * t1:.0f} ms/step)"
    )
    if t2 < t1:
        decisions.append(f"stages: 2, balance {two}: the stale pipeline measured {speed}")
        return two
    decisions.append(f"stages: 1: the 2-stage pipeline (balance {two}) measured only {speed}")
    return [len(model)]


def choose_balance(
    cfg: TrainConfig,
    ctx: Any,
    model: nn.Sequential,
    stages: int,
    devices: list[str],
    decisions: list[str],
    say: Callable[[str], None],
    timings: dict[str, float],
) -> list[int]:
    """Blocks per stage from :func:`choose_split`, rank 0's choice for every rank (it is
    timing-based); the trial's times go into ``timings``."""
    sample = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size)
    if not cfg.deterministic and cfg.balance == "auto":
        say(
            "stages: timing the model's blocks"
            + (", then one stage against two," if cfg.stages == "auto" else "")
            + " on a copy of the model (a few seconds)..."
        )
    balance = choose_split(cfg, model, sample, stages, devices, decisions, timings)
    return ctx.broadcast_object(balance)


def _cpu_choice(
    model: nn.Sequential,
    sample: torch.Tensor,
    two: list[int],
    devices: list[str],
    measured: tuple[float, float],
    decisions: list[str],
    timings: dict[str, float] | None,
) -> list[int]:
    """One thread, all threads or the stale pipeline, timed in the same trial (the stages'
    line says how the pipeline compared; the ``cpu:`` line which of all was fastest)."""
    t_all, t_pipe = measured
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t_one = measure_step_seconds(model, sample, [len(model)], devices)
    finally:
        torch.set_num_threads(threads)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trial = CpuTrial(
        one_thread_s=t_one,
        all_threads_s=t_all,
        pipeline_s=t_pipe,
        threads=threads,
        batch_size=int(sample.shape[0]),
        grad_bytes=grad_bytes,
        copy_bytes_per_s=measure_copy_bytes_per_s(grad_bytes),
    )
    one_replica = int(os.environ.get("WORLD_SIZE", "1")) <= 1
    chosen, line = choose_cpu_setting(trial, replicas_possible=one_replica)
    t_single = min(t_one, t_all)
    speed = (
        f"{t_single / t_pipe:.2f}x the speed of one stage ({1000 * t_pipe:.0f} vs "
        f"{1000 * t_single:.0f} ms/step)"
    )
    if chosen == "stale pipeline":
        decisions.append(f"stages: 2, balance {two}: the stale pipeline measured {speed}")
    else:
        decisions.append(f"stages: 1: the 2-stage pipeline (balance {two}) measured only {speed}")
    decisions.append(line)
    if timings is not None:
        timings["step_s"] = {"one thread": t_one, "all threads": t_all}.get(chosen, t_pipe)
        if chosen == "one thread":
            timings["threads"] = 1
    return two if chosen == "stale pipeline" else [len(model)]


def balance_by_parameters(model: nn.Sequential, stages: int) -> list[int]:
    """Contiguous split of the blocks that minimises the largest stage's parameter count."""
    return balance_by_weights([sum(p.numel() for p in b.parameters()) for b in model], stages)


def block_seconds(model: nn.Sequential, sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Each block's forward time on ``sample`` (the fastest of ``repeats`` passes, no grad)."""
    best = [float("inf")] * len(model)
    with torch.no_grad():
        for _ in range(repeats):
            x = sample
            for k, block in enumerate(model):
                t0 = time.perf_counter()
                x = block(x)
                best[k] = min(best[k], time.perf_counter() - t0)
    return best


def balance_by_weights(weights: list[float], stages: int) -> list[int]:
    """Contiguous split of blocks with these weights that minimises the heaviest stage."""
    scaled = [max(1, round(w * 1e6)) if isinstance(w, float) else max(1, int(w)) for w in weights]
    lo, hi = max(scaled), sum(scaled)
    while lo < hi:  # binary search on the heaviest stage's weight
        mid = (lo + hi) // 2
        if len(_greedy(scaled, mid, stages)) <= stages:
            hi = mid
        else:
            lo = mid + 1
    balance = _greedy(scaled, lo, stages)
    while len(balance) < stages:  # split the largest group until every stage has a block
        k = max(range(len(balance)), key=lambda i: balance[i])
        balance[k : k + 1] = [balance[k] - balance[k] // 2, balance[k] // 2]
    return balance


def _greedy(weights: list[int], cap: int, stages: int) -> list[int]:
    groups: list[int] = []
    total = cap + 1
    for i, w in enumerate(weights):
        left_blocks = len(weights) - i
        if total + w > cap or (len(groups) < stages and left_blocks <= stages - len(groups)):
            groups.append(0)
            total = 0
        groups[-1] += 1
        total += w
    return groups


def _split(
    cfg: TrainConfig,
    model: nn.Sequential,
    sample: torch.Tensor,
    stages: int,
    devices: list[str],
    decisions: list[str],
) -> list[int]:
    if stages == 1:
        return [len(model)]
    if cfg.deterministic:
        from ..pipeline.cost_model import estimate_layer_seconds

        # FLOPs and bytes from the shapes (the pipeline's balance cost="model"): the same split
        # on every run and machine, and closer to the stages' times than parameter counts,
        # which put a ResNet's wide, cheap last blocks on their own.
        balance = balance_by_weights(estimate_layer_seconds(model, sample), stages)
        decisions.append(
            f"balance: {balance} by modelled cost, FLOPs and bytes per block (--deterministic)"
        )
        return balance
    # Forward times per block: a fraction of a second, where a full profile of forward and
    # backward per split (partition_balance) took close to a minute on a loaded 2-core machine.
    balance = balance_by_weights(block_seconds(model, sample), stages)
    decisions.append(f"balance: {balance}, the blocks' measured forward times split evenly")
    return balance
