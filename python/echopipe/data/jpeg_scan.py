"""Finding a JPEG whose image data stops before its last block: cut, then ended with EOI.

A download cut in the middle of a JPEG's entropy-coded scan and then "repaired" with an EOI
marker (``FF D9``), or cut where ``FF D9`` happens to follow, passes every check of its markers,
and libjpeg (inside Pillow and DALI's CPU decoder alike) decodes it without an error: on
meeting the marker inside the scan it warns ("Corrupt JPEG data: premature end of data
segment"; Pillow drops the warning, DALI prints it to stderr without the file's name) and fills
the rest of the image with zero coefficients, a grey lower part. No decoder reports it to the
caller, so :func:`scan_cut_short` tells it by its effect: bytes put into the file just before
the EOI that ends the last scan are extraneous to a complete scan (libjpeg skips them, the
pixels do not change), but a scan that ran out decodes them as the missing blocks' data (the
pixels change). The cost is a second decode.
"""

from __future__ import annotations

import io

from PIL import Image

__all__ = ["end_of_image", "scan_cut_short", "strict_jpeg_decode"]

# Entropy-coded bytes are anything but FF (FF would need a stuffed 00); a varied pattern decodes
# to non-zero coefficients whatever the Huffman tables, where zeros could decode to nothing.
_FILL = bytes((i * 151 + 89) % 255 for i in range(64))
# A real JPEG has a few dozen segments (a progressive one a few per scan); more are refused.
_MAX_SEGMENTS = 4096
_NO_LENGTH = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn and TEM: markers without a length


def strict_jpeg_decode(data: bytes) -> Image.Image:
    """The JPEG in ``data`` decoded whole; raises (ValueError, OSError and Pillow's other
    types) when it cannot be, whatever ``LOAD_TRUNCATED_IMAGES`` says."""
    with Image.open(io.BytesIO(data)) as im:
        tile = im.tile[0]
        mode, size = im.mode, im.size
    # (codec, extents, offset, args): the JPEG decoder reads the whole file, markers and all.
    return Image.frombytes(mode, size, data[tile[2] :], tile[0], tile[3])


def end_of_image(data: bytes) -> int:
    """Offset of the EOI marker that ends the last scan of the JPEG in ``data`` (garbage after
    it, which decoders ignore, is not looked at). Raises ValueError saying why there is none:
    a segment that runs past the end of the file, or no EOI after the scans."""
    pos, in_scan = 2, False
    for _ in range(_MAX_SEGMENTS):
        # Entropy-coded data runs to the first FF that is not 00 (stuffing), RSTn or fill;
        # bytes between segments are skipped to the next FF, as libjpeg does (with a warning).
        pos = data.find(b"\xff", pos)
        while (
            in_scan
            and 0 <= pos < len(data) - 1
            and (data[pos + 1] == 0 or 0xD0 <= data[pos + 1] <= 0xD7)
        ):
            pos = data.find(b"\xff", pos + 2)
        if pos < 0 or pos + 1 >= len(data):
            raise ValueError("JPEG has no end-of-image marker after its scan")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == 0xD9:
            return pos
        if marker in _NO_LENGTH:
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if length < 2 or pos + 2 + length > len(data):
            raise ValueError(f"JPEG marker segment at byte {pos} runs past the end of the file")
        in_scan = marker == 0xDA
        pos += 2 + length
    raise ValueError(f"JPEG has more than {_MAX_SEGMENTS} marker segments")


def scan_cut_short(data: bytes, decoded: Image.Image) -> str | None:
    """Why the JPEG in ``data``, which Pillow decoded to ``decoded`` (loaded), is missing part
    of its image data (see the module notes), or None when nothing is missing."""
    try:
        end = end_of_image(data)
    except ValueError as exc:
        return f"{exc} (truncated?); decoders fill what is missing"
    cut = _CUT
    try:
        probe = strict_jpeg_decode(data[:end] + _FILL + data[end:])
        if _same_pixels(probe, decoded):
            cut = None
    except Exception:  # Pillow raises many types: the extra bytes were read as image data
        pass
    return cut


# Pixels compared at a time by _same_pixels: a few MiB per strip.
_STRIP_PIXELS = 1 << 20


def _same_pixels(a: Image.Image, b: Image.Image) -> bool:
    """Whether two decoded images are the same, compared a strip of rows at a time: a whole
    image's ``tobytes()`` would add two copies of each (Pillow joins its chunks), and with the
    two images held that made the check's peak nearly 6 times the decoded size (2.7 GiB for a
    660-byte JPEG whose header says 13000 x 13000) on each checking thread."""
    if a.mode != b.mode or a.size != b.size:
        return False
    width, height = a.size
    rows = max(1, _STRIP_PIXELS // max(width, 1))
    for top in range(0, height, rows):
        box = (0, top, width, min(height, top + rows))
        if a.crop(box).tobytes() != b.crop(box).tobytes():
            return False
    return True


_CUT = (
    "JPEG image data stops before the image is complete (cut, then ended with an "
    "end-of-image marker?); decoders fill the rest grey"
)
