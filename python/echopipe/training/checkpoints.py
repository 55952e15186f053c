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

A file that passes its digest may still be crafted, so it is also read with bounded memory
(:mod:`echopipe.filecheck`: its size compared with the header before the payload is read, no
compressed member, no decoded tree larger than a small multiple of the file) and every entry is
checked before use (:mod:`.checkpoint_schema`): :func:`read_checkpoint` returns only a
checkpoint a resume, ``export`` and ``--evaluate`` can use as it is.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..filecheck import FileCheckError, check_stored_zip, check_tree, open_regular, read_exactly
from ..models import build_model
from ..pipeline.checkpoint import atomic_write
from .checkpoint_codec import decode_state, encode_state
from .checkpoint_schema import check_train_state, flat_weights
from .schema_values import SchemaError

__all__ = [
    "CHECKPOINT_MAGIC",
    "CheckpointError",
    "RunCheckpoints",
    "atomic_write_bytes",
    "check_export",
    "decode_state",
    "encode_state",
    "export_state_dict",
    "read_checkpoint",
    "read_state_file",
    "write_checkpoint",
]

CHECKPOINT_MAGIC = b"echopipe-checkpoint 1\n"
"""First line of every checkpoint file; a file that does not start with it is not read."""

_OTHER_VERSION_RE = re.compile(rb"echopipe-checkpoint [0-9]{1,9}\n")
_DIGEST_RE = re.compile(rb"^sha256 ([0-9a-f]{64}) ([0-9]{1,15})\n$")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the reason."""


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, creating missing parent folders."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: f.write(data))


# --------------------------------------------------------------------------------------------
# One checkpoint file
# --------------------------------------------------------------------------------------------


def write_checkpoint(
    state: dict[str, Any], path: str | os.PathLike[str], *also: str | os.PathLike[str]
) -> Path:
    """Write ``state`` to ``path`` (and the same bytes to each of ``also``) atomically in the
    checksummed, weights-only format."""
    write = _checkpoint_writer(state)
    # ``path`` first: a process killed between the writes leaves its newest state resumable
    # (``also``, e.g. best.pt, one write behind) rather than an ``also`` without a ``path``.
    for target in (path, *also):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, write)
    return Path(path)


def _checkpoint_writer(state: dict[str, Any]) -> Callable[[Any], None]:
    """What writes ``state``'s file (header and payload) into an open file; the payload is
    serialised once, however many files take it."""
    buffer = io.BytesIO()
    torch.save(encode_state(state), buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    header = CHECKPOINT_MAGIC + f"sha256 {digest} {len(payload)}\n".encode()

    def write(f: Any) -> None:
        f.write(header)
        f.write(payload)

    return write


def read_state_file(path: str | os.PathLike[str]) -> Any:
    """The decoded payload of a file written by :func:`write_checkpoint`, read with bounded
    memory, without checking what it holds (:func:`read_checkpoint` does).

    In this order: the file must be a regular, non-sparse file; the magic line; the header's
    length compared with the file's size (nothing more is read on a mismatch); the payload's
    SHA-256; the payload's zip members stored uncompressed and inside it;
    ``torch.load(weights_only=True)``; the decoded tree no larger than a small multiple of the
    payload (:func:`~echopipe.filecheck.check_tree`: no shared references repeated without
    bound, no tensor view larger than its data).

    Raises:
        FileNotFoundError: ``path`` is missing (named).
        CheckpointError: anything else wrong with the file (named, with the reason).
    """
    p = Path(path)
    name = str(p)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {name!r} does not exist")
    payload = _read_payload(p)
    try:
        check_stored_zip(payload)
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except FileCheckError as exc:
        raise CheckpointError(f"checkpoint {name!r} {exc}; it is not loaded") from None
    except Exception as exc:  # pickle errors come in many types
        raise CheckpointError(f"checkpoint {name!r} cannot be read: {exc}") from None
    try:
        check_tree(state, budget=2 * len(payload) + (1 << 16))
        return decode_state(state)
    except (FileCheckError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {name!r} {exc}; it is not loaded") from None


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a train checkpoint written by :func:`write_checkpoint` onto the CPU, checked.

    The file is read as :func:`read_state_file` reads it, then every entry a resume,
    ``export`` or ``--evaluate`` reads is checked for type, range, shape and dtype
    (:func:`~.checkpoint_schema.check_train_state`), so a file that passes its SHA-256 but was
    crafted is refused here, in one line, rather than failing later inside the run.

    Raises:
        FileNotFoundError: ``path`` is missing (named).
        CheckpointError: anything else wrong with the file (named, with the reason).
    """
    state = read_state_file(path)
    name = str(path)
    if not isinstance(state, dict) or state.get("kind") != "echopipe-train":
        raise CheckpointError(f"{name!r} is not an echopipe train checkpoint")
    try:
        check_train_state(state)
    except SchemaError as exc:
        raise CheckpointError(f"checkpoint {name!r}: {exc}; it is not loaded") from None
    return state


def _read_payload(p: Path) -> bytes:
    """The payload of checkpoint ``p``, its length and digest checked against the header; the
    length is compared with the file's size before the payload is read."""
    name = str(p)
    try:
        f, size = open_regular(p)
    except FileCheckError as exc:
        raise CheckpointError(f"checkpoint {name!r} {exc}; it is not loaded") from None
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {name!r} cannot be opened ({exc.strerror or exc})"
        ) from None
    with f:
        magic = f.readline(len(CHECKPOINT_MAGIC) + 20)
        if magic != CHECKPOINT_MAGIC:
            ours = CHECKPOINT_MAGIC.decode().strip()
            if _OTHER_VERSION_RE.fullmatch(magic):  # one an echopipe older or newer wrote
                raise CheckpointError(
                    f"checkpoint {name!r} is of another format ({magic.decode().strip()!r}; "
                    f"this echopipe reads {ours!r}); it is not loaded"
                )
            raise CheckpointError(
                f"{name!r} is not an echopipe checkpoint (its first line is not {ours!r}); "
                "it is not loaded"
            )
        match = _DIGEST_RE.match(f.readline(100))
        if match is None:
            raise CheckpointError(f"checkpoint {name!r} has a damaged header; it is not loaded")
        digest, length = match.group(1).decode(), int(match.group(2))
        if size - f.tell() != length:
            raise CheckpointError(
                f"checkpoint {name!r} is truncated or padded ({size - f.tell()} payload bytes, "
                f"the header says {length}); it is not loaded"
            )
        try:
            payload = read_exactly(f, length)
        except FileCheckError as exc:
            raise CheckpointError(f"checkpoint {name!r} {exc}; it is not loaded") from None
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(
            f"checkpoint {name!r} fails its SHA-256 check (the file was altered or damaged); "
            "it is not loaded"
        )
    return payload


class RunCheckpoints:
    """A run folder's ``checkpoints/``: ``last.pt`` (newest), ``prev.pt`` (the one before it)
    and ``best.pt`` (best top-1).

    Only these names are ever written or replaced, so nothing else in the folder, nor any
    other run's files, is touched. ``prev.pt`` is what ranks whose newest checkpoints differ
    (one killed between two writes) fall back to. With ``root`` (the run folder), no folder
    between ``root`` and ``folder``, nor ``last.pt``, ``prev.pt`` or ``best.pt``, may be a
    symbolic link: a planted link would make the run read or write outside its folder.
    """

    def __init__(
        self, folder: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
    ) -> None:
        self.folder = Path(folder)
        self.root = Path(root) if root is not None else None
        self.last = self.folder / "last.pt"
        self.best = self.folder / "best.pt"
        self.prev = self.folder / "prev.pt"
        self.written = 0
        self.check_inside()

    def check_inside(self) -> None:
        """Refuse (CheckpointError) a symbolic link on the way from the run folder to the
        checkpoint files."""
        if self.root is None:
            return
        try:
            parts = self.folder.relative_to(self.root).parts
        except ValueError:
            raise CheckpointError(
                f"checkpoint folder {str(self.folder)!r} is not inside {str(self.root)!r}"
            ) from None
        here = self.root
        for part in (*parts, "last.pt", "prev.pt", "best.pt"):
            here = here / part
            if here.is_symlink():
                raise CheckpointError(
                    f"{str(here)!r} is a symbolic link (to {os.readlink(here)!r}); a run reads "
                    "and writes only inside its own folder, so it is not followed"
                )

    def existing(self) -> list[Path]:
        """Checkpoint files already in the folder (an earlier run's, when starting)."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if p.suffix == ".pt")

    def save(
        self, state: dict[str, Any], *, best: bool, on_last: Callable[[], None] | None = None
    ) -> Path:
        """Write ``state`` as ``last.pt``, and as ``best.pt`` too when ``best``; the file it
        replaces becomes ``prev.pt``. ``on_last`` is called once ``last.pt`` is in place,
        before ``best.pt`` is written: a ``best.pt`` that then cannot be written (raised, an
        ``OSError`` naming it) leaves a new ``last.pt`` that the caller already knows of."""
        self.check_inside()
        self.written += 1
        if self.last.is_file():
            # A second name for the current file, moved into place atomically: a kill at any
            # point leaves last.pt, and prev.pt older or equal.
            link = self.folder / ".prev.pt.link.tmp"
            link.unlink(missing_ok=True)
            os.link(self.last, link)
            os.replace(link, self.prev)
        write = _checkpoint_writer(state)
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(self.last, write)
        if on_last is not None:
            on_last()
        if best:
            atomic_write(self.best, write)
        return self.last


def export_state_dict(checkpoint: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], Any]:
    """The model's plain ``state_dict`` from a training checkpoint, and the checkpoint.

    The pipeline stores each stage's weights under the stage's own child numbers; they are
    renamed back to the flat model's (``<block>.<name>``), and the ``--amp`` wrapper's
    ``block.`` level is removed, so the result loads into
    ``build_model(state["model"]["name"], state["model"]["num_classes"])`` with
    ``strict=True`` (checked here: the names, shapes and dtypes are the model's).

    Raises:
        FileNotFoundError, CheckpointError: as :func:`read_checkpoint`.
    """
    state = read_checkpoint(checkpoint)
    weights = flat_weights(state["pipeline"])
    try:
        model = build_model(state["model"]["name"], num_classes=state["model"]["num_classes"])
        model.load_state_dict(weights, strict=True)
    except (RuntimeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r}: its weights do not load into "
            f"{state['model']['name']}: {str(exc).splitlines()[0]}"
        ) from None
    return weights, state


def check_export(path: str | os.PathLike[str], model: dict[str, Any]) -> None:
    """Check that the state_dict written to ``path`` by ``echopipe export`` loads into
    ``build_model(model["name"], model["num_classes"])`` with ``strict=True``.

    Raises:
        CheckpointError: it does not (named, with the first reason).
    """
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
        build_model(model["name"], num_classes=model["num_classes"]).load_state_dict(weights)
    except Exception as exc:  # a torch.load or load_state_dict failure, whatever its type
        raise CheckpointError(
            f"the exported {str(path)!r} does not load into {model['name']}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
