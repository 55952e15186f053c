"""The image check at ImageNet scale: threads, torchrun's ranks sharing it, interrupts, and a
decode check that ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` does not weaken (docs/train.md,
"Damaged images"). Real JPEG/PNG files written by Pillow; no clocks."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from echopipe.data import CorruptImageError, check_image_file, scan_image_folder
from pipeline_support import train_runs as tr


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


def _damaged_tree(root: Path) -> list[Path]:
    """Three classes of whole JPEGs and PNGs with damaged files at known places: the first bad
    one in scan order is a large JPEG cut inside its data (two slow decodes), the next an empty
    file a few places later (no decode), so a scan that took whichever check ended first
    would name the empty one."""
    bad = []
    for c, name in enumerate(("ant", "bee", "cat")):
        for i in range(12):
            if i % 4 == 3:
                data = _encode(_pixels(10 * c + i), "PNG")
            else:
                data = _encode(_pixels(10 * c + i), quality=85)
            _write(root / name / f"{i:02d}.{'png' if i % 4 == 3 else 'jpg'}", data)
    big = _encode(_pixels(99, (600, 800)), quality=95)
    bad.append(_write(root / "ant" / "02a_cut_eoi.jpg", _cut_with_eoi(big)))
    bad.append(_write(root / "ant" / "03a_empty.jpg", b""))
    bad.append(_write(root / "bee" / "sub" / "00_cut.jpg", _encode(_pixels(5))[:900]))
    png_cut = _png_cut_with_iend(_encode(_pixels(6), "PNG"))
    bad.append(_write(root / "bee" / "07a_png_cut.png", png_cut))
    bad.append(_write(root / "cat" / "11a_junk.jpg", b"GIF89a not an image"))
    return bad


@pytest.mark.parametrize("check", ["header", "decode"])
@pytest.mark.parametrize("workers", [2, 3, 8])
def test_threaded_scan_equals_the_sequential_one(tmp_path: Path, check: str, workers: int) -> None:
    _damaged_tree(tmp_path)
    one = scan_image_folder(tmp_path, check=check, on_corrupt="skip")  # type: ignore[arg-type]
    many = scan_image_folder(
        tmp_path,
        check=check,  # type: ignore[arg-type]
        on_corrupt="skip",
        workers=workers,
    )
    assert many.files == one.files and many.labels == one.labels
    assert many.skipped == one.skipped
    assert len(one.skipped) == (5 if check == "decode" else 3)
    with pytest.raises(CorruptImageError) as first:
        scan_image_folder(tmp_path, check=check)  # type: ignore[arg-type]
    with pytest.raises(CorruptImageError) as threaded:
        scan_image_folder(tmp_path, check=check, workers=workers)  # type: ignore[arg-type]
    assert (threaded.value.path, threaded.value.reason) == (first.value.path, first.value.reason)
    want = "02a_cut_eoi.jpg" if check == "decode" else "03a_empty.jpg"
    assert first.value.path == str(tmp_path / "ant" / want)


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


# ---- torchrun ------------------------------------------------------------------------------

_WORKER = """
import json, os, sys, threading
import echopipe.data.folder_check as folder_check
import echopipe.data.image_folder as image_folder
from echopipe.data import ScanShare
from echopipe.training.distributed import DistContext

checked, lock = [], threading.Lock()
real = image_folder.check_image_file

def counting(path, check="header"):
    with lock:
        checked.append(path)
    return real(path, check)

image_folder.check_image_file = counting  # counts the files this rank checks
folder_check._ROUND_PER_RANK = 3  # several rounds of exchanges on a small folder
ctx = DistContext.from_env(60)
share = ScanShare(ctx.rank, ctx.world_size, ctx.all_gather_object)
root, out = sys.argv[1], sys.argv[2]
index = image_folder.scan_image_folder(root, check="decode", on_corrupt="skip", workers=2,
                                       share=share)
in_skip_scan = list(checked)
first = None
try:
    image_folder.scan_image_folder(root, check="decode", workers=2, share=share)
except image_folder.CorruptImageError as exc:
    first = [exc.path, exc.reason]
with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
    json.dump({"files": index.files, "labels": index.labels, "skipped": index.skipped,
               "checked": in_skip_scan, "first": first}, f)
ctx.close()
"""


@pytest.mark.distributed
def test_two_gloo_ranks_share_the_check_and_end_with_the_same_lists(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _damaged_tree(root)
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{tr.free_port()}", str(worker),
           str(root), str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=tr.child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    alone = scan_image_folder(root, check="decode", on_corrupt="skip")
    for rank in ranks:
        assert rank["files"] == alone.files and rank["labels"] == alone.labels
        assert [tuple(s) for s in rank["skipped"]] == alone.skipped
    with pytest.raises(CorruptImageError) as first:
        scan_image_folder(root, check="decode")
    assert ranks[0]["first"] == ranks[1]["first"] == [first.value.path, first.value.reason]
    # The skip scan checked each file once overall: the ranks' shares are disjoint and whole.
    total = len(alone.files) + len(alone.skipped)
    shares = [r["checked"] for r in ranks]
    assert all(len(set(share)) == len(share) for share in shares)
    assert not set(shares[0]) & set(shares[1])
    assert len(shares[0]) + len(shares[1]) == total


# ---- Ctrl-C and SIGTERM ----------------------------------------------------------------------

_STOPPED = """
import os, sys, threading, time
import echopipe.data.image_folder as image_folder
from echopipe.cli import main

real, marks = image_folder.check_image_file, sys.argv[1]
started, lock = [], threading.Lock()

def blocking(path, check="header"):
    with lock:
        started.append(path)
        with open(os.path.join(marks, f"started{len(started)}"), "w"):
            pass
    # The first two checks (one per thread) hold until the test has sent its signal.
    if len(started) <= 2:
        while not os.path.exists(os.path.join(marks, "release")):
            time.sleep(0.01)
    return real(path, check)

image_folder.check_image_file = blocking
status = main(sys.argv[2:])
left = [t.name for t in threading.enumerate() if t.name.startswith("echopipe-check")]
with open(os.path.join(marks, "after.txt"), "w") as f:
    f.write(f"{len(started)} {left}")
sys.exit(status)
"""


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_during_the_check_ends_the_run_with_one_line(
    tmp_path: Path, sig: signal.Signals, status: int
) -> None:
    data = tmp_path / "data"
    for split, count in (("train", 40), ("val", 2)):
        for c in ("ant", "cat"):
            for i in range(count):
                _write(data / split / c / f"{i:02d}.JPEG", _encode(_pixels(i), quality=80))
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "stopped.py"
    script.write_text(_STOPPED)
    cmd = [sys.executable, str(script), str(marks), "train", "--data", str(data),
           "--output", str(tmp_path / "run"), "--check", "decode", "--no-progress"]  # fmt: skip
    env = dict(tr.child_env(), OMP_NUM_THREADS="2")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (marks / "started2").exists():  # both threads hold a file
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(sig)
        (marks / "release").touch()
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == status, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("echopipe train:")]
    assert len(lines) == 1 and "interrupted during start-up" in lines[0], err
    started, left = (marks / "after.txt").read_text().split(" ", 1)
    assert left == "[]"  # the pool's threads have ended
    assert int(started) < 80  # the queued checks were dropped


@pytest.mark.parametrize("progress", [True, False])
def test_the_check_says_what_it_does_unless_no_progress(tmp_path: Path, progress: bool) -> None:
    from echopipe.training import TrainConfig
    from echopipe.training.preflight import check_data

    for split in ("train", "val"):
        _damaged_tree(tmp_path / split)
    lines: list[str] = []
    cfg = TrainConfig(data=tmp_path, check="decode", on_corrupt="skip", progress=progress)
    _, classes, indexes = check_data(cfg, lines.append)
    assert classes == ["ant", "bee", "cat"] and len(indexes["train"].skipped) == 5
    said = [line for line in lines if line.startswith("data: checking the images of")]
    assert len(said) == (2 if progress else 0), lines
    if progress:
        assert said[0].startswith("data: checking the images of train/ (--check decode"), said


def test_evaluate_checks_only_val(tmp_path: Path) -> None:
    """``--evaluate`` reads only val/: train/ is listed for its classes, its images not
    decoded (an hour for ImageNet)."""
    from echopipe.training import DataError, TrainConfig
    from echopipe.training.preflight import check_data

    for split in ("train", "val"):
        for c in ("ant", "cat"):
            _write(tmp_path / split / c / "0.jpg", _encode(_pixels(1), quality=85))
    _write(tmp_path / "train" / "ant" / "cut.jpg", _cut_with_eoi(_encode(_pixels(2))))
    cfg = TrainConfig(data=tmp_path, check="decode", progress=False)
    _, classes, indexes = check_data(cfg, lambda m: None, check_train=False)
    assert classes == ["ant", "cat"] and len(indexes["val"].files) == 2
    with pytest.raises(DataError, match=r"cut\.jpg"):
        check_data(cfg, lambda m: None)
