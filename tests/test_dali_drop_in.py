"""An EchoPipeline used as a DALI pipeline: ``@echo_pipeline_def`` like ``@pipeline_def``, and
DALI's own PyTorch iterators on it, unchanged (real CPU pipelines over real JPEGs)."""

from __future__ import annotations

import math
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import fn  # noqa: E402
from nvidia.dali.plugin.pytorch import (  # noqa: E402
    DALIClassificationIterator,
    DALIGenericIterator,
    LastBatchPolicy,
)

import echopipe.dali as edali  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

N = 24


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("drop_in_jpegs")
    return solid_jpegs(root, N, lambda i: (10 + i % 3, 12), lambda i: 10 * i)


@edali.echo_pipeline_def(echo_factor=2)
def train_pipe(files, flip=True):
    jpegs, labels = fn.readers.file(
        files=files, labels=list(range(len(files))), random_shuffle=True, pad_last_batch=True,
        name="Reader",
    )  # fmt: skip
    images = fn.decoders.image(jpegs, device="cpu")
    images, labels = edali.echo(images, labels)
    images = fn.resize(images, size=(8, 8))
    if flip:
        images = fn.flip(images, horizontal=fn.random.coin_flip())
    return images, labels


def _make(files, **kwargs):
    return train_pipe(files, batch_size=5, num_threads=1, device_id=None, seed=12, **kwargs)


def test_decorator_takes_dali_arguments_at_call_time(files: list[str]) -> None:
    @edali.echo_pipeline_def
    def bare(files):
        jpegs, labels = fn.readers.file(files=files, pad_last_batch=True, name="Reader")
        return edali.echo(fn.decoders.image(jpegs), labels)

    with bare(files, batch_size=3, num_threads=1, device_id=None, seed=1, echo_factor=1.5) as p:
        assert p.max_batch_size == p.batch_size == 3 and p.device_id is None
        assert p.config.echo.factor == 1.5 and p.config.seed == 1
        outputs, _ = p.next_batch()
        assert len(outputs[0]) == 3
    with pytest.raises(ValueError, match=r"bare: batch_size is required"):
        bare(files, num_threads=1, device_id=None)
    # A keyword of the pipeline function goes to the function, not to DALI.
    with _make(files, flip=False) as p:
        assert p.reader_meta("Reader")["epoch_size"] == 2 * N


@pytest.mark.parametrize(
    ("policy", "steps", "last"),
    [(LastBatchPolicy.PARTIAL, 10, 3), (LastBatchPolicy.FILL, 10, 5), (LastBatchPolicy.DROP, 9, 5)],
)
def test_dali_classification_iterator_with_reader_name(
    files: list[str], policy: LastBatchPolicy, steps: int, last: int
) -> None:
    with _make(files) as pipe:
        it = DALIClassificationIterator(
            pipe, reader_name="Reader", last_batch_policy=policy, auto_reset=True
        )
        assert len(it) == steps  # the epoch is e * 24 = 48 samples, batches of 5
        for epoch in range(2):
            sizes, labels = [], []
            for batch in it:
                x, y = batch[0]["data"], batch[0]["label"]
                assert x.dtype == torch.uint8 and x.shape[1:] == (8, 8, 3)
                assert y.shape == (len(x), 1)  # DALI's label layout: (N, 1)
                sizes.append(len(y))
                labels += y.reshape(-1).tolist()
            assert len(sizes) == steps and sizes[-1] == last, (epoch, sizes)
            # Each epoch holds the reader epoch's copies: every file twice; FILL repeats
            # samples of its last batch (2 slots), DROP drops that batch's 3 copies.
            counts = Counter(labels)
            if policy == LastBatchPolicy.PARTIAL:
                assert counts == {i: 2 for i in range(N)}
            elif policy == LastBatchPolicy.FILL:
                assert set(counts) == set(range(N)) and min(counts.values()) == 2
            else:
                assert set(counts.values()) <= {1, 2} and sum(counts.values()) == 45


def test_dali_generic_iterator_lazy_and_auto_reset(files: list[str]) -> None:
    with _make(files) as pipe:
        it = DALIGenericIterator(
            pipe, ["data", "label"], reader_name="Reader", auto_reset="yes",
            prepare_first_batch=False,
        )  # fmt: skip
        assert not pipe.upstream_alive  # nothing ran yet
        first = [len(b[0]["label"]) for b in it]
        second = [len(b[0]["label"]) for b in it]
        assert first == second == [5] * 10
        emitted = pipe.stats().emitted
        assert emitted >= 96  # two epochs of 48 real copies (plus DALI's prefetch)


def test_finite_stream_ends_dali_iterator(files: list[str]) -> None:
    @edali.echo_pipeline_def(echo_factor=2, epochs=1)
    def finite(files):
        jpegs, labels = fn.readers.file(
            files=files, labels=list(range(len(files))), pad_last_batch=True, name="Reader"
        )
        return edali.echo(fn.resize(fn.decoders.image(jpegs), size=(8, 8)), labels)

    with finite(files, batch_size=5, num_threads=1, device_id=None) as pipe:
        it = DALIGenericIterator(pipe, ["data", "label"])
        for _ in range(2):
            labels = [x for b in it for x in b[0]["label"].reshape(-1).tolist()]
            # 48 real samples in 10 batches, the last one filled with repeats of its own.
            assert len(labels) == 50 and set(Counter(labels[:45]).values()) <= {1, 2}
            assert Counter(labels)[labels[-1]] >= 2
            it.reset()


@pytest.mark.filterwarnings("ignore:Please set `reader_name`")  # DALI's, for any size=
def test_dali_iterator_given_size_counts_its_own_epochs(files: list[str]) -> None:
    """DALI's size= (no reader_name) counts that many samples per epoch over the stream; on the
    epoch-aligned default (48 copies a pass) every epoch after the first pass was empty."""
    for size in (48, 20, 30):  # a pass; epochs that end with it; epochs that cross its end
        with _make(files) as pipe, warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always", edali.CountedSizeWarning)
            it = DALIGenericIterator(
                pipe, ["data", "label"], size=size, auto_reset=True,
                last_batch_policy=LastBatchPolicy.PARTIAL,
            )  # fmt: skip
            # Epochs other than a pass (10 batches of 5) are named in one warning.
            ours = [w for w in warned if issubclass(w.category, edali.CountedSizeWarning)]
            assert len(ours) == (size != 48), size
            epochs = [[x for b in it for x in b[0]["label"].reshape(-1).tolist()] for _ in "1234"]
            assert [len(labels) for labels in epochs] == [size] * 4, size
            if size == 48:  # each epoch is a pass: every file twice
                assert all(Counter(labels) == {i: 2 for i in range(N)} for labels in epochs)
    # Longer than a pass (10 batches): the first epoch ends with it, the second is refused.
    with _make(files) as pipe, pytest.warns(edali.CountedSizeWarning, match=r"size=70: .* 48\)"):
        it = DALIGenericIterator(pipe, ["data", "label"], size=70, auto_reset=True)
        assert sum(len(b[0]["label"]) for b in it) == 50
        with pytest.raises(ValueError, match=r"pass of 48 copies ended, without reset\(\)"):
            next(it)


def test_dali_checkpoints_resume_the_same_stream(files: list[str]) -> None:
    def make(**kw):
        return _make(files, deterministic=True, enable_checkpointing=True, **kw)

    def take(it, n):
        out = []
        for _ in range(n):
            b = next(it)[0]
            out.append((b["label"].reshape(-1).tolist(), b["data"].numpy().copy()))
        return out

    def iterator(pipe):
        return DALIGenericIterator(
            pipe, ["data", "label"], reader_name="Reader", auto_reset=True,
            last_batch_policy=LastBatchPolicy.PARTIAL,
        )  # fmt: skip

    with make() as pipe:
        it = iterator(pipe)
        take(it, 3)
        (checkpoint,) = it.checkpoints()
        assert isinstance(checkpoint, bytes)
        expected = take(it, 7)  # to the end of the epoch (10 batches of 48 copies)
        with pytest.raises(StopIteration):
            next(it)
        expected += take(it, 4)  # and into the next one
    with make(checkpoint=checkpoint) as pipe:
        assert pipe.is_restored_from_checkpoint
        it = iterator(pipe)
        got = take(it, 7)
        with pytest.raises(StopIteration):
            next(it)
        got += take(it, 4)
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert all(np.array_equal(g[1], e[1]) for g, e in zip(got, expected, strict=True))
    assert len(got[6][0]) == 3  # 48 = 9 * 5 + 3
    with pytest.raises(ValueError, match="not an echopipe"):
        make(checkpoint=b"plain DALI bytes")


def test_echo_iterator_takes_dali_iterator_arguments(files: list[str]) -> None:
    with _make(files) as pipe:
        it = edali.EchoIterator(
            pipe, ["data", "label"], reader_name="Reader", auto_reset="yes",
            last_batch_policy=LastBatchPolicy.PARTIAL, prepare_first_batch=True,
        )  # fmt: skip
        assert pipe.upstream_alive
        assert len(it) == math.ceil(2 * N / 5)
        assert sum(len(b[0]["label"]) for b in it) == 2 * N
        with pytest.raises(RuntimeError, match="Nope"):
            edali.EchoIterator(pipe, ["data", "label"], reader_name="Nope")
    with _make(files, epochs=None) as pipe:  # size= counts an epoch of a free-running stream
        it = edali.EchoIterator(
            [pipe], ["data", "label"], size=12, fill_last_batch=False, dynamic_shape=True,
        )  # fmt: skip
        assert it.last_batch_policy == LastBatchPolicy.PARTIAL and len(it) == 3
        assert [len(b[0]["label"]) for b in it] == [5, 5, 2]
        with pytest.raises(ValueError, match="not several"):
            edali.EchoIterator(pipe, ["data", "label"], size=12, reader_name="Reader")


def test_migration_guide_runs(tiny_imagenet) -> None:
    """docs/dali.md's migrated ResNet-50 loaders, run as written with device_id=None (no GPU)."""
    import re
    from pathlib import Path

    from nvidia.dali import Pipeline

    doc = (Path(__file__).resolve().parents[1] / "docs" / "dali.md").read_text()
    section = doc[doc.index("## Migrating DALI's ResNet-50") :]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:1]
    assert code.count("# echopipe") == 4  # the lines that differ from DALI's example
    assert "device_id=local_rank" in code
    code = code.replace("device_id=local_rank", "device_id=None")
    scope = dict(
        batch_size=4, workers=1, local_rank=0, world_size=1, crop_size=16, val_size=20,
        dali_cpu=True, traindir=str(tiny_imagenet / "train"), valdir=str(tiny_imagenet / "val"),
    )  # fmt: skip
    exec(compile(code, "docs/dali.md", "exec"), scope)
    loader, images, target = scope["train_loader"], scope["images"], scope["target"]
    assert len(loader) == scope["train_loader_len"] == math.ceil(2 * 32 / 4)  # 32 images, e=2
    assert images.shape == (4, 3, 16, 16) and images.dtype == torch.float32
    assert target.shape == (4,) and target.dtype == torch.int64
    seen = sum(len(d[0]["label"]) for d in loader)  # auto_reset: a second full epoch
    assert seen == 2 * 32
    val = scope["val_loader"]
    assert type(val._pipes[0]) is Pipeline  # no echo point: plain DALI
    assert sum(len(d[0]["label"]) for d in val) == 8  # 8 validation images, each once
    loader._pipes[0].close()


def _float_pipe(files, **kwargs):
    from nvidia.dali import types

    @edali.echo_pipeline_def(echo_factor=2)
    def chw(files):
        jpegs, labels = fn.readers.file(
            files=files, labels=[i % 3 for i in range(len(files))], pad_last_batch=True,
            name="Reader",
        )  # fmt: skip
        images = fn.resize(fn.decoders.image(jpegs), size=(8, 8))
        images, labels = edali.echo(images, labels)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW")
        return images, labels

    return chw(files, batch_size=6, num_threads=1, device_id=None, **kwargs)


@pytest.mark.parametrize("iterator", ["echopipe", "dali"])
def test_stale_pipeline_trains_on_what_dali_iterators_yield(files: list[str], iterator) -> None:
    from torch import nn

    from echopipe.pipeline import StalePipeline

    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 16), nn.ReLU(), nn.Linear(16, 3))
    with _float_pipe(files) as pipe:
        if iterator == "dali":
            it = DALIClassificationIterator(pipe, reader_name="Reader")  # labels: (N, 1) int32
        else:
            it = edali.EchoIterator(pipe, ["data", "label"], reader_name="Reader")
        sgd = lambda p: torch.optim.SGD(p, lr=1e-3)  # noqa: E731
        with StalePipeline(
            model, balance=[2, 2], optimizer=sgd, loss_fn=nn.functional.cross_entropy
        ) as stale:
            result = stale.run_epoch(it, drain=True)
            assert result.steps == len(it) == 8 and result.samples == 2 * N
            assert len(result.losses) == 8 and all(math.isfinite(v) for v in result.losses)
            assert stale.steps_applied == 8


def test_dali_checkpoint_of_a_free_running_pipeline_loses_no_sample(files: list[str]) -> None:
    @edali.echo_pipeline_def(echo_factor=2, epochs=1, enable_checkpointing=True)
    def finite(files):
        jpegs, labels = fn.readers.file(
            files=files, labels=list(range(len(files))), random_shuffle=True,
            pad_last_batch=True, name="Reader",
        )  # fmt: skip
        return edali.echo(fn.resize(fn.decoders.image(jpegs), size=(8, 8)), labels)

    def labels_of(it, n=None):
        out = []
        for step, batch in enumerate(it):
            out += batch[0]["label"].reshape(-1).tolist()
            if n is not None and step + 1 == n:
                break
        return out

    # 24 files * e = 2 = 48 samples = 8 batches of 6: no padding in the stream.
    with finite(files, batch_size=6, num_threads=1, device_id=None, seed=4) as pipe:
        it = DALIGenericIterator(pipe, ["data", "label"])
        before = labels_of(it, 3)
        (checkpoint,) = it.checkpoints()
    with finite(files, batch_size=6, num_threads=1, device_id=None, checkpoint=checkpoint) as pipe:
        after = labels_of(DALIGenericIterator(pipe, ["data", "label"]))
    assert len(before) == 18 and len(after) == 30
    assert Counter(before + after) == {i: 2 for i in range(N)}
