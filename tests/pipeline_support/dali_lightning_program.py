"""A Lightning program whose train_dataloader() is an echoed DALI pipeline (for
tests/test_dali_lightning.py).

The shape users write: one ``@echo_pipeline_def`` function with a padded, sharded
``fn.readers.file(..., shard_id=trainer.global_rank, num_shards=trainer.world_size,
name="Reader")`` that echoes only when training; ``train_dataloader()`` wraps it in DALI's
``DALIClassificationIterator`` or in ``EchoIterator``, ``val_dataloader()`` the same function
without the echo point in DALI's iterator. Every JPEG is one flat grey, unique per file, so each
delivered image names its file by content.

Run as a script for what needs its own processes: ``python dali_lightning_program.py MODE ROOT
OUT ITERATOR``, MODE ``ddp`` (two processes, gloo, rank r writes ``OUT.r``), ``error`` or
``interrupt`` (training_step raises at epoch 0, batch 2; OUT gets the exception's name).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import lightning
import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.types as types
import torch
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy
from torch import nn

import echopipe.dali as edali

BATCH, CLASSES, SIDE = 4, 3, 8


def make_jpegs(root: Path, train: int = 24, val: int = 6) -> dict[int, tuple[str, int]]:
    """train/ and val/ with one folder per class; file k is grey 8 k + 4: ``{grey: (split,
    class)}``."""
    from PIL import Image

    files: dict[int, tuple[str, int]] = {}
    k = 0
    for split, count in (("train", train), ("val", val)):
        for j in range(count):
            folder = root / split / f"c{j % CLASSES}"
            folder.mkdir(parents=True, exist_ok=True)
            grey = 8 * k + 4
            image = np.full((12, 12, 3), grey, np.uint8)
            Image.fromarray(image).save(folder / f"{j:03d}.jpg", quality=95)
            files[grey] = (split, j % CLASSES)
            k += 1
    return files


def greys(files: dict[int, tuple[str, int]], split: str) -> set[int]:
    """The grey levels (file ids) of ``split``'s files among :func:`make_jpegs`' ``files``."""
    return {g for g, (s, _) in files.items() if s == split}


@edali.echo_pipeline_def(exec_dynamic=True, echo_factor=2)
def create_pipeline(data_dir: str, shard_id: int, num_shards: int, is_training: bool = True):
    jpegs, labels = fn.readers.file(
        file_root=data_dir, shard_id=shard_id, num_shards=num_shards,
        random_shuffle=is_training, pad_last_batch=True, name="Reader",
    )  # fmt: skip
    images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
    images = fn.resize(images, resize_x=SIDE, resize_y=SIDE)
    if is_training:
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        images, labels = edali.echo(images, labels)
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW")
    return images, labels


def identify(images: torch.Tensor) -> list[int]:
    """The grey level (the file) of each flat CHW image."""
    greys = images[:, 0].mean(dim=(1, 2))
    assert float((images[:, 0].amax(dim=(1, 2)) - images[:, 0].amin(dim=(1, 2))).max()) < 3
    return [8 * round((float(g) - 4) / 8) + 4 for g in greys]


class EchoedFit(lightning.LightningModule):
    """Records each training batch as ``(epoch, batch_idx, [(grey, label), ...])`` and each
    validation epoch's greys; ``stop=(epoch, batch_idx, exception)`` raises there."""

    def __init__(self, root: str, iterator: str = "echo", stop=None, **pipe_kw) -> None:
        super().__init__()
        self.root, self.iterator, self.stop, self.pipe_kw = root, iterator, stop, pipe_kw
        self.layer = nn.Linear(3 * SIDE * SIDE, CLASSES)
        self.batches: list[tuple[int, int, list[tuple[int, int]]]] = []
        self.validated: dict[int, Counter] = defaultdict(Counter)
        self.lengths: list[int | float] = []
        self.pipes: list = []

    def _pipe(self, split: str, is_training: bool):
        pipe = create_pipeline(
            batch_size=BATCH, num_threads=1, device_id=None, seed=7 + self.global_rank,
            data_dir=os.path.join(self.root, split), shard_id=self.global_rank,
            num_shards=self.trainer.world_size, is_training=is_training, **self.pipe_kw,
        )  # fmt: skip
        self.pipes.append(pipe)
        return pipe

    def train_dataloader(self):
        cls = edali.EchoIterator if self.iterator == "echo" else DALIClassificationIterator
        return cls(self._pipe("train", True), reader_name="Reader", auto_reset=True,
                   last_batch_policy=LastBatchPolicy.PARTIAL)  # fmt: skip

    def val_dataloader(self):
        pipe = self._pipe("val", False)  # no echo point: a plain DALI pipeline
        pipe.build()
        return DALIClassificationIterator(pipe, reader_name="Reader", auto_reset=True,
                                          last_batch_policy=LastBatchPolicy.PARTIAL)  # fmt: skip

    def on_train_epoch_start(self) -> None:
        self.lengths.append(self.trainer.num_training_batches)

    def training_step(self, batch, batch_idx):
        x, y = batch[0]["data"], batch[0]["label"].reshape(-1).long()
        samples = list(zip(identify(x), y.tolist(), strict=True))
        self.batches.append((self.current_epoch, batch_idx, samples))
        if self.stop is not None and self.stop[:2] == (self.current_epoch, batch_idx):
            raise self.stop[2]
        return nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

    def validation_step(self, batch, batch_idx) -> None:
        self.validated[self.current_epoch].update(identify(batch[0]["data"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def close(self) -> None:
        for pipe in self.pipes:
            if isinstance(pipe, edali.EchoPipeline):
                pipe.close()


class CloseOnException(lightning.Callback):
    """Closes the module's pipelines when fit fails (Lightning's teardown runs after it)."""

    def on_exception(self, trainer, pl_module, exception) -> None:
        pl_module.close()


def trainer(**kw) -> lightning.Trainer:
    settings = dict(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, num_sanity_val_steps=0)  # fmt: skip
    return lightning.Trainer(**{**settings, **kw})


class _Report(lightning.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        with open(f"{self.out}.{trainer.global_rank}", "w") as f:
            json.dump({"lengths": pl_module.lengths, "batches": pl_module.batches,
                       "validated": {e: sorted(c.elements()) for e, c in
                                     pl_module.validated.items()}}, f)  # fmt: skip


def main(mode: str, root: str, out: str, iterator: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    if mode == "ddp":
        ddp = DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=60))
        module = EchoedFit(root, iterator)
        trainer(devices=2, strategy=ddp, callbacks=[_Report(out)]).fit(module)
        module.close()
        return
    error = KeyboardInterrupt() if mode == "interrupt" else RuntimeError("stop at batch 2")
    module = EchoedFit(root, iterator, stop=(0, 2, error))
    try:
        trainer().fit(module)
    except BaseException as exc:  # Lightning turns the KeyboardInterrupt into SystemExit
        Path(out).write_text(type(exc).__name__)
        raise


if __name__ == "__main__":
    main(*sys.argv[1:5])
