"""A training program in the shape of DALI's ResNet-50 PyTorch example, migrated in 4 lines.

The shape (written here, not copied): a helper decodes and augments images without seeing the
labels; one ``create_dali_pipeline(..., is_training=...)`` function, decorated with
``exec_dynamic=True``, builds both the training and the validation pipeline around a
``fn.readers.file(..., pad_last_batch=True, name="Reader")``; each is built and wrapped in
``DALIClassificationIterator(reader_name="Reader", last_batch_policy=PARTIAL, auto_reset=True)``;
the loop reads ``data[0]["data"]`` and ``data[0]["label"]`` and takes its progress total from
the iterator's ``_size``. The migration: the import, the decorator, and a guarded ``echo()``.
CPU decoding (``dali_cpu``) and ``device_id=None``: the machine has no GPU.

Every image is one flat colour, unique per file, so random crops, resizes and flips keep it and
each delivered sample names its file by content.
"""

from __future__ import annotations

import gc
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

import nvidia.dali.fn as fn  # noqa: E402
import nvidia.dali.types as types  # noqa: E402
from nvidia.dali import Pipeline  # noqa: E402
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy  # noqa: E402

import echopipe.dali as edali  # noqa: E402  (migration line 1)

CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS = 3, 7, 3
MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]
BATCH, CROP, SIZE = 4, 8, 10


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, tuple]]:
    """train/ and val/ with one folder per class; grey level 8 * k + 4 is file k."""
    from PIL import Image

    root = tmp_path_factory.mktemp("rn50_shape")
    files: dict[int, tuple[str, int]] = {}
    k = 0
    for split, per_class in (("train", TRAIN_PER_CLASS), ("val", VAL_PER_CLASS)):
        for c in range(CLASSES):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for j in range(per_class):
                grey = 8 * k + 4
                Image.fromarray(np.full((24, 20, 3), grey, np.uint8)).save(
                    folder / f"img_{j}.jpg", quality=95
                )
                files[grey] = (split, c)
                k += 1
    return root, files


def image_processing_func(images, crop, size, is_training=True, decoder_device="mixed"):
    if is_training:
        images = fn.decoders.image_random_crop(
            images, device=decoder_device, output_type=types.RGB,
            random_aspect_ratio=[0.8, 1.25], random_area=[0.25, 1.0], num_attempts=50,
        )  # fmt: skip
        images = fn.resize(images, resize_x=crop, resize_y=crop, interp_type=types.INTERP_LINEAR)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(images, device=decoder_device, output_type=types.RGB)
        images = fn.resize(images, size=size, mode="not_smaller", interp_type=types.INTERP_LINEAR)
        mirror = False
    return fn.crop_mirror_normalize(
        images, dtype=types.FLOAT, output_layout="CHW", crop=(crop, crop), mean=MEAN, std=STD,
        mirror=mirror,
    )  # fmt: skip


@edali.echo_pipeline_def(exec_dynamic=True, echo_factor=2)  # migration line 2: was @pipeline_def
def create_dali_pipeline(data_dir, crop, size, shard_id, num_shards, dali_cpu=False,
                         is_training=True):  # fmt: skip
    images, labels = fn.readers.file(
        file_root=data_dir, shard_id=shard_id, num_shards=num_shards,
        random_shuffle=is_training, pad_last_batch=True, name="Reader",
    )  # fmt: skip
    decoder_device = "cpu" if dali_cpu else "mixed"
    images = image_processing_func(images, crop, size, is_training, decoder_device)
    if is_training:  # migration line 3
        images, labels = edali.echo(images, labels)  # migration line 4
    return images, labels


def _loader(
    root: Path, split: str, shard_id: int, num_shards: int, is_training: bool, iterator=None
):
    pipe = create_dali_pipeline(
        batch_size=BATCH, num_threads=1, device_id=None, seed=12 + shard_id,
        data_dir=str(root / split), crop=CROP, size=SIZE, dali_cpu=True, shard_id=shard_id,
        num_shards=num_shards, is_training=is_training,
    )  # fmt: skip
    pipe.build()
    loader = (iterator or DALIClassificationIterator)(
        pipe, reader_name="Reader", last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True
    )
    return pipe, loader


def _identify(images: torch.Tensor, files: dict[int, tuple]) -> list[int]:
    """The grey level of each normalised CHW image: its file."""
    red = images[:, 0].float() * STD[0] + MEAN[0]
    assert float((red.amax(dim=(1, 2)) - red.amin(dim=(1, 2))).max()) < 3.0  # one flat colour
    greys = np.array(sorted(files))
    means = red.mean(dim=(1, 2)).numpy()
    nearest = greys[np.abs(means[:, None] - greys[None, :]).argmin(axis=1)]
    assert np.abs(means - nearest).max() < 3.0
    return nearest.tolist()


def _train_epoch(loader, model, optimizer, files, seen: list[tuple[int, int]]) -> int:
    steps = 0
    for i, data in enumerate(loader):
        images = data[0]["data"]
        target = data[0]["label"].squeeze(-1).long()
        train_loader_len = math.ceil(loader._size / BATCH)
        for group in optimizer.param_groups:  # an epoch-based warm-up, as the example's
            group["lr"] = 0.1 * (1 + i) / train_loader_len
        loss = torch.nn.functional.cross_entropy(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += zip(_identify(images, files), target.tolist(), strict=True)
        steps += 1
        assert i < train_loader_len
    return steps


def _validate(loader, model, files, seen: list[tuple[int, int]]) -> None:
    with torch.no_grad():
        for data in loader:
            images = data[0]["data"]
            target = data[0]["label"].squeeze(-1).long()
            model(images)
            seen += zip(_identify(images, files), target.tolist(), strict=True)


def _split_files(files: dict[int, tuple], split: str) -> set[int]:
    return {grey for grey, (s, _) in files.items() if s == split}


# "echo": the training loader's class name swapped for EchoIterator, nothing else changed (the
# validation pipeline has no echo point and keeps DALI's iterator).
@pytest.mark.parametrize("train_iterator", ["dali", "echo"])
@pytest.mark.parametrize("num_shards", [1, 3])
def test_migrated_example_trains_each_file_twice_and_validates_each_once(
    imagenet_like, num_shards: int, train_iterator: str
) -> None:
    root, files = imagenet_like
    train_files, val_files = _split_files(files, "train"), _split_files(files, "val")
    cls = edali.EchoIterator if train_iterator == "echo" else None
    shards = [
        (
            _loader(root, "train", s, num_shards, True, cls),
            _loader(root, "val", s, num_shards, False),
        )
        for s in range(num_shards)
    ]
    for (train_pipe, train_loader), (val_pipe, _) in shards:
        assert isinstance(train_pipe, edali.EchoPipeline)
        assert type(val_pipe) is Pipeline  # the validation call built no echo point
        # 21 training files: 7 per shard; e = 2 makes a shard's epoch 14 (42 for one shard).
        assert train_loader._size == train_loader.size == 2 * len(train_files) // num_shards
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * CROP * CROP, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _epoch in range(3):
        trained: list[tuple[int, int]] = []
        validated: list[tuple[int, int]] = []
        for (_, train_loader), (_, val_loader) in shards:
            steps = _train_epoch(train_loader, model, optimizer, files, trained)
            assert steps == len(train_loader) == math.ceil(train_loader._size / BATCH)
            _validate(val_loader, model, files, validated)
        assert Counter(g for g, _ in trained) == {g: 2 for g in train_files}
        assert Counter(g for g, _ in validated) == {g: 1 for g in val_files}
        assert all(files[g][1] == label for g, label in trained + validated)
    for (train_pipe, _), _val in shards:
        train_pipe.close()


@edali.echo_pipeline_def(exec_dynamic=True, echo_factor=2)
def create_dali_proxy_pipeline(crop, size, dali_cpu=False, is_training=True):
    filepaths = fn.external_source(name="images", no_copy=True)
    images = fn.io.file.read(filepaths)
    decoder_device = "cpu" if dali_cpu else "mixed"
    images = image_processing_func(images, crop, size, is_training, decoder_device)
    if is_training:
        (images,) = edali.echo(images)
    return images


# DALIServer.__del__ runs on the object whose __init__ refused the pipeline (DALI's own).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_proxy_mode_says_why_it_cannot_echo_and_what_to_use() -> None:
    """``--data-loader dali_proxy``: DALIServer maps each output batch to one input batch of the
    DataLoader's workers. Its validation pipeline (no echo point) is plain DALI and is taken;
    an echoing one is refused in one line that names EchoLoader over the proxy's DataLoader."""
    from nvidia.dali.plugin.pytorch.experimental import proxy as dali_proxy

    kw = dict(batch_size=BATCH, num_threads=1, device_id=None, crop=CROP, size=SIZE, dali_cpu=True)
    val_pipe = create_dali_proxy_pipeline(is_training=False, **kw)
    assert type(val_pipe) is Pipeline
    dali_proxy.DALIServer(val_pipe)  # accepted (not started: the proxy's workers need CUDA NVTX)
    with create_dali_proxy_pipeline(is_training=True, **kw) as train_pipe:
        with pytest.raises(TypeError) as refused:
            dali_proxy.DALIServer(train_pipe)
        message = str(refused.value)
        del refused  # its traceback holds the half-made DALIServer: collected inside the test
        gc.collect()
        assert "\n" not in message and "proxy mode" in message
        assert "echopipe.torch.EchoLoader" in message
