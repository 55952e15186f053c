"""A decode check that ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` does not weaken (docs/train.md,
"Damaged images"). Real JPEG/PNG files written by Pillow."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from echopipe.data import CorruptImageError, check_image_file


def _pixels(seed: int, size: tuple[int, int] = (96, 128)) -> np.ndarray:
    y, x = np.mgrid[0 : size[0], 0 : size[1]]
    smooth = np.stack([(x * 1.7) % 256, (y * 2.3) % 256, (x + y) % 256], axis=-1)
    noise = np.random.default_rng(seed).normal(0, 24, (*size, 3))
    return (smooth + noise).clip(0, 255).astype(np.uint8)


def _encode(pixels: np.ndarray, fmt: str = "JPEG", **save: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **save)
    return buf.getvalue()


def _cut_with_eoi(jpeg: bytes) -> bytes:
    scan = jpeg.rindex(b"\xff\xda")
    scan += 2 + int.from_bytes(jpeg[scan + 2 : scan + 4], "big")
    return jpeg[: scan + (len(jpeg) - 2 - scan) // 2] + b"\xff\xd9"


def _png_cut_with_iend(png: bytes) -> bytes:
    idat = png.index(b"IDAT") - 4
    length = int.from_bytes(png[idat : idat + 4], "big")
    return png[: idat + 8 + length // 2] + png[png.index(b"IEND") - 4 :]


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_decode_check_ignores_load_truncated_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's ``LOAD_TRUNCATED_IMAGES = True`` makes Pillow keep a PNG cut inside its image
    data; the check still names it, and leaves the global as the user set it."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    png = _write(tmp_path / "cut.png", _png_cut_with_iend(_encode(_pixels(3), "PNG")))
    with Image.open(png) as im:
        im.load()  # what the setting does: no error
    with pytest.raises(CorruptImageError, match="PNG") as exc:
        check_image_file(png, "decode")
    assert exc.value.path == str(png)
    jpeg = _write(tmp_path / "cut.jpg", _cut_with_eoi(_encode(_pixels(4), quality=90)))
    with pytest.raises(CorruptImageError):
        check_image_file(jpeg, "decode")
    for i, save in enumerate(({"quality": 90}, {"quality": 75, "progressive": True})):
        check_image_file(_write(tmp_path / f"whole{i}.jpg", _encode(_pixels(i), **save)), "decode")
    for i, mode in enumerate(("RGB", "L", "P", "RGBA")):
        whole = Image.fromarray(_pixels(i)).convert(mode)
        for interlace in (False, True):
            buf = io.BytesIO()
            whole.save(buf, format="PNG", interlace=interlace)
            check_image_file(_write(tmp_path / f"w{i}{interlace}.png", buf.getvalue()), "decode")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True
