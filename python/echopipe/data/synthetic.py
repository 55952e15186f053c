"""The synthetic ImageNet-style JPEG set on disk, and the cache that builds it once.

The set is real JPEG files in the ImageNet folder layout (``train/<wnid>/*.JPEG``,
``val/<wnid>/*.JPEG``), so the DALI readers and decoders do real work on it. Classes differ by
shape, hue and texture, and every image carries noise, clutter from other classes' palettes,
random placement, scale and rotation, and its own width and height (the drawing is in
:mod:`echopipe.data.synthetic_draw`). Generation is deterministic in its arguments and atomic on
disk, so several processes (torchrun ranks) can ask for the same set at once and all get one
complete copy. The public names are re-exported by :mod:`echopipe.data`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..filecheck import open_regular
from .synthetic_draw import class_styles, encode_jpeg, render_image

__all__ = [
    "MANIFEST_NAME",
    "SYNTHETIC_GENERATOR_VERSION",
    "default_dataset_dir",
    "ensure_synthetic_imagenet",
    "make_synthetic_imagenet",
    "read_manifest",
    "synthetic_class_names",
    "synthetic_dataset_name",
]

SYNTHETIC_GENERATOR_VERSION = 1
"""Bumped whenever the generator's output bytes change, so caches keyed on it are rebuilt."""

MANIFEST_NAME = "manifest.json"
_MANIFEST_MAX_BYTES = 1 << 20  # a longer one is not a manifest this module wrote
_GENERATOR_ID = "echopipe.synthetic_imagenet"


def synthetic_class_names(classes: int) -> list[str]:
    """WordNet-id-like folder names ``n0XXXXXXX`` whose sorted order is the class index order."""
    check_int("classes", classes, minimum=2)
    return [f"n{1_000_000 + 7_919 * c:08d}" for c in range(classes)]


def _synthetic_params(
    classes: int,
    per_class: int,
    size: tuple[int, int],
    seed: int,
    val_per_class: int,
    quality: int,
) -> dict[str, Any]:
    check_int("classes", classes, minimum=2)
    check_int("per_class", per_class, minimum=1)
    check_int("val_per_class", val_per_class, minimum=0)
    check_int("seed", seed, minimum=0)
    check_int("quality", quality, minimum=1)
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
    styles = class_styles(classes)
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
                pixels = render_image(rng, styles[c], other_hues, size)
                data = encode_jpeg(pixels, params["quality"])
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
        f, _ = open_regular(Path(root) / MANIFEST_NAME)  # a FIFO is refused, not waited on
        with f:
            data = json.loads(f.read(_MANIFEST_MAX_BYTES + 1))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _manifest_matches(root: Path, params: dict[str, Any]) -> bool:
    manifest = read_manifest(root)
    if manifest is None or manifest.get("generator") != _GENERATOR_ID:
        return False
    if manifest.get("params") != params:
        return False
    classes = manifest.get("classes", [])
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        return False
    # Cheap completeness check: the right number of files in every class folder.
    expected = {"train": params["per_class"], "val": params["val_per_class"]}
    for split, count in expected.items():
        for name in classes:
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


def check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
