"""Tests for echopipe.data: the synthetic JPEG set, its cache, folder scanning, and digits."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import echopipe
from echopipe.data import (
    MANIFEST_NAME,
    CorruptImageError,
    check_image_file,
    default_dataset_dir,
    ensure_synthetic_imagenet,
    load_digits,
    make_synthetic_imagenet,
    read_manifest,
    scan_image_folder,
    synthetic_class_names,
)

CLASSES = 10
PER_CLASS = 40
VAL_PER_CLASS = 20
SIZE = (48, 96)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("synthetic") / "set"
    return make_synthetic_imagenet(
        root, classes=CLASSES, per_class=PER_CLASS, size=SIZE, val_per_class=VAL_PER_CLASS
    )


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --- synthetic set: layout, determinism, content -------------------------------------------


def test_layout_counts_and_manifest(synthetic: Path) -> None:
    names = synthetic_class_names(CLASSES)
    assert names == sorted(names)
    assert sorted(p.name for p in synthetic.iterdir()) == sorted([MANIFEST_NAME, "train", "val"])
    for split, count in (("train", PER_CLASS), ("val", VAL_PER_CLASS)):
        assert sorted(p.name for p in (synthetic / split).iterdir()) == names
        for name in names:
            files = list((synthetic / split / name).iterdir())
            assert len(files) == count
            assert all(f.suffix == ".JPEG" for f in files)
    manifest = read_manifest(synthetic)
    assert manifest is not None
    assert manifest["counts"] == {"train": CLASSES * PER_CLASS, "val": CLASSES * VAL_PER_CLASS}
    assert manifest["classes"] == names
    assert manifest["params"]["size"] == list(SIZE)
    # No temporary folders are left next to the set.
    assert [p.name for p in synthetic.parent.iterdir()] == [synthetic.name]


def test_images_are_real_jpegs_of_varied_size(synthetic: Path) -> None:
    sizes = []
    for path in sorted((synthetic / "val").rglob("*.JPEG")):
        with Image.open(path) as im:
            assert im.format == "JPEG"
            assert im.mode == "RGB"
            im.load()
            sizes.append(im.size)
    widths = {w for w, _ in sizes}
    heights = {h for _, h in sizes}
    assert all(SIZE[0] <= s <= SIZE[1] for s in widths | heights)
    assert len(widths) > 20 and len(heights) > 20
    assert sum(w != h for w, h in sizes) > len(sizes) // 2


def test_same_seed_gives_identical_bytes_and_other_seed_differs(tmp_path: Path) -> None:
    kw = {"classes": 3, "per_class": 4, "val_per_class": 2, "size": (32, 40)}
    a = make_synthetic_imagenet(tmp_path / "a", seed=5, **kw)
    b = make_synthetic_imagenet(tmp_path / "b", seed=5, **kw)
    c = make_synthetic_imagenet(tmp_path / "c", seed=6, **kw)
    digest_a, digest_b, digest_c = _tree_digest(a), _tree_digest(b), _tree_digest(c)
    assert len(digest_a) == 3 * (4 + 2) + 1
    assert digest_a == digest_b
    assert digest_a.keys() == digest_c.keys()
    differing = [k for k in digest_a if digest_a[k] != digest_c[k]]
    assert len(differing) == len(digest_a)  # every image and the manifest
    assert read_manifest(a)["sha256"] == read_manifest(b)["sha256"] != read_manifest(c)["sha256"]


def _features(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    index = scan_image_folder(root)
    hue_hists, mean_rgb, pixels = [], [], []
    for path in index.files:
        with Image.open(path) as im:
            rgb = im.convert("RGB")
            hsv = np.asarray(rgb.convert("HSV")).reshape(-1, 3)
            saturated = hsv[hsv[:, 1] > 100, 0]
            hist = np.histogram(saturated, bins=24, range=(0, 256))[0].astype(np.float64)
            hue_hists.append(hist / max(hist.sum(), 1.0))
            mean_rgb.append(np.asarray(rgb, dtype=np.float64).reshape(-1, 3).mean(0))
            pixels.append(np.asarray(rgb.resize((16, 16)), dtype=np.float64).ravel() / 255)
    return np.array(hue_hists), np.array(mean_rgb), np.array(pixels), np.array(index.labels)


def _nearest_centroid_predictions(
    train: np.ndarray, train_labels: np.ndarray, test: np.ndarray
) -> np.ndarray:
    centroids = np.stack([train[train_labels == c].mean(0) for c in range(CLASSES)])
    return ((test[:, None, :] - centroids[None]) ** 2).sum(-1).argmin(1)


def test_classes_are_learnable_but_not_by_colour_alone(synthetic: Path) -> None:
    *train_feats, train_labels = _features(synthetic / "train")
    *val_feats, val_labels = _features(synthetic / "val")
    acc = {}
    preds = {}
    for name, tr, va in zip(("hue", "mean_rgb", "pixels"), train_feats, val_feats, strict=True):
        preds[name] = _nearest_centroid_predictions(tr, train_labels, va)
        acc[name] = float((preds[name] == val_labels).mean())
    chance = 1 / CLASSES
    # Measured (seeds 0-2): hue 0.47-0.54, mean RGB 0.22-0.32, pixels 0.28-0.41.
    assert acc["hue"] > 3 * chance, acc
    assert acc["pixels"] > 2 * chance, acc
    # Classes come in pairs that share a hue, so colour gets the pair right but not the class.
    pair_acc = float((preds["hue"] // 2 == val_labels // 2).mean())
    assert pair_acc > 0.75, (pair_acc, acc)
    assert acc["hue"] < 0.7, acc
    assert acc["mean_rgb"] < 0.5, acc


# --- make/ensure: atomicity, caching, concurrency ----------------------------------------


def test_make_refuses_non_empty_root_unless_overwrite(tmp_path: Path) -> None:
    root = tmp_path / "set"
    root.mkdir()
    (root / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match=str(root)):
        make_synthetic_imagenet(root, classes=2, per_class=1, val_per_class=0)
    assert (root / "keep.txt").exists()
    make_synthetic_imagenet(root, classes=2, per_class=1, val_per_class=0, overwrite=True)
    assert not (root / "keep.txt").exists()
    assert read_manifest(root)["counts"] == {"train": 2, "val": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"classes": 1}, "classes must be >= 2, got 1"),
        ({"per_class": 0}, "per_class must be >= 1, got 0"),
        ({"size": (64, 32)}, r"\(64, 32\)"),
        ({"size": (4, 8)}, r"\(4, 8\)"),
        ({"quality": 101}, "quality must be in \\[1, 100\\], got 101"),
        ({"val_per_class": -1}, "val_per_class must be >= 0, got -1"),
    ],
)
def test_make_rejects_bad_parameters(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_synthetic_imagenet(tmp_path / "set", **kwargs)
    assert not (tmp_path / "set").exists()


def test_make_rejects_bad_types(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="size"):
        make_synthetic_imagenet(tmp_path / "set", size=64)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="classes"):
        make_synthetic_imagenet(tmp_path / "set", classes=2.5)  # type: ignore[arg-type]


def test_default_dataset_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ECHOPIPE_CACHE_DIR", str(tmp_path / "cache"))
    assert default_dataset_dir() == tmp_path / "cache"
    monkeypatch.delenv("ECHOPIPE_CACHE_DIR")
    assert default_dataset_dir() == Path.home() / ".cache" / "echopipe"


def test_ensure_builds_once_and_reuses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ECHOPIPE_CACHE_DIR", str(tmp_path / "cache"))
    params = {"classes": 3, "per_class": 3, "val_per_class": 1, "size": (32, 40)}
    first = ensure_synthetic_imagenet(**params)
    assert first.parent == tmp_path / "cache"

    # Inode, size and mtime: reading a folder may move its atime (relatime), nothing else.
    def snapshot(root: Path) -> dict[Path, tuple[int, int, int]]:
        return {p: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
                for p in root.rglob("*")}  # fmt: skip

    stats = snapshot(first)
    inode = first.stat().st_ino
    second = ensure_synthetic_imagenet(**params)
    assert second == first
    assert second.stat().st_ino == inode
    assert snapshot(second) == stats

    other = ensure_synthetic_imagenet(**{**params, "seed": 1})
    assert other != first and other.parent == first.parent
    assert read_manifest(other)["params"]["seed"] == 1
    assert read_manifest(first)["params"]["seed"] == 0


def test_ensure_rebuilds_incomplete_set(tmp_path: Path) -> None:
    params = {"classes": 2, "per_class": 3, "val_per_class": 1, "size": (32, 40)}
    root = ensure_synthetic_imagenet(tmp_path, **params)
    expected = _tree_digest(root)
    victim = sorted((root / "train").rglob("*.JPEG"))[0]
    victim.unlink()
    rebuilt = ensure_synthetic_imagenet(tmp_path, **params)
    assert rebuilt == root
    assert _tree_digest(rebuilt) == expected
    (root / MANIFEST_NAME).write_text("{not json")
    assert _tree_digest(ensure_synthetic_imagenet(tmp_path, **params)) == expected
    # Class names that are not strings, and a FIFO under the manifest's name (opened without
    # blocking, it is refused instead of waited on): the set is made again either way.
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    (root / MANIFEST_NAME).write_text(json.dumps({**manifest, "classes": [1, 2]}))
    assert _tree_digest(ensure_synthetic_imagenet(tmp_path, **params)) == expected
    (root / MANIFEST_NAME).unlink()
    os.mkfifo(root / MANIFEST_NAME)
    assert read_manifest(root) is None
    assert _tree_digest(ensure_synthetic_imagenet(tmp_path, **params)) == expected


_ENSURE_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from echopipe.data import ensure_synthetic_imagenet

    cache, rank = Path(sys.argv[1]), sys.argv[2]
    (cache / f"ready-{rank}").touch()
    deadline = time.monotonic() + 60
    while not all((cache / f"ready-{r}").exists() for r in "01"):
        if time.monotonic() > deadline:
            sys.exit("peer never started")
        time.sleep(0.01)
    root = ensure_synthetic_imagenet(cache, classes=4, per_class=40, val_per_class=5)
    print(root, os.stat(root).st_ino)
    """
)


def test_concurrent_ensure_from_two_processes(tmp_path: Path) -> None:
    env = dict(os.environ)
    package_parent = str(Path(echopipe.__path__[0]).parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ENSURE_SCRIPT, str(tmp_path), str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out.split())
    assert outputs[0] == outputs[1]  # same folder, and the same build (same inode)
    root = Path(outputs[0][0])
    assert os.stat(root).st_ino == int(outputs[0][1])
    assert read_manifest(root)["counts"] == {"train": 160, "val": 20}
    index = scan_image_folder(root / "train", check="decode")
    assert len(index) == 160 and index.counts_per_class() == [40] * 4
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.startswith(("ready-", "."))]
    assert leftovers == [root.name]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# --- scan_image_folder ---------------------------------------------------------------------


def _jpeg_bytes(seed: int = 0, size: tuple[int, int] = (40, 30)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 20), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _good_tree(root: Path) -> list[Path]:
    written = []
    for cls, count in (("cat", 2), ("ant", 3)):
        (root / cls).mkdir(parents=True)
        for i in range(count):
            path = root / cls / f"img{i}.JPEG"
            path.write_bytes(_jpeg_bytes(i))
            written.append(path)
    return written


def test_scan_synthetic_split(synthetic: Path) -> None:
    index = scan_image_folder(synthetic / "val", check="decode")
    assert index.classes == synthetic_class_names(CLASSES)
    assert len(index) == CLASSES * VAL_PER_CLASS
    assert index.skipped == []
    for path, label in zip(index.files, index.labels, strict=True):
        assert Path(path).parent.name == index.classes[label]
    assert index.counts_per_class() == [VAL_PER_CLASS] * CLASSES
    assert index.files == sorted(index.files)


def test_scan_labels_sorted_classes_and_ignores_non_images(tmp_path: Path) -> None:
    _good_tree(tmp_path)
    (tmp_path / "ant" / "nested").mkdir()
    (tmp_path / "ant" / "nested" / "deep.png").write_bytes(_png_bytes())
    (tmp_path / "ant" / "notes.txt").write_text("not an image")
    (tmp_path / "cat" / ".hidden.JPEG").write_bytes(b"")
    (tmp_path / ".tmp-build").mkdir()
    (tmp_path / "stray.JPEG").write_bytes(b"")
    (tmp_path / "cat" / "upper.JPG").write_bytes(_jpeg_bytes(9))
    index = scan_image_folder(tmp_path, check="decode")
    assert index.classes == ["ant", "cat"]
    assert index.class_to_idx == {"ant": 0, "cat": 1}
    names = [str(Path(f).relative_to(tmp_path)) for f in index.files]
    assert names == [
        "ant/img0.JPEG",
        "ant/img1.JPEG",
        "ant/img2.JPEG",
        "ant/nested/deep.png",
        "cat/img0.JPEG",
        "cat/img1.JPEG",
        "cat/upper.JPG",
    ]
    assert index.labels == [0, 0, 0, 0, 1, 1, 1]


def test_scan_skips_and_counts_links_that_leave_the_root_or_loop(tmp_path: Path) -> None:
    """A loop and a link out of the data folder in a class folder: followed silently they
    would repeat files (or run forever) and pull in outside images. Both are left out and
    listed; a link that stays inside the root is followed."""
    root = tmp_path / "train"
    root.mkdir()
    _good_tree(root)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for i in range(5):
        (outside / f"o{i}.JPEG").write_bytes(_jpeg_bytes(i))
    (root / "ant" / "loop").symlink_to(root / "ant")  # loops back to its own folder
    (root / "ant" / "out").symlink_to(outside)
    (root / "ant" / "one_out.JPEG").symlink_to(outside / "o0.JPEG")
    (root / "cat" / "dangling.JPEG").symlink_to(tmp_path / "gone.JPEG")
    # Into another class: its images would get two labels (test_train_first_hour3).
    (root / "cat" / "sibling").symlink_to(root / "ant")
    (root / ".shared").mkdir()
    (root / ".shared" / "s0.JPEG").write_bytes(_jpeg_bytes(7))
    (root / "cat" / "shared").symlink_to(root / ".shared")  # inside the root: followed
    (root / "extra").symlink_to(outside)  # a class folder that is a link out
    index = scan_image_folder(root)
    assert index.classes == ["ant", "cat"]
    names = [str(Path(f).relative_to(root)) for f in index.files]
    assert names == [
        "ant/img0.JPEG", "ant/img1.JPEG", "ant/img2.JPEG",
        "cat/img0.JPEG", "cat/img1.JPEG", "cat/shared/s0.JPEG",
    ]  # fmt: skip
    skipped = {Path(p).name: why for p, why in index.links_skipped}
    assert set(skipped) == {"extra", "loop", "out", "one_out.JPEG", "dangling.JPEG", "sibling"}
    assert "loops" in skipped["loop"] and "leaves the data folder" in skipped["out"]
    assert "leaves" in skipped["one_out.JPEG"] and "dangles" in skipped["dangling.JPEG"]


def test_scan_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        scan_image_folder(missing)
    a_file = tmp_path / "file.JPEG"
    a_file.write_bytes(_jpeg_bytes())
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        scan_image_folder(a_file)


def test_scan_empty_folder_and_no_images(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path}.*no class sub-folders"):
        scan_image_folder(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "readme.txt").write_text("hi")
    with pytest.raises(ValueError, match=f"{tmp_path}.*has no images"):
        scan_image_folder(tmp_path)


def _truncated_jpeg() -> bytes:
    data = _jpeg_bytes(3, size=(64, 64))
    return data[: len(data) // 2]


def _truncated_png() -> bytes:
    data = _png_bytes()
    return data[: len(data) - 20]


def _jpeg_claiming(width: int, height: int) -> bytes:
    """A small real JPEG whose frame header (SOF0) claims ``width`` x ``height``."""
    data = bytearray(_jpeg_bytes(5))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def _png_claiming(width: int, height: int) -> bytes:
    data = bytearray(_png_bytes())
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    return bytes(data)


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("zero.JPEG", b"", "empty file"),
        ("garbage.JPEG", b"this is not an image at all" * 10, "not a JPEG or PNG"),
        ("truncated.JPEG", _truncated_jpeg(), "end-of-image marker"),
        ("truncated.png", _truncated_png(), "IEND"),
        ("bomb.JPEG", _jpeg_claiming(30000, 30000), "claims 30000 x 30000 pixels"),
        ("bomb.png", _png_claiming(20000, 9000), "claims 20000 x 9000 pixels"),
        ("no_frame.JPEG", b"\xff\xd8\xff\xd9", "before its first scan"),
        ("zero_height.JPEG", _jpeg_claiming(40, 0), "size 40 x 0"),
        ("scan_first.JPEG", b"\xff\xd8\xff\xda\x00\x02" + b"\x00" * 60 + b"\xff\xd9", "no frame"),
        (
            "many_segments.JPEG",
            b"\xff\xd8" + b"\xff\xfe\x00\x02" * 5000 + _jpeg_bytes(5)[2:],
            "more than 1024 segments",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
@pytest.mark.parametrize("check", ["header", "decode"])
def test_scan_corrupt_file_is_named(
    tmp_path: Path, name: str, content: bytes, reason: str, check: str
) -> None:
    _good_tree(tmp_path)
    bad = tmp_path / "cat" / name
    bad.write_bytes(content)
    with pytest.raises(CorruptImageError, match=reason) as info:
        scan_image_folder(tmp_path, check=check)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert info.value.path == str(bad)
    assert str(bad) in str(info.value)
    # check="none" trusts the extension.
    assert str(bad) in scan_image_folder(tmp_path, check="none").files


def test_decode_check_catches_what_headers_miss(tmp_path: Path) -> None:
    _good_tree(tmp_path)
    bad = tmp_path / "ant" / "scrambled.JPEG"
    good = bytearray(_jpeg_bytes(4))
    dht = good.index(b"\xff\xc4")
    good[dht + 5 : dht + 21] = b"\xff" * 16  # more Huffman codes than a table holds
    bad.write_bytes(bytes(good))
    index = scan_image_folder(tmp_path, check="header")
    assert str(bad) in index.files
    with pytest.raises(CorruptImageError, match="decode failed") as info:
        scan_image_folder(tmp_path, check="decode")
    assert info.value.path == str(bad)
    check_image_file(tmp_path / "ant" / "img0.JPEG", "decode")


def test_scan_skip_mode_counts_skipped(tmp_path: Path) -> None:
    good = _good_tree(tmp_path)
    bad = {
        tmp_path / "ant" / "a_zero.JPEG": b"",
        tmp_path / "cat" / "b_garbage.jpg": b"GIF89a....",
        tmp_path / "cat" / "c_trunc.jpeg": _truncated_jpeg(),
    }
    for path, content in bad.items():
        path.write_bytes(content)
    index = scan_image_folder(tmp_path, on_corrupt="skip")
    assert sorted(index.files) == sorted(str(p) for p in good)
    assert index.counts_per_class() == [3, 2]
    assert sorted(p for p, _ in index.skipped) == sorted(str(p) for p in bad)
    reasons = dict(index.skipped)
    assert "empty file" in reasons[str(tmp_path / "ant" / "a_zero.JPEG")]
    assert "47 49 46 38" in reasons[str(tmp_path / "cat" / "b_garbage.jpg")]


def test_the_pixel_limit_is_pillows_bomb_limit_and_sizes_below_it_pass(tmp_path: Path) -> None:
    """The header's size is checked against MAX_IMAGE_PIXELS: Pillow's own decompression-bomb
    error threshold, so a check="decode" scan and the header check agree."""
    from echopipe.data import MAX_IMAGE_PIXELS

    assert MAX_IMAGE_PIXELS == 2 * Image.MAX_IMAGE_PIXELS
    path = tmp_path / "big.JPEG"
    path.write_bytes(_jpeg_claiming(13000, 13000))  # 169 megapixels: under the limit
    check_image_file(path)
    path.write_bytes(_jpeg_claiming(13400, 13400))  # 180 megapixels
    with pytest.raises(CorruptImageError, match="MAX_IMAGE_PIXELS"):
        check_image_file(path)


def test_names_that_are_not_utf8_are_bad_files_and_such_class_folders_refused(
    tmp_path: Path,
) -> None:
    """DALI's reader takes only UTF-8 names: an image so named follows on_corrupt at every
    check level (named by its repr), and a class folder so named is refused, naming it."""
    good = _good_tree(tmp_path)
    bad = os.fsdecode(os.fsencode(tmp_path / "cat") + b"/\xff\xfe.JPEG")
    Path(bad).write_bytes(_jpeg_bytes(7))
    for check in ("none", "header", "decode"):
        with pytest.raises(CorruptImageError, match="not UTF-8") as info:
            scan_image_folder(tmp_path, check=check)  # type: ignore[arg-type]
        assert info.value.path == bad and repr(bad) in str(info.value)
        index = scan_image_folder(tmp_path, check=check, on_corrupt="skip")  # type: ignore[arg-type]
        assert sorted(index.files) == sorted(map(str, good))
        assert [p for p, _ in index.skipped] == [bad]
    os.unlink(bad)
    os.mkdir(os.fsencode(tmp_path) + b"/d\xff")
    Path(os.fsdecode(os.fsencode(tmp_path) + b"/d\xff/x.JPEG")).write_bytes(_jpeg_bytes(8))
    with pytest.raises(ValueError, match=r"class folder .*d\\udcff.* not UTF-8"):
        scan_image_folder(tmp_path, on_corrupt="skip")


def test_scan_skip_mode_with_nothing_left_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.JPEG").write_bytes(b"")
    with pytest.raises(ValueError, match="1 corrupt files skipped"):
        scan_image_folder(tmp_path, on_corrupt="skip")


def test_scan_rejects_bad_options(tmp_path: Path) -> None:
    _good_tree(tmp_path)
    with pytest.raises(ValueError, match="'full'"):
        scan_image_folder(tmp_path, check="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'ignore'"):
        scan_image_folder(tmp_path, on_corrupt="ignore")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'\.jpg'"):
        scan_image_folder(tmp_path, extensions=".jpg")  # type: ignore[arg-type]


# --- digits --------------------------------------------------------------------------------


def test_load_digits_shapes_split_and_normalisation() -> None:
    x_train, y_train, x_test, y_test = load_digits(image_size=32, test_fraction=0.25, seed=0)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.int64
    assert x_train.shape[1:] == (1, 32, 32) and x_test.shape[1:] == (1, 32, 32)
    assert len(x_train) + len(x_test) == 1797
    assert len(x_test) == pytest.approx(0.25 * 1797, abs=1)
    assert x_train.mean().item() == pytest.approx(0.0, abs=1e-4)
    assert x_train.std().item() == pytest.approx(1.0, abs=1e-3)
    # Stratified: each class's share of the test split is within one sample of its share overall.
    all_labels = torch.cat([y_train, y_test])
    for c in range(10):
        expected = (all_labels == c).sum().item() * len(y_test) / len(all_labels)
        assert abs((y_test == c).sum().item() - expected) <= 1


def test_load_digits_is_deterministic_and_seeded() -> None:
    a = load_digits(image_size=16, seed=3)
    b = load_digits(image_size=16, seed=3)
    c = load_digits(image_size=16, seed=4)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[1], c[1])
    native = load_digits(image_size=8)
    assert native[0].shape[1:] == (1, 8, 8)


def test_load_digits_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"test_fraction must be in \(0, 1\), got 1\.5"):
        load_digits(test_fraction=1.5)
    with pytest.raises(ValueError, match="image_size must be >= 8, got 4"):
        load_digits(image_size=4)


def test_manifest_is_json_with_params(synthetic: Path) -> None:
    manifest = json.loads((synthetic / MANIFEST_NAME).read_text())
    assert manifest["params"]["classes"] == CLASSES
    assert manifest["params"]["per_class"] == PER_CLASS
    assert len(manifest["sha256"]) == 64


def test_a_folder_that_cannot_be_listed_is_named_not_left_out(tmp_path: Path) -> None:
    """A sub-folder without read permission: the scan names it (OSError) instead of indexing
    the split without its images. Run in a child without the capabilities that let root read
    any folder."""
    import shutil

    (tmp_path / "train" / "ant" / "sub").mkdir(parents=True)
    (tmp_path / "train" / "cat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "ant" / "sub" / "a.JPEG")
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "cat" / "c.JPEG")
    (tmp_path / "train" / "ant" / "sub").chmod(0)
    program = ("import sys\nfrom echopipe.data import scan_image_folder\n"
               "try:\n    scan_image_folder(sys.argv[1], check='none')\n"
               "except OSError as exc:\n    print(exc)\n")  # fmt: skip
    cmd = [sys.executable, "-c", program, str(tmp_path / "train")]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: every folder can be listed")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    env = dict(os.environ, PYTHONPATH=str(Path(echopipe.__file__).parent.parent))
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    finally:
        (tmp_path / "train" / "ant" / "sub").chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert "cannot list the data folder" in done.stdout and "ant/sub" in done.stdout, done.stdout
