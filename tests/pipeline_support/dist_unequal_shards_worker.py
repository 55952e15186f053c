"""torchrun worker: DDP training over echo pipelines whose shards differ by one file.

Usage: ``torchrun --nproc_per_node=2 dist_unequal_shards_worker.py JPEG_DIR OUTDIR``. Each rank
reads shard ``rank`` of the folder's JPEGs (21 files: shards of 10 and 11) with the reader of
DALI's ResNet-50 example (``random_shuffle=True, pad_last_batch=True, name="Reader"``), echoes
them twice, and trains a small model wrapped in ``DistributedDataParallel`` for two epochs,
once under ``DALIClassificationIterator`` (the reader with ``stick_to_shard=True``, which DALI's
PARTIAL policy needs on shards of unequal size) and once under ``EchoIterator`` (the example's
reader as it is: the shards move every epoch). Every step's gradients are all-reduced, so ranks
that take different numbers of steps fail (Gloo's timeout, or a closed peer) instead of
finishing. Each rank writes its steps and the files it trained on to
``OUTDIR/rank<r>_<iterator>.json``.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from nvidia.dali import fn
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy
from torch.nn.parallel import DistributedDataParallel

import echopipe.dali as edali

BATCH, ECHO = 4, 2


@edali.echo_pipeline_def(num_threads=1, device_id=None, echo_factor=ECHO)
def train_pipe(files, shard_id, num_shards, stick_to_shard):
    jpegs, labels = fn.readers.file(
        files=files, labels=list(range(len(files))), shard_id=shard_id, num_shards=num_shards,
        random_shuffle=True, pad_last_batch=True, stick_to_shard=stick_to_shard, name="Reader",
    )  # fmt: skip
    images = fn.decoders.image(jpegs, device="cpu")
    images, labels = edali.echo(images, labels)
    return images, labels


def train(loader, model: torch.nn.Module) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, seen = [], []
    for _epoch in range(2):
        count = 0
        for data in loader:
            x = data[0]["data"].float().flatten(1) / 255.0
            y = data[0]["label"].reshape(-1).long()
            # An epoch's last batch may be empty on the smaller shard (as in plain DALI).
            loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
            optimizer.zero_grad()
            (loss / max(1, len(y))).backward()  # DDP all-reduces the gradients here
            optimizer.step()
            count += 1
            seen.append(y.tolist())
        steps.append(count)
    return {"steps": steps, "len": len(loader), "seen": seen}


def main() -> None:
    jpeg_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    files = sorted(str(p) for p in jpeg_dir.glob("*.jpg"))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8 * 8 * 3, len(files)))
    for name, stick in (("dali", True), ("echo", False)):
        pipe = train_pipe(files, rank, world, stick, batch_size=BATCH, seed=12 + rank)
        pipe.build()
        kind = DALIClassificationIterator if name == "dali" else edali.EchoIterator
        loader = kind(
            pipe, reader_name="Reader", last_batch_policy=LastBatchPolicy.PARTIAL,
            auto_reset=True,
        )  # fmt: skip
        result = train(loader, model)
        pipe.close()
        (out / f"rank{rank}_{name}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
