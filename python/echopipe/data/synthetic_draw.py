"""Drawing one image of the synthetic set: class styles, shapes, clutter, noise, JPEG bytes.

Each class has a shape, a hue shared with one other class, and a stripe or checker texture of
a class frequency; :func:`render_image` draws one sample of a class from its own RNG stream.
The set on disk (:mod:`echopipe.data.synthetic`) calls these; the bytes they produce are
covered by :data:`echopipe.data.SYNTHETIC_GENERATOR_VERSION`, so any change here must bump it.
"""

from __future__ import annotations

import colorsys
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

_SHAPES = ("ellipse", "rectangle", "triangle", "cross", "ring", "diamond")
_TEXTURES = ("stripes", "checker")


@dataclass(frozen=True)
class _ClassStyle:
    shape: str
    hue: float
    texture: str
    frequency: float


def class_styles(classes: int) -> list[_ClassStyle]:
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


def render_image(
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


def encode_jpeg(pixels: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
