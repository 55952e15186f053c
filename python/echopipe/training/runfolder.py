"""The run folder: which one a run writes to, its lock, and what a start leaves behind.

Without ``--output`` every run gets a new dated folder under ``echopipe-train/`` (the
convention of timm's ``output/train/<date>-<time>-<model>``), so a second experiment never
needs a hand-picked name. A folder belongs to one run: ``config.json`` carries the run's id,
which its checkpoints carry too, and a resume never writes into a folder of another run. A
start that is refused leaves nothing behind: the folders it made and its lock file go again.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..filecheck import open_regular
from .config import DEFAULT_OUTPUT_BASE, TrainConfig, UsageError

__all__ = [
    "RUN_FILES",
    "RunFolder",
    "ensure_same_run",
    "folder_run_id",
    "new_run_folder_name",
    "newest_run_folder",
    "read_run_config",
    "read_run_metrics",
    "refuse_inside_data",
]


def refuse_inside_data(out: Path, data: Path | None) -> None:
    """Refuse (UsageError) a run folder inside ``data``'s ``train/`` or ``val/``, before it is
    made: it would be listed as a class folder, and the start refused for classes that differ
    between the splits, naming the run's own folder as a class."""
    if data is None:
        return
    where = Path(os.path.realpath(out))  # the parts that exist, resolved through links
    for split in ("train", "val"):
        root = Path(os.path.realpath(Path(data) / split))
        if where == root or root in where.parents:
            raise UsageError(
                f"--output {str(out)!r} is inside --data's {split}/ folder ({root}): the run "
                f"folder would be read as a class of images; choose a folder outside {split}/"
            )


RUN_FILES = ("config.json", "metrics.json", "metrics.csv", "steps.csv", "training.png", "tb")
"""What a run writes into its folder besides ``checkpoints/``: a folder holding any of them that
no echopipe run wrote is refused rather than overwritten."""

_CONFIG_MAX_BYTES = 16 << 20  # config.json grows by one entry per restart; far below this
_OWN_FILES = ("last.pt", "prev.pt", "best.pt", *RUN_FILES)
# atomic_write's temporary names: ".<final name>.<random>.tmp"
_STALE_TMP = re.compile(r"^\.(" + "|".join(map(re.escape, _OWN_FILES)) + r")\.[^/]+\.tmp$")


def new_run_folder_name(model: str, now: float | None = None) -> str:
    """``<date>-<time>-<model>``, e.g. ``20261202-011500-resnet_small``."""
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"-{model}"


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, else None (missing, larger than the bound, damaged)."""
    try:
        f, _ = open_regular(path)  # a FIFO under the name is refused, not waited on
        with f:
            raw = f.read(_CONFIG_MAX_BYTES + 1)
        doc = json.loads(raw) if len(raw) <= _CONFIG_MAX_BYTES else None
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_run_metrics(folder: Path) -> dict[str, Any] | None:
    """``folder/metrics.json`` as a run wrote it, else None (missing, damaged; read bounded)."""
    doc = _read_json_object(folder / "metrics.json")
    return doc if doc is not None and isinstance(doc.get("epochs"), list) else None


def read_run_config(folder: Path) -> dict[str, Any] | None:
    """``folder/config.json`` when an echopipe run wrote it, else None (read bounded)."""
    doc = _read_json_object(folder / "config.json")
    try:
        if doc is not None and "echopipe" in doc["versions"] and "options" in doc:
            return doc
    except (KeyError, TypeError):
        pass
    return None


def folder_run_id(folder: Path) -> str | None:
    """The run id in ``folder/config.json`` ('' for a run from before run ids), or None when
    no echopipe run wrote one."""
    doc = read_run_config(folder)
    return None if doc is None else str(doc.get("run_id", ""))


def newest_run_folder(base: Path) -> Path | None:
    """The newest dated run folder under ``base`` that holds a checkpoint."""
    if not base.is_dir():
        return None
    runs = sorted(
        (p for p in base.iterdir() if p.is_dir() and any((p / "checkpoints").rglob("last.pt"))),
        key=lambda p: p.name,
    )
    return runs[-1] if runs else None


class RunFolder:
    """A run folder, created on :meth:`open` and locked by rank 0.

    Only what :meth:`open` created is removed by :meth:`discard` (a refused start), and only
    when nothing else was put there since.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.created: list[Path] = []
        self.lock: Any = None
        self.lock_file_made = False
        self.removed = False  # discard() removed the folder itself (a start that did not happen)

    @staticmethod
    def choose(
        cfg: TrainConfig, given_output: bool, share: Callable[[Any], Any],
        say: Callable[[str], None],
    ) -> RunFolder:  # fmt: skip
        """The folder of this run: ``--output``; with a bare ``--resume`` the newest run under
        ``echopipe-train/``; with ``--resume CKPT`` the checkpoint's own run folder; else a new
        dated folder. ``share`` hands rank 0's choice to every rank."""
        if given_output and cfg.output is not None:
            out = Path(cfg.output)
            if out.suffix == ".json" and not out.is_dir():
                # Older scripts named the metrics file; its folder is the run folder now.
                say(f"--output: {cfg.output} names a file; using its folder {out.parent}")
                out = out.parent
            return RunFolder(out)
        base = Path(DEFAULT_OUTPUT_BASE)
        out: Path | None = None
        if cfg.resume is True:
            out = newest_run_folder(base)
            if out is None:
                raise UsageError(
                    f"--resume: no run with a checkpoint under {str(base)!r}; give --output RUN "
                    "or --resume CKPT"
                )
            say(f"resume: the newest run, {out}")
        elif isinstance(cfg.resume, Path):
            out = _checkpoint_run_folder(cfg.resume)
        if out is None:
            out = base / new_run_folder_name(cfg.model)
            suffix = 1
            while out.exists():  # two runs started within the same second
                out = base / f"{new_run_folder_name(cfg.model)}-{suffix}"
                suffix += 1
        return RunFolder(Path(share(str(out))))

    def open(self, lock: bool) -> None:
        """Create the folder (and its parents) and, with ``lock``, take its lock."""
        missing = []
        p = self.path
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"--output {str(self.path)!r}: cannot create the run folder ({exc.strerror or exc})"
            ) from None
        self.created = missing
        clash = [name for name in RUN_FILES if (self.path / name).exists()]
        if clash and read_run_config(self.path) is None:
            self.discard()
            raise UsageError(
                f"--output {str(self.path)!r} holds {clash[0]!r}, which is not from an echopipe "
                "run and would be overwritten; choose a new or empty folder"
            )
        if lock:
            made = not (self.path / _LOCK_NAME).exists()
            self.lock = _lock(self.path)
            # Only once it is there: undoing a lock file a read-only folder refused would fail
            # too, and that error would replace the line saying why.
            self.lock_file_made = made

    def remove_stale_tmp(self, *folders: Path) -> int:
        """Delete temporary files of writes that a kill interrupted; how many there were."""
        removed = 0
        for folder in folders:
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if _STALE_TMP.match(entry.name) and entry.is_file() and not entry.is_symlink():
                    entry.unlink(missing_ok=True)
                    removed += 1
        return removed

    def release(self) -> None:
        """Let go of the lock (the run is over)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def discard(self) -> None:
        """Undo :meth:`open` for a start that did not happen: the lock file and the folders it
        created go, when they hold nothing else."""
        lock_file = self.path / _LOCK_NAME
        self.release()
        if self.lock_file_made:
            lock_file.unlink(missing_ok=True)
        for folder in self.created:  # the deepest first
            try:
                folder.rmdir()
            except OSError:  # not empty: it stays
                break
        self.removed = bool(self.created) and not self.path.exists()


_LOCK_NAME = ".echopipe-train.lock"


def _lock(out: Path) -> Any:
    """A held ``filelock`` on the run folder: two live runs never share one."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(out / _LOCK_NAME))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise UsageError(
            f"--output {str(out)!r} is in use by another echopipe train; wait for it or choose "
            "another --output"
        ) from None
    except OSError as exc:  # a folder on a read-only mount, or not ours to write
        raise UsageError(
            f"--output {str(out)!r}: cannot write in the run folder ({exc.strerror or exc})"
        ) from None
    return lock


def _checkpoint_run_folder(ckpt: Path) -> Path | None:
    """``RUN`` for a checkpoint at ``RUN/checkpoints/[rank<r>/]<name>.pt`` of an echopipe run."""
    parent = ckpt.resolve().parent
    if re.fullmatch(r"rank\d+", parent.name):
        parent = parent.parent
    if parent.name != "checkpoints":
        return None
    run = parent.parent
    return run if read_run_config(run) is not None else None


def ensure_same_run(out: Path, run_id: str, ckpt: Path, folder_holds_checkpoints: bool) -> None:
    """Refuse to resume the run ``run_id`` into ``out`` when ``out`` holds another run."""
    there = folder_run_id(out)
    if there is None and not folder_holds_checkpoints:
        return  # a new or empty folder: the run goes on there
    if there != run_id:
        raise UsageError(
            f"--output {str(out)!r} holds another run than the checkpoint "
            f"{str(ckpt)!r}; its files would be overwritten: choose a new or empty --output"
        )
