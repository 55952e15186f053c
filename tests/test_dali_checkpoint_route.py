"""DALI's checkpoint route on an echoing pipeline, as a DALI program takes it: a DALI iterator's
``checkpoints()`` or ``pipe.checkpoint()``, passed back as ``checkpoint=`` (real CPU pipelines
over real JPEGs, DALI's own iterator)."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import fn  # noqa: E402
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from pipeline_support.dali_pipes import labelled_flip_pipe as train_pipe  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

N = 30


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("checkpoint_route_jpegs")
    return solid_jpegs(root, N, lambda i: (10, 12), lambda i: 8 * i)


def _make(files, **kwargs):
    # A cache smaller than the epoch: the reader stands inside its epoch when the state is saved.
    return train_pipe(
        files, batch_size=4, num_threads=1, device_id=None, seed=3, cache_samples=12,
        shuffle_buffer=8, **kwargs,
    )  # fmt: skip


def _iterator(pipe):
    return DALIClassificationIterator(
        pipe, reader_name="Reader", auto_reset=True, last_batch_policy=LastBatchPolicy.PARTIAL
    )


def _labels(batches) -> list[int]:
    return [x for b in batches for x in b[0]["label"].reshape(-1).tolist()]


def test_dali_state_into_a_pipeline_without_checkpointing_is_refused(files: list[str]) -> None:
    with _make(files, enable_checkpointing=True) as pipe:
        it = _iterator(pipe)
        first = _labels(next(it) for _ in range(2))
        (checkpoint,) = it.checkpoints()
    # Before, the DALI state was dropped: the reader read its epoch again from the first file
    # while the echo state went on (14 of 30 files three or four times, 14 never).
    with pytest.raises(ValueError, match="create the pipeline with enable_checkpointing=True"):
        _make(files, checkpoint=checkpoint)
    with _make(files, checkpoint=checkpoint, enable_checkpointing=True) as pipe:
        rest = _labels(_iterator(pipe))
    assert Counter(first + rest) == {k: 2 for k in range(N)}


def test_deterministic_checkpoint_before_the_first_batch_restores(files: list[str]) -> None:
    def epochs(it) -> list[list[int]]:
        return [_labels(it) for _ in range(2)]

    with _make(files, enable_checkpointing=True, deterministic=True) as pipe:
        expected = epochs(_iterator(pipe))
    with _make(files, enable_checkpointing=True, deterministic=True) as pipe:
        # DALI's iterator has prepared its first batch; the sink has stored nothing yet.
        (checkpoint,) = _iterator(pipe).checkpoints()
    # Before, the restore refused its own checkpoint: "'layouts' has 0 entries, not 2".
    with _make(files, checkpoint=checkpoint, enable_checkpointing=True, deterministic=True) as pipe:
        assert epochs(_iterator(pipe)) == expected
    assert Counter(expected[0]) == {k: 2 for k in range(N)}


def test_pipeline_checkpoint_inside_a_pass_refuses_a_dali_iterator(files: list[str]) -> None:
    with _make(files, enable_checkpointing=True) as pipe:
        it = _iterator(pipe)
        first = _labels(next(it) for _ in range(2))
        checkpoint = pipe.checkpoint()  # DALI's Pipeline API: no iterator counters in it
    # Before, the iterator counted a whole epoch from the restored point: it handed out the
    # pass's rest and its padding as samples, and its next epoch raised a ValueError.
    refused = pytest.raises(ValueError, match=r"take the checkpoint with the iterator's checkp")
    with _make(files, checkpoint=checkpoint, enable_checkpointing=True) as pipe, refused:
        _iterator(pipe)
    with _make(files, checkpoint=checkpoint, enable_checkpointing=True) as pipe:
        rest: list[int] = []
        with pytest.raises(StopIteration):  # a run() loop takes the rest of the pass
            while True:
                rest += [int(x) for x in pipe.run()[1].as_array().reshape(-1)]
    assert Counter(first + rest) == {k: 2 for k in range(N)}


def test_dali_iterator_after_the_restored_pass_ended(files: list[str]) -> None:
    with _make(files, enable_checkpointing=True) as pipe:
        it = _iterator(pipe)
        _labels(next(it) for _ in range(2))
        checkpoint = pipe.checkpoint()
    with _make(files, checkpoint=checkpoint, enable_checkpointing=True) as pipe:
        with pytest.raises(StopIteration):  # a run() loop takes the rest of the restored pass
            while True:
                pipe.run()
        pipe.reset()
        # The next pass starts at its beginning, where an iterator counts whole epochs rightly.
        # Before, the refusal of the restored pass stayed for the pipeline's lifetime.
        assert Counter(_labels(_iterator(pipe))) == {k: 2 for k in range(N)}


@edali.echo_pipeline_def(echo_factor=2, num_threads=1, device_id=None)
def sharded_pipe(files, shard_id, num_shards):
    jpegs, labels = fn.readers.file(
        files=files, labels=list(range(len(files))), shard_id=shard_id, num_shards=num_shards,
        random_shuffle=True, pad_last_batch=True, name="Reader",
    )  # fmt: skip
    return edali.echo(fn.decoders.image(jpegs, device="cpu"), labels)


def _echo_iterator(pipe):
    return edali.EchoIterator(
        pipe, reader_name="Reader", auto_reset=True, last_batch_policy=LastBatchPolicy.PARTIAL
    )


@pytest.mark.parametrize("iterator", ["dali", "echo"])
def test_a_checkpoint_of_another_shard_is_refused(files: list[str], iterator: str) -> None:
    """DALI's ResNet-50 example saves its checkpoint on rank 0 alone. A program that adds the
    loader's state to it restores rank 0's state on every rank: plain DALI's rank 1 then
    reads its own files, but an echo pipeline's cache and stashed batches hold rank 0's
    samples, so rank 1 trained on shard 0's files until its pass ended (16 samples here),
    silently. Now refused in one line naming both shards; its own shard still restores."""

    def make(shard: int, **kwargs):
        return sharded_pipe(
            files, shard, 2, batch_size=4, seed=3, enable_checkpointing=True, cache_samples=12,
            shuffle_buffer=8, **kwargs,
        )  # fmt: skip

    def restored(shard: int, state):
        pipe = make(shard, **(dict(checkpoint=state) if iterator == "dali" else {}))
        it = _iterator(pipe) if iterator == "dali" else _echo_iterator(pipe)
        if iterator == "echo":
            it.load_state_dict(state)
        return pipe, it

    with make(0) as pipe:
        it = _iterator(pipe) if iterator == "dali" else _echo_iterator(pipe)
        first = _labels(next(it) for _ in range(2))
        state = it.checkpoints()[0] if iterator == "dali" else it.state_dict()
    with pytest.raises(edali.CheckpointShardError, match=r"shard 0 of 2 .* reads shard 1 of 2"):
        restored(1, state)
    pipe, it = restored(0, state)
    with pipe:
        rest = _labels(it)
    counts = Counter(first + rest)  # (the reader's shuffled split)
    assert len(counts) == N // 2 and set(counts.values()) == {2}


@pytest.mark.parametrize("other", [20, 30])
def test_a_checkpoint_over_another_data_set_is_refused(files: list[str], other: int) -> None:
    """A state restored over a reader of another size: its cache and position belong to the
    data set it was saved over. Before, DALI's iterator failed a pass later in a line about
    reset() and size= (24 files saved, 21 restored), or epochs silently missed files (24
    saved, 30 restored: epochs of 28 and 27 of the 30 files)."""
    with _make(files[:24], enable_checkpointing=True) as pipe:
        it = _iterator(pipe)
        first = _labels(next(it) for _ in range(2))
        (checkpoint,) = it.checkpoints()
    refused = pytest.raises(edali.CheckpointShardError, match=f"of 24 samples, .* has {other};")
    with refused:
        _make(files[:other], checkpoint=checkpoint, enable_checkpointing=True)
    with _make(files[:24], checkpoint=checkpoint, enable_checkpointing=True) as pipe:
        rest = _labels(_iterator(pipe))
    assert Counter(first + rest) == {k: 2 for k in range(24)}
