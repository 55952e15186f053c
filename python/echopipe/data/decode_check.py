"""The ``"decode"`` check of an image file: a full decode that no setting of Pillow's weakens.

``PIL.ImageFile.LOAD_TRUNCATED_IMAGES = True``, which a user's code may set for its own
reasons, makes :meth:`PIL.ImageFile.ImageFile.load` keep what it decoded of a file that ends
early or that its decoder fails on, and makes the PNG reader skip bad chunk checksums. It is a
module global, read by every thread; the check neither sets it nor depends on it:

- a JPEG is decoded with :meth:`PIL.Image.Image.frombytes`, which hands the whole file to the
  decoder and raises when the decoder fails or wants more data than the file holds, whatever
  the global says; then a second time to find a scan cut and ended with an EOI marker
  (:mod:`echopipe.data.jpeg_scan`, whose second decode is as strict);
- a PNG is read chunk by chunk here: every chunk's CRC must match, and the concatenated IDAT
  data must be one complete zlib stream holding exactly the bytes the header's size, bit
  depth, colour type and interlacing call for. Pillow then decodes it as well.

A decode holds the file and up to two decoded copies of the image: about 1.4 GB at the largest
size the header check lets through. The checks of one process share :data:`DECODE_BUDGET`, so
a pool of threads that meets a folder of such images holds about that once, not once per
thread; ordinary photos (a few MB each) never wait for it.
"""

from __future__ import annotations

import contextlib
import io
import threading
import warnings
import zlib
from collections.abc import Iterator

from PIL import Image

from .jpeg_scan import scan_cut_short, strict_jpeg_decode

__all__ = ["DECODE_BUDGET", "DECODE_BUDGET_BYTES", "MemoryBudget", "decode_bytes", "decode_problem"]

DECODE_BUDGET_BYTES = 1 << 30
"""Memory the decode checks of one process may hold at once (bytes); one decode that needs more
waits until it can run alone."""

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Samples per pixel of each PNG colour type (greyscale, RGB, palette, grey + alpha, RGBA).
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
# Adam7: (x start, y start, x step, y step) of each of the seven passes.
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
          (0, 1, 1, 2))  # fmt: skip


class MemoryBudget:
    """Bytes that threads hold while they work: a request waits until it fits beside the others,
    and one larger than the whole budget waits for all of it (it then runs alone). The waits end
    when a holder does; a holder stuck in a read is the folder check's per-file timeout's to
    name (:data:`~echopipe.data.folder_check.FILE_TIMEOUT_S`)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = self.peak = self.holds = self.waiting = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Holds ``nbytes`` (at most the whole budget) for the ``with`` block."""
        n = max(0, min(int(nbytes), self.total))
        with self._cond:
            self.waiting += 1
            while self.used + n > self.total:
                self._cond.wait()
            self.waiting -= 1
            self.used += n
            self.peak, self.holds = max(self.peak, self.used), self.holds + 1
        try:
            yield
        finally:
            with self._cond:
                self.used -= n
                self._cond.notify_all()


DECODE_BUDGET = MemoryBudget(DECODE_BUDGET_BYTES)


def decode_bytes(file_bytes: int, pixels: int) -> int:
    """What the decode check of a file holds at most: the file, and two images of up to 8 bytes
    per pixel (a JPEG's second decode in :mod:`.jpeg_scan`; a 16-bit RGBA PNG's inflated data
    and Pillow's image)."""
    return file_bytes + 2 * 8 * pixels


def decode_problem(data: bytes) -> str | None:
    """Why the JPEG or PNG in ``data`` (whose header check passed) does not decode whole, or
    None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if data.startswith(_PNG_SIGNATURE):
                problem = _png_problem(data)
                if problem is not None:
                    return problem
                with Image.open(io.BytesIO(data)) as im:
                    im.load()
                return None
            decoded = strict_jpeg_decode(data)
            # libjpeg's warnings never reach Pillow's caller; see jpeg_scan.
            cut = scan_cut_short(data, decoded)
    except Exception as exc:  # Pillow raises many types for bad data
        return f"decode failed: {exc}"
    return cut


def _png_problem(data: bytes) -> str | None:
    """Why the PNG's chunks or image data are damaged, or None."""
    pos, idat, header = len(_PNG_SIGNATURE), [], b""
    while True:
        if pos + 12 > len(data):
            return "PNG ends inside a chunk (truncated?)"
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8]
        end = pos + 12 + length
        if end > len(data):
            return f"PNG chunk {kind!r} at byte {pos} runs past the end of the file (truncated?)"
        body = data[pos + 8 : end - 4]
        if zlib.crc32(kind + body) != int.from_bytes(data[end - 4 : end], "big"):
            return f"PNG chunk {kind!r} at byte {pos} has a bad checksum (damaged)"
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos = end
    if len(header) != 13:
        return "PNG has no valid IHDR chunk"
    try:
        inflate = zlib.decompressobj()
        pixels = inflate.decompress(b"".join(idat))
    except zlib.error as exc:
        return f"PNG image data is damaged ({exc})"
    if not inflate.eof:
        return "PNG image data stops before the image is complete (cut, then ended with IEND?)"
    want = _png_data_bytes(header)
    if want is not None and len(pixels) != want:
        return f"PNG image data holds {len(pixels)} bytes where its header calls for {want}"
    return None


def _png_data_bytes(header: bytes) -> int | None:
    """Bytes of filtered image data the IHDR chunk calls for, or None for a colour type or bit
    depth it does not define (Pillow's decode then judges)."""
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    depth, colour, interlace = header[8], header[9], header[12]
    if colour not in _PNG_CHANNELS or depth not in (1, 2, 4, 8, 16):
        return None
    bits = depth * _PNG_CHANNELS[colour]

    def rows(w: int, h: int) -> int:  # one filter byte per row, then the row's samples
        return 0 if w == 0 or h == 0 else h * (1 + (w * bits + 7) // 8)

    if interlace == 0:
        return rows(width, height)
    return sum(
        rows((width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy) for x0, y0, dx, dy in _ADAM7
    )
