"""DALI ``Pipeline`` arguments and methods a DALI program passes or calls on the pipeline that
``@echo_pipeline_def`` gives (real CPU pipelines over real JPEGs, DALI's own iterators)."""

from __future__ import annotations

import re
from collections import Counter
from contextlib import nullcontext

import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import Pipeline, fn  # noqa: E402
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from echopipe.dali.state_check import DaliStateError  # noqa: E402
from pipeline_support.dali_pipes import labelled_flip_pipe as train_pipe  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

N = 14


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("pipeline_args_jpegs")
    return solid_jpegs(root, N, lambda i: (10, 12), lambda i: 10 * i)


def _make(files, **kwargs):
    return train_pipe(files, batch_size=4, num_threads=1, device_id=None, seed=5, **kwargs)


def test_separated_prefetch_queues_are_accepted(files: list[str]) -> None:
    separated = {"cpu_size": 3, "gpu_size": 2}
    with _make(files, prefetch_queue_depth=separated) as pipe:
        pipe.build()
        assert pipe.downstream.prefetch_queue_depth == separated
        it = DALIClassificationIterator(
            pipe, reader_name="Reader", auto_reset=True, last_batch_policy=LastBatchPolicy.PARTIAL
        )
        for _ in range(2):
            labels = Counter(x for b in it for x in b[0]["label"].reshape(-1).tolist())
            assert labels == {k: 2 for k in range(N)}
    with _make(files, prefetch_queue_depth=separated) as pipe, edali.EchoIterator(pipe) as it:
        for _ in range(2):
            labels = Counter(x for b in it for x in b[0]["label"].reshape(-1).tolist())
            assert labels == {k: 2 for k in range(N)}


@pytest.mark.parametrize("depth", [0, {"cpu_size": 0, "gpu_size": 1}])
def test_a_prefetch_depth_below_one_is_named(files: list[str], depth) -> None:
    named = r"prefetch_queue_depth must be .*, got " + re.escape(repr(depth))
    with pytest.raises(ValueError, match=named):
        _make(files, prefetch_queue_depth=depth)


@pytest.mark.parametrize("seed", [None, -1])
def test_dalis_no_seed_draws_a_random_seed(files: list[str], seed) -> None:
    """``seed=None`` is DALI's default and ``-1`` its older one, both "draw a random seed"; a
    DALI program passing ``seed=args.seed`` with either was refused (EchoConfigError: "seed
    must be an integer"). Now each pipeline draws its own, as DALI does (which warns that -1
    is deprecated)."""
    deprecated = pytest.warns(UserWarning, match="negative seed") if seed == -1 else nullcontext()
    with deprecated:
        pipes = [
            train_pipe(files, batch_size=4, num_threads=1, device_id=None, seed=seed)
            for _ in range(2)
        ]
    with pipes[0], pipes[1]:
        assert pipes[0].config.seed != pipes[1].config.seed
        it = DALIClassificationIterator(
            pipes[0], reader_name="Reader", last_batch_policy=LastBatchPolicy.PARTIAL
        )
        labels = Counter(x for b in it for x in b[0]["label"].reshape(-1).tolist())
        assert labels == {k: 2 for k in range(N)}


@edali.echo_pipeline_def(echo_factor=2)
def maybe_echo_pipe(files, is_training=True):
    jpegs, labels = fn.readers.file(
        files=files, labels=list(range(len(files))), pad_last_batch=True, name="Reader"
    )
    images = fn.decoders.image(jpegs, device="cpu")
    if is_training:
        images, labels = edali.echo(images, labels)
    return images, labels


def test_serialize_is_refused_in_one_line_and_the_plain_call_serializes(files: list[str]) -> None:
    settings = {"batch_size": 4, "num_threads": 1, "device_id": None}
    with maybe_echo_pipe(files, **settings) as pipe:
        with pytest.raises(edali.PipelineNotSerializableError, match="without its echo") as e:
            pipe.serialize(filename="unused")
        assert isinstance(e.value, TypeError)
    plain = maybe_echo_pipe(files, is_training=False, **settings)
    copy = Pipeline.deserialize(serialized_pipeline=plain.serialize(), **settings)
    copy.build()
    assert [int(x) for x in copy.run()[1].as_array().reshape(-1)] == [0, 1, 2, 3]


def test_an_echo_checkpoint_given_to_the_plain_call_is_named(files: list[str]) -> None:
    """The training call's checkpoint passed to the call without the echo point (the
    validation pipeline): DALI said only 'Failed to deserialize checkpoint from protobuf'."""
    settings = {"batch_size": 4, "num_threads": 1, "device_id": None}
    with maybe_echo_pipe(files, enable_checkpointing=True, **settings) as pipe:
        it = DALIClassificationIterator(pipe, reader_name="Reader")
        next(it)
        (checkpoint,) = it.checkpoints()
    with pytest.raises(DaliStateError, match=r"builds no echo\(\) point") as refused:
        maybe_echo_pipe(
            files, is_training=False, enable_checkpointing=True, checkpoint=checkpoint, **settings
        )
    assert "\n" not in str(refused.value)


def test_a_pipeline_closed_before_its_build_says_so(files: list[str]) -> None:
    with _make(files) as pipe:
        pass
    # Before, DALI built the sink and failed on the cache's name, in many lines.
    for build in (pipe.build, lambda: DALIClassificationIterator(pipe, reader_name="Reader")):
        with pytest.raises(RuntimeError, match=r"^this EchoPipeline was closed$"):
            build()


def test_run_loop_after_the_pass_ended_is_told_to_reset(files: list[str]) -> None:
    def labels_to_end(pipe) -> Counter[int]:
        labels: Counter[int] = Counter()
        with pytest.raises(StopIteration):
            while True:
                labels.update(int(x) for x in pipe.run()[1].as_array().reshape(-1))
        return labels

    with _make(files) as pipe:
        assert labels_to_end(pipe) == {k: 2 for k in range(N)}
        # Before, the message spoke only of DALI iterators given size=.
        with pytest.raises(ValueError, match=r"without reset\(\): call reset\(\) to start"):
            pipe.run()
        pipe.reset()
        assert set(labels_to_end(pipe)) == set(range(N))


def test_reset_inside_a_pass_of_a_run_loop_changes_nothing(files: list[str]) -> None:
    with _make(files) as pipe:
        labels = Counter(int(x) for x in pipe.run()[1].as_array().reshape(-1))
        pipe.reset()  # as Pipeline.reset inside an epoch: the pass goes on to its end
        with pytest.raises(StopIteration):
            while True:
                labels.update(int(x) for x in pipe.run()[1].as_array().reshape(-1))
        # Before, the stream went on into the next pass without an end: each file 4 times.
        assert labels == {k: 2 for k in range(N)}
        pipe.reset()
        with pytest.raises(StopIteration):
            while True:
                pipe.run()
