"""Small real JPEGs: solid colours the DALI tests recognise, and a two-class data folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def solid_jpegs(
    root: Path,
    count: int,
    shape: Callable[[int], tuple[int, int]],
    value: Callable[[int], int],
    quality: int | None = 95,
) -> list[str]:
    """Writes ``img_00.jpg``... into ``root``: file ``i`` is one colour ``value(i)`` at
    ``shape(i)`` (height, width); returns the paths in order. ``quality=None`` keeps PIL's
    default."""
    from PIL import Image

    options = {} if quality is None else {"quality": quality}
    paths = []
    for i in range(count):
        path = root / f"img_{i:02d}.jpg"
        Image.fromarray(np.full((*shape(i), 3), value(i), np.uint8)).save(path, **options)
        paths.append(str(path))
    return paths


def two_class_folder(root: Path) -> Path:
    """``root/{train,val}/{ant,cat}/NN.JPEG``: 6 training and 2 validation JPEGs of 32 x 32
    noise per class (what the image-check tests of ``echopipe train`` read); returns ``root``."""
    from PIL import Image

    for split, count in (("train", 6), ("val", 2)):
        for c in ("ant", "cat"):
            (root / split / c).mkdir(parents=True)
            for i in range(count):
                pixels = np.random.default_rng(i).integers(0, 255, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{i:02d}.JPEG", quality=80)
    return root
