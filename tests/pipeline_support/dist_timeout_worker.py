"""torchrun worker: a rank whose neighbour stops taking part gets a TimeoutError, not a hang.

Usage: ``torchrun --nproc_per_node=2 dist_timeout_worker.py OUTDIR``. Both ranks build a
2-stage :class:`DistributedStalePipeline` with ``timeout_s=2``. Rank 0 trains; rank 1 never
calls ``train_step`` and only waits until rank 0 is done (a key in torchrun's store, which
outlives the process group that the timed-out receive leaves unusable). Rank 0 writes what it
raised, and after how many seconds, to ``OUTDIR/rank0.txt``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from echopipe.pipeline import DistributedStalePipeline
from pipeline_support.models import make_batches, sgd, small_cnn


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pipe = DistributedStalePipeline(
        small_cnn(0), balance=[4, 4], optimizer=sgd,
        loss_fn=torch.nn.functional.cross_entropy, timeout_s=2,
    )  # fmt: skip
    # torchrun's agent serves the store on the master port; every worker is a client of it.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    done = out / "rank0.txt"
    if rank == 0:
        t0 = time.monotonic()
        try:
            for x, y in make_batches(6):
                pipe.train_step(x, y)
            pipe.drain()
            outcome = "no error"
        except TimeoutError as exc:
            outcome = f"TimeoutError: {exc}"
        done.write_text(f"{time.monotonic() - t0:.2f}\n{outcome}\n")
        store.set("echopipe_rank0_done", "1")
    else:
        store.wait(["echopipe_rank0_done"])  # bounded by the store's 60 s timeout
    # The process group cannot be shut down cleanly after a timed-out receive.
    os._exit(0)


if __name__ == "__main__":
    main()
