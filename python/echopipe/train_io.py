"""Files written by ``echopipe train``: atomic checkpoints, the metrics JSON and the plots.

Checkpoints are written to a temporary file in the checkpoint folder, flushed and fsynced, moved
over their final name with ``os.replace`` and the folder entry is fsynced too. A process killed
at any point therefore leaves either the previous set of checkpoints or the new one, never a
truncated file under a checkpoint name; stray temporary files from a killed write are ignored
(and cleaned up by the next successful save).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .pipeline.checkpoint import atomic_save, atomic_write

__all__ = ["CheckpointManager", "atomic_write_bytes", "write_metrics", "write_plots"]

_CKPT_RE = re.compile(r"^ckpt-(\d{9})\.pt$")


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, creating missing parent folders."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: f.write(data))


class CheckpointManager:
    """Numbered checkpoints ``ckpt-<step>.pt`` in one folder; keeps the newest ``keep``.

    Args:
        folder: where the checkpoints live (created if missing).
        keep: how many of the newest checkpoints to keep (``>= 1``).

    Attributes:
        written: checkpoints written by this manager (the caller adds earlier runs' count).
    """

    def __init__(self, folder: str | os.PathLike[str], keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.written = 0

    def path_for(self, step: int) -> Path:
        """The file name of the checkpoint at global step ``step``."""
        return self.folder / f"ckpt-{int(step):09d}.pt"

    def list(self) -> list[Path]:
        """Complete checkpoints in the folder, oldest first."""
        found = []
        for p in self.folder.iterdir():
            m = _CKPT_RE.match(p.name)
            if m and p.is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step`` atomically, then prune old ones."""
        final = atomic_save(state, self.path_for(step))
        self.written += 1
        for old in self.list()[: -self.keep]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        for stray in self.folder.glob(".ckpt-*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                stray.unlink()
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None`` if there is none."""
        found = self.list()
        return found[-1] if found else None

    @staticmethod
    def load(path: str | os.PathLike[str]) -> dict[str, Any]:
        """Load a checkpoint onto the CPU; ``FileNotFoundError`` names a missing file."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint not found: {str(p)!r}")
        # weights_only=False: the state holds numpy and Python RNG states (our own files).
        state = torch.load(p, map_location="cpu", weights_only=False)
        if not isinstance(state, dict) or state.get("kind") != "echopipe-train":
            raise ValueError(f"{str(p)!r} is not an echopipe train checkpoint")
        return state


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_metrics(path: str | os.PathLike[str], document: dict[str, Any]) -> Path:
    """Write the metrics document as JSON atomically (non-finite floats become ``null``)."""
    text = json.dumps(_json_safe(document), indent=2, sort_keys=False)
    return atomic_write_bytes(path, (text + "\n").encode())


def write_plots(rows: Sequence[dict[str, Any]], stem: str | os.PathLike[str]) -> list[Path]:
    """Validation top-1 against fresh examples seen and against wall time, as two PNGs.

    Args:
        rows: the per-epoch metric rows (``val_top1``, ``fresh_samples``, ``wall_s``).
        stem: path prefix; the files are ``<stem>_acc_vs_fresh.png`` and
            ``<stem>_acc_vs_time.png``.

    Returns:
        The two paths written.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    stem_path = Path(stem)
    stem_path.parent.mkdir(parents=True, exist_ok=True)
    acc = [100.0 * float(r["val_top1"]) for r in rows]
    out = []
    for key, xlabel, suffix in (
        ("fresh_samples", "fresh training examples read", "acc_vs_fresh"),
        ("wall_s", "wall time (s)", "acc_vs_time"),
    ):
        xs = [float(r[key]) for r in rows]
        fig, ax = plt.subplots(figsize=(5.0, 3.5), dpi=100)
        ax.plot(xs, acc, marker="o")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation top-1 (%)")
        ax.set_title(f"echopipe train: top-1 vs {xlabel.split(' (')[0]}")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        target = stem_path.parent / f"{stem_path.name}_{suffix}.png"
        tmp = target.parent / f".{target.name}.tmp.png"
        fig.savefig(tmp)
        plt.close(fig)
        os.replace(tmp, target)
        out.append(target)
    return out
