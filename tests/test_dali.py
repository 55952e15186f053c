"""echopipe.dali: the echo sink/source operators inside real DALI CPU pipelines on real JPEGs."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import Pipeline, fn  # noqa: E402
from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from echopipe.dali import plugin  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

LBP = edali.LastBatchPolicy


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """24 small real JPEGs of different sizes; file i is filled with value 10 * i."""
    root = tmp_path_factory.mktemp("dali_jpegs")
    return solid_jpegs(root, 24, lambda i: (12 + i % 5, 16), lambda i: 10 * i)


def _labels_of(it: edali.EchoIterator) -> list[int]:
    out: list[int] = []
    for batch in it:
        out += batch[0]["label"].reshape(-1).tolist()
    return out


def _make(files, *, after="decode", **opts):
    """An echo pipeline over ``files``; free-running (``epochs=None``) unless ``epochs`` is given
    (tests/test_dali_epochs.py covers the epoch-aligned default)."""
    n = len(files)
    opts.setdefault("epochs", None)

    @edali.echo_pipeline_def(num_threads=1, device_id=None, **opts)
    def pipe(files):
        jpegs, labels = fn.readers.file(
            files=files, labels=list(range(n)), random_shuffle=True, pad_last_batch=True
        )
        images = fn.decoders.image(jpegs, device="cpu")
        if after == "augment":
            images = fn.resize(images, size=(8, 8))
        images, labels = edali.echo(images, labels)
        if after == "decode":
            images = fn.resize(images, size=(8, 8))
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return images, labels

    return pipe(files)


# ---- plugin and version check ----------------------------------------------------------------


def test_plugin_records_the_installed_dali_version() -> None:
    import nvidia.dali

    assert plugin.read_built_version(plugin.plugin_path()) == nvidia.dali.__version__
    assert edali.built_dali_version() == nvidia.dali.__version__


def test_version_mismatch_names_both_versions(tmp_path: Path) -> None:
    with pytest.raises(edali.DaliVersionMismatchError, match=r"DALI 2\.1\.0.*DALI 2\.4\.0"):
        edali.check_dali_version("2.1.0", "2.4.0")
    edali.check_dali_version("2.4.0", "2.4.0")
    # The real path: a plugin file whose marker says another version.
    fake = tmp_path / "libechopipe_dali.so"
    fake.write_bytes(b"\x7fELF...ECHOPIPE_DALI_BUILT_VERSION=1.99.0\n...")
    with pytest.raises(edali.DaliVersionMismatchError, match=r"1\.99\.0.*2\.4\.0"):
        edali.check_dali_version(plugin.read_built_version(fake), "2.4.0")
    fake.write_bytes(b"not a plugin")
    with pytest.raises(edali.DaliPluginMissingError, match=r"libechopipe_dali\.so"):
        plugin.read_built_version(fake)


def test_gpu_backend_registered_when_cuda_compiled() -> None:
    from nvidia.dali.ops import _registry

    from echopipe.native import build_config

    assert "EchopipeEchoSink" in _registry.cpu_ops()
    assert "EchopipeEchoSource" in _registry.cpu_ops()
    if build_config().get("cuda_compiled"):
        assert edali.gpu_backend_compiled()
        assert "EchopipeEchoSource" in _registry.gpu_ops()
        assert "EchopipeEchoSink" in _registry.gpu_ops()


# ---- exact accounting --------------------------------------------------------------------------


@pytest.mark.parametrize("after", ["decode", "augment"])
@pytest.mark.parametrize("e", [2.0, 1.5])
def test_each_sample_is_emitted_floor_or_ceil_e_times(
    jpegs: list[str], after: str, e: float
) -> None:
    pipe = _make(
        jpegs,
        after=after,
        batch_size=5,
        upstream_batch_size=4,
        echo_factor=e,
        epochs=1,
        shuffle_buffer=4,
        cache_samples=16,
        seed=3,
    )
    with edali.EchoIterator(pipe, ["data", "label"], last_batch_policy=LBP.PARTIAL) as it:
        labels = _labels_of(it)
        stats = pipe.stats()
        counts = Counter(labels)
        assert set(counts) == set(range(len(jpegs)))
        assert set(counts.values()) <= {int(np.floor(e)), int(np.ceil(e))}
        assert len(labels) == stats.emitted == it.stats.samples
        assert stats.fresh_in == len(jpegs) == it.stats.fresh
        assert it.stats.echoed == len(labels) - len(jpegs)
        hist = stats.emit_histogram
        assert sum(k * c for k, c in enumerate(hist)) == len(labels)
    assert not pipe.upstream_alive


def test_batch_echoing_repeats_whole_upstream_batches(jpegs: list[str]) -> None:
    pipe = _make(
        jpegs,
        batch_size=8,
        upstream_batch_size=4,
        echo_factor=2.0,
        mode="batch",
        epochs=1,
        shuffle_buffer=8,
        cache_samples=24,
    )
    blocks = []
    while True:
        try:
            outputs, info = pipe.next_batch()
        except StopIteration:
            break
        valid = info[:, 0] == 1
        labels = np.array(outputs[1].as_tensor()).reshape(-1)[valid]
        for start in range(0, len(labels), 4):
            blocks.append(tuple(labels[start : start + 4]))
        ids = info[valid, 1]
        for start in range(0, len(ids), 4):  # each unit comes back whole, in put order
            assert list(ids[start : start + 4]) == list(range(ids[start], ids[start] + 4))
    pipe.close()
    counts = Counter(blocks)
    assert len(counts) == len(jpegs) // 4 and set(counts.values()) == {2}
    assert sorted(x for b in counts for x in b) == list(range(len(jpegs)))


def test_fields_keep_dtype_shape_and_layout(jpegs: list[str]) -> None:
    @edali.echo_pipeline_def(batch_size=4, num_threads=1, device_id=None, epochs=1)
    def three_fields(files):
        jpegs, labels = fn.readers.file(
            files=files, labels=list(range(len(files))), pad_last_batch=True
        )
        images = fn.decoders.image(jpegs)
        shapes = images.shape()
        images, labels, shapes = edali.echo(images, labels, shapes)
        return images, labels, shapes

    with three_fields(jpegs) as pipe:
        outputs, info = pipe.next_batch()
        images, labels, shapes = outputs
        assert images.layout() == "HWC"
        for i in range(4):
            image = np.array(images.at(i))
            assert image.dtype == np.uint8 and image.shape == tuple(np.array(shapes.at(i)))
            label = int(np.array(labels.at(i)).reshape(-1)[0])
            # JPEG i was filled with 10 * i: decoding round-trips it within a few levels.
            assert abs(float(image.mean()) - 10 * label) < 3
        assert np.array(labels.at(0)).dtype == np.int32
        assert (info[:, 0] == 1).all()


def test_a_field_with_too_many_dimensions_is_named(jpegs: list[str]) -> None:
    @edali.echo_pipeline_def(batch_size=4, num_threads=1, device_id=None, epochs=None)
    def nine_dims(files):
        _, labels = fn.readers.file(files=files)
        return edali.echo(fn.reshape(labels, shape=[1] * 9))

    expected = "input 0 has 9 dimensions; the echo cache stores at most 8"
    with pytest.raises(RuntimeError, match=expected), nine_dims(jpegs) as pipe:
        pipe.next_batch()


def test_a_sample_larger_than_the_cache_is_named_in_one_line(jpegs: list[str]) -> None:
    # DALI's own message for the sink's refusal is a many-line operator trace.
    with _make(jpegs, batch_size=4, cache_bytes=100) as pipe, pytest.raises(RuntimeError) as caught:
        pipe.next_batch()
    text = str(caught.value)
    assert re.fullmatch(
        r"the upstream DALI pipeline failed: .*\d+ bytes.*capacity_bytes=100.*", text
    ), text
    assert "\n" not in text and "Critical error" in str(caught.value.__cause__)


# ---- end of input and last-batch policies ----------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "sizes"), [(LBP.FILL, [4, 4, 4]), (LBP.PARTIAL, [4, 4, 2]), (LBP.DROP, [4, 4])]
)
def test_finite_stream_drains_and_respects_last_batch_policy(
    jpegs: list[str], policy: LBP, sizes: list[int]
) -> None:
    files = jpegs[:10]
    pipe = _make(files, batch_size=4, echo_factor=1.0, epochs=1, shuffle_buffer=4, cache_samples=16)
    with edali.EchoIterator(pipe, ["data", "label"], last_batch_policy=policy) as it:
        for _ in range(2):  # two passes: reset() starts the next one
            got = [len(b[0]["label"]) for b in it]
            assert got == sizes
            with pytest.raises(StopIteration):
                next(it)
            it.reset()
        assert it.stats.fresh == (20 if policy != LBP.DROP else 16)
        assert it.stats.padded == (4 if policy == LBP.FILL else 0)
        assert it.stats.dropped == (4 if policy == LBP.DROP else 0)


def test_drop_refuses_an_epoch_shorter_than_a_batch(jpegs: list[str]) -> None:
    # 3 copies per epoch, batches of 4: DROP keeps no batch (len() said 1, then 0 were yielded
    # in every epoch); refused as DALI's iterators refuse it.
    pipe = _make(jpegs[:3], batch_size=4, echo_factor=1.0, epochs=1, cache_samples=16)
    with edali.EchoIterator(pipe, ["data", "label"], last_batch_policy=LBP.DROP) as it:
        assert len(it) == 0
        with pytest.raises(ValueError, match=r"DROP drops every batch: .* has 3 copies, fewer "):
            next(it)
    with _make(jpegs[:3], batch_size=4, echo_factor=1.0, epochs=1, cache_samples=16) as pipe:
        it = edali.EchoIterator(pipe, ["data", "label"], last_batch_policy=LBP.PARTIAL)
        assert len(it) == 1 and [len(b[0]["label"]) for b in it] == [3]


def test_endless_stream_epochs_have_fixed_length(jpegs: list[str]) -> None:
    pipe = _make(jpegs, batch_size=6, echo_factor=2.0, shuffle_buffer=6, cache_samples=32)
    with edali.EchoIterator(pipe, ["data", "label"], auto_reset=True) as it:
        assert len(it) == 8  # 24 fresh * e=2 / 6
        first = _labels_of(it)
        second = _labels_of(it)
        assert len(first) == len(second) == 48
        assert it.stats.epochs == 2 and it.stats.steps == 16


def test_set_echo_factor_mid_stream_changes_emissions_per_sample(jpegs: list[str]) -> None:
    pipe = _make(
        jpegs, batch_size=4, echo_factor=1.0, epochs=1, deterministic=True, shuffle_buffer=4,
        cache_samples=16,
    )  # fmt: skip
    with edali.EchoIterator(pipe, ["data", "label"], last_batch_policy=LBP.PARTIAL) as it:
        labels: list[int] = []
        for step, batch in enumerate(it):
            labels += batch[0]["label"].reshape(-1).tolist()
            if step == 0:
                with pytest.raises(ValueError, match=r"0\.5"):
                    pipe.set_echo_factor(0.5)
                pipe.set_echo_factor(3.0)
                assert pipe.config.echo.factor == 3.0 and pipe.cache.echo_factor == 3.0
    counts = Counter(labels)
    assert sorted(counts) == list(range(24))  # every sample, none lost
    assert set(counts.values()) == {1, 3}  # committed before the change: 1 copy, after: 3
    late = [k for k, v in counts.items() if v == 3]
    hist = pipe.stats().emit_histogram
    assert hist[1] == 24 - len(late) and hist[3] == len(late)

    endless = _make(jpegs, batch_size=6, echo_factor=2.0, shuffle_buffer=6, cache_samples=32)
    with edali.EchoIterator(endless, ["data", "label"], auto_reset=True) as it:
        assert len(it) == 8  # 24 fresh * 2 / 6
        endless.set_echo_factor(1.0)
        assert len(it) == 4  # the epoch length follows the factor


# ---- determinism, shutdown, checkpoints --------------------------------------------------------


def _stream(jpegs: list[str], steps: int, seed: int) -> tuple[list[int], list[np.ndarray]]:
    pipe = _make(
        jpegs,
        batch_size=4,
        echo_factor=1.5,
        deterministic=True,
        seed=seed,
        shuffle_buffer=4,
        cache_samples=16,
    )
    with edali.EchoIterator(pipe, ["data", "label"], steps_per_epoch=steps) as it:
        batches = list(it)
    return (
        [x for b in batches for x in b[0]["label"].reshape(-1).tolist()],
        [b[0]["data"].numpy() for b in batches],
    )


def test_same_seed_gives_the_same_stream(jpegs: list[str]) -> None:
    labels_a, data_a = _stream(jpegs, 10, seed=7)
    labels_b, data_b = _stream(jpegs, 10, seed=7)
    labels_c, _ = _stream(jpegs, 10, seed=8)
    assert labels_a == labels_b
    assert all(np.array_equal(a, b) for a, b in zip(data_a, data_b, strict=True))
    assert labels_a != labels_c


def test_close_during_a_run_joins_the_upstream_thread(jpegs: list[str]) -> None:
    # A cache that is almost always full: the upstream thread waits for room when closed.
    pipe = _make(jpegs, batch_size=4, echo_factor=3.0, shuffle_buffer=4, cache_samples=8)
    it = edali.EchoIterator(pipe, ["data", "label"], steps_per_epoch=1000)
    next(it)
    assert pipe.upstream_alive
    closer = threading.Timer(0.2, it.close)
    closer.start()
    t0 = time.monotonic()
    with pytest.raises((RuntimeError, StopIteration)):
        while True:
            next(it)
    closer.join()
    assert time.monotonic() - t0 < 10
    assert not pipe.upstream_alive
    with pytest.raises(RuntimeError, match="closed"):
        pipe.next_batch()


def test_upstream_supply_counts_the_waits_for_room_in_a_full_cache(jpegs: list[str]) -> None:
    """What ``--echo auto`` reads at both ends of a pause: the fresh samples stored, and the
    seconds the upstream waited because the cache was full (it would have read then). Nobody
    draws after the first batch, so the upstream fills the 8 slots and then only waits."""
    pipe = _make(jpegs, batch_size=4, echo_factor=3.0, shuffle_buffer=4, cache_samples=8)
    assert pipe.upstream_supply() == (0, 0.0)
    with edali.EchoIterator(pipe, ["data", "label"], steps_per_epoch=1000) as it:
        next(it)

        def waited_past(seconds: float) -> tuple[int, float]:
            deadline = time.monotonic() + 30  # a bound, not a measurement
            while pipe.upstream_supply()[1] < seconds and time.monotonic() < deadline:
                time.sleep(0.01)
            return pipe.upstream_supply()

        fresh, waited = waited_past(0.2)
        assert waited >= 0.2 and fresh == pipe.stats().fresh_in >= 8
        later, waited_more = waited_past(waited + 0.2)
        assert later == fresh and waited_more >= waited + 0.2  # it stored nothing meanwhile
        for _ in range(8):  # 32 copies: more than the 8 full slots' 24 tickets, so room
            next(it)
        deadline = time.monotonic() + 30
        while pipe.upstream_supply()[0] == fresh and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pipe.upstream_supply()[0] > fresh


def test_interpreter_exit_without_close_does_not_hang(jpegs: list[str]) -> None:
    script = textwrap.dedent(
        f"""
        import echopipe.dali as edali
        from nvidia.dali import fn
        files = {jpegs!r}
        @edali.echo_pipeline_def(batch_size=4, num_threads=1, device_id=None, cache_samples=8,
                                 shuffle_buffer=4, echo_factor=2.0, epochs=None)
        def pipe(files):
            j, l = fn.readers.file(files=files, labels=list(range(len(files))))
            images, labels = edali.echo(fn.decoders.image(j), l)
            return images, labels
        p = pipe(files)
        p.next_batch()
        print("ok", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok" in done.stdout


def test_checkpoint_resume_continues_the_same_stream(jpegs: list[str]) -> None:
    def make() -> edali.EchoIterator:
        pipe = _make(
            jpegs,
            batch_size=4,
            echo_factor=2.0,
            deterministic=True,
            seed=11,
            shuffle_buffer=4,
            cache_samples=16,
            enable_checkpointing=True,
        )
        return edali.EchoIterator(pipe, ["data", "label"], steps_per_epoch=100)

    def take(it: edali.EchoIterator, m: int) -> list[tuple[list[int], np.ndarray]]:
        out = []
        for _ in range(m):
            b = next(it)[0]
            out.append((b["label"].reshape(-1).tolist(), b["data"].numpy().copy()))
        return out

    with make() as it:
        take(it, 5)
        state = it.state_dict()
        expected = take(it, 8)
        stats_before = it.stats.steps
    with make() as resumed:
        resumed.load_state_dict(state)
        got = take(resumed, 8)
        assert resumed.stats.steps == stats_before
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert all(np.array_equal(g[1], e[1]) for g, e in zip(got, expected, strict=True))


def test_checkpoint_of_a_free_running_pipeline_loses_no_sample(jpegs: list[str]) -> None:
    def make():
        return _make(
            jpegs,
            batch_size=4,
            echo_factor=1.0,
            epochs=1,
            seed=2,
            shuffle_buffer=4,
            cache_samples=16,
            prefetch_queue_depth=3,
            enable_checkpointing=True,
        )

    with make() as pipe, edali.EchoIterator(pipe, ["d", "label"]) as it:
        first = [
            x
            for _, b in zip(range(2), it, strict=False)
            for x in b[0]["label"].reshape(-1).tolist()
        ]
        state = it.state_dict()
    with make() as pipe2, edali.EchoIterator(pipe2, ["d", "label"]) as it2:
        it2.load_state_dict(state)
        rest = _labels_of(it2)
    assert sorted(first + rest) == list(range(len(jpegs)))


# ---- public API: tensors, timing, epoch length, tracing, upstream errors ---------------------


def test_cpu_outputs_become_tensors_with_one_host_copy(jpegs: list[str]) -> None:
    pipe = _make(jpegs, batch_size=6, echo_factor=2.0, shuffle_buffer=6, cache_samples=32)
    with edali.EchoIterator(pipe, ["data", "label"], steps_per_epoch=8) as it:
        outputs, _ = pipe.next_batch()
        expected = np.array(outputs[0].as_tensor())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            images = edali.to_torch(outputs[0])
        # One copy out of DALI by numpy, shared with torch: no torch clone/copy on top of it.
        torch_ops = {event.key for event in prof.key_averages()}
        assert not torch_ops & {"aten::clone", "aten::copy_", "aten::_to_copy"}, torch_ops
        assert images.device.type == "cpu" and images.dtype == torch.uint8
        assert images.shape == (6, 8, 8, 3) and np.array_equal(images.numpy(), expected)
        for _ in range(4):  # DALI reuses its output buffers for these batches
            next(it)
        assert np.array_equal(images.numpy(), expected)


@pytest.mark.parametrize("deterministic", [False, True])
def test_upstream_time_is_recorded_per_upstream_batch(
    jpegs: list[str], deterministic: bool
) -> None:
    # A state saved inside the reader's epoch needs DALI's checkpoints (refused without them).
    pipe = _make(
        jpegs, batch_size=6, upstream_batch_size=3, echo_factor=2.0, shuffle_buffer=6,
        cache_samples=32, deterministic=deterministic, enable_checkpointing=True,
    )  # fmt: skip
    assert pipe.upstream_time() == (0, 0.0) and math.isnan(pipe.upstream_step_seconds())
    with edali.EchoIterator(pipe, ["data", "label"], steps_per_epoch=8) as it:
        assert math.isnan(it.stats.t_up)
        assert len(_labels_of(it)) == 48
        stats = pipe.stats()
        # 48 samples at e = 2 need at least 24 fresh ones: 8 upstream batches of 3, all timed
        # at depth 1 (deterministic), all but the first (it ran alone) at depth 2.
        timed = 8 if deterministic else 7
        assert stats.upstream_batches >= timed and stats.t_up_total_s > 0
        per_batch = stats.t_up_total_s / stats.upstream_batches
        assert stats.t_up_per_batch_s == pytest.approx(per_batch * 6 / 3)
        assert stats.t_up_per_batch_s == pipe.upstream_step_seconds()
        assert it.stats.upstream_batches >= timed and it.stats.upstream_time_s > 0
        assert it.stats.t_up > 0 and it.stats.t_down_per_step > 0 and it.stats.ratio > 0
        state = it.state_dict()
    restored = _make(
        jpegs, batch_size=6, upstream_batch_size=3, echo_factor=2.0, shuffle_buffer=6,
        cache_samples=32, deterministic=deterministic, enable_checkpointing=True,
    )  # fmt: skip
    with restored:
        restored.load_state_dict(state["pipeline"])
        restored.start()
        batches, seconds = restored.upstream_time()
        saved = state["pipeline"]["runner"]
        assert saved["iterations"] >= saved["timed"] >= timed
        assert batches >= saved["timed"] and seconds >= saved["seconds"] > 0


def test_shard_size_is_known_before_the_first_batch_and_epoch_length_can_change(
    jpegs: list[str],
) -> None:
    opts = dict(batch_size=6, echo_factor=2.0, shuffle_buffer=6, cache_samples=32,
                deterministic=True, enable_checkpointing=True)  # fmt: skip
    pipe = _make(jpegs, **opts)
    assert pipe.shard_size == 24  # builds the DALI pipelines, runs nothing
    assert pipe.upstream_time() == (0, 0.0) and pipe.stats().fresh_in == 0
    with edali.EchoIterator(pipe, ["data", "label"]) as it:
        assert it.shard_size == 24 and it.steps_per_epoch == len(it) == 8
        it.steps_per_epoch = 3
        assert len(it) == 3 and len(_labels_of(it)) == 18
        it.reset()
        it.set_epoch_size(12)  # fresh samples: 12 * e / 6 steps
        assert it.steps_per_epoch == 4 and len(_labels_of(it)) == 24
        it.reset()
        it.set_epoch_size()
        assert it.steps_per_epoch == 8
        with pytest.raises(ValueError, match="steps_per_epoch must be an int >= 1, got 0"):
            it.steps_per_epoch = 0
        with pytest.raises(ValueError, match="not both"):
            it.set_epoch_size(12, steps_per_epoch=3)
        state = it.state_dict()
        expected = _labels_of(it)
    # Building early (shard_size) still lets a checkpoint be loaded before the first batch.
    again = _make(jpegs, **opts)
    assert again.shard_size == 24
    with edali.EchoIterator(again, ["data", "label"]) as it2:
        it2.load_state_dict(state)
        assert _labels_of(it2) == expected
    finite = _make(jpegs, batch_size=6, echo_factor=2.0, cache_samples=32, epochs=1)
    # The constructor refuses the same lengths: it took them, and len() and _size disagreed
    # with the 48 copies each epoch still yielded.
    for key, value in (("size", 21), ("epoch_size", 5), ("steps_per_epoch", 2)):
        with pytest.raises(ValueError, match=rf"^{key}={value}: a finite stream \(epochs=1\)"):
            edali.EchoIterator(finite, ["data", "label"], **{key: value})
    with (
        edali.EchoIterator(finite, ["data", "label"]) as it3,
        pytest.raises(ValueError, match="finite stream"),
    ):
        it3.steps_per_epoch = 2


def _failing_pipe(jpegs: list[str], seen: list[str | None], **opts):
    def fail_on_third_batch(batch: list[np.ndarray]) -> list[np.ndarray]:
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("synthetic reader failure on batch 3")
        return batch

    calls: list[int] = []

    @edali.echo_pipeline_def(batch_size=4, num_threads=1, device_id=None, cache_samples=16,
                             shuffle_buffer=4, epochs=None, **opts)  # fmt: skip
    def pipe(files):
        seen.append(edali.current_stage())
        jpegs_, labels = fn.readers.file(files=files, labels=list(range(len(files))))
        if edali.current_stage() != "downstream":  # python_function is never pruned
            jpegs_ = fn.python_function(
                jpegs_, function=fail_on_third_batch, batch_processing=True, num_outputs=1
            )
        images = fn.resize(fn.decoders.image(jpegs_), size=(8, 8))
        return edali.echo(images, labels)

    return pipe(jpegs)


@pytest.mark.parametrize("deterministic", [False, True])
def test_current_stage_and_upstream_error_hook(jpegs: list[str], deterministic: bool) -> None:
    assert edali.current_stage() is None
    seen: list[str | None] = []
    described: list[BaseException] = []

    def name_it(error: BaseException) -> BaseException:
        described.append(error)
        return LookupError(f"named by the hook: {error}")

    pipe = _failing_pipe(jpegs, seen, deterministic=deterministic, on_upstream_error=name_it)
    assert pipe.shard_size == 24
    # The first trace is DALI's own, which finds the echo point (no stage: nothing is split).
    assert seen == [None, "upstream", "downstream"] and edali.current_stage() is None
    with (
        edali.EchoIterator(pipe, ["data", "label"], steps_per_epoch=100) as it,
        pytest.raises(LookupError, match="synthetic reader failure on batch 3") as caught,
    ):
        for _ in it:
            pass
    assert caught.value.__cause__ is described[0]
    # Without a hook: the generic error, still chained to DALI's.
    plain = _failing_pipe(jpegs, [], deterministic=deterministic)
    with (
        edali.EchoIterator(plain, ["data", "label"], steps_per_epoch=100) as it,
        pytest.raises(RuntimeError, match="upstream DALI pipeline failed") as caught,
    ):
        for _ in it:
            pass
    assert "synthetic reader failure" in str(caught.value.__cause__)


# ---- usage errors ------------------------------------------------------------------------------


def test_usage_errors_name_the_problem(jpegs: list[str]) -> None:
    with pytest.raises(RuntimeError, match="echo_pipeline_def"):
        edali.echo(None)
    with pytest.raises(ValueError, match="cache_samples=5"):
        _make(jpegs, batch_size=4, cache_samples=5)
    with pytest.raises(ValueError, match="multiple of upstream_batch_size"):
        _make(jpegs, batch_size=6, upstream_batch_size=4, mode="batch")
    for key in ("upstream_batch_size", "upstream_num_threads"):  # 0 is not "the default"
        with pytest.raises(ValueError, match=f"^{key} must be .*, got 0$"):
            _make(jpegs, batch_size=4, **{key: 0})

    @edali.echo_pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def no_echo():
        jpegs_, labels = fn.readers.file(files=jpegs)
        return fn.decoders.image(jpegs_), labels

    assert type(no_echo()) is Pipeline  # no echo point: plain DALI (tests/test_dali_epochs.py)

    @edali.echo_pipeline_def(batch_size=4, num_threads=1, device_id=None, epochs=1)
    def unpadded():
        jpegs_, labels = fn.readers.file(files=jpegs)
        return edali.echo(fn.decoders.image(jpegs_), labels)

    with pytest.raises(ValueError, match="pad_last_batch=True"), unpadded() as p:
        p.next_batch()

    @edali.echo_pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def unpadded_default():
        jpegs_, labels = fn.readers.file(files=jpegs, name="Reader")
        return edali.echo(fn.decoders.image(jpegs_), labels)

    # Without padding "auto" cannot align epochs: the stream runs free, and DALI's iterators,
    # which would count epochs over it, are refused in one line naming both ways out.
    with unpadded_default() as p:
        assert not p.finite and p.config.epochs is None
        expected = "reader 'Reader' has no pad_last_batch=True.* epochs=None"
        with pytest.raises(ValueError, match=expected):
            DALIGenericIterator(p, ["data", "label"], reader_name="Reader")
        outputs, _ = p.next_batch()
        assert len(outputs[1]) == 4
