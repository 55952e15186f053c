"""Files written by ``echopipe train``: safe checkpoints, the metrics JSON and the plots.

A checkpoint file is a two-line text header followed by a ``torch.save`` payload::

    echopipe-checkpoint 1\\n
    sha256 <64 hex digits> <payload bytes>\\n
    <payload>

The header is read and the digest checked before anything is unpickled, so a foreign, truncated
or altered file is refused with one line naming it. The payload itself is loaded with
``torch.load(weights_only=True)``: it holds only tensors and plain Python values. Values that
``weights_only`` would refuse (``bytes``, numpy arrays, tuples such as the RNG states) are
encoded as tagged dicts of tensors and plain values by :func:`encode_state` and decoded back by
:func:`decode_state`, so no file can make the loader run code.

Every file is written to a unique temporary file in the target folder (``tempfile.mkstemp``),
fsynced and moved over its final name with ``os.replace``: a process killed at any point leaves
the previous file or the complete new one, and a planted file or symlink at a predictable name
is never written through.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .pipeline.checkpoint import atomic_write

__all__ = [
    "CHECKPOINT_MAGIC",
    "CheckpointError",
    "CheckpointManager",
    "atomic_write_bytes",
    "decode_state",
    "encode_state",
    "read_checkpoint",
    "write_checkpoint",
    "write_metrics",
    "write_plots",
]

CHECKPOINT_MAGIC = b"echopipe-checkpoint 1\n"
"""First line of every checkpoint file; a file that does not start with it is not read."""

_DIGEST_RE = re.compile(rb"^sha256 ([0-9a-f]{64}) ([0-9]{1,15})\n$")
_CKPT_RE = re.compile(r"^ckpt-(\d{9})\.pt$")
_TAG = "__echopipe_codec__"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the reason."""


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, creating missing parent folders."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: f.write(data))


# --------------------------------------------------------------------------------------------
# Encoding for weights_only
# --------------------------------------------------------------------------------------------


def encode_state(obj: Any) -> Any:
    """``obj`` with every value ``torch.load(weights_only=True)`` refuses made loadable.

    ``bytes`` and numpy arrays become uint8 tensors with their dtype and shape, tuples become
    tagged lists, numpy scalars become Python numbers. :func:`decode_state` reverses it.
    """
    if isinstance(obj, np.generic):  # before float: np.float64 is a float subclass
        return obj.item()
    if isinstance(obj, torch.Tensor | str | int | float | bool | type(None)):
        return obj
    if isinstance(obj, bytes | bytearray):
        return {_TAG: "bytes", "data": torch.frombuffer(bytearray(obj), dtype=torch.uint8)
                if obj else torch.empty(0, dtype=torch.uint8)}  # fmt: skip
    if isinstance(obj, np.ndarray):
        raw = np.ascontiguousarray(obj).tobytes()
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
        return {_TAG: "ndarray", "dtype": obj.dtype.str, "shape": list(obj.shape),
                "data": data.to(torch.uint8)}  # fmt: skip
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "items": [encode_state(v) for v in obj]}
    if isinstance(obj, list):
        return [encode_state(v) for v in obj]
    if isinstance(obj, dict):
        return {k: encode_state(v) for k, v in obj.items()}
    raise TypeError(f"checkpoint state holds a {type(obj).__name__}, which is not stored")


def decode_state(obj: Any) -> Any:
    """The inverse of :func:`encode_state`."""
    if isinstance(obj, list):
        return [decode_state(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag == "bytes":
        return obj["data"].numpy().tobytes()
    if tag == "ndarray":
        flat = np.frombuffer(obj["data"].numpy().tobytes(), dtype=np.dtype(obj["dtype"]))
        return flat.reshape(obj["shape"]).copy()
    if tag == "tuple":
        return tuple(decode_state(v) for v in obj["items"])
    return {k: decode_state(v) for k, v in obj.items()}


# --------------------------------------------------------------------------------------------
# One checkpoint file
# --------------------------------------------------------------------------------------------


def write_checkpoint(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` to ``path`` atomically in the checksummed, weights-only format."""
    buffer = io.BytesIO()
    torch.save(encode_state(state), buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    header = CHECKPOINT_MAGIC + f"sha256 {digest} {len(payload)}\n".encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)

    def write(f: Any) -> None:
        f.write(header)
        f.write(payload)

    return atomic_write(path, write)


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint written by :func:`write_checkpoint` onto the CPU.

    The magic line, the length and the SHA-256 digest are checked before the payload is
    unpickled, and it is unpickled with ``weights_only=True``.

    Raises:
        FileNotFoundError: ``path`` is missing (named).
        CheckpointError: the file is not an echopipe checkpoint, is truncated, or its digest
            does not match (named, with the reason).
    """
    p = Path(path)
    if not p.is_file():
        what = "is not a file" if p.exists() else "does not exist"
        raise FileNotFoundError(f"checkpoint {str(p)!r} {what}")
    with open(p, "rb") as f:
        magic = f.read(len(CHECKPOINT_MAGIC))
        if magic != CHECKPOINT_MAGIC:
            raise CheckpointError(
                f"{str(p)!r} is not an echopipe checkpoint (its first line is not "
                f"{CHECKPOINT_MAGIC.decode().strip()!r}); it is not loaded"
            )
        match = _DIGEST_RE.match(f.readline(100))
        if match is None:
            raise CheckpointError(f"checkpoint {str(p)!r} has a damaged header; it is not loaded")
        payload = f.read()
    digest, length = match.group(1).decode(), int(match.group(2))
    if len(payload) != length:
        raise CheckpointError(
            f"checkpoint {str(p)!r} is truncated or padded ({len(payload)} payload bytes, the "
            f"header says {length}); it is not loaded"
        )
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(
            f"checkpoint {str(p)!r} fails its SHA-256 check (the file was altered or damaged); "
            "it is not loaded"
        )
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors come in many types
        raise CheckpointError(f"checkpoint {str(p)!r} cannot be read: {exc}") from None
    state = decode_state(state)
    if not isinstance(state, dict) or state.get("kind") != "echopipe-train":
        raise CheckpointError(f"{str(p)!r} is not an echopipe train checkpoint")
    return state


class CheckpointManager:
    """Numbered checkpoints ``ckpt-<step>.pt`` in one folder; keeps the newest ``keep``.

    Only files this format wrote are ever deleted: checkpoints are pruned by their numbered
    names, and stray temporary files only when they carry this folder's temp prefix.

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
        self.keep = keep
        self.written = 0

    def path_for(self, step: int) -> Path:
        """The file name of the checkpoint at global step ``step``."""
        return self.folder / f"ckpt-{int(step):09d}.pt"

    def list(self) -> list[Path]:
        """Checkpoint files in the folder by name, oldest first (not yet verified)."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            m = _CKPT_RE.match(p.name)
            if m and p.is_file() and not p.is_symlink():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step`` atomically, then prune old ones."""
        self.folder.mkdir(parents=True, exist_ok=True)
        final = write_checkpoint(state, self.path_for(step))
        self.written += 1
        for old in self.list()[: -self.keep]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        # Temporary files of this manager's own writes that a kill left behind.
        for stray in self.folder.glob(".ckpt-*.pt.*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                stray.unlink()
        return final

    def latest(self) -> Path | None:
        """The newest checkpoint file by name, or ``None`` if there is none."""
        found = self.list()
        return found[-1] if found else None

    @staticmethod
    def load(path: str | os.PathLike[str]) -> dict[str, Any]:
        """:func:`read_checkpoint`: checked, weights-only."""
        return read_checkpoint(path)


# --------------------------------------------------------------------------------------------
# Metrics and plots
# --------------------------------------------------------------------------------------------


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
        atomic_write(target, lambda f, fig=fig: fig.savefig(f, format="png"))
        plt.close(fig)
        out.append(target)
    return out
