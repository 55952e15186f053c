"""Datasets for echopipe: a synthetic ImageNet-style JPEG set, folder scanning, and digits.

This module is the public face of three pieces, each in its own module:

* the synthetic set (:mod:`echopipe.data.synthetic`, drawn by :mod:`echopipe.data.synthetic_draw`):
  real JPEG files in the ImageNet folder layout (``train/<wnid>/*.JPEG``,
  ``val/<wnid>/*.JPEG``), so the DALI readers and decoders do real work on it. Classes differ
  by shape, hue and texture, and every image carries noise, clutter from other classes'
  palettes, random placement, scale and rotation, and its own width and height. Generation is
  deterministic in its arguments and atomic on disk, so several processes (torchrun ranks) can
  ask for the same set at once and all get one complete copy;
* folder scanning (:mod:`echopipe.data.image_folder`): an ImageFolder tree indexed with labels,
  its files checked (on a pool of threads, and under torchrun shared out among the ranks:
  :mod:`echopipe.data.folder_check`), bad ones named (:class:`CorruptImageError`) or left out;
* scikit-learn's digits as tensors (:mod:`echopipe.data.digits`).
"""

from __future__ import annotations

from .digits import load_digits
from .folder_check import FILE_TIMEOUT_S, CheckFailedError, ScanShare, default_workers
from .image_folder import (
    MAX_IMAGE_PIXELS,
    CorruptImageError,
    ImageFolderIndex,
    check_image_file,
    scan_image_folder,
)
from .synthetic import (
    MANIFEST_NAME,
    SYNTHETIC_GENERATOR_VERSION,
    default_dataset_dir,
    ensure_synthetic_imagenet,
    make_synthetic_imagenet,
    read_manifest,
    synthetic_class_names,
    synthetic_dataset_name,
)

__all__ = [
    "FILE_TIMEOUT_S",
    "MAX_IMAGE_PIXELS",
    "SYNTHETIC_GENERATOR_VERSION",
    "CheckFailedError",
    "CorruptImageError",
    "ImageFolderIndex",
    "ScanShare",
    "check_image_file",
    "default_dataset_dir",
    "default_workers",
    "ensure_synthetic_imagenet",
    "load_digits",
    "make_synthetic_imagenet",
    "read_manifest",
    "scan_image_folder",
    "synthetic_class_names",
    "synthetic_dataset_name",
]

# Not in __all__ (as before the split), but imported by callers and tests.
_ = (MANIFEST_NAME,)
