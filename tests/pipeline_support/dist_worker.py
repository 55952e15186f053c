"""torchrun worker for the 2-process Gloo tests of DistributedStalePipeline.

Usage: ``torchrun --nproc_per_node=2 dist_worker.py OUTDIR``. Runs two scenarios in one
process group and writes each rank's results to OUTDIR for the test to compare against the
single-process engine:

1. pipeline: 2 stages (one per rank), 12 minibatches with a hybrid switch at 8, evaluate,
   checkpoint, continue 3 minibatches; a fresh pipeline loads the checkpoint and continues the
   same 3 minibatches.
2. dp: 1 stage, 2 data-parallel replicas, each on half of every minibatch.
3. the StalePipeline API: ``balance="auto"``, ``run_epoch``, ``accuracy``, ``evaluate`` in
   chunks.
4. hook: a ``grad_hook`` clipping the gradients and ``ReduceLROnPlateau`` stepped on the last
   stage's metric (rank 0 passes none), in the pipeline and over 2 replicas.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from echopipe.pipeline import DistributedStalePipeline, HybridSchedule, init_distributed
from pipeline_support import models
from pipeline_support.models import make_batches, sgd, small_cnn


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    # "auto": Gloo on this CPU-only machine (and wherever GPUs are fewer than local ranks).
    backend, device = init_distributed("auto", timeout_s=120)
    assert (backend, device.type) == ("gloo", "cpu") or torch.cuda.device_count() >= 2
    rank = dist.get_rank()
    batches = make_batches(15)
    loss_fn = torch.nn.functional.cross_entropy

    def build(seed: int) -> DistributedStalePipeline:
        return DistributedStalePipeline(
            small_cnn(seed),
            balance=[4, 4],
            optimizer=sgd,
            loss_fn=loss_fn,
            hybrid=HybridSchedule(8),
        )

    pipe = build(0)
    assert pipe.staleness() == [2, 0]
    losses = []
    for x, y in batches[:12]:
        result = pipe.train_step(x, y) if pipe.is_first else pipe.train_step()
        losses.extend((r.index, r.value) for r in result.finished)
    losses.extend((r.index, r.value) for r in pipe.drain())
    assert pipe.staleness() == [0, 0] and not pipe.pipelined
    logits = pipe.evaluate(batches[0][0] if pipe.is_first else None)
    pipe.save_checkpoint(out / "ck")
    stage_after_12 = {k: v.clone() for k, v in pipe.stage.state_dict().items()}
    for x, y in batches[12:]:
        losses.extend((r.index, r.value) for r in pipe.train_step(x, y).finished)
    losses.extend((r.index, r.value) for r in pipe.drain())
    resumed = build(99)
    resumed.load_checkpoint(out / "ck")
    for x, y in batches[12:]:
        resumed.train_step(x, y)
    resumed.drain()
    torch.save(
        {
            "stage_index": pipe.stage_index,
            "after_12": stage_after_12,
            "final": pipe.stage.state_dict(),
            "resumed": resumed.stage.state_dict(),
            "losses": losses,
            "logits": logits,
            "updates": pipe.steps_applied,
            "updates_per_stage": pipe.updates_per_stage,
            "samples_seen": pipe.samples_seen,
        },
        out / f"pipeline_rank{rank}.pt",
    )

    dp = DistributedStalePipeline(small_cnn(0), balance=[8], optimizer=sgd, loss_fn=loss_fn)
    assert dp.num_replicas == 2 and dp.staleness() == [0]
    for x, y in batches[:6]:
        half = slice(3 * rank, 3 * rank + 3)
        dp.train_step(x[half], y[half])
    dp.drain()
    torch.save({"final": dp.stage.state_dict()}, out / f"dp_rank{rank}.pt")

    # 3. The StalePipeline API: balance="auto" agreed by both ranks, run_epoch over DALI-style
    # dict batches with (N, 1) int32 labels (stage 0 reads them, rank 1 passes None), accuracy.
    auto = DistributedStalePipeline(
        small_cnn(0), balance="auto", num_stages=2, sample_input=batches[0][0],
        optimizer=sgd, loss_fn=loss_fn,
    )  # fmt: skip
    epoch = DistributedStalePipeline(small_cnn(0), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn)
    loader = [[{"data": x, "label": y.reshape(-1, 1).int()}] for x, y in batches[:7]]
    result = epoch.run_epoch(loader if epoch.is_first else None, drain=True)
    accuracy = epoch.accuracy(
        batches[0][0] if epoch.is_first else None, batches[0][1] if epoch.is_first else None,
        batch_size=4,
    )  # fmt: skip
    chunked = epoch.evaluate(batches[0][0] if epoch.is_first else None, batch_size=4)
    torch.save(
        {
            "auto_balance": auto.balance,
            "chunked_logits": chunked,
            "steps": result.steps,
            "samples": result.samples,
            "losses": result.losses,
            "final": epoch.stage.state_dict(),
            "accuracy": accuracy,
            "optimizers": [o is not None for o in epoch.optimizers],
        },
        out / f"api_rank{rank}.pt",
    )
    hooked(out, rank, batches)
    dist.barrier()
    dist.destroy_process_group()


def hooked(out: Path, rank: int, batches: list) -> None:
    """Scenario 4 (see the module docstring)."""
    loss_fn = torch.nn.functional.cross_entropy
    norms: list[tuple[int, float]] = []
    pipe = DistributedStalePipeline(
        small_cnn(0), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn, scheduler=models.plateau,
        grad_hook=models.clip_hook(norms),
    )  # fmt: skip
    loader = batches[:5] if pipe.is_first else None
    refused = []
    try:  # an epoch's end would step the plateau scheduler without a metric
        pipe.run_epoch(loader)
    except TypeError as exc:
        refused.append(str(exc))
    for metric in models.PLATEAU_METRICS:
        pipe.run_epoch(loader, step_schedulers=False)
        pipe.step_schedulers(metric if pipe.is_last else None)
    try:  # only the first stage has one
        pipe.step_schedulers(1.0 if pipe.is_first else None)
    except ValueError as exc:
        refused.append(str(exc))
    optimizer = pipe.optimizers[pipe.stage_index]
    assert optimizer is not None
    dp_norms: list[tuple[int, float]] = []
    dp = DistributedStalePipeline(
        small_cnn(0), balance=[8], optimizer=sgd, loss_fn=loss_fn,
        grad_hook=models.clip_hook(dp_norms),
    )  # fmt: skip
    for x, y in batches[:6]:
        half = slice(3 * rank, 3 * rank + 3)
        dp.train_step(x[half], y[half])
    dp.drain()
    torch.save(
        {
            "final": pipe.stage.state_dict(), "lr": optimizer.param_groups[0]["lr"],
            "norms": norms, "refused": refused, "dp_final": dp.stage.state_dict(),
            "dp_norms": dp_norms,
        },
        out / f"hook_rank{rank}.pt",
    )  # fmt: skip


if __name__ == "__main__":
    main()
