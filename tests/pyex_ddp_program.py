"""A program of the shape of pytorch/examples ``imagenet/main.py`` with ``--multiprocessing-
distributed`` (``mp.spawn`` of the ranks, gloo, ``DistributedDataParallel``), written here (not
copied; torchvision has no build for the CPU torch used here) with the two-line EchoLoader wrap
of the train loader. Run by ``tests/test_echo_loader_pyex_ddp.py``.

Its flags are the example's (``-j/--workers``, ``--epochs``, ``-b``, ``--resume``,
``-e/--evaluate``, ``--world-size``, ``--rank``, ``--dist-url``, ``--dist-backend``,
``--multiprocessing-distributed``, ``--dummy``) plus, for the test: ``--nprocs`` (the ranks per
node, the example's GPU count), ``--dummy-size``, ``--echo-factor`` (0: no EchoLoader),
``--save-loader-state``/``--load-loader-state`` (the EchoLoader state in the checkpoint dict),
``--val-workers`` (the validation loaders' workers, default ``--workers``: fewer keep the
test's runs short), ``--read-delay`` (seconds per sample, to keep a job busy for a signal),
``--dist-timeout`` (gloo's, so that ranks that take different numbers of steps fail instead
of waiting 30 min),
``--record DIR`` (per rank and epoch: the ids of the samples each step trained on, with their
targets, ``len(train_loader)`` and the steps run; the same for validation).
It prints ``running RANK`` once each rank has run a training step.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from echopipe.torch import EchoLoader

SIDE = 8  # images are 3 x SIDE x SIDE


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="imagenet/main.py-shaped training with EchoLoader")
    p.add_argument("data", nargs="?", default="imagenet")
    p.add_argument("-j", "--workers", default=2, type=int)
    p.add_argument("--epochs", default=2, type=int)
    p.add_argument("--start-epoch", default=0, type=int)
    p.add_argument("-b", "--batch-size", default=4, type=int)
    p.add_argument("--lr", default=0.1, type=float)
    p.add_argument("-p", "--print-freq", default=1, type=int)
    p.add_argument("--resume", default="", type=str)
    p.add_argument("-e", "--evaluate", action="store_true")
    p.add_argument("--world-size", default=-1, type=int)
    p.add_argument("--rank", default=-1, type=int)
    p.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
    p.add_argument("--dist-backend", default="gloo", type=str)
    p.add_argument("--multiprocessing-distributed", action="store_true")
    p.add_argument("--dummy", action="store_true")
    p.add_argument("--nprocs", default=2, type=int)
    p.add_argument("--dummy-size", default=53, type=int)
    p.add_argument("--echo-factor", default=2.0, type=float)
    p.add_argument("--save-loader-state", action="store_true")
    p.add_argument("--load-loader-state", action="store_true")
    p.add_argument("--read-delay", default=0.0, type=float)
    p.add_argument("--dist-timeout", default=60.0, type=float)
    p.add_argument("--record", default="", type=str)
    p.add_argument("--val-workers", default=-1, type=int)  # -1: --workers
    p.add_argument("--checkpoint", default="checkpoint.pth.tar", type=str)
    return p


class FakeImages(Dataset):
    """FakeData's shape: image i drawn from a generator seeded by i, its target too."""

    def __init__(self, size: int, classes: int, delay: float) -> None:
        self.size, self.classes, self.delay = size, classes, delay

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.delay:
            time.sleep(self.delay)
        return self.load(i)

    def load(self, i: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(1000 + i)
        image = torch.rand(3, SIDE, SIDE, generator=gen)
        return image, int(torch.randint(self.classes, (1,), generator=gen))


class JpegFolder(Dataset):
    """ImageFolder's shape: ``root/<class>/<file>.JPEG``, decoded with PIL, resized."""

    def __init__(self, root: Path, delay: float) -> None:
        self.classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        self.samples = [(f, c) for c, name in enumerate(self.classes)
                        for f in sorted((root / name).iterdir())]  # fmt: skip
        self.delay = delay

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.delay:
            time.sleep(self.delay)
        return self.load(i)

    def load(self, i: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[i]
        with Image.open(path) as img:
            rgb = np.asarray(img.convert("RGB").resize((SIDE, SIDE)), dtype=np.float32)
        return torch.from_numpy(rgb / 255.0).permute(2, 0, 1).contiguous(), target


def key(image: torch.Tensor) -> str:
    return hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=8).hexdigest()


class Recorder(nn.Module):
    """The model's first layer: notes the keys of the images each step sees."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.keys.append([key(row) for row in x.detach()])
        return x


class Targets(nn.CrossEntropyLoss):
    """The loss, noting the targets of each step."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[int]] = []

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.batches.append(target.tolist())
        return super().forward(output, target)


def main() -> None:
    args = arguments().parse_args()
    args.distributed = args.world_size > 1 or args.multiprocessing_distributed
    if args.multiprocessing_distributed:
        args.world_size = args.nprocs * args.world_size
        mp.spawn(main_worker, nprocs=args.nprocs, args=(args.nprocs, args))
    else:
        main_worker(0, 1, args)


def main_worker(gpu: int, nprocs: int, args: argparse.Namespace) -> None:
    device = torch.device("cpu")
    if args.distributed:
        args.rank = args.rank * nprocs + gpu
        dist.init_process_group(
            backend=args.dist_backend, init_method=args.dist_url, world_size=args.world_size,
            rank=args.rank, timeout=datetime.timedelta(seconds=args.dist_timeout),
        )  # fmt: skip
    rank = args.rank if args.distributed else 0
    recorder = Recorder()
    model: nn.Module = nn.Sequential(recorder, nn.Flatten(), nn.Linear(3 * SIDE * SIDE, 10))
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model)
    criterion = Targets()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = StepLR(optimizer, step_size=30, gamma=0.1)
    best_acc1, loader_state = 0.0, None
    if args.resume:
        if os.path.isfile(args.resume):
            checkpoint = torch.load(args.resume)  # weights_only, torch's default
            args.start_epoch = checkpoint["epoch"]
            best_acc1 = checkpoint["best_acc1"]
            model.load_state_dict(checkpoint["state_dict"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            if args.load_loader_state:
                loader_state = checkpoint["train_loader"]
        else:
            print(f"=> no checkpoint found at '{args.resume}'", flush=True)

    if args.dummy:
        train_dataset = FakeImages(args.dummy_size, 10, args.read_delay)
        val_dataset = FakeImages(args.dummy_size // 2 + 1, 10, 0.0)
    else:
        train_dataset = JpegFolder(Path(args.data) / "train", args.read_delay)
        val_dataset = JpegFolder(Path(args.data) / "val", 0.0)

    if args.distributed:
        train_sampler = DistributedSampler(train_dataset)
        val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    else:
        train_sampler, val_sampler = None, None

    train_loader = DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=True, sampler=train_sampler)  # fmt: skip
    if args.echo_factor:
        train_loader = EchoLoader(train_loader, echo_factor=args.echo_factor)
        if loader_state is not None:
            train_loader.load_state_dict(loader_state)
    args.val_workers = args.workers if args.val_workers < 0 else args.val_workers
    val_loader = DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.val_workers, pin_memory=True, sampler=val_sampler)  # fmt: skip

    datasets = {"train": train_dataset, "val": val_dataset}

    def record(name: str, extra: dict) -> None:
        kind = "train" if name.startswith("train") else "val"
        if args.record:
            samples = [datasets[kind].load(i) for i in range(len(datasets[kind]))]
            keys = {key(image): i for i, (image, _) in enumerate(samples)}
            ids = [[keys[k] for k in step] for step in recorder.keys]
            labels = [target for _, target in samples]
            out = dict(extra, ids=ids, targets=criterion.batches, labels=labels)
            path = Path(args.record) / f"rank{rank}_{name}.json"
            path.write_text(json.dumps(out))
        recorder.keys.clear()
        criterion.batches.clear()

    if args.evaluate:
        validate(val_loader, model, criterion, args, device)
        record("val", {"echo_epochs": train_loader.stats().epoch if args.echo_factor else 0})
        return

    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        total, steps = train(train_loader, model, criterion, optimizer, epoch, device, args)
        record(f"train{epoch}", {"len": total, "steps": steps})
        acc1 = validate(val_loader, model, criterion, args, device)
        record(f"val{epoch}", {})
        scheduler.step()
        best_acc1 = max(acc1, best_acc1)
        if not args.multiprocessing_distributed or args.rank % nprocs == 0:
            state = {
                "epoch": epoch + 1, "arch": "tiny", "state_dict": model.state_dict(),
                "best_acc1": best_acc1, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }  # fmt: skip
            if args.save_loader_state:
                state["train_loader"] = train_loader.state_dict()
            torch.save(state, args.checkpoint)
    if args.distributed:
        dist.destroy_process_group()
    if args.multiprocessing_distributed:
        # A spawned rank ends here, before interpreter teardown: there torch's Gloo threads were
        # twice destroyed still joinable ("terminate called without an active exception",
        # SIGABRT, after all of the rank's work; pytorch/pytorch#190489). Everything the tests
        # read was written above.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class AverageMeter:
    def __init__(self, name: str) -> None:
        self.name, self.sum, self.count = name, 0.0, 0

    def update(self, val: float, n: int = 1) -> None:
        self.sum += val * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / max(self.count, 1)

    def all_reduce(self) -> None:
        total = torch.tensor([self.sum, self.count], dtype=torch.float32)
        dist.all_reduce(total, dist.ReduceOp.SUM)
        self.sum, self.count = total.tolist()


class ProgressMeter:
    def __init__(self, num_batches: int, meters: list[AverageMeter], prefix: str = "") -> None:
        self.num_batches, self.meters, self.prefix = num_batches, meters, prefix

    def display(self, batch: int) -> None:
        shown = " ".join(f"{m.name} {m.avg:.3f}" for m in self.meters)
        print(f"{self.prefix}[{batch}/{self.num_batches}] {shown}", flush=True)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    with torch.no_grad():
        return float((output.argmax(1) == target).float().mean() * 100)


def train(train_loader, model, criterion, optimizer, epoch, device, args) -> tuple[int, int]:
    losses, top1 = AverageMeter("Loss"), AverageMeter("Acc@1")
    progress = ProgressMeter(len(train_loader), [losses, top1], prefix=f"Epoch: [{epoch}]")
    model.train()
    steps = 0
    for i, (images, target) in enumerate(train_loader):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        losses.update(loss.item(), images.size(0))
        top1.update(accuracy(output, target), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps = i + 1
        if i == 0 and epoch == args.start_epoch:
            print(f"running {args.rank if args.distributed else 0}", flush=True)
        if i % args.print_freq == 0:
            progress.display(i + 1)
    return progress.num_batches, steps


def validate(val_loader, model, criterion, args, device) -> float:
    losses, top1 = AverageMeter("Loss"), AverageMeter("Acc@1")

    def run_validate(loader: DataLoader) -> None:
        with torch.no_grad():
            for images, target in loader:
                output = model(images.to(device))
                loss = criterion(output, target.to(device))
                losses.update(loss.item(), images.size(0))
                top1.update(accuracy(output, target), images.size(0))

    model.eval()
    run_validate(val_loader)
    if args.distributed:
        top1.all_reduce()
    covered = len(val_loader.sampler) * args.world_size
    if args.distributed and covered < len(val_loader.dataset):
        aux = Subset(val_loader.dataset, range(covered, len(val_loader.dataset)))
        run_validate(DataLoader(aux, batch_size=args.batch_size, num_workers=args.val_workers))
    return top1.avg


if __name__ == "__main__":
    main()
