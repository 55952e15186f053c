"""Which way to spend a CPU machine's cores on training, from rates measured in one trial.

On a few shared cores one process with every intra-op thread can be the slowest setting
(``bench/pipeline.py --quick`` on 2 loaded cores: 973 samples/s with one thread, 226 with two),
so ``--stages auto`` times one stage with one thread, one stage with all threads and the stale
pipeline, and estimates data-parallel replicas (``torchrun --nproc-per-node N``, one thread
each) as ``N`` times the one-thread rate, each replica's step lengthened by an all-reduce of the
gradients. The all-reduce is modelled, not run: a ring all-reduce moves ``2 (N - 1) / N`` times
the gradient bytes through each rank, here at the measured memory-copy rate, which is a lower
bound on its cost (gloo over loopback is slower than a copy), so the estimate is optimistic.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CpuTrial", "allreduce_seconds", "choose_cpu_setting"]


@dataclass(frozen=True)
class CpuTrial:
    """Seconds per training step of one batch, measured in one trial on the CPU.

    Attributes:
        one_thread_s: one stage, ``torch.set_num_threads(1)``.
        all_threads_s: one stage, all ``threads``.
        pipeline_s: the 2-stage stale pipeline (``None`` when not timed).
        threads: the intra-op threads the process has (the replica count considered).
        batch_size: samples per step.
        grad_bytes: bytes of the gradients a replica all-reduces each step.
        copy_bytes_per_s: measured memory-copy rate, for the all-reduce model.
    """

    one_thread_s: float
    all_threads_s: float
    pipeline_s: float | None
    threads: int
    batch_size: int
    grad_bytes: int
    copy_bytes_per_s: float


def allreduce_seconds(grad_bytes: int, replicas: int, copy_bytes_per_s: float) -> float:
    """Modelled ring all-reduce per step: ``2 (N - 1) / N`` of the gradient bytes at the copy
    rate (0 for one replica)."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) / replicas * grad_bytes / copy_bytes_per_s


def choose_cpu_setting(trial: CpuTrial, replicas_possible: bool = True) -> tuple[str, str]:
    """The fastest in-process setting (``"one thread"``, ``"all threads"`` or ``"stale
    pipeline"``) and the decision's line, which also says when replicas would beat all three.

    ``replicas_possible`` is false where the run already is one of several replicas.
    """
    rates = {
        "one thread": trial.batch_size / trial.one_thread_s,
        "all threads": trial.batch_size / trial.all_threads_s,
    }
    if trial.pipeline_s is not None:
        rates["stale pipeline"] = trial.batch_size / trial.pipeline_s
    chosen = max(rates, key=lambda k: rates[k])
    n = trial.threads
    ar = allreduce_seconds(trial.grad_bytes, n, trial.copy_bytes_per_s)
    parts = [f"{k} {v:.0f}" for k, v in rates.items()]
    line = f"cpu: fastest in the trial: {chosen} ({', '.join(parts)} samples/s"
    if replicas_possible and n > 1:
        replica_rate = n * trial.batch_size / (trial.one_thread_s + ar)
        parts_r = (
            f"; {n} replicas of one thread about {replica_rate:.0f}, estimated as {n}x the "
            f"one-thread rate with a modelled all-reduce of {1000 * ar:.1f} ms per step"
        )
        if replica_rate > rates[chosen]:
            return chosen, (
                f"cpu: fastest: {n} replicas of one thread (estimated); rerun with torchrun "
                f"--nproc-per-node {n} and OMP_NUM_THREADS=1 (the global batch becomes "
                f"{n}x{trial.batch_size}). In-process, {chosen} was fastest "
                f"({', '.join(parts)} samples/s{parts_r})"
            )
        line += parts_r
    return chosen, line + ")"
