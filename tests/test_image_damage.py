"""Damaged images written by Pillow: what the checks, Pillow, DALI's CPU decoder and
``echopipe train`` do with each (docs/train.md, "Damaged images")."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from echopipe.cli import main
from echopipe.data import CorruptImageError, check_image_file, scan_image_folder

# Encodings a dataset holds: baseline, progressive, optimised tables, no chroma subsampling,
# grey, restart markers.
ENCODINGS = {
    "baseline": {"quality": 90},
    "progressive": {"quality": 75, "progressive": True},
    "optimized": {"quality": 50, "optimize": True},
    "444": {"quality": 80, "subsampling": 0},
    "grey": {"quality": 85},
    "restarts": {"quality": 85, "restart_marker_blocks": 4},
}


def _pixels(seed: int = 0, size: tuple[int, int] = (96, 128)) -> np.ndarray:
    """A smooth picture with noise: every block holds data, as in a photograph."""
    y, x = np.mgrid[0 : size[0], 0 : size[1]]
    smooth = np.stack([(x * 1.7) % 256, (y * 2.3) % 256, (x + y) % 256], axis=-1)
    noise = np.random.default_rng(seed).normal(0, 24, (*size, 3))
    return (smooth + noise).clip(0, 255).astype(np.uint8)


def _encode(pixels: np.ndarray, fmt: str = "JPEG", **save: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **save)
    return buf.getvalue()


def _jpeg(encoding: str = "baseline", seed: int = 0) -> bytes:
    pixels = _pixels(seed)
    return _encode(pixels[..., 0] if encoding == "grey" else pixels, **ENCODINGS[encoding])


def _cut_with_eoi(jpeg: bytes, keep: float = 0.5) -> bytes:
    """Cut inside the last scan's entropy-coded data (``keep`` of the way), then end it with
    EOI: a "repaired" download."""
    scan = jpeg.rindex(b"\xff\xda")
    scan += 2 + int.from_bytes(jpeg[scan + 2 : scan + 4], "big")
    return jpeg[: scan + int((len(jpeg) - 2 - scan) * keep)] + b"\xff\xd9"


def _png_cut_with_iend(png: bytes) -> bytes:
    idat = png.index(b"IDAT") - 4
    length = int.from_bytes(png[idat : idat + 4], "big")
    return png[: idat + 8 + length // 2] + png[png.index(b"IEND") - 4 :]


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _dali_decode(path: Path) -> np.ndarray:
    """The file decoded by a real DALI CPU pipeline (reader, ``fn.decoders.image`` on the CPU)."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def decode():  # type: ignore[no-untyped-def]
        jpegs, _ = fn.readers.file(files=[str(path)], labels=[0])
        return fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    (images,) = pipe.run()
    return np.array(images.at(0))


def test_pillow_and_dalis_cpu_decoder_take_a_jpeg_cut_and_ended_with_eoi_silently(
    tmp_path: Path,
) -> None:
    """The premise: neither decoder says anything to its caller; the missing part is grey."""
    path = _write(tmp_path / "cut.jpg", _cut_with_eoi(_jpeg()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Image.open(path) as im:
            im.load()
            pil = np.asarray(im.convert("RGB"))
    assert not caught and pil.shape == (96, 128, 3)
    assert (pil[-8:] == 128).all()  # zero coefficients: mid grey
    dali = _dali_decode(path)
    assert dali.shape == (96, 128, 3) and (dali[-8:] == 128).all()
    check_image_file(path, "header")  # its markers are all there


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9])
def test_decode_check_names_a_jpeg_cut_inside_its_image_data(
    tmp_path: Path, encoding: str, keep: float
) -> None:
    path = _write(tmp_path / "cut.jpg", _cut_with_eoi(_jpeg(encoding), keep))
    check_image_file(path, "header")
    with pytest.raises(CorruptImageError) as info:
        check_image_file(path, "decode")
    assert info.value.path == str(path)
    assert "stops before the image is complete" in info.value.reason


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_decode_check_passes_whole_jpegs(tmp_path: Path, encoding: str) -> None:
    """No false alarm: whole files of every encoding, one with data after its end, and one
    whose comment segment holds an EOI (the segments are walked, not searched)."""
    whole = _jpeg(encoding)
    comment = b"\xff\xfe\x00\x06\xff\xd9\xff\xd9"
    for name, data in [
        ("whole.jpg", whole),
        ("trailer.jpg", whole + bytes(range(256)) * 2),
        ("comment.jpg", whole[:2] + comment + whole[2:]),
    ]:
        check_image_file(_write(tmp_path / name, data), "decode")


def test_header_check_passes_a_jpeg_with_more_than_a_kib_after_its_end(tmp_path: Path) -> None:
    """Data after the end marker (a camera's trailer, an appended video) is ignored by Pillow
    and DALI alike; the header check looked for the marker only in the last KiB."""
    whole = _jpeg()
    path = _write(tmp_path / "trailer.jpg", whole + bytes(range(256)) * 16)
    check_image_file(path, "header")
    check_image_file(path, "decode")
    reference = _write(tmp_path / "whole.jpg", whole)
    assert np.array_equal(_dali_decode(path), _dali_decode(reference))
    # Still refused: a JPEG with no end marker anywhere after its scan.
    cut = _write(tmp_path / "cut.jpg", whole[: len(whole) // 2] + bytes(range(256)) * 16)
    with pytest.raises(CorruptImageError, match="no end-of-image marker"):
        check_image_file(cut, "header")


def _damaged_folder(root: Path) -> dict[str, Path]:
    """A class folder holding one file of each kind, the damaged ones between whole ones."""
    whole = _jpeg()
    png = _encode(_pixels(1), "PNG")
    files = {
        "a_whole": _write(root / "c" / "a_whole.jpg", whole),
        "b_empty": _write(root / "c" / "b_empty.jpg", b""),
        "c_cut_eoi": _write(root / "c" / "c_cut_eoi.jpg", _cut_with_eoi(whole)),
        "d_cut": _write(root / "c" / "d_cut.jpg", whole[: len(whole) // 2]),
        "e_trailer": _write(root / "c" / "e_trailer.jpg", whole + bytes(range(256)) * 16),
        "f_png_cut": _write(root / "c" / "f_png_cut.png", _png_cut_with_iend(png)),
        "g_png": _write(root / "c" / "g_png.png", png),
    }
    _write(root / "d" / "whole.jpg", whole)
    return files


@pytest.mark.parametrize(
    ("check", "left_out"),
    [("header", {"b_empty", "d_cut"}), ("decode", {"b_empty", "c_cut_eoi", "d_cut", "f_png_cut"})],
)
def test_scan_skips_and_counts_each_damaged_file(
    tmp_path: Path, check: str, left_out: set[str]
) -> None:
    files = _damaged_folder(tmp_path)
    index = scan_image_folder(tmp_path, check=check, on_corrupt="skip")  # type: ignore[arg-type]
    skipped = {p for p, _ in index.skipped}
    assert skipped == {str(files[k]) for k in left_out}
    assert set(index.files) == {str(p) for k, p in files.items() if k not in left_out} | {
        str(tmp_path / "d" / "whole.jpg")
    }


# ---- echopipe train ----------------------------------------------------------------------------


def _dataset(root: Path) -> Path:
    for split, count in (("train", 4), ("val", 2)):
        for c in ("ant", "cat"):
            for i in range(count):
                _write(root / split / c / f"{i}.JPEG", _jpeg(seed=i))
    return root


def _train(data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--output", str(run), "-b", "4", "--image-size", "32",
            "--epochs", "1", "--stages", "1", "--no-progress", *extra]  # fmt: skip


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("echopipe train: error: "), err
    assert not any(line.startswith("echopipe train: error") for line in lines[:-1]), err
    return lines[-1]


def test_train_check_decode_stops_naming_a_jpeg_cut_and_ended_with_eoi(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _dataset(tmp_path / "data")
    cut = _write(data / "train" / "cat" / "cut.JPEG", _cut_with_eoi(_jpeg(seed=7)))
    assert main(_train(data, tmp_path / "run", "--check", "decode")) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert str(cut) in line and "stops before the image is complete" in line


def test_train_check_decode_skips_counts_and_sums_up_damaged_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _dataset(tmp_path / "data")
    _write(data / "train" / "cat" / "cut.JPEG", _cut_with_eoi(_jpeg(seed=7)))
    _write(data / "train" / "ant" / "cut.JPEG", _cut_with_eoi(_jpeg(seed=8), 0.3))
    _write(data / "val" / "ant" / "cut.JPEG", _cut_with_eoi(_jpeg(seed=9)))
    run = tmp_path / "run"
    assert main(_train(data, run, "--check", "decode", "--on-corrupt", "skip")) == 0
    out, err = capsys.readouterr()
    assert "2 corrupt image(s) left out of train/" in err, err
    assert "1 corrupt image(s) left out of val/" in err, err
    summary = out[out.index("echopipe train: summary") :]
    counts = ["2 corrupt image(s) of train/", "1 corrupt image(s) of val/"]
    assert f"left out            {', '.join(counts)}" in summary, summary
    doc = json.loads((run / "metrics.json").read_text())
    assert doc["summary"]["left_out"] == counts
    assert doc["epochs"][0]["val_images"] == 4
    assert json.loads((run / "config.json").read_text())["options"]["check"] == "decode"


def test_train_header_check_skips_empty_and_cut_files_and_trains_on_trailers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 0-byte file mid-folder and a JPEG cut without an end marker are left out and counted;
    a JPEG with more than a KiB after its end marker is trained on, as DALI decodes it."""
    data = _dataset(tmp_path / "data")
    whole = _jpeg(seed=5)
    _write(data / "train" / "ant" / "1a_empty.JPEG", b"")
    _write(data / "train" / "cat" / "1a_cut.JPEG", whole[: len(whole) // 2])
    _write(data / "train" / "cat" / "9_trailer.JPEG", whole + bytes(range(256)) * 16)
    run = tmp_path / "run"
    assert main(_train(data, run, "--on-corrupt", "skip")) == 0
    out, err = capsys.readouterr()
    assert "2 corrupt image(s) left out of train/" in err, err
    assert "left out            2 corrupt image(s) of train/ (named at the start)" in out, out
    assert "Traceback" not in err


def test_train_names_a_png_cut_with_iend_that_dali_cannot_decode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It passes the header check; DALI's decoder fails on it, and the run stops naming it."""
    data = _dataset(tmp_path / "data")
    png = _write(data / "train" / "ant" / "cut.png", _png_cut_with_iend(_encode(_pixels(3), "PNG")))
    assert main(_train(data, tmp_path / "run", "--on-corrupt", "skip")) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert str(png) in line and "--check decode" in line, line
