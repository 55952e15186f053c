"""Odd but valid image files, written by Pillow, through the checks, DALI's CPU decoder and
``echopipe train`` (docs/train.md, "Image kinds")."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from echopipe.cli import main
from echopipe.data import check_image_file, scan_image_folder


def _pixels(h: int = 48, w: int = 64, seed: int = 0) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    smooth = np.stack([(x * 3) % 256, (y * 5) % 256, (x + y) % 256], axis=-1)
    noise = np.random.default_rng(seed).normal(0, 10, (h, w, 3))
    return (smooth + noise).clip(0, 255).astype(np.uint8)


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


# name -> (image, format, save options); every kind a real ImageNet-style folder may hold.
def _kinds() -> dict[str, tuple[Image.Image, str, dict[str, object]]]:
    rgb = Image.fromarray(_pixels())
    grey16 = Image.fromarray(_pixels()[..., 0].astype(np.uint16) * 257)
    return {
        "grey.JPEG": (rgb.convert("L"), "JPEG", {}),
        "cmyk.JPEG": (rgb.convert("CMYK"), "JPEG", {}),
        "progressive.JPEG": (rgb, "JPEG", {"progressive": True}),
        "exif6.JPEG": (Image.fromarray(_pixels(32, 64)), "JPEG", {"exif": _exif(6)}),
        "exif8.JPEG": (Image.fromarray(_pixels(32, 64)), "JPEG", {"exif": _exif(8)}),
        "exif3.JPEG": (Image.fromarray(_pixels(32, 64)), "JPEG", {"exif": _exif(3)}),
        "one.JPEG": (Image.fromarray(_pixels(1, 1)), "JPEG", {}),
        "wide.JPEG": (Image.fromarray(_pixels(16, 4000)), "JPEG", {}),
        "png_named.JPEG": (rgb, "PNG", {}),
        "rgba.png": (rgb.convert("RGBA"), "PNG", {}),
        "grey16.png": (grey16, "PNG", {}),
        "palette.png": (rgb.convert("P", palette=Image.Palette.ADAPTIVE), "PNG", {}),
        "grey_alpha.png": (rgb.convert("LA"), "PNG", {}),
        "bilevel.png": (rgb.convert("1"), "PNG", {}),
        "upper.PNG": (rgb, "PNG", {}),
        "upper.JPG": (rgb, "JPEG", {}),
        "mixed.Jpeg": (rgb, "JPEG", {}),
    }


def _write_kinds(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (image, fmt, options) in _kinds().items():
        image.save(folder / name, format=fmt, **options)  # type: ignore[arg-type]
        paths[name] = folder / name
    return paths


def _dali_decode(paths: list[Path]) -> dict[str, np.ndarray]:
    """Each file decoded by one real DALI CPU pipeline (reader, ``fn.decoders.image``, RGB)."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=len(paths), num_threads=1, device_id=None)
    def decode():  # type: ignore[no-untyped-def]
        jpegs, _ = fn.readers.file(files=[str(p) for p in paths], labels=[0] * len(paths))
        sources = fn.get_property(jpegs, key="source_info")
        return fn.decoders.image(jpegs, device="cpu", output_type=types.RGB), sources

    pipe = decode()
    pipe.build()
    images, sources = pipe.run()
    return {
        Path(bytes(np.array(sources.at(i))).decode()).name: np.array(images.at(i))
        for i in range(len(paths))
    }


def _reference(path: Path) -> np.ndarray:
    """What DALI's decoder gives, from Pillow: EXIF orientation applied, and a 16-bit image
    scaled to 8 bits (Pillow's ``convert("RGB")`` clips it to white instead)."""
    with Image.open(path) as im:
        if im.mode.startswith("I;16"):
            grey = (np.asarray(im).astype(np.uint32) // 257).astype(np.uint8)
            return np.repeat(grey[..., None], 3, axis=-1)
        return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))


def test_every_kind_passes_both_checks_and_decodes_to_its_rgb_pixels(tmp_path: Path) -> None:
    paths = _write_kinds(tmp_path / "c")
    for path in paths.values():
        check_image_file(path, "header")
        check_image_file(path, "decode")
    decoded = _dali_decode(list(paths.values()))
    for name, path in paths.items():
        want = _reference(path)
        got = decoded[name]
        assert got.dtype == np.uint8 and got.shape == want.shape, (name, got.shape, want.shape)
        assert np.abs(got.astype(int) - want).max() <= 1, name
    assert decoded["exif6.JPEG"].shape == (64, 32, 3)  # turned upright, as Pillow does not


def _other_formats(folder: Path) -> list[Path]:
    rgb = Image.fromarray(_pixels())
    files = []
    for name, fmt in (("b.bmp", "BMP"), ("g.gif", "GIF"), ("t.TIF", "TIFF"), ("w.webp", "WEBP")):
        rgb.save(folder / name, format=fmt)
        files.append(folder / name)
    return files


def test_scan_lists_files_of_other_image_formats(tmp_path: Path) -> None:
    """BMP, GIF, TIFF and WebP files, which torchvision's ImageFolder reads, are listed as
    left out (echopipe reads JPEG and PNG), not passed over in silence."""
    _write_kinds(tmp_path / "a")
    (tmp_path / "b").mkdir()
    Image.fromarray(_pixels()).save(tmp_path / "b" / "x.JPEG")
    others = _other_formats(tmp_path / "b")
    (tmp_path / "b" / "notes.txt").write_text("not an image")
    index = scan_image_folder(tmp_path)
    assert len(index.files) == len(_kinds()) + 1 and not index.skipped
    assert [p for p, _ in index.other_formats] == [str(p) for p in others]
    assert all("reads JPEG and PNG only" in why for _, why in index.other_formats)


def test_train_on_every_kind_says_and_counts_other_formats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    for split in ("train", "val"):
        for c in ("ant", "bee"):
            _write_kinds(data / split / c)
    webp = data / "train" / "bee" / "w.webp"
    Image.fromarray(_pixels()).save(webp, format="WEBP")
    run = tmp_path / "run"
    argv = ["train", "--data", str(data), "--output", str(run), "-b", "4", "--image-size", "32",
            "--epochs", "1", "--max-steps", "2", "--stages", "1", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    assert f"data: 1 image(s) of other formats left out of train/ (e.g. {webp}: a .webp" in err
    assert "left out            1 image(s) of other formats of train/" in out, out
    doc = json.loads((run / "metrics.json").read_text())
    assert doc["summary"]["left_out"] == ["1 image(s) of other formats of train/"]
    assert doc["epochs"][0]["val_images"] == 2 * len(_kinds())


def _header_bomb(width: int, height: int) -> bytes:
    """A 16 x 16 JPEG whose frame header says ``width`` x ``height``: a few hundred bytes that
    decode (grey beyond the first blocks) to ``3 * width * height`` bytes."""
    buf = io.BytesIO()
    Image.fromarray(_pixels(16, 16)).save(buf, format="JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


_PEAK = """
import resource, sys
from echopipe.data import CorruptImageError, check_image_file
check_image_file(sys.argv[2], "decode")  # Pillow's codecs loaded, the baseline settled
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    check_image_file(sys.argv[1], "decode")
except CorruptImageError as exc:
    print(exc.reason, file=sys.stderr)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_decode_check_of_a_header_bomb_holds_about_two_decoded_images(tmp_path: Path) -> None:
    """A file under MAX_IMAGE_PIXELS is decoded by --check decode: twice (the cut-scan probe,
    jpeg_scan), so two decoded images at least. Comparing the two with whole-image
    ``tobytes()`` held nearly six (2.7 GiB for a 660-byte file saying 13000 x 13000), on every
    checking thread at once."""
    bomb = tmp_path / "bomb.JPEG"
    bomb.write_bytes(_header_bomb(5000, 5000))
    small = tmp_path / "small.JPEG"
    small.write_bytes(_header_bomb(16, 16))
    run = subprocess.run(
        [sys.executable, "-c", _PEAK, str(bomb), str(small)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "stops before the image is complete" in run.stderr, run.stderr
    decoded = 3 * 5000 * 5000
    assert int(run.stdout) < 3.5 * decoded, (int(run.stdout) / decoded, run.stderr)


_VAL_PEAK = """
import resource, sys
import numpy as np
from echopipe.dali import imagenet_val_pipeline
pipe = imagenet_val_pipeline(sys.argv[1], batch_size=1, image_size=32, num_threads=1,
                             prefetch_queue_depth=1)
pipe.build()
shapes = [np.array(pipe.run()[0].at(0)).shape]  # a/plain.JPEG: the baseline settles
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
image = np.array(pipe.run()[0].at(0))  # a/strip.png
assert image.shape == (3, 32, 32) and np.isfinite(image).all(), image.shape
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_validation_of_a_one_pixel_high_image_stays_small(tmp_path: Path) -> None:
    """A valid 100000 x 1 PNG (a few hundred bytes) in val/: resized whole to a shorter side of
    37 it was 3.7 M x 37 pixels (411 MB), for a 32 x 32 centre crop; it is cut to its centre
    at MAX_VAL_ASPECT first."""
    for c in ("a", "b"):
        (tmp_path / "val" / c).mkdir(parents=True)
        Image.fromarray(_pixels()).save(tmp_path / "val" / c / "plain.JPEG")
    strip = np.tile(_pixels(1, 1000), (1, 100, 1))
    Image.fromarray(strip).save(tmp_path / "val" / "a" / "strip.png")
    run = subprocess.run(
        [sys.executable, "-c", _VAL_PEAK, str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) < 100 * 2**20, int(run.stdout)
