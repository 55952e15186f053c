"""The files an ImageNet builder reads: the split folder, its checked index, and the shard.

Folder layout. ``data_dir`` may be either a dataset root holding the split folder (``train/`` or
``val/``), or the split folder itself; the split folder holds one sub-folder per class with the
JPEGs inside (``data_dir/train/<class>/*.JPEG`` or ``data_dir/<class>/*.JPEG``). Class ids are the
sorted class folder names. Files are listed in Python (:func:`echopipe.data.scan_image_folder`)
and checked before DALI opens them, so an empty or garbage file gives a
:class:`~echopipe.data.CorruptImageError` naming it (``on_corrupt="error"``) or is left out and
counted (``on_corrupt="skip"``); the index, including ``skipped``, is attached to the returned
pipeline as ``folder_index``.

Sharding works the way DALI readers do: ``shard_id``/``num_shards`` go to ``fn.readers.file``,
which reads a contiguous ``1/num_shards`` of the file list. The training file list is first
permuted with ``seed`` (the same permutation on every rank, so shards stay disjoint and each
holds a mix of classes), and an echoing rank echoes only the samples its own reader produced.

The public names are re-exported by :mod:`echopipe.dali.builders` and :mod:`echopipe.dali`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..data import ImageFolderIndex, scan_image_folder
from .source_tap import UpstreamTap
from .specs import CheckLevel, OnCorrupt

__all__ = ["index_imagenet_split", "resolve_split_dir"]

READER_NAME = "Reader"


def resolve_split_dir(data_dir: str | Path, split: str) -> Path:
    """The class-folder root for ``split``: ``data_dir/split`` if it exists, else ``data_dir``.

    Raises:
        FileNotFoundError: ``data_dir`` is missing or not a folder.
    """
    root = Path(data_dir)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(f"data_dir {str(root)!r} {what}")
    candidate = root / split
    return candidate if candidate.is_dir() else root


def index_imagenet_split(
    data_dir: str | Path | ImageFolderIndex,
    split: str,
    *,
    check: CheckLevel = "header",
    on_corrupt: OnCorrupt = "error",
) -> ImageFolderIndex:
    """List and check the images of one split (see the module notes on the accepted layouts).

    An :class:`~echopipe.data.ImageFolderIndex` given as ``data_dir`` (a split scanned and
    checked already, as ``echopipe train`` does before it builds its pipelines) is used as it
    is: its files are not listed or checked again.

    Raises:
        FileNotFoundError: no such folder.
        ValueError: no class folders or no images.
        CorruptImageError: a bad file and ``on_corrupt="error"`` (names the file).
    """
    if isinstance(data_dir, ImageFolderIndex):
        return data_dir
    return scan_image_folder(resolve_split_dir(data_dir, split), check=check, on_corrupt=on_corrupt)


@dataclass(frozen=True)
class ReaderArgs:
    files: list[str]
    labels: list[int]
    shard_id: int
    num_shards: int
    random_shuffle: bool
    pad_last_batch: bool
    stick_to_shard: bool
    seed: int
    initial_fill: int


def train_reader_args(
    index: ImageFolderIndex,
    *,
    shard_id: int,
    num_shards: int,
    seed: int,
    shuffle_files: bool,
    stick_to_shard: bool,
    initial_fill: int,
) -> ReaderArgs:
    files, labels = list(index.files), list(index.labels)
    if shuffle_files:
        # One permutation, the same on every rank (it depends on seed only), so the contiguous
        # shards DALI cuts stay disjoint while each one mixes all classes.
        order = np.random.default_rng(seed).permutation(len(files))
        files = [files[i] for i in order]
        labels = [labels[i] for i in order]
    return ReaderArgs(
        files=files,
        labels=labels,
        shard_id=shard_id,
        num_shards=num_shards,
        random_shuffle=True,
        pad_last_batch=False,
        stick_to_shard=stick_to_shard,
        seed=seed + shard_id,
        initial_fill=initial_fill,
    )


def val_reader_args(
    index: ImageFolderIndex, *, shard_id: int, num_shards: int, seed: int, stick_to_shard: bool
) -> ReaderArgs:
    # Sorted files, no shuffle, and the last batch padded so every image is read once per epoch.
    return ReaderArgs(
        files=list(index.files),
        labels=list(index.labels),
        shard_id=shard_id,
        num_shards=num_shards,
        random_shuffle=False,
        pad_last_batch=True,
        stick_to_shard=stick_to_shard,
        seed=seed,
        initial_fill=1,
    )


def attach(pipe: Any, index: ImageFolderIndex, tap: UpstreamTap | None) -> Any:
    if tap is not None:
        # Made after the pipeline's own finalizer, so run before it (at collection and at
        # exit): the join of its upstream thread then waits for no read delay.
        weakref.finalize(pipe, tap.stop)
    pipe.folder_index = index
    pipe.skipped_files = list(index.skipped)
    pipe.upstream_tap = tap
    pipe.reader_name = READER_NAME
    return pipe
