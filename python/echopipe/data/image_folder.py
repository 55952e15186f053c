"""Indexing an ImageFolder-layout tree and checking that its files are usable images.

:func:`scan_image_folder` lists ``root/<class>/**/<image>`` with labels from the sorted class
folders, checks each file (:func:`check_image_file`: JPEG/PNG markers, or a full decode) and
either stops at the first bad one with a :class:`CorruptImageError` naming it or leaves it out
and records why. Symbolic links are followed only while they stay inside ``root``. The DALI
builders and the trainer's preflight list their files with it. The public names are
re-exported by :mod:`echopipe.data`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from PIL import Image

__all__ = ["CorruptImageError", "ImageFolderIndex", "check_image_file", "scan_image_folder"]


class CorruptImageError(ValueError):
    """An image file that cannot be used; ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"corrupt image {self.path!r}: {reason}")


@dataclass
class ImageFolderIndex:
    """Files of an ImageFolder-layout tree (``root/<class>/**/<image>``) and their labels.

    Classes are the sorted names of ``root``'s sub-folders; ``labels[i]`` is the index in
    ``classes`` of ``files[i]``'s class. ``skipped`` lists ``(path, reason)`` for files left
    out by ``on_corrupt="skip"``; ``links_skipped`` lists ``(path, reason)`` for symbolic
    links left out because they leave ``root``, loop or dangle. ``root`` is the scanned folder.
    """

    files: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    root: str = ""
    links_skipped: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.files)

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class folder name to label id."""
        return {name: i for i, name in enumerate(self.classes)}

    def counts_per_class(self) -> list[int]:
        """Number of kept files for each label id."""
        counts = [0] * len(self.classes)
        for label in self.labels:
            counts[label] += 1
        return counts


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_TAIL_BYTES = 1024


def check_image_file(path: str | Path, check: Literal["header", "decode"] = "header") -> None:
    """Raise :class:`CorruptImageError` if ``path`` is not a usable JPEG or PNG.

    ``"header"`` reads the first and last bytes: the file must be non-empty, start with a JPEG
    SOI marker (``FF D8 FF``) and hold an EOI marker (``FF D9``) within its last 1 KiB, or start
    with the PNG signature and hold an ``IEND`` chunk within its last 1 KiB. ``"decode"`` also
    decodes the whole image with Pillow.
    """
    if check not in ("header", "decode"):
        raise ValueError(f"check must be 'header' or 'decode', got {check!r}")
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            fh.seek(0, os.SEEK_END)
            length = fh.tell()
            fh.seek(max(0, length - _TAIL_BYTES))
            tail = fh.read()
    except OSError as exc:
        raise CorruptImageError(path, f"cannot read: {exc.strerror or exc}") from exc
    if length == 0:
        raise CorruptImageError(path, "empty file (0 bytes)")
    if head.startswith(b"\xff\xd8\xff"):
        if b"\xff\xd9" not in tail:
            raise CorruptImageError(
                path, f"JPEG has no end-of-image marker FFD9 (truncated? {length} bytes)"
            )
    elif head.startswith(_PNG_SIGNATURE):
        if b"IEND" not in tail:
            raise CorruptImageError(path, f"PNG has no IEND chunk (truncated? {length} bytes)")
    else:
        raise CorruptImageError(
            path, f"not a JPEG or PNG: starts with bytes {head[:4].hex(' ').upper()!r}"
        )
    if check == "decode":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Image.open(path) as im:
                    im.load()
        except Exception as exc:  # Pillow raises many types for bad data
            raise CorruptImageError(path, f"decode failed: {exc}") from exc


def scan_image_folder(
    root: str | Path,
    *,
    check: Literal["none", "header", "decode"] = "header",
    on_corrupt: Literal["error", "skip"] = "error",
    extensions: Sequence[str] = (".jpg", ".jpeg", ".JPEG", ".png"),
) -> ImageFolderIndex:
    """Index an ImageFolder tree, checking each image as asked.

    Class folders are ``root``'s non-hidden sub-folders, sorted; images are found recursively
    inside them, in sorted order, by file extension (compared case-insensitively). Hidden files
    and folders (leading ``.``) are ignored, as are files directly in ``root``. Symbolic links
    are followed only while they stay inside ``root``; a link that leaves it, dangles, or leads
    back into a folder already being walked (a loop) is left out and listed in
    ``links_skipped``, so a link can neither pull in files from elsewhere nor repeat a folder.
    A folder that cannot be listed raises OSError naming it (its images would be missing).

    Args:
        root: the dataset split folder, e.g. ``.../train``.
        check: ``"none"`` (extension only), ``"header"`` (markers, see
            :func:`check_image_file`) or ``"decode"`` (full Pillow decode).
        on_corrupt: ``"error"`` raises on the first bad file; ``"skip"`` leaves it out and
            records it in ``skipped``.
        extensions: file name endings counted as images.

    Raises:
        FileNotFoundError: ``root`` does not exist (or is not a folder).
        ValueError: ``root`` has no class sub-folders, or no images are left.
        CorruptImageError: a bad file when ``on_corrupt="error"``; names the file and reason.
        OSError: a folder of the tree cannot be listed; names it.
    """
    if check not in ("none", "header", "decode"):
        raise ValueError(f"check must be 'none', 'header' or 'decode', got {check!r}")
    if on_corrupt not in ("error", "skip"):
        raise ValueError(f"on_corrupt must be 'error' or 'skip', got {on_corrupt!r}")
    if isinstance(extensions, str):
        raise TypeError(f"extensions must be a sequence of strings, got the string {extensions!r}")
    exts = tuple(e.lower() for e in extensions)
    root_path = Path(root)
    if not root_path.is_dir():
        what = "is not a folder" if root_path.exists() else "does not exist"
        raise FileNotFoundError(f"image folder {str(root_path)!r} {what}")
    real_root = os.path.realpath(root_path)
    index = ImageFolderIndex(root=str(root_path))
    classes = []
    for e in sorted(os.scandir(root_path), key=lambda e: e.name):
        if e.name.startswith(".") or not e.is_dir(follow_symlinks=True):
            continue
        reason = _link_problem(e.path, real_root, set()) if e.is_symlink() else None
        if reason is None:
            classes.append(e.name)
        else:
            index.links_skipped.append((e.path, reason))
    if not classes:
        raise ValueError(f"image folder {str(root_path)!r} has no class sub-folders")
    index.classes = classes
    for label, name in enumerate(classes):
        for path in _walk_images(root_path / name, exts, real_root, index.links_skipped):
            if check != "none":
                try:
                    check_image_file(path, check)
                except CorruptImageError as exc:
                    if on_corrupt == "error":
                        raise
                    index.skipped.append((exc.path, exc.reason))
                    continue
            index.files.append(path)
            index.labels.append(label)
    if not index.files:
        detail = f" ({len(index.skipped)} corrupt files skipped)" if index.skipped else ""
        raise ValueError(
            f"image folder {str(root_path)!r} has no images with extensions {list(extensions)}"
            f" in its {len(classes)} class folders{detail}"
        )
    return index


def _inside(path: str, real_root: str) -> bool:
    return path == real_root or path.startswith(real_root.rstrip(os.sep) + os.sep)


def _link_problem(path: str, real_root: str, walking: set[str]) -> str | None:
    """Why the symbolic link ``path`` is left out, or ``None`` if it may be followed."""
    try:
        target = os.path.realpath(path, strict=True)
    except (OSError, RuntimeError):
        return "link loops or dangles"
    if not _inside(target, real_root):
        return f"link leaves the data folder (to {target})"
    if target in walking:
        return "link loops back into a folder above it"
    return None


def _walk_images(
    folder: Path, exts: tuple[str, ...], real_root: str, links_skipped: list[tuple[str, str]]
) -> Iterator[str]:
    # Depth first with the real paths of the folders being walked, so a link back into one of
    # them is seen as a loop; links out of the root are refused before they are followed.
    stack = [(str(folder), frozenset({os.path.realpath(folder)}))]
    while stack:
        dirpath, walking = stack.pop()
        try:
            entries = sorted(os.scandir(dirpath), key=lambda e: e.name)
        except OSError as exc:  # its images would be left out unnoticed: refuse instead
            raise OSError(exc.errno, f"cannot list the data folder {dirpath!r}: "
                          f"{exc.strerror or exc}") from None  # fmt: skip
        subdirs = []
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_symlink():
                reason = _link_problem(e.path, real_root, set(walking))
                if reason is not None:
                    links_skipped.append((e.path, reason))
                    continue
            if e.is_dir(follow_symlinks=True):
                subdirs.append(e.path)
            elif e.name.lower().endswith(exts) and e.is_file(follow_symlinks=True):
                yield e.path
        for sub in reversed(subdirs):
            stack.append((sub, walking | {os.path.realpath(sub)}))
