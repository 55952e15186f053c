"""Where one epoch-aligned pass ends and the next begins: ``EchoIterator.reset()`` inside an
epoch, a state saved inside the reader's epoch without DALI's checkpoints, and
``set_echo_factor`` between two epochs under DALI's own iterator (real CPU pipelines, real
JPEGs).

Every JPEG is one flat grey, unique per file, and the random crop and flip after the echo point
keep it, so each delivered image names its file by content (as in
tests/test_dali_resnet50_shape.py); the label must name the same file.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import fn  # noqa: E402
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

LBP = LastBatchPolicy
N, BATCH = 30, 4


def _grey(i: int) -> int:
    return 8 * i + 4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return solid_jpegs(tmp_path_factory.mktemp("pass_jpegs"), N, lambda i: (12, 10), _grey)


@edali.echo_pipeline_def(num_threads=1, device_id=None, seed=5, batch_size=BATCH)
def echo_pipe(files):
    jpegs, labels = fn.readers.file(
        files=files, labels=list(range(len(files))), random_shuffle=True, pad_last_batch=True,
        name="Reader",
    )  # fmt: skip
    images, labels = edali.echo(fn.decoders.image(jpegs), labels)
    images = fn.random_resized_crop(images, size=(6, 6), random_area=[0.3, 1.0])
    return fn.flip(images, horizontal=fn.random.coin_flip()), labels


def _files_of(batch: list[dict[str, torch.Tensor]]) -> list[int]:
    """The file each image of the batch shows (its grey level), checked against its label."""
    images = batch[0]["data"].float()
    assert float((images.amax(dim=(1, 2, 3)) - images.amin(dim=(1, 2, 3))).max()) < 4.0
    means = images.mean(dim=(1, 2, 3)).numpy()
    shown = np.rint((means - 4) / 8).astype(int)
    assert np.abs(means - (8 * shown + 4)).max() < 3.0
    assert shown.tolist() == batch[0]["label"].reshape(-1).tolist()
    return shown.tolist()


def _epoch(it) -> list[int]:
    """The files of one epoch's batches, in order."""
    return [f for batch in it for f in _files_of(batch)]


def _each(times: int) -> dict[int, int]:
    return dict.fromkeys(range(N), times)


# ---- EchoIterator.reset() inside an epoch -------------------------------------------------------


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(("steps", "policy"), [(1, LBP.PARTIAL), (10, LBP.PARTIAL), (14, LBP.DROP)])
def test_a_reset_inside_an_epoch_starts_a_whole_next_epoch(files, deterministic, steps, policy):
    """15 steps of 60 copies; a reset() after ``steps`` of them drops the rest of the pass:
    the next epoch is every file twice in 15 steps, and so is the one after. (The rest of the
    old pass was handed out as the next "epoch": 10 steps after a reset at step 5.) DALI's own
    iterators ignore a reset inside an epoch, with a warning; EchoIterator's says it starts
    the next pass."""
    with echo_pipe(files, echo_factor=2, deterministic=deterministic) as pipe:
        it = edali.EchoIterator(pipe, reader_name="Reader", last_batch_policy=policy)
        assert len(it) == 15 and pipe.epoch_copies() == 2 * N
        for _ in range(steps):
            next(it)
        it.reset()
        for _ in range(2):
            epoch = [_files_of(b) for b in it]
            assert len(epoch) == 15  # steps
            assert Counter(f for b in epoch for f in b) == _each(2)
            it.reset()
        assert pipe.copies_discarded == 2 * N - steps * BATCH
        assert pipe.stats().fresh_in == 3 * N  # three whole reader epochs, none read twice


def test_a_reset_before_the_first_batch_or_twice_drops_nothing(files) -> None:
    with echo_pipe(files, echo_factor=2) as pipe:
        it = edali.EchoIterator(pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL)
        it.reset()
        assert Counter(_epoch(it)) == _each(2)
        it.reset()
        it.reset()
        assert Counter(_epoch(it)) == _each(2)
        assert pipe.copies_discarded == 0


# ---- state_dict() inside the reader's epoch needs DALI's checkpoints ----------------------------


@pytest.mark.parametrize("epochs", ["auto", None])
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_state_inside_the_reader_epoch_needs_dalis_checkpoints(files, epochs, deterministic):
    """A cache of 12 samples cannot hold the 30-file epoch, so after one batch the reader stands
    inside its epoch: without enable_checkpointing=True the state is refused when it is saved
    (a restored reader would start from the first file while the echo state goes on from the
    saved iteration: files repeated and missed), and the epoch goes on unharmed."""
    opts = {"echo_factor": 2, "cache_samples": 12, "epochs": epochs}
    with echo_pipe(files, deterministic=deterministic, **opts) as pipe:
        it = edali.EchoIterator(pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL)
        first = _files_of(next(it))
        with pytest.raises(ValueError, match=r"enable_checkpointing=True$") as err:
            it.state_dict()
        assert isinstance(err.value, edali.DaliCheckpointNeededError)
        assert "\n" not in str(err.value) and "'Reader'" in str(err.value)
        if epochs == "auto":
            assert Counter(first + _epoch(it)) == _each(2)


def test_a_state_saved_at_an_epochs_end_needs_no_dali_checkpoint(files) -> None:
    """Saved after the epoch's end, the reader stands at its next epoch's start, which is where
    a fresh reader starts: the restored pipeline's next epoch is every file twice."""
    opts = {"echo_factor": 2, "cache_samples": 12}
    with echo_pipe(files, **opts) as pipe:
        it = edali.EchoIterator(pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL)
        assert Counter(_epoch(it)) == _each(2)
        state = it.state_dict()
    with echo_pipe(files, **opts) as pipe:
        it = edali.EchoIterator(pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL)
        it.load_state_dict(state)
        it.reset()
        assert Counter(_epoch(it)) == _each(2)
        it.reset()
        assert Counter(_epoch(it)) == _each(2)


# ---- set_echo_factor between two epochs under DALI's iterator -----------------------------------


def _dali_iterator(pipe) -> DALIClassificationIterator:
    return DALIClassificationIterator(
        pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL, auto_reset=True
    )


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_factor_set_between_epochs_makes_the_whole_next_epoch(files, deterministic) -> None:
    """DALI's iterator resets the pipeline when it ends an epoch and schedules the next
    batches at once; those drew the next pass at the old factor (deterministic mode filled the
    cache right there), so the iterator created again after set_echo_factor(3), told 90
    copies, got 60 at e = 2. The next pass now starts at the next draw: every file 3 times,
    in as many copies and steps as the iterator was told."""
    with echo_pipe(files, echo_factor=2, deterministic=deterministic) as pipe:
        it = _dali_iterator(pipe)
        assert Counter(_epoch(it)) == _each(2)
        pipe.set_echo_factor(3)
        it = _dali_iterator(pipe)  # DALI reads the epoch's length when it is created
        assert it._size == 3 * N and len(it) == math.ceil(3 * N / BATCH)
        for _ in range(2):
            epoch = [_files_of(b) for b in it]
            assert len(epoch) == len(it)  # steps
            assert Counter(f for b in epoch for f in b) == _each(3)
        assert pipe.copies_discarded == 0 and pipe.stats().fresh_in == 3 * N


def test_an_iterator_that_counts_the_old_factor_is_refused(files) -> None:
    """Kept after set_echo_factor, DALI's iterator would end the epoch after the 60 copies it
    was told, inside a pass of 90: the next draw says so in one line, and an iterator created
    then goes on with whole epochs."""
    with echo_pipe(files, echo_factor=2, deterministic=True) as pipe:
        it = _dali_iterator(pipe)
        assert Counter(_epoch(it)) == _each(2)
        pipe.set_echo_factor(3)
        with pytest.raises(ValueError, match=r"90 copies.* told 60") as err:
            next(it)
        assert isinstance(err.value, edali.EpochSizeChangedError)
        assert (err.value.told, err.value.copies) == (60, 90) and "\n" not in str(err.value)
        assert Counter(_epoch(_dali_iterator(pipe))) == _each(3)
