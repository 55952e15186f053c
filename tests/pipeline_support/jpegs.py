"""Small real JPEGs the DALI tests recognise by their solid colour."""

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
