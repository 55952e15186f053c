"""A Lightning program that trains over an echoed DALI pipeline whose shards differ in size
(for tests/test_dali_lightning_ddp.py).

``python dali_lightning_ddp_program.py ROOT OUT ITERATOR``: a real ``lightning.Trainer``
(``accelerator="cpu", devices=2``, ``strategy="ddp"`` over gloo, ``max_epochs=2``) fits a
LightningModule shaped like a user's: ``setup()`` builds the training pipeline of
``ROOT/train`` (the reader padded, sharded by ``trainer.global_rank`` over
``trainer.world_size``, echoed twice), ``train_dataloader()`` wraps it in ``EchoIterator``
(ITERATOR ``echo``; the reader as DALI's ResNet-50 example has it, its shards moving every
epoch) or in DALI's ``DALIClassificationIterator`` (``dali``; ``stick_to_shard=True``, which
DALI's PARTIAL needs on shards of unequal size; ``dali_size``: an older DALI program's
``size=pipe.epoch_size("Reader") // world_size`` instead of ``reader_name``, moving shards).
Every JPEG is one flat grey, unique per file
(:func:`dali_lightning_program.make_jpegs`), so each image names its file. Rank r writes
``OUT/rank<r>.json``: ``len()`` per epoch as Lightning read it, the steps it took per epoch,
``global_step`` and, per epoch, ``[grey, label]`` of every sample it trained on.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections import defaultdict
from pathlib import Path

import lightning
import nvidia.dali.fn as fn
import nvidia.dali.types as types
import torch
from lightning.pytorch.strategies import DDPStrategy
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy
from torch import nn

import echopipe.dali as edali

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline_support.dali_lightning_program import CLASSES, SIDE, identify

BATCH, ECHO = 4, 2


@edali.echo_pipeline_def(exec_dynamic=True, echo_factor=ECHO)
def train_pipeline(data_dir: str, shard_id: int, num_shards: int, stick_to_shard: bool):
    jpegs, labels = fn.readers.file(
        file_root=data_dir, shard_id=shard_id, num_shards=num_shards, random_shuffle=True,
        pad_last_batch=True, stick_to_shard=stick_to_shard, name="Reader",
    )  # fmt: skip
    images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
    images = fn.resize(images, resize_x=SIDE, resize_y=SIDE)
    images, labels = edali.echo(images, labels)
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW")
    return images, labels


class ShardedFit(lightning.LightningModule):
    """Builds its pipeline in ``setup()`` and records what each epoch trained on."""

    def __init__(self, root: str, out: str, iterator: str) -> None:
        super().__init__()
        self.root, self.out, self.iterator = root, out, iterator
        self.layer = nn.Linear(3 * SIDE * SIDE, CLASSES)
        self.pipe = None
        self.lengths: list[int | float] = []
        self.steps: dict[int, int] = defaultdict(int)
        self.seen: dict[int, list[list[int]]] = defaultdict(list)

    def setup(self, stage: str) -> None:
        self.pipe = train_pipeline(
            batch_size=BATCH, num_threads=1, device_id=None, seed=7 + self.trainer.global_rank,
            data_dir=str(Path(self.root) / "train"), shard_id=self.trainer.global_rank,
            num_shards=self.trainer.world_size, stick_to_shard=self.iterator == "dali",
        )  # fmt: skip

    def train_dataloader(self):
        if self.iterator == "echo":
            return edali.EchoIterator(self.pipe, reader_name="Reader", auto_reset=True,
                                      last_batch_policy=LastBatchPolicy.PARTIAL)  # fmt: skip
        if self.iterator == "dali_size":  # an older DALI program: its own size, no reader_name
            self.pipe.build()
            size = self.pipe.epoch_size("Reader") // self.trainer.world_size
            policy = LastBatchPolicy.PARTIAL
            return DALIClassificationIterator(self.pipe, size=size, auto_reset=True,
                                              last_batch_policy=policy)  # fmt: skip
        return DALIClassificationIterator(self.pipe, reader_name="Reader", auto_reset=True,
                                          last_batch_policy=LastBatchPolicy.PARTIAL)  # fmt: skip

    def on_train_epoch_start(self) -> None:
        self.lengths.append(self.trainer.num_training_batches)

    def training_step(self, batch, batch_idx):
        x, y = batch[0]["data"], batch[0]["label"].reshape(-1).long()
        self.steps[self.current_epoch] += 1
        if len(y):  # (the smaller shard's last step may be empty)
            self.seen[self.current_epoch] += list(zip(identify(x), y.tolist(), strict=True))
        # The smaller shard's last step may be empty (as in plain DALI): a sum over no samples
        # is 0 with zero gradients, which DDP's all-reduce takes like any other.
        loss = nn.functional.cross_entropy(self.layer(x.flatten(1)), y, reduction="sum")
        return loss / max(1, len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        report = {"lengths": self.lengths, "steps": self.steps, "seen": self.seen,
                  "global_step": self.trainer.global_step}  # fmt: skip
        out = Path(self.out) / f"rank{self.trainer.global_rank}.json"
        out.write_text(json.dumps(report))
        self.pipe.close()


def main(root: str, out: str, iterator: str) -> None:
    torch.set_num_threads(1)
    ddp = DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=60))
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=ddp, max_epochs=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(ShardedFit(root, out, iterator))


if __name__ == "__main__":
    main(*sys.argv[1:4])
