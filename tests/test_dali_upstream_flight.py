"""The upstream pipeline runs its next iteration while this one is collected (depth 2), and
goes back to one at a time where two in flight would break something (real CPU pipelines).

The first H200 run found the echo pipeline's decode feeding the cache at 0.65x the rate of the
same decode alone: its upstream ran at DALI depth 1, one stage after another."""

from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

import nvidia.dali.fn as fn  # noqa: E402
import nvidia.dali.types as types  # noqa: E402
from nvidia.dali import Pipeline  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from echopipe.dali.config import EchoPipelineConfig  # noqa: E402
from echopipe.dali.epochs import EpochGeometry, ReaderEpochs  # noqa: E402
from echopipe.dali.pair import PairSettings, upstream_depth  # noqa: E402
from echopipe.dali.upstream_flight import UpstreamFlight  # noqa: E402
from echopipe.echo import EchoConfig  # noqa: E402
from pipeline_support.sources import EndlessSource  # noqa: E402

BATCH = 4


@edali.echo_pipeline_def(echo_factor=1)
def counted_source_pipe(source, parallel=False):
    images, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=parallel,
        dtype=[types.UINT8, types.INT32],
    )  # fmt: skip
    images, labels = edali.echo(images, labels)
    return images, labels


class StoredAtEachCall:
    """A per-sample source that notes, at each iteration's first sample, how many fresh
    samples the upstream runner had collected into the cache by then."""

    def __init__(self) -> None:
        self.pipe: object = None
        self.stored_at: dict[int, int] = {}

    def __call__(self, info: object) -> tuple[np.ndarray, np.ndarray]:
        it = info.iteration  # type: ignore[attr-defined]
        if it not in self.stored_at and self.pipe is not None:
            self.stored_at[it] = self.pipe.upstream_supply()[0]  # type: ignore[attr-defined]
        i = info.idx_in_epoch  # type: ignore[attr-defined]
        return np.full((2, 2, 3), i % 250, np.uint8), np.array(i, np.int32)


@pytest.mark.parametrize("exec_pipelined", [True, False], ids=["depth-2", "control-depth-1"])
def test_the_second_iteration_starts_before_the_first_is_collected(exec_pipelined: bool) -> None:
    """DALI calls an external_source's callback when an iteration is scheduled, in the thread
    that schedules it: the runner's. At depth 2 the first schedule starts two iterations, so
    the second one's callback sees nothing collected yet; at depth 1 (DALI told not to
    pipeline: the control) it sees the first batch stored."""
    source = StoredAtEachCall()
    pipe = counted_source_pipe(
        source, batch_size=BATCH, num_threads=1, device_id=None, seed=0,
        exec_pipelined=exec_pipelined, exec_async=exec_pipelined,
    )  # fmt: skip
    source.pipe = pipe
    with pipe, edali.EchoIterator(pipe, ["data", "label"], steps_per_epoch=10**6) as it:
        stream = iter(it)
        for _ in range(6):
            next(stream)
        assert pipe.upstream.prefetch_queue_depth == (2 if exec_pipelined else 1)
    assert source.stored_at[0] == 0
    assert source.stored_at[1] == (0 if exec_pipelined else BATCH)
    # Never more than two in flight: iteration k starts once k - 1 are back.
    assert all(stored >= (k - 1) * BATCH for k, stored in source.stored_at.items())


# DALI's worker pool leaves the parent's copies of its sockets to the collector (a plain DALI
# pipeline with a parallel source warns the same), which pytest reports as unraisable.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_parallel_source_gives_every_sample_once_and_whole() -> None:
    """A parallel external_source reuses its shared-memory buffers after `depth` batches: a
    runner that scheduled as far ahead as the cache had room (it did, before the cap) handed
    out samples twice and images torn from their labels. With e = 1 each sample comes once."""
    pipe = counted_source_pipe(
        EndlessSource((128, 512, 1)), parallel=True, batch_size=BATCH, num_threads=1,
        device_id=None, seed=0, cache_samples=256, epochs=None, py_num_workers=2,
        py_start_method="spawn",
    )  # fmt: skip
    labels: list[int] = []
    with pipe:
        for _ in range(150):
            (images, batch_labels), info = pipe.next_batch()
            for s in range(len(batch_labels)):
                if info[s, 0]:
                    label = int(np.asarray(batch_labels[s]))
                    labels.append(label)
                    assert (np.asarray(images[s]) == label % 251).all(), label
    assert len(labels) >= 500 and len(set(labels)) == len(labels)
    del pipe
    gc.collect()  # (DALI's pool's sockets go here, under this test's filter)


def test_a_reader_beside_a_source_that_ends_its_epochs_runs_at_depth_1(tmp_path) -> None:
    """An external_source that ends its epoch resets DALI, whose next schedule starts two
    iterations again, wherever the reader's epoch stands: with epochs, one at a time."""
    files = []
    for i in range(24):
        path = tmp_path / f"r{i:02d}.bin"
        path.write_bytes(bytes([i]) * 8)
        files.append(str(path))
    offsets = [[np.array([k], np.int32)] * BATCH for k in range(5)]  # 5 batches an epoch

    @edali.echo_pipeline_def(echo_factor=1.0)
    def reader_and_source():
        data, label = fn.readers.file(files=files, labels=list(range(24)), pad_last_batch=True)
        offset = fn.external_source(source=offsets, cycle="raise", dtype=types.INT32)
        data, label = edali.echo(data, label + offset * 0)
        return data, label

    pipe = reader_and_source(batch_size=BATCH, num_threads=1, device_id=None, seed=0, epochs=3)
    with pipe, edali.EchoIterator(pipe, ["data", "label"]) as it:
        assert sum(1 for _ in it) == 18  # three reader epochs of 6 batches
        assert pipe.upstream.prefetch_queue_depth == 1


def _source_pipe(epoch: int) -> Pipeline:
    """A plain DALI pipeline at depth 2 over a batch source that ends each epoch after
    ``epoch`` batches (DALI's StopIteration)."""
    calls = {"n": 0}

    def source() -> list[np.ndarray]:
        calls["n"] += 1
        if calls["n"] % (epoch + 1) == 0:
            raise StopIteration
        return [np.full((1,), calls["n"], np.int32)] * 2

    pipe = Pipeline(batch_size=2, num_threads=1, device_id=None, prefetch_queue_depth=2)
    with pipe:
        pipe.set_outputs(fn.external_source(source=source, batch=True, dtype=types.INT32))
    pipe.build()
    return pipe


def test_each_iteration_costs_the_time_since_this_side_was_ready_for_it() -> None:
    """Overlapping iterations are not counted twice: an iteration costs from the later of its
    schedule and the last collect until it is back, and only one that ran behind another
    gives the pipelined rate (an injected clock)."""
    ticks = iter([0.0, 5.0, 6.0, 8.0, 9.0])
    flight = UpstreamFlight(_source_pipe(epoch=100), depth=2, clock=lambda: next(ticks))
    assert flight.next_count == 2
    flight.schedule()  # t=0: two iterations
    assert (flight.in_flight, flight.next_count) == (2, 1)
    outputs, cost, behind = flight.collect()  # t=5: it ran alone, its cost is its latency
    assert int(np.asarray(outputs[0][0])[0]) == 1 and (cost, behind) == (5.0, False)
    flight.schedule()  # t=6: a third
    # The second ran behind the first (8 - 5), the third behind the second (9 - 8): the rate.
    assert [flight.collect()[1:], flight.collect()[1:]] == [(3.0, True), (1.0, True)]
    assert flight.in_flight == 0


def test_an_input_that_ends_its_epoch_is_reset_and_read_again() -> None:
    flight = UpstreamFlight(_source_pipe(epoch=3), depth=2)
    values = []
    for _ in range(20):
        if len(values) == 6:
            break
        if flight.in_flight < 2:
            flight.schedule()
        got = flight.collect()
        if got is None:  # the epoch ended: DALI was reset, the next schedule starts two
            assert flight.in_flight == 0 and flight.next_count == 2
            continue
        values.append(int(np.asarray(got[0][0][0])[0]))
    assert values == [1, 2, 3, 5, 6, 7]  # the source's 4th and 8th calls end its epochs


def test_an_input_with_no_batch_in_an_epoch_is_named() -> None:
    flight = UpstreamFlight(_source_pipe(epoch=0), depth=2)
    flight.schedule()
    with pytest.raises(edali.EmptyUpstreamEpochError, match="StopIteration at once"):
        flight.collect()


def _settings(**pipeline_kwargs: object) -> PairSettings:
    return PairSettings(
        fn=counted_source_pipe, fn_args=(), fn_kwargs={}, cache_name="x", num_threads=1,
        upstream_num_threads=1, device_id=None, prefetch=2, enable_checkpointing=False,
        pipeline_kwargs=dict(pipeline_kwargs),
    )  # fmt: skip


def _geometry(iterations: int, epochs: int | None = 1) -> EpochGeometry:
    size = iterations * 8
    reader = ReaderEpochs(name="Reader", size=size, shards=1, shard_id=0, stick_to_shard=False,
                          padded=True, padded_shard=size)  # fmt: skip
    return EpochGeometry(epochs=epochs, reader=reader, unaligned_reader=None,
                         shard_size=iterations * 8, iterations=iterations)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "settings", "geometry", "restore", "depth"),
    [
        ({}, {}, None, {}, 2),  # the first build's guess
        ({}, {}, _geometry(10), {}, 2),
        ({}, {}, _geometry(10, epochs=None), {}, 2),  # free-running: no epoch to stay in
        ({"deterministic": True}, {}, None, {}, 1),
        ({}, {"exec_pipelined": False}, None, {}, 1),
        ({}, {"exec_async": False}, None, {}, 1),
        ({"cache_samples": 8 + 2 * 8 - 1}, {}, None, {}, 1),  # no room for two batches
        ({"cache_samples": 8 + 2 * 8}, {}, None, {}, 2),
        ({}, {}, _geometry(1), {}, 1),  # DALI's first two would cross the epoch's end
        ({}, {}, _geometry(10), {"runner": {"iter_in_epoch": 8}}, 2),
        ({}, {}, _geometry(10), {"runner": {"iter_in_epoch": 9}}, 1),  # restored at its last
    ],
)
def test_the_upstream_runs_two_iterations_only_where_that_is_safe(
    change: dict, settings: dict, geometry: EpochGeometry | None, restore: dict, depth: int
) -> None:
    config = EchoPipelineConfig(batch_size=8, echo=EchoConfig(factor=2.0, shuffle_buffer=8))
    config = replace(config, **change).resolved()
    assert upstream_depth(config, _settings(**settings), geometry, restore) == depth
