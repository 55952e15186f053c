"""The ready-made ImageNet pipelines (echopipe.dali.builders) and the Python echo peer.

Everything runs real CPU DALI pipelines (``device_id=None``) over real JPEGs written by Pillow.
"""

from __future__ import annotations

import collections
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")
edali = pytest.importorskip("echopipe.dali", exc_type=ImportError)

from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: E402

from echopipe.dali import EchoIterator, LastBatchPolicy  # noqa: E402
from echopipe.dali.base import EchoPipelineBase, PipelineStats  # noqa: E402
from echopipe.dali.builder_checks import MAX_PIPELINE_SEED  # noqa: E402
from echopipe.dali.builders import (  # noqa: E402
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImagenetEchoPipeline,
    explain_decode_failure,
    imagenet_decode_pipeline,
    imagenet_train_pipeline,
    imagenet_val_pipeline,
    index_imagenet_split,
)
from echopipe.dali.peer import python_echo_train_pipeline  # noqa: E402
from echopipe.dali.peer_buffer import PythonEchoBuffer  # noqa: E402
from echopipe.data import CorruptImageError, make_synthetic_imagenet  # noqa: E402

pytestmark = pytest.mark.dali

SIZE = 16
# The normalised range of a pixel in [0, 255], per channel.
LOW = min((0.0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True))
HIGH = max((1.0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes x 8 train images, 3 classes x 3 val images (9: not a multiple of the batch)."""
    root = tmp_path_factory.mktemp("builders") / "data"
    return make_synthetic_imagenet(
        root, classes=3, per_class=8, size=(24, 40), seed=1, val_per_class=3
    )


def _copy_train(data: Path, dest: Path) -> Path:
    shutil.copytree(data / "train", dest / "train")
    return dest


def _good_jpeg_bytes(data: Path) -> bytes:
    return next(iter(sorted((data / "train").rglob("*.JPEG")))).read_bytes()


def _drain_echo(pipe: Any, names: tuple[str, ...] = ("data", "label")) -> tuple[list, Any]:
    """All batches of a finite echo stream, and the iterator's stats."""
    with EchoIterator(pipe, list(names), last_batch_policy=LastBatchPolicy.PARTIAL) as it:
        batches = list(it)
        return batches, it.stats


def _run_in_thread(target: Any, timeout: float) -> BaseException | None:
    """Runs ``target`` in a thread; fails the test if it has not finished within ``timeout``."""
    outcome: list[BaseException | None] = []

    def body() -> None:
        try:
            target()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still running after {timeout} s (hang)"
    return outcome[0]


# ---- outputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("echo_insert", "dtype", "np_dtype"),
    [("after_decode", "float", np.float32), ("after_augment", "half", np.float16)],
)
def test_echo_train_outputs_nchw_normalised_and_echoed(
    data: Path, echo_insert: str, dtype: str, np_dtype: type
) -> None:
    pipe = imagenet_train_pipeline(
        data, batch_size=4, image_size=SIZE, echo_factor=2.0, echo_insert=echo_insert,
        dtype=dtype, epochs=1, num_threads=1, upstream_threads=1, seed=3,
    )  # fmt: skip
    assert isinstance(pipe, ImagenetEchoPipeline)
    batches, stats = _drain_echo(pipe)
    images = np.concatenate([b[0]["data"].numpy() for b in batches])
    labels = np.concatenate([b[0]["label"].numpy() for b in batches])
    assert images.shape == (48, 3, SIZE, SIZE)
    assert images.dtype == np_dtype
    assert labels.dtype == np.int64 and labels.shape == (48,)
    assert float(images.min()) >= LOW - 0.01 and float(images.max()) <= HIGH + 0.01
    # Normalised, not raw pixels: centred near zero with a spread of about one.
    assert abs(float(images.astype(np.float32).mean())) < 1.0
    assert 0.2 < float(images.astype(np.float32).std()) < 2.0
    # Every one of the 24 files is stored once and handed out exactly twice.
    assert stats.fresh == 24 and stats.echoed == 24
    assert collections.Counter(labels.tolist()) == {0: 16, 1: 16, 2: 16}
    assert pipe.upstream_tap is not None and pipe.upstream_tap.samples == 24


def test_plain_and_val_pipelines_do_not_load_the_plugin_and_echo_checks_it_first(
    data: Path, tmp_path: Path
) -> None:
    fake = tmp_path / "libechopipe_dali.so"
    fake.write_bytes(b"\x7fELF...ECHOPIPE_DALI_BUILT_VERSION=1.99.0\n...")
    script = f"""
import nvidia.dali
from nvidia.dali.ops import _registry
import echopipe.dali as edali
from echopipe.dali import plugin

root = {str(data)!r}
for build in (edali.imagenet_val_pipeline, edali.imagenet_plain_train_pipeline):
    pipe = build(root, batch_size=4, image_size=16, num_threads=1)
    pipe.build()
    assert len(pipe.run()[0]) == 4
assert plugin._lib is None and "EchopipeEchoSink" not in _registry.cpu_ops()
real = plugin.plugin_path
plugin.plugin_path = lambda: {str(fake)!r}  # a plugin built for another DALI
try:
    edali.imagenet_train_pipeline(root, batch_size=4, image_size=16, num_threads=1)
except edali.DaliVersionMismatchError as exc:
    assert "1.99.0" in str(exc) and nvidia.dali.__version__ in str(exc), str(exc)
else:
    raise SystemExit("no DaliVersionMismatchError")
plugin.plugin_path = real
pipe = edali.imagenet_train_pipeline(root, batch_size=4, image_size=16, num_threads=1)
with edali.EchoIterator(pipe, ["data", "label"], steps_per_epoch=1) as it:
    assert next(it)[0]["data"].shape == (4, 3, 16, 16)
assert plugin._lib is not None and "EchopipeEchoSink" in _registry.cpu_ops()
print("lazy plugin ok")
"""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lazy plugin ok" in proc.stdout


def test_plain_train_pipeline_outputs(data: Path) -> None:
    pipe = imagenet_train_pipeline(
        data / "train", batch_size=5, image_size=SIZE, echo_factor=None, num_threads=1
    )
    pipe.build()
    images, labels = pipe.run()
    assert images.layout() == "CHW"
    arr = np.array(images.as_tensor())
    assert arr.shape == (5, 3, SIZE, SIZE) and arr.dtype == np.float32
    assert arr.min() >= LOW - 0.01 and arr.max() <= HIGH + 0.01
    lab = np.array(labels.as_tensor())
    assert lab.dtype == np.int64 and set(lab.tolist()) <= {0, 1, 2}
    assert pipe.folder_index.classes == sorted(p.name for p in (data / "train").iterdir())


def test_root_and_split_folder_give_the_same_index(data: Path) -> None:
    a = index_imagenet_split(data, "train")
    b = index_imagenet_split(data / "train", "train")
    assert a.files == b.files and len(a) == 24
    assert len(index_imagenet_split(data, "val")) == 9


# ---- validation ------------------------------------------------------------------------------


def _val_epoch(data: Path, shard_id: int, num_shards: int, epochs: int = 1) -> list[list[str]]:
    pipe = imagenet_val_pipeline(
        data, batch_size=4, image_size=SIZE, resize_size=20, shard_id=shard_id,
        num_shards=num_shards, num_threads=1, return_paths=True,
    )  # fmt: skip
    it = DALIGenericIterator(
        pipe, ["data", "label", "path"], reader_name=pipe.reader_name,
        last_batch_policy=LastBatchPolicy.PARTIAL,
    )  # fmt: skip
    seen = []
    for _ in range(epochs):
        paths = []
        for batch in it:
            out = batch[0]
            assert out["data"].shape[1:] == (3, SIZE, SIZE)
            for row, label in zip(out["path"].numpy(), out["label"].tolist(), strict=True):
                path = bytes(row.astype(np.uint8)).decode()
                assert label == pipe.folder_index.classes.index(Path(path).parent.name)
                paths.append(path)
        it.reset()
        seen.append(paths)
    return seen


def test_val_sees_every_image_exactly_once_per_epoch(data: Path) -> None:
    expected = sorted(str(p) for p in (data / "val").rglob("*.JPEG"))
    for paths in _val_epoch(data, 0, 1, epochs=2):
        assert sorted(paths) == expected  # 9 images, batches of 4: 4 + 4 + 1
        hist = collections.Counter(Path(p).parent.name for p in paths)
        assert sorted(hist.values()) == [3, 3, 3]


def test_val_shards_cover_the_set_disjointly(data: Path) -> None:
    (a,) = _val_epoch(data, 0, 2)
    (b,) = _val_epoch(data, 1, 2)
    assert not set(a) & set(b)
    assert sorted(a + b) == sorted(str(p) for p in (data / "val").rglob("*.JPEG"))
    assert {len(a), len(b)} == {4, 5}


def test_val_pipeline_is_deterministic_centre_crop(data: Path) -> None:
    def first_batch() -> np.ndarray:
        pipe = imagenet_val_pipeline(data, batch_size=3, image_size=SIZE, num_threads=1)
        pipe.build()
        return np.array(pipe.run()[0].as_tensor())

    assert np.array_equal(first_batch(), first_batch())


# ---- sharding of the echoing training pipeline ----------------------------------------------


def test_train_shards_are_disjoint_and_each_echoes_only_its_own(data: Path) -> None:
    read: list[set[str]] = []
    for shard in (0, 1):
        pipe = imagenet_train_pipeline(
            data, batch_size=4, image_size=SIZE, echo_factor=3.0, epochs=1, shard_id=shard,
            num_shards=2, num_threads=1, upstream_threads=1, seed=5,
        )  # fmt: skip
        batches, stats = _drain_echo(pipe)
        files = pipe.upstream_tap.recent_files()  # 12 files = 3 batches, all in the history
        assert len(files) == 12 == len(set(files))
        labels = collections.Counter(
            int(x) for b in batches for x in b[0]["label"].tolist()
        )  # fmt: skip
        classes = pipe.folder_index.classes
        own = collections.Counter(classes.index(Path(f).parent.name) for f in files)
        assert labels == {k: 3 * v for k, v in own.items()}
        assert stats.fresh == 12 and stats.samples == 36
        read.append(set(files))
    assert not read[0] & read[1]
    assert read[0] | read[1] == {str(p) for p in (data / "train").rglob("*.JPEG")}


def test_restored_train_pipeline_continues_the_reader_epoch(data: Path) -> None:
    """With DALI's checkpoints on, a pipeline restored mid-epoch reads only the files the saved
    one had not read yet, in its shuffled order: together the two read each file exactly once.
    (Deterministic mode, so that the upstream reads only when the consumer needs it and the
    saved pipeline's tap holds exactly the files behind the checkpoint.)"""

    def make() -> Any:
        return imagenet_train_pipeline(
            data, batch_size=4, image_size=SIZE, echo_factor=2.0, epochs=1, seed=9,
            shuffle_buffer=4, cache_samples=8, deterministic=True, num_threads=1,
            upstream_threads=1, enable_checkpointing=True,
        )  # fmt: skip

    saved = make()
    with EchoIterator(saved, ["data", "label"]) as it:
        first = [int(x) for _, b in zip(range(5), it, strict=False) for x in b[0]["label"]]
        state = it.state_dict()
        read_before = saved.upstream_tap.recent_files()
    assert len(first) == 20 and 4 <= len(read_before) < 24
    restored = make()
    with EchoIterator(restored, ["data", "label"], last_batch_policy=LastBatchPolicy.PARTIAL) as it:
        it.load_state_dict(state)
        rest = [int(x) for b in it for x in b[0]["label"]]
        assert it.stats.fresh == 24  # counters continue from the checkpoint
    read_after = restored.upstream_tap.recent_files()
    assert sorted(read_before + read_after) == sorted(
        str(p) for p in (data / "train").rglob("*.JPEG")
    )
    assert collections.Counter(first + rest) == {0: 16, 1: 16, 2: 16}


# ---- corrupt files ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("zz_empty.JPEG", b"", "empty file"),
        ("zz_garbage.JPEG", b"this is not a jpeg at all" * 10, "not a JPEG or PNG"),
    ],
)
def test_corrupt_file_error_names_it(
    data: Path, tmp_path: Path, name: str, content: bytes, reason: str
) -> None:
    root = _copy_train(data, tmp_path)
    bad = next(iter(sorted((root / "train").iterdir()))) / name
    bad.write_bytes(content)
    for build in (
        lambda: imagenet_train_pipeline(root, batch_size=4, image_size=SIZE),
        lambda: imagenet_train_pipeline(root, batch_size=4, image_size=SIZE, echo_factor=None),
        lambda: imagenet_val_pipeline(root / "train", batch_size=4, image_size=SIZE),
    ):
        with pytest.raises(CorruptImageError, match=reason) as info:
            build()
        assert info.value.path == str(bad)
        assert str(bad) in str(info.value)


def test_corrupt_files_skipped_and_counted(data: Path, tmp_path: Path) -> None:
    root = _copy_train(data, tmp_path)
    folder = sorted((root / "train").iterdir())[1]
    empty, garbage = folder / "a_empty.JPEG", folder / "b_garbage.JPEG"
    empty.write_bytes(b"")
    garbage.write_bytes(b"\x00\x01garbage" * 40)
    pipe = imagenet_train_pipeline(
        root, batch_size=4, image_size=SIZE, echo_factor=2.0, epochs=1, on_corrupt="skip",
        num_threads=1, upstream_threads=1,
    )  # fmt: skip
    assert sorted(p for p, _ in pipe.skipped_files) == [str(empty), str(garbage)]
    assert len(pipe.folder_index) == 24
    batches, stats = _drain_echo(pipe)
    assert stats.fresh == 24 and stats.samples == 48  # training sees the 24 good ones only
    labels = collections.Counter(int(x) for b in batches for x in b[0]["label"].tolist())
    assert labels == {0: 16, 1: 16, 2: 16}
    assert set(pipe.upstream_tap.recent_files()).isdisjoint({str(empty), str(garbage)})
    val = imagenet_val_pipeline(root / "train", batch_size=4, image_size=SIZE, on_corrupt="skip")
    assert len(val.skipped_files) == 2 and len(val.folder_index) == 24


def _plant_undecodable(data: Path, tmp_path: Path) -> Path:
    """A file that passes the header check (markers, frame size) but that no decoder can read:
    its Huffman table's code counts add up to more codes than a table can hold."""
    root = _copy_train(data, tmp_path)
    bad = sorted((root / "train").iterdir())[0] / "zz_passes_header.JPEG"
    good = bytearray(_good_jpeg_bytes(data))
    dht = good.index(b"\xff\xc4")
    good[dht + 5 : dht + 21] = b"\xff" * 16
    bad.write_bytes(bytes(good))
    return bad


def test_decoder_failure_surfaces_from_echo_iterator_naming_the_file(
    data: Path, tmp_path: Path
) -> None:
    bad = _plant_undecodable(data, tmp_path)
    pipe = imagenet_train_pipeline(
        bad.parent.parent.parent, batch_size=4, image_size=SIZE, echo_factor=2.0,
        num_threads=1, upstream_threads=1, shuffle_files=False,
    )  # fmt: skip
    assert pipe.skipped_files == []  # the header check cannot see it

    def consume() -> None:
        with EchoIterator(pipe, ["data", "label"], steps_per_epoch=1000) as it:
            for _ in it:
                pass

    error = _run_in_thread(consume, timeout=60)
    assert isinstance(error, CorruptImageError), repr(error)
    assert error.path == str(bad)
    assert "DALI's decoder failed" in str(error)


def test_decoder_failure_named_for_plain_dali(data: Path, tmp_path: Path) -> None:
    bad = _plant_undecodable(data, tmp_path)
    pipe = imagenet_train_pipeline(
        bad.parent.parent, batch_size=4, image_size=SIZE, echo_factor=None, num_threads=1,
        shuffle_files=False,
    )  # fmt: skip
    pipe.build()
    with pytest.raises(CorruptImageError, match="DALI's decoder failed") as info:
        for _ in range(10):
            pipe.run()
    assert info.value.path == str(bad) and "decoders.image" in str(info.value.__cause__)
    named = explain_decode_failure(pipe.upstream_tap, info.value.__cause__)
    assert isinstance(named, CorruptImageError) and named.path == str(bad)
    other = RuntimeError("echo cache was closed")
    assert explain_decode_failure(pipe.upstream_tap, other) is other  # not a decoder error
    # With a full decode check the scan finds it up front.
    with pytest.raises(CorruptImageError, match="decode failed") as scan:
        imagenet_train_pipeline(bad.parent.parent, batch_size=4, check="decode")
    assert scan.value.path == str(bad)


@pytest.mark.parametrize("on_corrupt", ["error", "skip"])
def test_a_decoder_failure_suggests_only_what_is_not_in_use(
    data: Path, tmp_path: Path, on_corrupt: str
) -> None:
    """on_corrupt='skip' leaves out what the scan's check finds, and the header check cannot
    see this file: the message names a full decode, and on_corrupt='skip' only when not given."""
    bad = _plant_undecodable(data, tmp_path)
    pipe = imagenet_train_pipeline(
        bad.parent.parent, batch_size=4, image_size=SIZE, echo_factor=None, num_threads=1,
        shuffle_files=False, on_corrupt=on_corrupt,
    )  # fmt: skip
    assert pipe.skipped_files == []
    pipe.build()
    with pytest.raises(CorruptImageError, match="DALI's decoder failed") as info:
        for _ in range(10):
            pipe.run()
    message = str(info.value)
    assert info.value.path == str(bad) and "check='decode'" in message
    assert ("on_corrupt='skip'" in message) == (on_corrupt == "error"), message


def test_validation_pipeline_names_an_undecodable_file(data: Path, tmp_path: Path) -> None:
    """A file in val/ that passes the header check but not DALI's decoder is named by DALI's own
    iterator on the validation pipeline, as the training pipelines name it, not reported as a
    bare ``nvImageCodec failure``."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    bad = _plant_undecodable(data, tmp_path)
    root = bad.parent.parent.parent
    (root / "train").rename(root / "val")
    bad = root / "val" / bad.parent.name / bad.name
    pipe = imagenet_val_pipeline(root, batch_size=4, image_size=SIZE, num_threads=1)
    assert pipe.skipped_files == []  # the same header check as train cannot see it

    def iterate() -> None:
        pipe.build()
        it = DALIGenericIterator(
            [pipe], ["data", "label"], reader_name=pipe.reader_name,
            last_batch_policy=LastBatchPolicy.PARTIAL,
        )  # fmt: skip
        for _ in it:
            pass

    error = _run_in_thread(iterate, timeout=60)
    assert isinstance(error, CorruptImageError), repr(error)
    assert error.path == str(bad) and "DALI's decoder failed" in str(error)
    # The same check="decode" that finds it in train/ up front finds it in val/.
    with pytest.raises(CorruptImageError, match="decode failed") as scan:
        imagenet_val_pipeline(root, batch_size=4, image_size=SIZE, check="decode")
    assert scan.value.path == str(bad)


# ---- read delay ------------------------------------------------------------------------------


def test_read_delay_is_counted_in_the_upstream_only(data: Path) -> None:
    pipe = imagenet_train_pipeline(
        data, batch_size=4, image_size=SIZE, echo_factor=4.0, epochs=1, read_delay_ms=1.5,
        num_threads=1, upstream_threads=1,
    )  # fmt: skip
    _, stats = _drain_echo(pipe)
    tap = pipe.upstream_tap.stats()
    assert stats.steps == 24  # 96 samples downstream in batches of 4
    # 6 upstream batches of 4, each delayed 4 x 1.5 ms; nothing in the downstream.
    assert tap["batches"] == 6 and tap["samples"] == 24
    assert tap["delay_s"] == pytest.approx(24 * 1.5e-3)
    # Timed for t_up: the five that ran behind another (the first, alone, costs its latency).
    assert pipe.stats().upstream_batches == 5


def test_the_samples_put_while_auto_times_the_reader_are_echoed_from_the_start(
    data: Path,
) -> None:
    """``--echo auto`` times the upstream while it fills the cache, and the samples it puts
    then are the first steps' input. All put at e = 1, they were used up in as many steps as
    upstream batches, each step then waiting for the reader; after the second upstream batch
    they are put at the target of the estimate of the moment (here e_max: steps of 1 ns), and
    the first factor's top-up gives the ones put before it its tickets too."""
    from echopipe.echo.controller import EchoController
    from echopipe.training.echo_start import prime_echo

    pipe = imagenet_train_pipeline(
        data, batch_size=4, image_size=SIZE, echo_factor=1.0, epochs=1, read_delay_ms=25.0,
        num_threads=1, upstream_threads=1,
    )  # fmt: skip
    decisions: list[str] = []
    factor = prime_echo(EchoController(e_max=3.0), pipe, 1e-9, decisions, timeout_s=60.0)
    assert factor == 3.0 and decisions[0].startswith("echo: e = 3 from step 0"), decisions
    deadline = time.monotonic() + 60
    while pipe.stats().fresh_in < 24 and time.monotonic() < deadline:
        time.sleep(0.01)  # the epoch's 24 samples, 4 per upstream batch of 100 ms
    stats = pipe.stats()
    assert stats.fresh_in == 24 and stats.emitted == 0
    # Each of the 24 at 3. Before: 24 (all at 1); then, put at the estimate after batch 1,
    # 8 + 16 * 3 = 56 (batches 0 and 1 at 1).
    assert stats.tickets_left == 24 * 3, stats
    pipe.close()


def test_read_delay_in_plain_and_decode_pipelines(data: Path) -> None:
    plain = imagenet_train_pipeline(
        data, batch_size=3, image_size=SIZE, echo_factor=None, read_delay_ms=2.0, num_threads=1
    )
    plain.build()
    for _ in range(4):
        plain.run()
    tap = plain.upstream_tap.stats()
    assert tap["samples"] >= 12 and tap["samples"] % 3 == 0
    assert tap["delay_s"] == pytest.approx(tap["samples"] * 2e-3)
    no_delay = imagenet_decode_pipeline(data, batch_size=3)
    no_delay.build()
    no_delay.run()
    assert no_delay.upstream_tap.stats()["delay_s"] == 0.0
    assert no_delay.upstream_tap.samples >= 3


def test_close_cuts_short_the_read_delay_the_upstream_waits_in(data: Path) -> None:
    # Each upstream batch of 4 asks for 4 x 10 s: a close that joined the upstream thread only
    # after the delay would leave the tap's wait ended by its timer, not by the close.
    pipe = imagenet_train_pipeline(
        data, batch_size=4, image_size=SIZE, echo_factor=2.0, read_delay_ms=10_000,
        num_threads=1, upstream_threads=1,
    )  # fmt: skip
    tap = pipe.upstream_tap
    pipe.start()
    deadline = time.monotonic() + 120  # a hang guard only
    while tap.stats()["waiting"] == 0:
        assert time.monotonic() < deadline, "the upstream never entered the read delay"
        time.sleep(0.01)
    assert _run_in_thread(pipe.close, timeout=120) is None
    after = tap.stats()
    assert after["cut_short"] >= 1 and after["waiting"] == 0
    assert not pipe.upstream_alive


# ---- argument errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"decode_device": "mixed"}, ValueError, "needs device_id"),
        ({"decode_device": "gpu"}, ValueError, "decode_device"),
        ({"shard_id": 2, "num_shards": 2}, ValueError, "shard_id"),
        ({"dtype": "int8"}, ValueError, "dtype"),
        ({"echo_insert": "before_read"}, ValueError, "echo_insert"),
        ({"read_delay_ms": -1.0}, ValueError, "read_delay_ms"),
        ({"on_corrupt": "ignore"}, ValueError, "on_corrupt"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"image_size": 2.5}, TypeError, "image_size"),
        # past DALI's int64 seeds: named here, not by DALI's or the cache's pybind signature
        ({"seed": 1 << 64}, ValueError, rf"^seed must be in \[0, {MAX_PIPELINE_SEED}\], got "),
        ({"seed": -1}, ValueError, r"^seed must be in \[0, \d+\], got -1$"),
        ({"seed": "3"}, TypeError, r"^seed must be an int, got '3' \(str\)$"),
    ],
)
def test_bad_arguments_are_named(
    data: Path, kwargs: dict[str, Any], error: type, match: str
) -> None:
    args: dict[str, Any] = {"batch_size": 4, "image_size": SIZE, **kwargs}
    with pytest.raises(error, match=match):
        imagenet_train_pipeline(data, **args)


@pytest.mark.parametrize("shard_id", [0, 1])
def test_the_largest_seed_leaves_room_for_the_seeds_made_from_it(data: Path, shard_id: int) -> None:
    """The builder's seed plus the shard id (and the pair's + 1) still fit DALI's int64."""
    with imagenet_train_pipeline(
        data, batch_size=4, image_size=SIZE, num_threads=1, seed=MAX_PIPELINE_SEED,
        shard_id=shard_id, num_shards=2,
    ) as pipe:  # fmt: skip
        _, labels = pipe.run()
        assert len(np.array(labels.as_tensor())) == 4


def test_missing_folder_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        imagenet_val_pipeline(missing, batch_size=2)
    with pytest.raises(ValueError, match="resize_size"):
        imagenet_val_pipeline(tmp_path, batch_size=2, image_size=32, resize_size=16)


# ---- the Python echo peer --------------------------------------------------------------------


def test_python_echo_buffer_tickets_and_close() -> None:
    buf = PythonEchoBuffer(capacity=64, echo_factor=1.5, seed=0)
    for i in range(40):
        assert buf.put((np.array([i]),))
    buf.end_of_input()
    drawn = []
    while batch := buf.take(7, timeout=5):
        drawn += [int(s[0][0]) for s in batch]
    counts = collections.Counter(drawn)
    assert set(counts) == set(range(40)) and set(counts.values()) == {1, 2}
    assert buf.emitted == len(drawn) and buf.fresh == 40
    full = PythonEchoBuffer(capacity=1, echo_factor=1.0)
    full.put((np.zeros(1),))
    with pytest.raises(TimeoutError):
        full.put((np.zeros(1),), timeout=0.05)
    full.close()
    assert not full.put((np.zeros(1),))
    with pytest.raises(RuntimeError, match="closed"):
        full.take(1)
    with pytest.raises(ValueError, match="echo_factor"):
        PythonEchoBuffer(4, 0.5)


def test_python_echo_peer_runs_one_epoch(data: Path) -> None:
    with python_echo_train_pipeline(
        data, batch_size=5, image_size=SIZE, echo_factor=2.0, fresh_samples=24,
        shuffle_buffer=16, read_delay_ms=0.5,
    ) as pipe:  # fmt: skip
        labels: list[int] = []
        shapes = set()
        with pytest.raises(StopIteration):
            for _ in range(100):
                images, lab = pipe.run()
                shapes.add(np.array(images.as_tensor()).shape[1:])
                labels += np.array(lab.as_tensor()).tolist()
        assert shapes == {(3, SIZE, SIZE)}
        assert collections.Counter(labels) == {0: 16, 1: 16, 2: 16}
        stats = pipe.stats()
        assert stats.fresh_in == 24 and stats.emitted == 48
        assert stats.resident == stats.tickets_left == 0
        assert stats.emit_histogram[2] == 24 and sum(stats.emit_histogram) == 24
        assert pipe.upstream_tap.samples >= 24
        # The same stats type as EchoPipeline's, each field with the same meaning.
        assert isinstance(pipe, EchoPipelineBase) and isinstance(stats, PipelineStats)
        assert stats.upstream_batches >= 5 and stats.t_up_total_s > 0
        per_iteration = stats.t_up_total_s / stats.upstream_batches
        assert stats.t_up_per_batch_s == pytest.approx(per_iteration * 5 / pipe.upstream_batch_size)
        assert stats.source_wait_s >= 0 and stats.downstream_wait_s > 0


# ---- the benchmark script --------------------------------------------------------------------


def test_benchmark_script_runs_and_writes_its_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "bench" / "dali_echo.py"
    monkeypatch.syspath_prepend(str(path.parent))  # as when run as a script: its helpers import
    spec = importlib.util.spec_from_file_location("bench_dali_echo", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = [
        "--quick", "--seconds", "0.05", "--echo-factors", "1", "3", "--batch-size", "8",
        "--image-size", "16", "--classes", "2", "--per-class", "12", "--size", "24", "32",
        "--data-root", str(tmp_path / "data"), "--results-dir", str(tmp_path / "results"),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "results" / "dali_echo.json").read_text())
    figures = result["figures"]
    assert [row["echo_factor"] for row in figures["rows"]] == [1.0, 3.0]
    for row in figures["rows"]:
        assert row["echopipe_img_s"] > 0 and row["python_echo_img_s"] > 0
        assert row["ideal_img_s"] == pytest.approx(
            min(
                row["echo_factor"] * figures["upstream_alone_img_s"],
                figures["downstream_alone_img_s"],
            )
        )
    assert figures["read_delay_ms_per_sample"] >= 0
    assert result["machine"]["cpu_count"] == os.cpu_count()
    assert len(result["claims"]) == 2
    assert all(isinstance(claim["met"], bool) for claim in result["claims"])


def test_specs_replace_the_keywords_for_echopipe_and_the_peer(data: Path) -> None:
    from echopipe.dali import AugmentSpec, EchoPipeline, EchoSpec, ReaderSpec

    reader = ReaderSpec(num_threads=1, seed=3, read_delay_ms=0.5)
    augment = AugmentSpec(image_size=SIZE, dtype="half")
    echo = EchoSpec(echo_factor=2.0, shuffle_buffer=8, cache_samples=64)
    with imagenet_train_pipeline(
        data, batch_size=4, reader=reader, augment=augment, echo=echo, epochs=1
    ) as pipe:  # a keyword goes to the spec that owns its name (here EchoSpec.epochs)
        assert (pipe.config.echo.factor, pipe.config.epochs, pipe.config.seed) == (2.0, 1, 3)
        assert (pipe.config.echo.shuffle_buffer, pipe.config.cache_samples) == (8, 64)
        batches, stats = _drain_echo(pipe)
        assert stats.fresh == 24 and batches[0][0]["data"].dtype == torch.float16
    plain = imagenet_train_pipeline(data, batch_size=4, reader=reader, augment=augment, echo=None)
    assert not isinstance(plain, EchoPipeline) and plain.max_batch_size == 4
    with pytest.raises(TypeError, match="unexpected keyword 'echo_facter'"):
        imagenet_train_pipeline(data, batch_size=4, echo_facter=2.0)
    with pytest.raises(TypeError, match=r"\['cache_bytes'\] given for a pipeline without echo"):
        imagenet_train_pipeline(data, batch_size=4, echo=None, cache_bytes=1 << 20)
    # echo_factor=None switches echo off at one call site that also passes echo options.
    plain = imagenet_train_pipeline(
        data, batch_size=4, image_size=SIZE, echo_factor=None, upstream_threads=2,
        cache_bytes=1 << 20, num_threads=1,
    )  # fmt: skip
    assert not isinstance(plain, EchoPipeline)
    with pytest.raises(TypeError, match="expected a ReaderSpec, got AugmentSpec"):
        imagenet_train_pipeline(data, batch_size=4, reader=augment)  # type: ignore[arg-type]
    # The peer takes the very same specs.
    with python_echo_train_pipeline(
        data, batch_size=4, reader=reader, augment=augment, echo=echo, fresh_samples=24
    ) as peer:
        labels: list[int] = []
        with pytest.raises(StopIteration):
            for _ in range(100):
                images, lab = peer.run()
                assert np.array(images.as_tensor()).dtype == np.float16
                labels += np.array(lab.as_tensor()).tolist()
        assert collections.Counter(labels) == {0: 16, 1: 16, 2: 16}
        assert peer.buffer.capacity == 64
    with pytest.raises(ValueError, match="supports only epochs=None, got 1"):
        python_echo_train_pipeline(data, batch_size=4, reader=reader, echo=echo, epochs=1)
