"""scikit-learn's 8x8 handwritten digits as normalised image tensors, for quick model tests.

No files, no DALI: the pipeline convergence tests, the model tests and some benchmarks train on
these. The public name is re-exported by :mod:`echopipe.data`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .synthetic import check_int

__all__ = ["load_digits"]


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

    check_int("image_size", image_size, minimum=8)
    check_int("seed", seed, minimum=0)
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
