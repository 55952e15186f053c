"""Checkpoints of ``echopipe train``: checksummed, weights-only, atomic; last, best, export.

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

import hashlib
import io
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..pipeline.checkpoint import atomic_write

__all__ = [
    "CHECKPOINT_MAGIC",
    "CheckpointError",
    "RunCheckpoints",
    "atomic_write_bytes",
    "decode_state",
    "encode_state",
    "export_state_dict",
    "read_checkpoint",
    "write_checkpoint",
]

CHECKPOINT_MAGIC = b"echopipe-checkpoint 1\n"
"""First line of every checkpoint file; a file that does not start with it is not read."""

_DIGEST_RE = re.compile(rb"^sha256 ([0-9a-f]{64}) ([0-9]{1,15})\n$")
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
        return {
            _TAG: "bytes",
            "data": torch.frombuffer(bytearray(obj), dtype=torch.uint8)
            if obj
            else torch.empty(0, dtype=torch.uint8),
        }
    if isinstance(obj, np.ndarray):
        raw = np.ascontiguousarray(obj).tobytes()
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
        return {
            _TAG: "ndarray",
            "dtype": obj.dtype.str,
            "shape": list(obj.shape),
            "data": data.to(torch.uint8),
        }
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


def write_checkpoint(
    state: dict[str, Any], path: str | os.PathLike[str], *also: str | os.PathLike[str]
) -> Path:
    """Write ``state`` to ``path`` (and the same bytes to each of ``also``) atomically in the
    checksummed, weights-only format."""
    buffer = io.BytesIO()
    torch.save(encode_state(state), buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    header = CHECKPOINT_MAGIC + f"sha256 {digest} {len(payload)}\n".encode()

    def write(f: Any) -> None:
        f.write(header)
        f.write(payload)

    for target in (*also, path):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, write)
    return Path(path)


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


class RunCheckpoints:
    """A run folder's ``checkpoints/``: ``last.pt`` (newest), ``prev.pt`` (the one before it)
    and ``best.pt`` (best top-1).

    Only these names are ever written or replaced, so nothing else in the folder, nor any
    other run's files, is touched. ``prev.pt`` is what ranks whose newest checkpoints differ
    (one killed between two writes) fall back to.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.last = self.folder / "last.pt"
        self.best = self.folder / "best.pt"
        self.prev = self.folder / "prev.pt"
        self.written = 0

    def existing(self) -> list[Path]:
        """Checkpoint files already in the folder (an earlier run's, when starting)."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if p.suffix == ".pt")

    def save(self, state: dict[str, Any], *, best: bool) -> Path:
        """Write ``state`` as ``last.pt``, and as ``best.pt`` too when ``best``; the file it
        replaces becomes ``prev.pt``."""
        self.written += 1
        if self.last.is_file():
            # A second name for the current file, moved into place atomically: a kill at any
            # point leaves last.pt, and prev.pt older or equal.
            link = self.folder / ".prev.pt.link.tmp"
            link.unlink(missing_ok=True)
            os.link(self.last, link)
            os.replace(link, self.prev)
        return write_checkpoint(state, self.last, *((self.best,) if best else ()))


def export_state_dict(checkpoint: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], Any]:
    """The model's plain ``state_dict`` from a training checkpoint, and its config.

    The pipeline stores each stage's weights under the stage's own child numbers; they are
    renamed back to the flat model's (``<block>.<name>``), and the ``--amp`` wrapper's
    ``block.`` level is removed, so the result loads into
    ``build_model(config["model"], num_classes)`` with ``strict=True``.
    """
    state = read_checkpoint(checkpoint)
    pipe = state["pipeline"]
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for count, stage in zip(pipe["balance"], pipe["stages"], strict=True):
        for key, value in stage.items():
            child, _, rest = key.partition(".")
            if rest.startswith("block."):  # the autocast wrapper of --amp
                rest = rest[len("block.") :]
            out[f"{offset + int(child)}.{rest}"] = value
        offset += count
    return out, state
