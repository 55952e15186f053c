"""Atomic checkpoint files for pipelines.

A checkpoint is written to a temporary file in the destination's folder, flushed to disk, then
moved over the destination with ``os.replace``; a crash mid-write leaves the previous
checkpoint intact and no half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..filecheck import FileCheckError, check_stored_zip, check_tree, open_regular, read_exactly

__all__ = ["CheckpointFileError", "atomic_save", "atomic_write", "load_file"]


def _fsync_dir(folder: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temp_file_for(final: Path) -> tuple[int, str]:
    """A new temporary file beside ``final`` (descriptor, name), with the mode a plain write
    would give (0666 less the umask): mkstemp's 0600 made every run file private."""
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, name


def _umask() -> int:
    """The process's umask, read without changing it (/proc), else set back at once."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(file)`` on a temporary file next to ``path``, then move it over ``path``.

    The file is flushed and fsynced before ``os.replace`` and the folder entry after it, so a
    process killed at any point leaves either the old file or the complete new one. The folder
    must exist (``FileNotFoundError`` names it otherwise). A write or move that fails (a full
    disk, a folder in ``path``'s place) removes the temporary file and raises an ``OSError``
    naming ``path``. Returns the final path.
    """
    final = Path(path)
    folder = final.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder does not exist: {folder}")
    fd, tmp_name = _temp_file_for(final)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp_name):
            # A write into a full disk (ENOSPC, EFBIG) names no file, and a failed os.replace
            # (a folder in the final name's place) names the temporary file this just removed:
            # the final file is named instead.
            raise OSError(exc.errno, exc.strerror, str(final)) from exc
        raise
    _fsync_dir(folder)
    return final


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` ``obj`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda f: _save_into(obj, f))


class _KeptWriteError:
    """A file as ``torch.save`` writes it, keeping the ``OSError`` of a write that fails."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def _save_into(obj: Any, file: BinaryIO) -> None:
    # torch.save's zip writer turns a failed write (a full disk) into a RuntimeError about
    # stream positions; the write's own OSError says why (and atomic_write names the file).
    kept = _KeptWriteError(file)
    try:
        torch.save(obj, kept)
    except RuntimeError:
        if kept.error is not None:
            raise kept.error from None
        raise


class CheckpointFileError(ValueError):
    """A pipeline checkpoint file that cannot be used; the message names it and says why."""


def load_file(path: str | os.PathLike[str]) -> Any:
    """Load a checkpoint written by :func:`atomic_save` onto the CPU, with bounded memory.

    The file must be a regular, non-sparse file; its zip members must be stored uncompressed
    and lie inside it; it is unpickled with ``torch.load(weights_only=True)``; and the result
    may not decode to more than a small multiple of the file's size (no tensor view larger
    than its data).

    Raises:
        FileNotFoundError: ``path`` is missing (named).
        CheckpointFileError: anything else wrong with the file (named, with the reason).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    try:
        f, size = open_regular(p)
        with f:
            data = read_exactly(f, size)
        check_stored_zip(data)
    except FileCheckError as exc:
        raise CheckpointFileError(f"checkpoint {str(p)!r} {exc}; it is not loaded") from None
    except OSError as exc:
        raise CheckpointFileError(f"checkpoint {str(p)!r} cannot be read: {exc}") from None
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors come in many types
        raise CheckpointFileError(f"checkpoint {str(p)!r} cannot be read: {exc}") from None
    try:
        check_tree(state, budget=2 * len(data) + (1 << 16))
    except FileCheckError as exc:
        raise CheckpointFileError(f"checkpoint {str(p)!r} {exc}; it is not loaded") from None
    return state
