"""Datasets for echopipe: a synthetic ImageNet-style JPEG set, folder scanning, and digits.

The synthetic set is real JPEG files in the ImageNet folder layout (``train/<wnid>/*.JPEG``,
``val/<wnid>/*.JPEG``), so the DALI readers and decoders do real work on it. Classes differ by
shape, hue and texture, and every image carries noise, clutter from other classes' palettes,
random placement, scale and rotation, and its own width and height. Generation is
deterministic in its arguments and atomic on disk, so several processes (torchrun ranks) can
ask for the same set at once and all get one complete copy.
"""

from __future__ import annotations

import colorsys
import contextlib
import errno
import hashlib
import io
import json
import math
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor

__all__ = [
    "SYNTHETIC_GENERATOR_VERSION",
    "CorruptImageError",
    "ImageFolderIndex",
    "check_image_file",
    "default_dataset_dir",
    "ensure_synthetic_imagenet",
    "load_digits",
    "make_synthetic_imagenet",
    "read_manifest",
    "scan_image_folder",
    "synthetic_class_names",
    "synthetic_dataset_name",
]

SYNTHETIC_GENERATOR_VERSION = 1
"""Bumped whenever the generator's output bytes change, so caches keyed on it are rebuilt."""

MANIFEST_NAME = "manifest.json"
_GENERATOR_ID = "echopipe.synthetic_imagenet"
_SHAPES = ("ellipse", "rectangle", "triangle", "cross", "ring", "diamond")
_TEXTURES = ("stripes", "checker")


class CorruptImageError(ValueError):
    """An image file that cannot be used; ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"corrupt image {self.path!r}: {reason}")


# --------------------------------------------------------------------------------------------
# Synthetic ImageNet-style JPEG set
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ClassStyle:
    shape: str
    hue: float
    texture: str
    frequency: float


def synthetic_class_names(classes: int) -> list[str]:
    """WordNet-id-like folder names ``n0XXXXXXX`` whose sorted order is the class index order."""
    _check_int("classes", classes, minimum=2)
    return [f"n{1_000_000 + 7_919 * c:08d}" for c in range(classes)]


def _class_styles(classes: int) -> list[_ClassStyle]:
    # Pairs of classes share a hue group, so colour alone cannot tell a pair apart: the model
    # must also use shape and texture. Shapes and textures cycle with different periods so no
    # single cue identifies a class either.
    groups = (classes + 1) // 2
    styles = []
    for c in range(classes):
        styles.append(
            _ClassStyle(
                shape=_SHAPES[c % len(_SHAPES)],
                hue=((c // 2) / groups + 0.07) % 1.0,
                texture=_TEXTURES[c % 2],
                frequency=1.5 + (c * 3 % 5) * 0.75,
            )
        )
    return styles


def _shape_mask(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    if shape == "ellipse":
        return u * u + (v / 0.62) ** 2 <= 1.0
    if shape == "rectangle":
        return (np.abs(u) <= 0.95) & (np.abs(v) <= 0.6)
    if shape == "triangle":
        mask = np.ones(u.shape, dtype=bool)
        for k in range(3):
            a = math.pi / 2 + k * 2 * math.pi / 3
            mask &= u * math.cos(a) + v * math.sin(a) <= 0.5
        return mask
    if shape == "cross":
        au, av = np.abs(u), np.abs(v)
        return ((au <= 1.0) & (av <= 0.3)) | ((au <= 0.3) & (av <= 1.0))
    if shape == "ring":
        r2 = u * u + v * v
        return (r2 <= 1.0) & (r2 >= 0.3)
    if shape == "diamond":
        return np.abs(u) + np.abs(v) <= 1.0
    raise ValueError(f"unknown shape {shape!r}")


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v), dtype=np.float32)


def _object_coords(
    xs: np.ndarray, ys: np.ndarray, cx: float, cy: float, radius: float, angle: float
) -> tuple[np.ndarray, np.ndarray]:
    c, s = math.cos(angle), math.sin(angle)
    dx, dy = xs - cx, ys - cy
    return (c * dx + s * dy) / radius, (-s * dx + c * dy) / radius


def _render_image(
    rng: np.random.Generator,
    style: _ClassStyle,
    other_hues: Sequence[float],
    size: tuple[int, int],
) -> np.ndarray:
    lo, hi = size
    height = int(rng.integers(lo, hi + 1))
    width = int(rng.integers(lo, hi + 1))
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)

    # Background: a dull random colour with a random linear gradient.
    bg = _hsv(rng.random(), rng.uniform(0.0, 0.3), rng.uniform(0.25, 0.75))
    gx, gy = rng.uniform(-0.25, 0.25, size=2) / max(height, width)
    ramp = (xs * gx + ys * gy)[..., None]
    img = np.clip(bg[None, None, :] + ramp, 0.0, 1.0)

    short = min(height, width)
    # Clutter: small plain shapes in other classes' hues, drawn under the main object.
    for _ in range(int(rng.integers(1, 4))):
        hue = other_hues[int(rng.integers(len(other_hues)))] + rng.uniform(-0.04, 0.04)
        u, v = _object_coords(
            xs,
            ys,
            rng.uniform(0, width),
            rng.uniform(0, height),
            rng.uniform(0.08, 0.2) * short,
            rng.uniform(0, 2 * math.pi),
        )
        mask = _shape_mask(_SHAPES[int(rng.integers(len(_SHAPES)))], u, v)
        img[mask] = _hsv(hue, rng.uniform(0.5, 1.0), rng.uniform(0.5, 1.0))

    # Main object: class shape, hue and texture at a random place, scale and rotation.
    radius = rng.uniform(0.25, 0.45) * short
    cx = rng.uniform(radius * 0.8, width - radius * 0.8)
    cy = rng.uniform(radius * 0.8, height - radius * 0.8)
    u, v = _object_coords(xs, ys, cx, cy, radius, rng.uniform(0, 2 * math.pi))
    mask = _shape_mask(style.shape, u, v)
    freq = style.frequency * rng.uniform(0.85, 1.15)
    phase = rng.uniform(0, 2 * math.pi)
    if style.texture == "stripes":
        pattern = np.sin(2 * math.pi * freq * u + phase) > 0
    else:
        pattern = (np.sin(2 * math.pi * freq * u + phase) * np.sin(2 * math.pi * freq * v)) > 0
    hue = style.hue + rng.uniform(-0.035, 0.035)
    sat = rng.uniform(0.6, 1.0)
    light = _hsv(hue, sat, rng.uniform(0.8, 1.0))
    dark = _hsv(hue, sat, rng.uniform(0.3, 0.5))
    img[mask] = np.where(pattern[mask][:, None], light[None, :], dark[None, :])

    img += rng.normal(0.0, 0.04, size=img.shape).astype(np.float32)
    return (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def _encode_jpeg(pixels: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _synthetic_params(
    classes: int,
    per_class: int,
    size: tuple[int, int],
    seed: int,
    val_per_class: int,
    quality: int,
) -> dict[str, Any]:
    _check_int("classes", classes, minimum=2)
    _check_int("per_class", per_class, minimum=1)
    _check_int("val_per_class", val_per_class, minimum=0)
    _check_int("seed", seed, minimum=0)
    _check_int("quality", quality, minimum=1)
    if quality > 100:
        raise ValueError(f"quality must be in [1, 100], got {quality}")
    try:
        lo, hi = (int(s) for s in size)
    except (TypeError, ValueError):
        raise TypeError(f"size must be a (min_side, max_side) pair of ints, got {size!r}") from None
    if not 8 <= lo <= hi:
        raise ValueError(f"size must satisfy 8 <= min_side <= max_side, got {tuple(size)!r}")
    return {
        "classes": int(classes),
        "per_class": int(per_class),
        "size": [lo, hi],
        "seed": int(seed),
        "val_per_class": int(val_per_class),
        "quality": int(quality),
        "version": SYNTHETIC_GENERATOR_VERSION,
    }


def make_synthetic_imagenet(
    root: str | Path,
    classes: int = 10,
    per_class: int = 100,
    size: tuple[int, int] = (48, 96),
    seed: int = 0,
    val_per_class: int = 20,
    quality: int = 90,
    *,
    overwrite: bool = False,
) -> Path:
    """Write a synthetic ImageNet-style JPEG dataset to ``root`` and return ``root``.

    Layout: ``root/train/<wnid>/<wnid>_<i>.JPEG``, ``root/val/<wnid>/<wnid>_val_<i>.JPEG`` and
    ``root/manifest.json`` (parameters, counts, class names, a SHA-256 over all files). Each
    class has a shape, a hue shared with one other class, and a stripe or checker texture of a
    class frequency; images add a random background, 1-3 distractor shapes in other classes'
    hues, random position, scale and rotation, pixel noise, and a height and a width each drawn
    from ``size``. The bytes depend only on the arguments.

    The set is written into a temporary sibling folder, then renamed into place, so readers
    never see a partial set.

    Args:
        root: folder to create.
        classes: number of classes (>= 2).
        per_class: training images per class.
        size: ``(min_side, max_side)``; height and width are each uniform in it.
        seed: RNG seed.
        val_per_class: validation images per class (0 for none).
        quality: JPEG quality 1-100.
        overwrite: replace an existing non-empty ``root``; otherwise that is an error.

    Raises:
        FileExistsError: ``root`` exists, is not empty, and ``overwrite`` is false.
        ValueError, TypeError: bad parameters (the message names the value).
    """
    params = _synthetic_params(classes, per_class, size, seed, val_per_class, quality)
    root = Path(root)
    if _non_empty_dir(root) and not overwrite:
        raise FileExistsError(f"dataset folder {str(root)!r} exists and is not empty")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        manifest = _write_synthetic(tmp, params)
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _replace_dir(tmp, root, overwrite=overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _write_synthetic(out: Path, params: dict[str, Any]) -> dict[str, Any]:
    classes = params["classes"]
    names = synthetic_class_names(classes)
    styles = _class_styles(classes)
    size = (params["size"][0], params["size"][1])
    digest = hashlib.sha256()
    counts = {}
    for split_id, (split, count) in enumerate(
        (("train", params["per_class"]), ("val", params["val_per_class"]))
    ):
        counts[split] = 0
        for c, name in enumerate(names):
            folder = out / split / name
            folder.mkdir(parents=True)
            # With two classes both share one hue; clutter then takes the complementary hue.
            other_hues = [s.hue for s in styles if s.hue != styles[c].hue] or [
                (styles[c].hue + 0.5) % 1.0
            ]
            for i in range(count):
                # One RNG stream per image keeps every image independent of the loop order.
                rng = np.random.default_rng([params["seed"], split_id, c, i])
                pixels = _render_image(rng, styles[c], other_hues, size)
                data = _encode_jpeg(pixels, params["quality"])
                stem = f"{name}_{i:05d}" if split == "train" else f"{name}_val_{i:05d}"
                rel = f"{split}/{name}/{stem}.JPEG"
                (out / rel).write_bytes(data)
                digest.update(rel.encode() + b"\0" + data)
                counts[split] += 1
    return {
        "generator": _GENERATOR_ID,
        "params": params,
        "classes": names,
        "counts": counts,
        "sha256": digest.hexdigest(),
    }


def _non_empty_dir(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        raise FileExistsError(f"{str(path)!r} exists and is not a folder") from None


def _replace_dir(src: Path, dst: Path, *, overwrite: bool) -> None:
    # rename(2) onto an empty folder or a missing name is atomic; a non-empty one must first be
    # moved aside, which leaves a short window where dst is missing (never partial).
    try:
        os.replace(src, dst)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if not overwrite:
            raise FileExistsError(f"dataset folder {str(dst)!r} was created concurrently") from exc
    old = dst.parent / f".{dst.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(dst, old)
    try:
        os.replace(src, dst)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(root: str | Path) -> dict[str, Any] | None:
    """The manifest of a synthetic set at ``root``, or ``None`` if missing or unreadable."""
    try:
        data = json.loads((Path(root) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _manifest_matches(root: Path, params: dict[str, Any]) -> bool:
    manifest = read_manifest(root)
    if manifest is None or manifest.get("generator") != _GENERATOR_ID:
        return False
    if manifest.get("params") != params:
        return False
    # Cheap completeness check: the right number of files in every class folder.
    expected = {"train": params["per_class"], "val": params["val_per_class"]}
    for split, count in expected.items():
        for name in manifest.get("classes", []):
            folder = root / split / name
            try:
                with os.scandir(folder) as it:
                    if sum(1 for e in it if e.name.endswith(".JPEG")) != count:
                        return False
            except OSError:
                return False
    return True


def default_dataset_dir() -> Path:
    """Cache folder for generated data: ``$ECHOPIPE_CACHE_DIR`` or ``~/.cache/echopipe``."""
    env = os.environ.get("ECHOPIPE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "echopipe"


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    from filelock import FileLock, Timeout

    # A timeout, not a blocking wait: a stuck holder gives a clear TimeoutError, not a hang.
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=timeout)
    except Timeout:
        raise TimeoutError(f"could not lock {str(path)!r} within {timeout:.0f} s") from None
    try:
        yield
    finally:
        lock.release()


def synthetic_dataset_name(params: dict[str, Any]) -> str:
    """Folder name of a cached synthetic set: readable parameters plus a short hash of all."""
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    lo, hi = params["size"]
    return f"synthetic-imagenet-c{params['classes']}-n{params['per_class']}-s{lo}-{hi}-{key}"


def ensure_synthetic_imagenet(
    root: str | Path | None = None,
    *,
    classes: int = 10,
    per_class: int = 100,
    size: tuple[int, int] = (48, 96),
    seed: int = 0,
    val_per_class: int = 20,
    quality: int = 90,
    lock_timeout: float = 600.0,
) -> Path:
    """Return a synthetic set with these parameters, generating it once per cache folder.

    The set lives in ``root / synthetic_dataset_name(params)`` (``root`` defaults to
    :func:`default_dataset_dir`), so different parameters get different folders. An existing
    set is reused when its manifest matches and its file counts are complete; otherwise it is
    rebuilt. A file lock serialises builders across processes; the build itself is atomic.

    Args:
        root: cache folder holding generated sets.
        classes, per_class, size, seed, val_per_class, quality: see
            :func:`make_synthetic_imagenet`.
        lock_timeout: seconds to wait for another process's build before ``TimeoutError``.

    Returns:
        The dataset folder (contains ``train/``, ``val/`` and ``manifest.json``).
    """
    params = _synthetic_params(classes, per_class, size, seed, val_per_class, quality)
    cache = Path(root) if root is not None else default_dataset_dir()
    target = cache / synthetic_dataset_name(params)
    if _manifest_matches(target, params):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / f".{target.name}.lock", lock_timeout):
        if not _manifest_matches(target, params):
            make_synthetic_imagenet(
                target,
                classes=classes,
                per_class=per_class,
                size=size,
                seed=seed,
                val_per_class=val_per_class,
                quality=quality,
                overwrite=True,
            )
    return target


# --------------------------------------------------------------------------------------------
# Image folder scanning
# --------------------------------------------------------------------------------------------


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
        except OSError as exc:
            links_skipped.append((dirpath, f"cannot list: {exc.strerror or exc}"))
            continue
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


# --------------------------------------------------------------------------------------------
# scikit-learn digits
# --------------------------------------------------------------------------------------------


def load_digits(
    image_size: int = 32, test_fraction: float = 0.25, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 8x8 digits (1797 images, shipped with sklearn), as image tensors.

    Pixels are scaled to [0, 1], resized bilinearly to ``image_size``, then normalised with the
    training split's mean and standard deviation. The split is stratified and deterministic in
    ``seed``.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: float32 ``(N, 1, image_size, image_size)``
        images and int64 ``(N,)`` labels.
    """
    from sklearn.datasets import load_digits as _sk_load_digits
    from sklearn.model_selection import train_test_split

    _check_int("image_size", image_size, minimum=8)
    _check_int("seed", seed, minimum=0)
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    bunch = _sk_load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) / 16.0
    labels = np.asarray(bunch.target, dtype=np.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(labels)), test_size=test_fraction, random_state=seed, stratify=labels
    )
    x = torch.from_numpy(images).unsqueeze(1)
    if image_size != x.shape[-1]:
        x = torch.nn.functional.interpolate(
            x, size=(image_size, image_size), mode="bilinear", align_corners=False
        )
    x_train, x_test = x[torch.from_numpy(idx_train)], x[torch.from_numpy(idx_test)]
    mean, std = x_train.mean(), x_train.std()
    x_train = ((x_train - mean) / std).contiguous()
    x_test = ((x_test - mean) / std).contiguous()
    y = torch.from_numpy(labels)
    return x_train, y[torch.from_numpy(idx_train)], x_test, y[torch.from_numpy(idx_test)]


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
