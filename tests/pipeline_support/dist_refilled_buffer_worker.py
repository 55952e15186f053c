"""Two processes (torch.multiprocessing), a two-stage pipeline with ``timeout_s=10``:

0. rank 0 feeds a list instead of a tensor, alone;
1. stage 0 begins with a layer that changes its input in place, and gets a new tensor per
   minibatch: the pipeline's own change must not be taken for the caller's;
2. a loop that refills one input (or target) buffer in place per minibatch, as a plain loop
   may, while stage 0 still holds the previous minibatch; then a ``drain()`` after the error.

Usage: ``python dist_refilled_buffer_worker.py OUTDIR PORT REUSED`` (REUSED: ``input`` or
``target``). Rank 0 writes what each part raised (the ``PipelineError``'s stage after a bar) to
``OUTDIR/rank0.txt``; rank 1, left waiting for rank 0, ends when rank 0 has written (an event,
not a time).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline_support.models import make_batches, sgd, small_cnn
from pipeline_support.spawned_ranks import join_gloo, spawn_two_ranks


class _NormalizeInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sub_(0.5).mul_(2.0)


def _outcome(exc: Exception | None) -> str:
    if exc is None:
        return "no error"
    stage = getattr(exc, "stage", None)
    return f"{type(exc).__name__}: {exc}" + ("" if stage is None else f" | stage {stage}")


def run(rank: int, out: Path, port: int, rank0_done: Any, *, reused: str) -> None:
    from echopipe.pipeline import DistributedStalePipeline

    join_gloo(rank, port, timeout_s=60)
    loss_fn = torch.nn.functional.cross_entropy
    lines = []
    model = nn.Sequential(_NormalizeInPlace(), *small_cnn(0))
    pipe = DistributedStalePipeline(
        model, balance=[5, 4], optimizer=sgd, loss_fn=loss_fn, timeout_s=10
    )
    failure: Exception | None = None
    if rank == 0:  # refused before any message: rank 1 does not take part
        x, y = make_batches(1)[0]
        try:
            pipe.train_step(x.tolist(), y)  # type: ignore[arg-type]
        except Exception as exc:
            failure = exc
        lines.append(_outcome(failure))
        failure = None
    try:
        for x, y in make_batches(4):
            pipe.train_step(x, y)
        pipe.drain()
    except Exception as exc:
        failure = exc
    lines.append(_outcome(failure))

    pipe = DistributedStalePipeline(
        small_cnn(0), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn, timeout_s=10
    )
    batches = make_batches(5)
    x_buffer, y_buffer = batches[0][0].clone(), batches[0][1].clone()
    failure = None
    try:
        for x, y in batches:
            if reused == "input":
                x = x_buffer.copy_(x)
            else:
                y = y_buffer.copy_(y)
            pipe.train_step(x, y)
        pipe.drain()
    except Exception as exc:
        failure = exc
    lines.append(_outcome(failure))
    if rank == 0 and failure is not None:
        try:
            pipe.drain()  # the caller tries again
            lines.append("no error")
        except Exception as exc:
            lines.append(_outcome(exc))
    if rank == 0:
        (out / "rank0.txt").write_text("\n".join(lines) + "\n")
        rank0_done.set()
    else:
        rank0_done.wait(timeout=120)  # a guard against a hang, not a bound on speed
    os._exit(0)  # a rank left waiting by the other cannot shut its process group down


def main() -> None:
    spawn_two_ranks(functools.partial(run, reused=sys.argv[3]), with_event=True)


if __name__ == "__main__":
    main()
