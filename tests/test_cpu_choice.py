"""The CPU throughput choice of ``--stages auto``: a pure function of measured step times, the
real trial on a copy of a model, and the line ``echopipe train`` prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echopipe.training.cpu_choice import CpuTrial, allreduce_seconds, choose_cpu_setting


def trial(one: float, all_: float, pipe: float | None, threads: int = 2) -> CpuTrial:
    # 1 MB of gradients at 1 GB/s: a ring all-reduce of 2 replicas moves 1 MB per rank, 1 ms.
    return CpuTrial(one, all_, pipe, threads, 32, 10**6, 1e9)


def test_allreduce_model_is_the_ring_volume_at_the_copy_rate() -> None:
    assert allreduce_seconds(10**6, 1, 1e9) == 0.0
    assert allreduce_seconds(10**6, 2, 1e9) == pytest.approx(1e-3)
    assert allreduce_seconds(10**6, 4, 1e9) == pytest.approx(1.5e-3)


def test_one_thread_beating_all_threads_is_chosen_and_said() -> None:
    # The loaded 2-core case of bench/pipeline.py: one thread 4x the rate of two. Replicas of
    # one thread each (2 x 32 / 0.034 s) beat every in-process setting: the line says how to run.
    chosen, line = choose_cpu_setting(trial(0.033, 0.14, 0.1))
    assert chosen == "one thread"
    assert line.startswith("cpu: fastest: 2 replicas of one thread (estimated)")
    assert "torchrun --nproc-per-node 2" in line and "OMP_NUM_THREADS=1" in line
    assert "one thread 970, all threads 229, stale pipeline 320 samples/s" in line
    assert "modelled all-reduce of 1.0 ms per step" in line


def test_in_process_winner_when_replicas_do_not_pay() -> None:
    # The all-reduce costs more than the second core gains: replicas are said, not advised.
    slow_net = CpuTrial(0.1, 0.06, 0.05, 2, 32, 10**8, 1e9)
    chosen, line = choose_cpu_setting(slow_net)
    assert chosen == "stale pipeline"
    assert line.startswith("cpu: fastest in the trial: stale pipeline (")
    assert "2 replicas of one thread about 320" in line and "torchrun" not in line
    chosen, line = choose_cpu_setting(trial(0.1, 0.05, None))
    assert chosen == "all threads" and "stale pipeline" not in line


def test_replicas_are_not_advised_inside_a_replica_or_with_one_thread() -> None:
    _, line = choose_cpu_setting(trial(0.033, 0.14, 0.1), replicas_possible=False)
    assert line.startswith("cpu: fastest in the trial: one thread") and "replica" not in line
    _, line = choose_cpu_setting(trial(0.033, 0.14, 0.1, threads=1))
    assert "replica" not in line


def test_a_step_is_the_slope_between_two_windows_not_one_windows_mean() -> None:
    from echopipe.training.decide import _LONG_STEPS, _SHORT_STEPS, steady_step_seconds

    # Two stages of 50 ms: each drained-to-drained window pays one more stage time to fill and
    # drain. One window's mean reads that as step time (4 steps: 62.5 ms, 1.25x).
    step, fill = 0.05, 0.05

    def window(n: int) -> float:
        return fill + n * step

    got = steady_step_seconds(window(_SHORT_STEPS), window(_LONG_STEPS), stages=2)
    assert got == pytest.approx(step)
    assert window(4) / 4 == pytest.approx(1.25 * step)
    # A short window slowed by load: the slope would be negative; it is held to the fill the
    # stages can have (at most stages - 1 whole steps) ...
    long_s = window(_LONG_STEPS)
    assert steady_step_seconds(long_s, long_s, stages=2) == pytest.approx(
        long_s / (_LONG_STEPS + 1)
    )
    # ... and a long window slowed by load to no more than its own mean.
    assert steady_step_seconds(0.0, long_s, stages=2) == pytest.approx(long_s / _LONG_STEPS)
    # One stage has no fill to take away: a slope below the mean is noise.
    assert steady_step_seconds(window(_SHORT_STEPS), long_s, stages=1) == pytest.approx(
        long_s / _LONG_STEPS
    )


def test_the_trial_times_a_real_two_stage_pipeline_by_its_windows() -> None:
    from echopipe.models import build_model
    from echopipe.training.decide import _LONG_STEPS, _SHORT_STEPS, measure_step_seconds

    # The clock is read at each window's start and end, in that order; its readings make the
    # two windows T(n) = 0.02 + n * 0.03 s (a fill of two thirds of a step), whatever the
    # pipeline really took.
    ends = iter([0.0, 0.02 + _SHORT_STEPS * 0.03, 10.0, 10.02 + _LONG_STEPS * 0.03])
    model = build_model("resnet_small", num_classes=4)
    got = measure_step_seconds(
        model,
        torch.randn(4, 3, 32, 32),
        [2, len(model) - 2],
        ["cpu", "cpu"],
        clock=lambda: next(ends),
    )
    assert got == pytest.approx(0.03)
    assert next(ends, None) is None  # both windows were timed, nothing else read the clock


def test_the_trial_times_one_thread_and_restores_the_threads() -> None:
    from echopipe.models import build_model
    from echopipe.training import TrainConfig
    from echopipe.training.decide import choose_split

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = build_model("resnet_small", num_classes=4)
        decisions: list[str] = []
        timings: dict[str, float] = {}
        cpu = ["cpu", "cpu"]
        sample = torch.randn(8, 3, 32, 32)
        balance = choose_split(TrainConfig(), model, sample, 2, cpu, decisions, timings)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    (line,) = [d for d in decisions if d.startswith("cpu: fastest")]
    assert "one thread" in line and "all threads" in line and "stale pipeline" in line
    assert timings["step_s"] > 0 and timings.get("threads", 1) == 1
    assert (len(balance) == 2) == ("fastest in the trial: stale pipeline" in line or (
        "In-process, stale pipeline" in line))  # fmt: skip


def test_default_train_prints_which_setting_was_fastest(tiny_imagenet: Path) -> None:
    """The default ``echopipe train`` on two threads prints the trial's winner among one
    thread, all threads, the stale pipeline and replicas, and --echo auto's step-0 decision."""
    import echopipe

    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(Path(echopipe.__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-m", "echopipe.cli", "train", "--data", str(tiny_imagenet),
         "--batch-size", "8", "--image-size", "32", "--no-progress", "--epochs", "1",
         "--output", str(tiny_imagenet.parent / "cpu-choice-run")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "cpu: fastest" in out
    assert "replicas of one thread" in out
    assert "from step 0 (R = " in out or "echo: starts at e = 1" in out
