"""Bounded reading of the files echopipe loads (checkpoints, saved states).

A file from elsewhere may pass every checksum and still be built to hurt the reader: a header
that declares 50 GiB, a sparse file that costs no disk but reads as gigabytes of zeros, a zip
member that inflates a thousandfold, a ``.npy`` header whose shape asks for a terabyte, a
pickle whose shared references make a small file decode into a huge tree, or a tensor view
whose strides make 4 bytes look like a gigabyte. The helpers here check sizes and structure
against the file's own length *before* anything is allocated from a declared figure, so the
memory a file can make the process use stays a small multiple of the file's size.

Every refusal is a :class:`FileCheckError` whose message says what is wrong (the caller names
the file).
"""

from __future__ import annotations

import errno
import io
import math
import os
import stat
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "FileCheckError",
    "check_stored_zip",
    "check_tree",
    "memory_bytes",
    "open_regular",
    "read_exactly",
    "read_npz",
]

_CHUNK = 1 << 20
_NPY_DTYPE_KINDS = "biufc"


class FileCheckError(ValueError):
    """A file or blob that fails a bounded-reading check; the message says why."""


def memory_bytes() -> int:
    """Physical memory of this machine: no file larger than it is read into memory."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not Linux: no ceiling from the machine
        return 1 << 62


def open_regular(path: str | os.PathLike[str]) -> tuple[io.BufferedReader, int]:
    """``(binary file, size)`` of a regular, non-sparse file.

    Opened without blocking (a FIFO or device under the name is refused, not waited on), and
    checked on the open descriptor, so the name cannot be swapped between check and read. A
    file that is mostly holes (``truncate``-made, never written by echopipe) is refused before
    any of it is read: its length is not backed by data.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileCheckError("is not a regular file")
        size = st.st_size
        if _has_hole(fd, size):
            raise FileCheckError(
                f"is a sparse file ({size} bytes long but mostly never written); echopipe "
                "never writes one"
            )
        if size > memory_bytes():
            raise FileCheckError(f"is {size} bytes, more than this machine's memory")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    return f, size


def _has_hole(fd: int, size: int) -> bool:
    """Whether most of the file is holes (never written). A copy made with ``cp
    --sparse=always`` (or a file system that stores zero blocks as holes) may have a few holes
    where a real checkpoint holds zeros; a ``truncate``-made file is nearly all hole."""
    if size == 0:
        return False
    try:
        data, pos = 0, 0
        for _ in range(4096):  # extents; a real file has few, a crafted one is cut short
            start = os.lseek(fd, pos, os.SEEK_DATA)
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            data += pos - start
            if pos >= size:
                break
        else:
            return False  # too fragmented to count: let the reader's other checks decide
        return data < size // 2
    except OSError as exc:  # ENXIO: no data after pos (the rest is a hole)
        if exc.errno == errno.ENXIO:
            return data < size // 2
        return False  # no SEEK_DATA here: the size checks alone
    except AttributeError:
        return False
    finally:
        os.lseek(fd, 0, os.SEEK_SET)


def read_exactly(f: io.BufferedReader, count: int) -> bytes:
    """``count`` bytes from ``f`` in chunks; FileCheckError when the file ends first or has
    more after them (it changed while read)."""
    out = bytearray()
    while len(out) < count:
        chunk = f.read(min(_CHUNK, count - len(out)))
        if not chunk:
            raise FileCheckError(f"ends after {len(out)} of {count} bytes (it changed while read)")
        out += chunk
    if f.read(1):
        raise FileCheckError(f"holds more than the {count} bytes it had (it changed while read)")
    return bytes(out)


def check_stored_zip(data: bytes, *, max_members: int = 1 << 16) -> zipfile.ZipFile:
    """The zip archive in ``data``, every member checked to be stored uncompressed and to lie
    inside ``data``: no member can inflate beyond the archive's own size."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as exc:
        raise FileCheckError(f"is not a readable zip archive ({exc})") from None
    if len(members) > max_members:
        raise FileCheckError(f"holds {len(members)} archive members (at most {max_members})")
    total = 0
    names = set()
    for info in members:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise FileCheckError(
                f"archive member {info.filename!r} is compressed; echopipe stores members "
                "uncompressed, so a compressed one is refused (it could inflate without bound)"
            )
        if info.header_offset + info.file_size > len(data) or info.filename in names:
            raise FileCheckError(f"archive member {info.filename!r} is damaged or repeated")
        names.add(info.filename)
        total += info.file_size
    if total > len(data):
        raise FileCheckError("archive members declare more bytes than the archive holds")
    return archive


def read_npz(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of an ``np.savez`` archive, each ``.npy`` header checked against its member's
    length before the array is made; no object (pickled) arrays."""
    archive = check_stored_zip(data)
    out: dict[str, np.ndarray] = {}
    for info in archive.infolist():
        if not info.filename.endswith(".npy"):
            raise FileCheckError(f"archive member {info.filename!r} is not a .npy array")
        try:
            raw = archive.read(info)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
            raise FileCheckError(f"archive member {info.filename!r} is damaged ({exc})") from None
        out[info.filename[: -len(".npy")]] = _npy_array(raw, info.filename)
    return out


def _npy_array(raw: bytes, name: str) -> np.ndarray:
    fmt = np.lib.format
    stream = io.BytesIO(raw)
    try:
        version = fmt.read_magic(stream)
        reader = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = reader(stream, max_header_size=10_000)
    except (ValueError, TypeError, SyntaxError, OverflowError, EOFError) as exc:
        raise FileCheckError(f"array {name!r} has a damaged header ({exc})") from None
    if dtype.kind not in _NPY_DTYPE_KINDS or dtype.hasobject or dtype.subdtype is not None:
        raise FileCheckError(f"array {name!r} has dtype {dtype}, which echopipe never stores")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise FileCheckError(f"array {name!r} declares shape {shape}")
    count = math.prod(shape)
    offset = stream.tell()
    if count * dtype.itemsize != len(raw) - offset:
        raise FileCheckError(
            f"array {name!r} declares shape {shape} ({count * dtype.itemsize} bytes) but holds "
            f"{len(raw) - offset}"
        )
    flat = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran else "C").copy()


def check_tree(obj: Any, *, budget: int, max_depth: int = 64) -> None:
    """Check that walking ``obj`` (nested dicts, lists, tuples, strings, bytes, tensors and
    numpy arrays) visits at most ``budget`` items and bytes in all, and no deeper than
    ``max_depth``.

    Shared references are counted at every visit, as a decoder that copies would pay them, so
    a small pickle whose memo repeats one list a million times is refused. A tensor counts the
    bytes it would take if copied, and must lie inside its storage (no stride-0 or overlapping
    view that makes a few bytes look like gigabytes).
    """
    spent = 0
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise FileCheckError(f"is nested deeper than {max_depth} levels")
        spent += 1 + _payload_bytes(value)
        if spent > budget:
            raise FileCheckError(
                f"decodes to more than {budget} items and bytes (shared references repeated, "
                "or a view larger than its data)"
            )
        for child in _children(value):
            stack.append((child, depth + 1))


def _children(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield v
    elif isinstance(value, list | tuple):
        yield from value


def _payload_bytes(value: Any) -> int:
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage"):
        return _tensor_bytes(value)
    return 0


def _tensor_bytes(t: Any) -> int:
    """Bytes a copy of tensor ``t`` takes; FileCheckError for a view reaching outside its
    storage or larger than it."""
    itemsize = t.element_size()
    capacity = t.untyped_storage().nbytes() // max(itemsize, 1)
    numel = t.numel()
    if numel == 0:
        return 0
    if any(s < 0 for s in t.stride()) or t.storage_offset() < 0:
        raise FileCheckError("holds a tensor with negative strides")
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    if last >= capacity or numel > capacity:
        raise FileCheckError(
            f"holds a tensor of shape {tuple(t.shape)} that reaches outside its {capacity}-"
            "element storage (a view larger than its data)"
        )
    return numel * itemsize
