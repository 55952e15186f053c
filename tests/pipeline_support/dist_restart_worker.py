"""Worker for test_pipeline_distributed: two Gloo ranks of a stale pipeline joined with the
public ``init_distributed``; on the job's first attempt rank 1 exits after step 2, torchrun
restarts both, and the second attempt must join and train (no resume: a fresh start)."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from echopipe.pipeline import DistributedStalePipeline, init_distributed

torch.set_num_threads(1)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
init_distributed("gloo", timeout_s=60)
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
pipe = DistributedStalePipeline(
    model, balance=[2, 1], optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    loss_fn=nn.functional.cross_entropy, timeout_s=60,
)  # fmt: skip
for step in range(6):
    pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    if attempt == "0" and rank == 1 and step == 2:
        os._exit(17)  # a rank lost mid-run
pipe.drain()
Path(sys.argv[1], f"attempt{attempt}_rank{rank}").write_text(str(pipe.steps_applied))
pipe.close()
dist.destroy_process_group()
