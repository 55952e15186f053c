"""torchrun worker: DistributedStalePipeline trained under the caller's bfloat16 autocast.

Usage: ``torchrun --nproc_per_node=2 dist_amp_worker.py OUTDIR``. Two stages with recompute;
every ``train_step`` runs inside ``torch.autocast("cpu", dtype=torch.bfloat16)`` and the final
``drain()`` outside it, so the recompute passes of the minibatches still in flight run in a call
without autocast. Each rank writes its stage's weights to OUTDIR/stage<k>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from echopipe.pipeline import DistributedStalePipeline, init_distributed
from pipeline_support.amp_programs import BALANCE, amp_batches, amp_mlp, amp_sgd, train_under_bf16


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    init_distributed("auto", timeout_s=120)
    pipe = DistributedStalePipeline(
        amp_mlp(),
        balance=BALANCE,
        optimizer=amp_sgd,
        loss_fn=torch.nn.functional.cross_entropy,
        recompute=True,
        timeout_s=120,
    )
    train_under_bf16(pipe, amp_batches(), first=pipe.is_first)
    torch.save(pipe.stage.state_dict(), out / f"stage{pipe.stage_index}.pt")
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
