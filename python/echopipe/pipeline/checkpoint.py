"""Atomic checkpoint files for pipelines.

A checkpoint is written to a temporary file in the destination's folder, flushed to disk, then
moved over the destination with ``os.replace``; a crash mid-write leaves the previous
checkpoint intact and no half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_save", "load_file"]


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` ``obj`` to ``path`` atomically; returns the final path."""
    final = Path(path)
    folder = final.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder does not exist: {folder}")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    return final


def load_file(path: str | os.PathLike[str]) -> Any:
    """Load a checkpoint written by :func:`atomic_save` onto the CPU."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    return torch.load(p, map_location="cpu", weights_only=True)
