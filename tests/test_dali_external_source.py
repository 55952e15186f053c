"""An ``fn.external_source`` feeding the echo point, in DALI's per-sample callback shape
(``batch=False``, sequential and ``parallel=True``): a callback that ends its epochs with
StopIteration is read epoch after epoch (real CPU pipelines, no reader)."""

from __future__ import annotations

import gc
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

import nvidia.dali.fn as fn  # noqa: E402
import nvidia.dali.types as types  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from pipeline_support.sources import EpochSource  # noqa: E402


@edali.echo_pipeline_def(echo_factor=2)
def sample_source_pipe(source, parallel=False):
    images, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=parallel,
        dtype=[types.UINT8, types.INT32],
    )  # fmt: skip
    images, labels = edali.echo(images, labels)
    return fn.flip(images, horizontal=1), labels


# DALI's worker pool leaves the parent's copies of its sockets to the collector (a plain DALI
# pipeline with a parallel source warns the same), which pytest reports as unraisable.
_DALI_POOL_SOCKETS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.mark.parametrize(
    "parallel",
    [False, pytest.param(True, marks=_DALI_POOL_SOCKETS)],
    ids=["sequential", "parallel"],
)
def test_source_that_ends_its_epochs_is_read_epoch_after_epoch(parallel: bool) -> None:
    workers = {"py_num_workers": 2, "py_start_method": "spawn"} if parallel else {}
    pipe = sample_source_pipe(
        EpochSource(8), parallel=parallel, batch_size=4, num_threads=1, device_id=None, seed=1,
        **workers,
    )  # fmt: skip
    labels: Counter[int] = Counter()
    with pipe, edali.EchoIterator(pipe, ["data", "label"], size=16) as it:
        for _ in range(3):  # 48 copies: more than the 16 copies of the source's first epoch
            for batch in it:
                labels.update(batch[0]["label"].reshape(-1).tolist())
                images = batch[0]["data"]
                assert (images == batch[0]["label"].reshape(-1, 1, 1, 1)).all()
        stats = pipe.stats()
    assert sum(labels.values()) == 48
    assert set(labels) <= set(range(8))
    assert stats.fresh_in >= 24  # three epochs of the source at least
    del pipe, it
    gc.collect()  # (DALI's pool's sockets go here, under this test's filter)


def test_source_with_no_sample_in_an_epoch_is_named() -> None:
    pipe = sample_source_pipe(EpochSource(0), batch_size=4, num_threads=1, device_id=None)
    with (
        pipe,
        edali.EchoIterator(pipe, ["data", "label"], size=8) as it,
        pytest.raises(RuntimeError, match="StopIteration at once") as caught,
    ):
        next(it)
    assert isinstance(caught.value.__cause__, edali.EmptyUpstreamEpochError)


def _three_batches():
    for i in range(3):
        labels = [np.array([4 * i + j], np.int32) for j in range(4)]
        yield [np.full((2, 2, 3), int(x[0]), np.uint8) for x in labels], labels


@edali.echo_pipeline_def(echo_factor=2)
def batch_source_pipe(cycle):
    images, labels = fn.external_source(
        source=_three_batches, num_outputs=2, dtype=[types.UINT8, types.INT32], cycle=cycle
    )
    return edali.echo(images, labels)


def test_generator_function_source_with_cycle_raise_is_read_again() -> None:
    pipe = batch_source_pipe("raise", batch_size=4, num_threads=1, device_id=None, seed=1)
    labels: Counter[int] = Counter()
    with pipe, edali.EchoIterator(pipe, ["data", "label"], size=24) as it:
        for _ in range(2):  # 48 copies: the source's 12 samples over 2 epochs at least
            for batch in it:
                labels.update(batch[0]["label"].reshape(-1).tolist())
        assert pipe.stats().fresh_in >= 24
    assert sum(labels.values()) == 48
    assert set(labels) <= set(range(12))


def test_source_that_cannot_start_again_names_cycle() -> None:
    # DALI's default cycle=None: after StopIteration a generator function's source stays ended.
    pipe = batch_source_pipe(None, batch_size=4, num_threads=1, device_id=None, seed=1)
    with (
        pipe,
        edali.EchoIterator(pipe, ["data", "label"], size=24) as it,
        pytest.raises(RuntimeError, match='cycle="raise"') as caught,
    ):
        for _ in range(2):
            for _ in it:
                pass
    assert isinstance(caught.value.__cause__, edali.EmptyUpstreamEpochError)
