"""A Lightning program that stops mid-epoch with a checkpoint and resumes it, under DDP with
an EchoLoader train dataloader (for tests/test_echo_loader_lightning_ddp.py).

``python echo_loader_lightning_ddp_program.py MODE OUT``: a real ``lightning.Trainer``
(``accelerator="cpu", devices=2``, ``strategy="ddp"`` over gloo) fits a module whose
``train_dataloader()`` wraps ``DataLoader(Ids(), batch_size=6, sampler=DistributedSampler)``
(45 samples, 23 a rank) in ``EchoLoader(echo_factor=2)``: 8 steps an epoch. MODE ``save``
stops at ``max_steps=STOP`` (mid-epoch 0) with a ``ModelCheckpoint`` at that step
(``OUT/mid.ckpt``); MODE ``resume`` fits 2 epochs from it. Rank r writes
``OUT/MODE.rank<r>.json``: the steps per epoch and the sample ids each epoch trained on.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections import defaultdict
from pathlib import Path

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from echopipe.torch import EchoLoader

SAMPLES, BATCH, ECHO, SEED, STOP = 45, 6, 2.0, 3, 5


class Ids(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), i % 3


class Recorded(lightning.LightningModule):
    """Records what each epoch trained on; builds its sharded EchoLoader itself."""

    def __init__(self, out: str, mode: str) -> None:
        super().__init__()
        self.out, self.mode = out, mode
        self.layer = nn.Linear(4, 3)
        self.steps: dict[int, int] = defaultdict(int)
        self.seen: dict[int, list[int]] = defaultdict(list)
        self.loader: EchoLoader | None = None

    def train_dataloader(self) -> EchoLoader:
        data = DataLoader(Ids(), batch_size=BATCH, sampler=DistributedSampler(Ids(), seed=SEED))
        self.loader = EchoLoader(data, echo_factor=ECHO)
        return self.loader

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.steps[self.current_epoch] += 1
        self.seen[self.current_epoch] += [int(v) for v in x[:, 0]]
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        report = {"steps": self.steps, "seen": self.seen, "global_step": self.trainer.global_step}
        out = Path(self.out) / f"{self.mode}.rank{self.trainer.global_rank}.json"
        out.write_text(json.dumps(report))
        if self.loader is not None:
            self.loader.close()


def main(mode: str, out: str) -> None:
    torch.set_num_threads(1)
    ddp = DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=60))
    kw: dict = {"max_steps": STOP} if mode == "save" else {"max_epochs": 2}
    saving = ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=STOP,
                             save_top_k=-1, enable_version_counter=False)  # fmt: skip
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=ddp, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        enable_checkpointing=mode == "save", callbacks=[saving] if mode == "save" else [], **kw,
    )  # fmt: skip
    ckpt = str(Path(out) / "mid.ckpt") if mode == "resume" else None
    trainer.fit(Recorded(out, mode), ckpt_path=ckpt)


if __name__ == "__main__":
    main(*sys.argv[1:3])
