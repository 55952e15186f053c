"""The checks that can refuse a run before any heavy work: run folder, resume, data folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .checkpoints import read_checkpoint
from .config import DataError, TrainConfig, UsageError, flag, free_on_resume

__all__ = ["check_data", "load_resume", "lock_run_folder", "run_folder"]


def run_folder(cfg: TrainConfig, say: Callable[[str], None]) -> Path:
    """The run folder of ``--output``, created if missing."""
    out = Path(cfg.output)
    if out.suffix == ".json" and not out.is_dir():
        # Older scripts named the metrics file; its folder is the run folder now.
        out = out.parent
        say(f"--output: {cfg.output} names a file; using its folder {out}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"--output {str(out)!r}: cannot create the run folder ({exc.strerror or exc})"
        ) from None
    clash = [name for name in RUN_FILES if (out / name).exists()]
    if clash and not _is_run_folder(out):
        raise UsageError(
            f"--output {str(out)!r} holds {clash[0]!r}, which is not from an echopipe run and "
            "would be overwritten; choose a new or empty folder"
        )
    return out


RUN_FILES = ("config.json", "metrics.json", "metrics.csv", "training.png", "tb")
"""What a run writes into its folder besides ``checkpoints/`` (whose own check, in the trainer's
``prepare``, asks for ``--resume``): a folder holding any of them from elsewhere is refused."""


def _is_run_folder(out: Path) -> bool:
    """Whether ``out/config.json`` was written by ``echopipe train`` (see ``write_config``)."""
    import json

    try:
        doc = json.loads((out / "config.json").read_text())
        return "echopipe" in doc["versions"] and "options" in doc
    except (OSError, ValueError, KeyError, TypeError):
        return False


def lock_run_folder(out: Path) -> Any:
    """A held ``filelock`` on the run folder: two live runs never share one."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(out / ".echopipe-train.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise UsageError(
            f"--output {str(out)!r} is in use by another echopipe train; wait for it or choose "
            "another --output"
        ) from None
    return lock


def load_resume(cfg: TrainConfig, path: Path, world_size: int) -> dict[str, Any]:
    """The checkpoint to resume, checked, with the options it was written with compared."""
    if not path.is_file():
        raise UsageError(
            f"--resume: no checkpoint {str(path)!r} in this run folder; start without "
            "--resume, or give --resume CKPT"
        )
    saved = read_checkpoint(path)
    was, now = saved.get("config", {}), cfg.fixed_on_resume()
    if "run" not in saved or "pipeline" not in saved:
        raise UsageError(f"--resume {str(path)!r} holds no training run to continue")
    changed = [k for k in now if k in was and was[k] != now[k]]
    if changed:
        diffs = "; ".join(f"{flag(k)} was {was[k]!r}, now {now[k]!r}" for k in changed)
        raise UsageError(
            f"--resume {str(path)!r}: {diffs}. Resume with the checkpoint's options; only these "
            f"may change: {', '.join(free_on_resume())}"
        )
    if saved["run"]["world_size"] != world_size:
        raise UsageError(
            f"--resume: the checkpoint was written by {saved['run']['world_size']} replica(s), "
            f"this run has {world_size}"
        )
    return saved


def check_data(cfg: TrainConfig, say: Callable[[str], None]) -> tuple[Path, list[str]]:
    """The data folder and its classes; the synthetic set is made here when needed.

    Lists train/ (the train input's scan checks each image) and checks val/'s headers; warns
    about empty class folders, which stay classes of the model.
    """
    from ..data import scan_image_folder

    if cfg.data is None:
        from ..data import ensure_synthetic_imagenet

        data_dir = ensure_synthetic_imagenet(
            classes=cfg.synthetic_classes, per_class=cfg.synthetic_per_class
        )
        say(f"data: synthetic set {data_dir}")
    else:
        data_dir = Path(cfg.data)
    for split in ("train", "val"):
        if not (data_dir / split).is_dir():
            raise DataError(
                f"--data {str(data_dir)!r} has no {split}/ folder (ImageNet layout: "
                "train/<class>/*.JPEG and val/<class>/*.JPEG)"
            )
    try:
        train = scan_image_folder(data_dir / "train", check="none")
        # val/ is header-checked here, before any training (the train input's scan checks
        # train/), so a corrupt validation file stops the run before its first epoch.
        val = scan_image_folder(
            data_dir / "val",
            check="header",
            on_corrupt=cfg.on_corrupt,  # type: ignore[arg-type]
        )
    except (ValueError, FileNotFoundError) as exc:
        raise DataError(f"--data: {exc}") from None
    if len(train.classes) < 2:
        raise DataError(
            f"--data {str(data_dir)!r}: train/ has {len(train.classes)} class folder(s); a "
            "classifier needs at least 2"
        )
    if val.classes != train.classes:
        extra = sorted(set(val.classes) ^ set(train.classes))
        raise DataError(
            f"--data {str(data_dir)!r}: val/ and train/ have different class folders (e.g. "
            f"{extra[0]!r})"
        )
    for name, n in zip(train.classes, train.counts_per_class(), strict=True):
        if n == 0:
            say(
                f"warning: class folder train/{name} has no images; the class stays among the "
                "model's outputs but is never trained"
            )
    return data_dir, train.classes
