"""The training file list a checkpoint was written over, and a resume's check of it.

A checkpoint's input state holds DALI's reader position in the file list it was given (in the
order the seed permutes it). Over another list that position names other files: files added
to or swapped in ``train/`` since the stop would make the resumed epoch repeat some samples and
skip others, silently when the count stayed the same (DALI's own check compares only the count:
:class:`~echopipe.dali.CheckpointShardError`). So a checkpoint records the list the reader was
given, each file's name under ``train/`` and its size in the reader's order (no contents are
read), with a digest, and a resume compares it with the list it reads now:

* inside an epoch (or with the epoch trained, not validated), another list is refused in one
  line saying what changed and what to do;
* at an epoch's end, the next epoch reads the new list: the resume says so in one line, and the
  input starts afresh over it (the reader's position and cached samples of the old list are
  dropped).

Checkpoints written before the record (format 1 has it) are not checked.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from typing import TYPE_CHECKING, Any

from .config import DataError
from .schema_values import check_dict, check_int, need

if TYPE_CHECKING:
    from ..data import ImageFolderIndex
    from .state import RunState

__all__ = [
    "FILE_LIST_FORMAT",
    "check_file_list",
    "check_file_list_entry",
    "file_list_record",
    "resume_file_list",
]

FILE_LIST_FORMAT = 1
"""The version of a checkpoint's ``train_files`` entry."""

_MAX_LINE = 4096 + 24  # a path's bytes (PATH_MAX) and its size, per file of the list


def _entries(index: ImageFolderIndex) -> list[tuple[str, int]]:
    """``(name under the split folder, size or -1)`` of each file, in the reader's order."""
    root = index.root
    out = []
    for path in index.files:
        try:
            size = os.stat(path).st_size
        except OSError:  # gone since the scan: the reader will say so
            size = -1
        out.append((os.path.relpath(path, root) if root else path, size))
    return out


def file_list_record(entries: list[tuple[str, int]]) -> dict[str, Any]:
    """What a checkpoint records of the training files ``entries`` (:func:`_entries`) lists."""
    text = "".join(f"{name}\t{size}\n" for name, size in entries)
    data = text.encode("utf-8", "surrogateescape")
    return {
        "format": FILE_LIST_FORMAT,
        "count": len(entries),
        "sha256": hashlib.sha256(data).hexdigest(),
        "list": zlib.compress(data, 6),
    }


def check_file_list_entry(entry: Any) -> None:
    """A checkpoint's ``train_files`` entry has the types and ranges :func:`check_file_list`
    reads (its list is decompressed only there, bounded by its count and its size)."""
    check_dict(entry, "train_files", {"format", "count", "sha256", "list"}, set())
    check_int(entry["format"], "train_files 'format'", FILE_LIST_FORMAT, FILE_LIST_FORMAT)
    check_int(entry["count"], "train_files 'count'")  # the list's size bounds what it unpacks
    digest = entry["sha256"]
    ok = isinstance(digest, str) and len(digest) == 64 and set(digest) <= set("0123456789abcdef")
    need(ok, "train_files 'sha256'", "is not a SHA-256 digest")
    need(isinstance(entry["list"], bytes), "train_files 'list'", "is not bytes")


def _saved_entries(saved: dict[str, Any]) -> list[tuple[str, int]] | None:
    """The recorded list, or None where it does not decompress within its count's bound or
    does not match its digest (then only the digest is compared)."""
    # DEFLATE expands at most about 1032-fold: a crafted count cannot make this allocate more.
    limit = min(max(1, saved["count"]) * _MAX_LINE, 1032 * len(saved["list"]) + 1024)
    try:
        unzip = zlib.decompressobj()
        data = unzip.decompress(saved["list"], limit)
    except zlib.error:
        return None
    if unzip.unconsumed_tail or hashlib.sha256(data).hexdigest() != saved["sha256"]:
        return None
    out = []
    for line in data.decode("utf-8", "surrogateescape").splitlines():
        name, _, size = line.rpartition("\t")
        try:
            out.append((name, int(size)))
        except ValueError:  # (its digest matched: only a crafted record gets here)
            out.append((name, -1))
    return out


def _what_changed(old: list[tuple[str, int]] | None, new: list[tuple[str, int]]) -> str:
    """How ``new`` differs from ``old``: ``2 added (e.g. 'n1/x.JPEG'), 1 removed (e.g. ...)``."""
    if old is None:
        return f"the checkpoint's record of its list is unreadable; the folder lists {len(new)}"
    before, now = dict(old), dict(new)
    parts = []
    for what, names in (
        ("added", [n for n in now if n not in before]),
        ("removed", [n for n in before if n not in now]),
        ("changed in size", [n for n in now if n in before and now[n] != before[n]]),
    ):
        if names:
            parts.append(f"{len(names)} {what} (e.g. {names[0]!r})")
    return ", ".join(parts) or "the same files in another order"


def check_file_list(
    saved: dict[str, Any] | None,
    index: ImageFolderIndex,
    entries: list[tuple[str, int]],
    current: dict[str, Any],
    st: RunState,
    where: str,
) -> str | None:
    """The line a resume over a changed ``train/`` says at an epoch's end, where the input
    then starts afresh; None when nothing changed. The checkpoint ``where`` recorded ``saved``
    (None: written before the record, not compared); ``entries`` are ``index``'s files as
    the reader reads them now, and ``current`` is their :func:`file_list_record`.

    Raises:
        DataError: the list changed and ``st`` stopped inside an epoch (or before its
            validation), whose reader position belongs to the old list.
    """
    if saved is None or saved["sha256"] == current["sha256"]:
        return None
    changed = _what_changed(_saved_entries(saved), entries)
    folder = index.root or "train/"
    if st.step_in_epoch == 0:
        return (
            f"resume: {folder} changed since {where} was written at the end of epoch "
            f"{st.epoch} ({changed}): epoch {st.epoch + 1} reads the new list of "
            f"{len(index.files)} files, and the input starts afresh over it"
        )
    raise DataError(
        f"--resume {where!r}: {folder} changed since this checkpoint ({st.position()}, step "
        f"{st.global_step}) was written over its {saved['count']} files: {changed}; the "
        "interrupted epoch's reader position belongs to the old list (its samples would be "
        "repeated or skipped): restore the folder as it was, or resume from a checkpoint "
        "written at an epoch's end (--resume CKPT)"
    )


def resume_file_list(
    saved: dict[str, Any] | None, index: ImageFolderIndex, where: str
) -> tuple[dict[str, Any], str | None]:
    """``(record, line)``: :func:`file_list_record` of ``index`` for the run's checkpoints,
    and on a resume from ``saved`` (the checkpoint ``where``) what :func:`check_file_list`
    says of it (None: the input is restored as saved)."""
    from .state import RunState

    entries = _entries(index)  # one stat per file, shared by the record and the check
    record = file_list_record(entries)
    if saved is None:
        return record, None
    st = RunState.from_state_dict(saved["run"])
    return record, check_file_list(saved.get("train_files"), index, entries, record, st, where)
