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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

from . import folder_check
from .decode_check import DECODE_BUDGET, decode_bytes, decode_problem
from .folder_check import ScanShare, check_files
from .folder_walk import RENAME, is_utf8, list_tree, open_regular_image

__all__ = [
    "MAX_IMAGE_PIXELS",
    "CorruptImageError",
    "ImageFolderIndex",
    "check_image_file",
    "scan_image_folder",
]


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
    links left out because they leave ``root``, loop, dangle or point into another class
    folder; ``other_formats`` lists
    ``(path, reason)`` for files of image formats not read (BMP, GIF, TIFF, WebP, PNM: see
    :data:`~echopipe.data.folder_walk.OTHER_IMAGE_EXTENSIONS`). ``root`` is the scanned folder.
    """

    files: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    root: str = ""
    links_skipped: list[tuple[str, str]] = field(default_factory=list)
    other_formats: list[tuple[str, str]] = field(default_factory=list)

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

MAX_IMAGE_PIXELS = 2 * 89_478_485
"""Largest image (width x height) the header check accepts: Pillow's decompression-bomb limit
(``2 * PIL.Image.MAX_IMAGE_PIXELS``), about 179 megapixels, or 537 MB decoded as RGB, above
any camera's. The size is read from the file's header, where a 2 KB file can claim 30000 x
30000 and make the decoder allocate gigabytes; a larger image is corrupt."""

# JPEG start-of-frame markers (C4 DHT, C8 JPG and CC DAC are not frames).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# A real JPEG has a few dozen segments before its first scan; seeking past more is refused.
_MAX_JPEG_SEGMENTS = 1024


def _jpeg_frame_size(fh: BinaryIO, length: int) -> tuple[int, int, int]:
    """``(width, height, offset of the first scan)`` of the JPEG in ``fh``, read segment by
    segment up to its first scan (a few bytes per segment; their data are skipped by seeking).
    Raises ValueError saying what is wrong when there is no frame before the scan."""
    pos, size = 2, None
    for _ in range(_MAX_JPEG_SEGMENTS):
        fh.seek(pos)
        head = fh.read(4)
        if len(head) < 2 or head[0] != 0xFF:
            raise ValueError(f"JPEG has no marker at byte {pos} (damaged before its first scan)")
        marker = head[1]
        if marker == 0xFF:  # a fill byte before a marker
            pos += 1
            continue
        if marker == 0xD9:
            raise ValueError("JPEG ends (EOI) before its first scan: it holds no image")
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a segment
            pos += 2
            continue
        if len(head) < 4:
            raise ValueError(f"JPEG ends inside the marker at byte {pos}")
        seg = int.from_bytes(head[2:4], "big")
        if seg < 2 or pos + 2 + seg > length:
            raise ValueError(f"JPEG segment at byte {pos} has a bad length {seg}")
        if marker in _SOF_MARKERS:
            frame = fh.read(5)
            if seg < 8 or len(frame) < 5:
                raise ValueError(f"JPEG frame header at byte {pos} is too short")
            size = (int.from_bytes(frame[3:5], "big"), int.from_bytes(frame[1:3], "big"))
        elif marker == 0xDA:
            if size is None:
                raise ValueError("JPEG has a scan but no frame header (SOF) before it")
            return (*size, pos)
        pos += 2 + seg
    raise ValueError(f"JPEG has more than {_MAX_JPEG_SEGMENTS} segments before its first scan")


def _eoi_after(fh: BinaryIO, pos: int) -> bool:
    """Whether an EOI marker follows ``pos`` (in entropy-coded data ``FF`` is always followed by
    ``00`` or a restart marker, so ``FF D9`` there is the end). Read only for a JPEG whose last
    KiB holds none: one with more than that of other data after its end, which decoders
    ignore (a camera's trailer, an appended video)."""
    fh.seek(pos)
    carry = b""
    while chunk := fh.read(1 << 20):
        if b"\xff\xd9" in carry + chunk:
            return True
        carry = chunk[-1:]
    return False


def _check_size(width: int, height: int) -> str | None:
    """Why an image of this size is refused, or None."""
    if width == 0 or height == 0:
        return f"its header gives the size {width} x {height}"
    if width * height > MAX_IMAGE_PIXELS:
        return (
            f"its header claims {width} x {height} pixels, more than the {MAX_IMAGE_PIXELS} "
            "(MAX_IMAGE_PIXELS) echopipe decodes (a decompression bomb?)"
        )
    return None


def check_image_file(path: str | Path, check: Literal["header", "decode"] = "header") -> None:
    """Raise :class:`CorruptImageError` if ``path`` is not a usable JPEG or PNG.

    ``"header"`` reads the first bytes, the marker segments up to the first scan, and the last
    bytes: the file must be non-empty, start with a JPEG SOI marker (``FF D8 FF``), have a
    frame header (SOF) before its first scan (SOS) and an EOI marker (``FF D9``) after it
    (looked for in its last 1 KiB, and only when none is there in the rest of the file), or
    start with the PNG signature and an ``IHDR`` chunk and hold an ``IEND`` chunk within its
    last 1 KiB. The size in the frame header or ``IHDR`` must be non-zero and at most
    :data:`MAX_IMAGE_PIXELS`. A FIFO, socket or device is refused without being opened.

    ``"decode"`` also decodes the whole image with Pillow, and a JPEG a second time to find
    image data that stops before the image is complete: a file cut inside its scan and ended
    with an EOI marker, which Pillow and DALI's CPU decoder both decode without an error,
    filling the rest grey (:mod:`echopipe.data.jpeg_scan`).
    """
    if check not in ("header", "decode"):
        raise ValueError(f"check must be 'header' or 'decode', got {check!r}")
    path = os.fspath(path)
    size_problem, ended, pixels = None, False, 0
    try:
        with _open(path) as fh:
            head = fh.read(24)
            fh.seek(0, os.SEEK_END)
            length = fh.tell()
            fh.seek(max(0, length - _TAIL_BYTES))
            tail = fh.read()
            ended = b"\xff\xd9" in tail
            if head.startswith(b"\xff\xd8\xff"):
                try:
                    width, height, scan = _jpeg_frame_size(fh, length)
                    size_problem, pixels = _check_size(width, height), width * height
                    ended = ended or _eoi_after(fh, scan)
                except ValueError as exc:
                    size_problem = str(exc)
    except OSError as exc:
        raise CorruptImageError(path, f"cannot read: {exc.strerror or exc}") from exc
    if length == 0:
        raise CorruptImageError(path, "empty file (0 bytes)")
    if head.startswith(b"\xff\xd8\xff"):
        if not ended:
            raise CorruptImageError(
                path, f"JPEG has no end-of-image marker FFD9 (truncated? {length} bytes)"
            )
    elif head.startswith(_PNG_SIGNATURE):
        if b"IEND" not in tail:
            raise CorruptImageError(path, f"PNG has no IEND chunk (truncated? {length} bytes)")
        if head[12:16] != b"IHDR":
            raise CorruptImageError(path, "PNG does not start with an IHDR chunk")
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        size_problem, pixels = _check_size(width, height), width * height
    else:
        raise CorruptImageError(
            path, f"not a JPEG or PNG: starts with bytes {head[:4].hex(' ').upper()!r}"
        )
    if size_problem is not None:
        raise CorruptImageError(path, size_problem)
    if check == "decode":
        with DECODE_BUDGET.hold(decode_bytes(length, pixels)):
            _decode(path)


def _decode(path: str) -> None:
    """The ``"decode"`` check of a file whose header passed (:mod:`.decode_check`)."""
    try:
        with _open(path) as fh:
            data = fh.read()
    except OSError as exc:
        raise CorruptImageError(path, f"cannot read: {exc.strerror or exc}") from exc
    problem = decode_problem(data)
    if problem is not None:
        raise CorruptImageError(path, problem)


def _open(path: str) -> BinaryIO:
    """``path`` for reading; a FIFO, device or socket is refused unopened."""
    try:
        return open_regular_image(path)
    except ValueError as exc:
        raise CorruptImageError(path, str(exc)) from None


def scan_image_folder(
    root: str | Path,
    *,
    check: Literal["none", "header", "decode"] = "header",
    on_corrupt: Literal["error", "skip"] = "error",
    extensions: Sequence[str] = (".jpg", ".jpeg", ".JPEG", ".png"),
    workers: int = 1,
    share: ScanShare | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_classes: Callable[[list[str]], None] | None = None,
) -> ImageFolderIndex:
    """Index an ImageFolder tree, checking each image as asked.

    Class folders are ``root``'s non-hidden sub-folders, sorted; images are found recursively
    inside them, in sorted order, by file extension (compared case-insensitively); files of image
    formats not read (BMP, GIF, TIFF, WebP, PNM) are listed in ``other_formats``. Hidden files
    and folders (leading ``.``) are ignored, as are files directly in ``root``. Symbolic links
    are followed only while they stay inside ``root``; a link that leaves it, dangles, or leads
    back into a folder already being walked (a loop) is left out and listed in
    ``links_skipped``, so a link can neither pull in files from elsewhere nor repeat a folder;
    so is a link into another class's folder (or a class folder linking to another), whose
    images would otherwise be trained under two labels.
    A folder that cannot be listed raises OSError naming it (its images would be missing).
    DALI's reader takes only UTF-8 names: an image whose name (or sub-folder's) is not UTF-8 is
    a bad file at every ``check``, as is one that is not a regular file (a FIFO, socket or
    device: never opened); a class folder or ``root`` so named is refused.

    Args:
        root: the dataset split folder, e.g. ``.../train``.
        check: ``"none"`` (extension and name only), ``"header"`` (markers and size, see
            :func:`check_image_file`) or ``"decode"`` (full Pillow decode, which also finds a
            JPEG cut inside its image data and ended with an EOI marker).
        on_corrupt: ``"error"`` raises on the first bad file; ``"skip"`` leaves it out and
            records it in ``skipped``.
        extensions: file name endings counted as images.
        workers: threads that check files side by side (:mod:`.folder_check`); the tree is
            listed first, and the result is the one-thread scan's, in the same order.
        share: under torchrun, this rank's share of the checks; the ranks compare their file
            lists (also with ``check="none"``) and combine what they found (collectives: every
            rank must call the scan with the same folder). A rank whose listing fails (a folder
            it may not read, a missing ``root``) tells the others in their next exchange, and
            every rank raises the same :class:`CheckFailedError` naming that rank.
        progress: called with ``(checked, total)`` of this process's share at the start of the
            checks and then about every 30 seconds.
        on_classes: called with the class names before any image is listed (torchrun's ranks
            compare theirs there, through :func:`.folder_check.exchange`); what it raises stops
            the scan, a ValueError as this rank's own (told to the others like a listing
            failure), anything else as every rank's.

    Raises:
        FileNotFoundError: ``root`` does not exist (or is not a folder).
        ValueError: ``root`` has no class sub-folders, or no images are left, or it or a class
            folder has a name that is not UTF-8.
        CorruptImageError: a bad file when ``on_corrupt="error"``; names the file and reason.
        CheckFailedError: a file's check raised or ran past ``FILE_TIMEOUT_S``, or a listing
            failed, here or on another rank (:mod:`.folder_check`); names the rank and file.
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
    index = ImageFolderIndex(root=str(root_path))
    not_files: dict[str, str] = {}  # FIFOs, sockets, devices named like images: refused
    ranks = share is not None and share.world > 1
    try:
        index.classes, paths, labels = list_tree(
            root_path, exts, index.links_skipped, not_files, on_classes, index.other_formats
        )
    except (OSError, ValueError) as exc:  # this rank's own: the others wait in an exchange
        if ranks:
            assert share is not None
            raise folder_check.listing_failed(share, _said(exc)) from exc
        raise
    if ranks:  # also with check="none": a listing failure above is told in this exchange
        assert share is not None
        cut = len(os.path.dirname(index.root)) + 1 if os.path.dirname(index.root) else 0
        # Relative to root's parent ("train/n01/x.JPEG"): the error names the split too.
        folder_check.same_files(share, [p[cut:] for p in paths], _sizes(paths, check))
    _check_listed(index, paths, labels, check, on_corrupt, workers, share, progress, not_files)
    if not index.files:
        raise _no_images(index, list(extensions))
    return index


def _no_images(index: ImageFolderIndex, extensions: list[str]) -> ValueError:
    """The error for a folder left with no images, saying what was left out."""
    detail = f" ({len(index.skipped)} corrupt files skipped)" if index.skipped else ""
    if index.other_formats:
        detail += f" ({index.other_formats[0][1]}: {len(index.other_formats)} such files)"
    return ValueError(
        f"image folder {index.root!r} has no images with extensions {extensions}"
        f" in its {len(index.classes)} class folders{detail}"
    )


def _sizes(paths: list[str], check: str) -> list[int] | None:
    """The files' sizes (-1: no stat) when they are checked: each rank checks only its share,
    so a file cut short on one node's copy is found by comparing sizes (a stat per file, far
    less than the check's reads)."""
    if check == "none":
        return None
    sizes = []
    for path in paths:
        try:
            sizes.append(os.stat(path).st_size)
        except OSError:  # the check names it
            sizes.append(-1)
    return sizes


def _said(exc: BaseException) -> str:
    """An error's text without Python's ``[Errno N]`` prefix."""
    return (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)


def _check_listed(
    index: ImageFolderIndex,
    paths: list[str],
    labels: list[int],
    check: str,
    on_corrupt: str,
    workers: int,
    share: ScanShare | None,
    progress: Callable[[int, int], None] | None,
    not_files: dict[str, str],
) -> None:
    """Check the listed files (:mod:`.folder_check`) and fill ``index`` with the good ones."""

    def check_one(path: str) -> str | None:
        try:
            if path in not_files:
                raise CorruptImageError(path, not_files[path])
            if not is_utf8(path):
                raise CorruptImageError(path, f"its name is not UTF-8{RENAME}")
            if check != "none":
                check_image_file(path, check)  # type: ignore[arg-type]
        except CorruptImageError as exc:
            return exc.reason
        return None

    heavy = check != "none"  # the name check alone is not worth threads or a collective
    bad = check_files(
        paths,
        check_one,
        stop_at_first=on_corrupt == "error",
        workers=workers if heavy else 1,
        share=share if heavy else None,
        progress=progress if heavy else None,
        compared=True,  # scan_image_folder compared the ranks' lists
        file_timeout_s=folder_check.FILE_TIMEOUT_S if heavy else None,
    )
    if bad and on_corrupt == "error":
        raise CorruptImageError(paths[bad[0][0]], bad[0][1])
    left_out = {i for i, _ in bad}
    index.skipped = [(paths[i], reason) for i, reason in bad]
    index.files = [p for i, p in enumerate(paths) if i not in left_out]
    index.labels = [n for i, n in enumerate(labels) if i not in left_out]
