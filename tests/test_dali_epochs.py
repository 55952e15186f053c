"""Epoch-aligned echo under DALI's own iterators, and conditional echo (real CPU pipelines, real
JPEGs).

The properties DALI's iterator tests check on plain pipelines (every sample of the reader epoch in
each epoch, no duplicates, the last-batch policies, sizes, ``reader_name`` across shards,
``pad_last_batch``), checked here on echo pipelines: at e = 1 as plain DALI gives them, at e = 2
scaled by e, and for a fractional e with an exact total per epoch.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import Pipeline, fn, pipeline_def  # noqa: E402
from nvidia.dali.plugin.pytorch import (  # noqa: E402
    DALIClassificationIterator,
    DALIGenericIterator,
    LastBatchPolicy,
)

import echopipe.dali as edali  # noqa: E402
from echopipe.echo import copies_per_epoch  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

LBP = LastBatchPolicy
N = 20  # over 3 shards: DALI's shards hold 6, 7 and 7 files
BATCH = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return solid_jpegs(
        tmp_path_factory.mktemp("epoch_jpegs"), N, lambda i: (8, 8), lambda i: 10 * i
    )


def _reader(files, shard_id=0, num_shards=1, **kw):
    return fn.readers.file(
        files=files, labels=list(range(len(files))), shard_id=shard_id, num_shards=num_shards,
        pad_last_batch=True, name="Reader", **kw,
    )  # fmt: skip


def _body(files, shard_id, num_shards, is_training, reader_kw):
    jpegs, labels = _reader(files, shard_id, num_shards, **reader_kw)
    images = fn.decoders.image(jpegs)
    if is_training:
        images, labels = edali.echo(images, labels)
    return fn.flip(images, horizontal=fn.random.coin_flip()), labels


@edali.echo_pipeline_def(num_threads=1, device_id=None, seed=7)
def echo_pipe(files, shard_id=0, num_shards=1, is_training=True, reader_kw=None):
    return _body(files, shard_id, num_shards, is_training, reader_kw or {})


@pipeline_def(num_threads=1, device_id=None, seed=7)
def plain_pipe(files, shard_id=0, num_shards=1, reader_kw=None):
    return _body(files, shard_id, num_shards, False, reader_kw or {})


def _epochs(it, epochs: int) -> list[list[list[int]]]:
    """Labels of every batch of ``epochs`` epochs (auto_reset iterators)."""
    return [[b[0]["label"].reshape(-1).tolist() for b in it] for _ in range(epochs)]


def _flat(epoch: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(epoch))


def _plain_epochs(files, shard, shards, reader_kw, epochs=3) -> list[set[int]]:
    """The files plain DALI's iterator gives each epoch (the reader decides which a shard gets:
    with ``random_shuffle`` the shards are drawn from a shuffled list)."""
    pipe = plain_pipe(files, shard, shards, batch_size=BATCH, reader_kw=reader_kw)
    it = DALIGenericIterator(
        pipe, ["data", "label"], reader_name="Reader", last_batch_policy=LBP.PARTIAL,
        auto_reset=True,
    )  # fmt: skip
    out = [_flat(ep) for ep in _epochs(it, epochs)]
    assert all(len(set(ep)) == len(ep) for ep in out)  # plain DALI: each file once
    return [set(ep) for ep in out]


# ---- conditional echo ---------------------------------------------------------------------------


def test_a_call_without_echo_is_the_plain_dali_pipeline(files: list[str]) -> None:
    val = echo_pipe(files, batch_size=BATCH, is_training=False, reader_kw={"random_shuffle": True})
    plain = plain_pipe(files, batch_size=BATCH, reader_kw={"random_shuffle": True})
    assert type(val) is Pipeline
    val.build()
    plain.build()
    assert val.reader_meta("Reader") == plain.reader_meta("Reader")
    assert val.epoch_size("Reader") == plain.epoch_size("Reader") == N
    for _ in range(3):  # same seed, same graph: the same batches
        (a_img, a_lab), (b_img, b_lab) = val.run(), plain.run()
        assert np.array_equal(np.array(a_lab.as_tensor()), np.array(b_lab.as_tensor()))
        pairs = zip(a_img, b_img, strict=True)
        assert all(np.array_equal(np.array(x), np.array(y)) for x, y in pairs)
    train = echo_pipe(files, batch_size=BATCH, is_training=True)
    assert isinstance(train, edali.EchoPipeline)
    train.close()


# ---- every epoch is the reader epoch's copies ---------------------------------------------------


@pytest.mark.parametrize("e", [1, 2])
@pytest.mark.parametrize("policy", [LBP.PARTIAL, LBP.FILL, LBP.DROP])
@pytest.mark.parametrize("shard", [0, 1, 2])
def test_each_epoch_holds_each_shard_sample_e_times(files, e, policy, shard) -> None:
    kw = {"random_shuffle": True, "stick_to_shard": True}
    (mine,) = set(map(frozenset, _plain_epochs(files, shard, 3, kw)))
    pipe = echo_pipe(files, shard, 3, batch_size=BATCH, echo_factor=e, reader_kw=kw)
    copies = e * len(mine)  # DALI's shard sizes 6, 7, 7 times e: 12, 14, 14 at e = 2
    # Every shard's epoch is padded to the largest one's batches (DROP: the smallest one's
    # whole batches), as DALI's padded reader does, so the shards take equal steps.
    size = 6 * e if policy == LBP.DROP else 7 * e
    with pipe:
        it = DALIClassificationIterator(
            pipe, reader_name="Reader", last_batch_policy=policy, auto_reset=True
        )
        assert it._size == size
        steps = size // BATCH if policy == LBP.DROP else math.ceil(size / BATCH)
        assert len(it) == steps
        for epoch in _epochs(it, 3):
            labels = [x for batch in epoch for x in batch]
            counts = Counter(labels)
            assert len(epoch) == steps and all(len(b) == BATCH for b in epoch[: copies // BATCH])
            if policy == LBP.PARTIAL:
                assert counts == {i: e for i in mine}  # at e = 1: no duplicate, none missing
            elif policy == LBP.FILL:
                # Only the last batches are filled (with repeats of samples), as in DALI.
                extra = counts - Counter({i: e for i in mine})
                assert len(labels) == steps * BATCH and set(counts) == mine
                assert min(counts.values()) == e and sum(extra.values()) == len(labels) - copies
                assert set(extra) <= set(_flat(epoch[copies // BATCH :]))
            else:
                assert len(labels) == steps * BATCH and max(counts.values()) <= e
        assert pipe.copies_discarded == pipe.stats().copies_discarded == 0


def test_the_next_epoch_reopens_the_cache_before_the_upstream_steps(
    files: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At an epoch's end the cache takes puts again before the upstream runner resumes; with the
    reopening made slow, a runner resumed first would meet an ended cache and fail the epoch."""
    from echopipe.echo import EchoCache

    reset = EchoCache.reset_input
    monkeypatch.setattr(EchoCache, "reset_input", lambda self: (time.sleep(0.05), reset(self)))
    pipe = echo_pipe(files, batch_size=BATCH, echo_factor=2)
    with pipe:
        it = DALIGenericIterator(
            pipe, ["data", "label"], reader_name="Reader", last_batch_policy=LBP.PARTIAL,
            auto_reset=True,
        )  # fmt: skip
        for epoch in _epochs(it, 4):
            assert Counter(_flat(epoch)) == {i: 2 for i in range(N)}


@pytest.mark.parametrize("policy", [LBP.PARTIAL, LBP.FILL, LBP.DROP])
def test_at_e1_the_epochs_match_plain_dali(files: list[str], policy) -> None:
    """The same lengths, batch sizes and files per epoch as the plain pipeline. The echo epoch
    is shuffled, so DROP keeps other files of the shard than plain DALI (as many, none twice),
    and FILL's extra slot repeats another sample of the last batch (plain DALI's is the
    reader's padding, the shard's last file; echopipe never stores the padding)."""
    kw = {"random_shuffle": False, "stick_to_shard": True}
    shape = []
    files_per_epoch = []
    for make in (plain_pipe, echo_pipe):
        opts = {"echo_factor": 1} if make is echo_pipe else {}
        pipe = make(files, 1, 3, batch_size=BATCH, reader_kw=kw, **opts)
        it = DALIGenericIterator(
            pipe, ["data", "label"], reader_name="Reader", last_batch_policy=policy,
            auto_reset=True,
        )  # fmt: skip
        epochs = _epochs(it, 3)
        # DALI's DROP size is the whole data set's // shards (6 here, for a shard of 7), the
        # smallest shard's, and so is the echo pipeline's.
        shape.append((len(it), it._size, [[len(b) for b in ep] for ep in epochs]))
        files_per_epoch.append([Counter(_flat(ep)) for ep in epochs])
        if make is echo_pipe:
            pipe.close()
    assert shape[0] == shape[1]
    (mine,) = set(map(frozenset, _plain_epochs(files, 1, 3, kw)))
    for plain, echoed in zip(*files_per_epoch, strict=True):
        if policy == LBP.PARTIAL:
            assert plain == echoed == {i: 1 for i in mine}
        elif policy == LBP.FILL:
            assert set(plain) == set(echoed) == mine
            assert sorted(plain.values()) == sorted(echoed.values())  # one file twice
        else:
            assert set(echoed) <= mine and set(echoed.values()) == set(plain.values()) == {1}


def test_padding_is_never_delivered_beyond_plain_dali(files: list[str]) -> None:
    """The reader pads each shard's epoch with its last sample; PARTIAL delivers it e times per
    epoch, like every other sample, over many epochs (it is never stored as a sample)."""
    kw = {"random_shuffle": False, "stick_to_shard": True}
    (mine,) = set(map(frozenset, _plain_epochs(files, 0, 3, kw)))
    pipe = echo_pipe(files, 0, 3, batch_size=5, echo_factor=2, reader_kw=kw)
    with pipe:
        it = DALIClassificationIterator(
            pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL, auto_reset=True
        )
        for epoch in _epochs(it, 8):
            assert Counter(_flat(epoch)) == {i: 2 for i in mine}
        assert pipe.stats().fresh_in == 8 * 6  # the padding never entered the cache


@pytest.mark.parametrize("e", [1.5, 2.3])
def test_a_fractional_echo_factor_has_an_exact_total_per_epoch(files, e) -> None:
    kw = {"random_shuffle": True, "stick_to_shard": True}
    for shard in range(3):
        (mine,) = set(map(frozenset, _plain_epochs(files, shard, 3, kw)))
        pipe = echo_pipe(files, shard, 3, batch_size=BATCH, echo_factor=e, reader_kw=kw)
        with pipe:
            it = DALIClassificationIterator(
                pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL, auto_reset=True
            )
            total = copies_per_epoch(e, len(mine))  # 6 files at 1.5: 9; 7 files at 2.3: 16
            assert it._size == copies_per_epoch(e, 7)  # the largest shard's, on every shard
            for epoch in _epochs(it, 3):
                counts = Counter(_flat(epoch))
                assert set(counts) == mine and sum(counts.values()) == total
                assert set(counts.values()) <= {math.floor(e), math.ceil(e)}


def test_shards_that_move_every_epoch_keep_their_size_when_equal(files: list[str]) -> None:
    """18 files over 3 shards, stick_to_shard=False (DALI's default): each epoch a shard reads
    the next one's 6 files; the echo epoch holds exactly those, twice."""
    eighteen = files[:18]
    kw = {"random_shuffle": True}
    expected = _plain_epochs(eighteen, 2, 3, kw, epochs=4)
    assert len(set(map(frozenset, expected))) == 3  # the reader did move
    with echo_pipe(eighteen, 2, 3, batch_size=BATCH, echo_factor=2, reader_kw=kw) as pipe:
        it = DALIGenericIterator(
            pipe, ["data", "label"], reader_name="Reader", last_batch_policy=LBP.PARTIAL,
            auto_reset=True,
        )  # fmt: skip
        got = [Counter(_flat(ep)) for ep in _epochs(it, 4)]
    assert got == [Counter({i: 2 for i in ep}) for ep in expected]


def test_shards_of_unequal_size_that_move_are_refused_in_one_line(files: list[str]) -> None:
    with echo_pipe(files, 0, 3, batch_size=BATCH, echo_factor=2) as pipe:
        expected = r"reader 'Reader': 20 samples over 3 shards .* stick_to_shard=True"
        with pytest.raises(ValueError, match=expected):  # PARTIAL trims by the first epoch's
            DALIClassificationIterator(pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL)
        # EchoIterator's epochs end with the data: each holds the reader epoch's files twice.
        it = edali.EchoIterator(
            pipe, ["data", "label"], reader_name="Reader", last_batch_policy=LBP.PARTIAL
        )
        sizes = []
        for _ in range(3):
            labels = [x for b in it for x in b[0]["label"].reshape(-1).tolist()]
            assert set(Counter(labels).values()) == {2}
            sizes.append(len(labels))
            it.reset()
        assert sizes == [12, 14, 14]  # shard 0 reads shards 0, 1, 2 in turn


def test_manual_reset_and_prepare_first_batch(files: list[str]) -> None:
    """The older example's loop: auto_reset=False and ``loader.reset()`` after each epoch."""
    with echo_pipe(files, batch_size=BATCH, echo_factor=2,
                   reader_kw={"random_shuffle": True}) as pipe:  # fmt: skip
        it = DALIGenericIterator(
            pipe, ["data", "label"], reader_name="Reader", last_batch_policy=LBP.PARTIAL,
            prepare_first_batch=False,
        )  # fmt: skip
        for _ in range(3):
            labels = [x for b in it for x in b[0]["label"].reshape(-1).tolist()]
            assert Counter(labels) == {i: 2 for i in range(N)}
            it.reset()


def test_copies_spread_over_the_whole_epoch(files: list[str]) -> None:
    """The default buffer (4 batches) holds the whole 20-file epoch here, so the copies land as
    in a full shuffle of the epoch's 40 copies: mostly in different batches."""
    with echo_pipe(files, batch_size=BATCH, echo_factor=2, deterministic=True,
                   reader_kw={"random_shuffle": True}) as pipe:  # fmt: skip
        it = DALIClassificationIterator(
            pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL, auto_reset=True
        )
        same_batch = gaps = pairs = 0
        for epoch in _epochs(it, 4):
            where: dict[int, list[int]] = {}
            for step, batch in enumerate(epoch):
                for label in batch:
                    where.setdefault(label, []).append(step)
            for first, second in where.values():
                same_batch += first == second
                gaps += second - first
                pairs += 1
    # A full shuffle of 40 copies in batches of 4 puts 3/39 of the pairs into one batch and
    # the copies 10/3 batches apart on average; a 1-batch buffer gives about 1 batch.
    assert same_batch / pairs < 0.25 and gaps / pairs > 2.0


def test_stats_or_a_checkpoint_mid_epoch_keeps_the_deterministic_stream(files: list[str]) -> None:
    """In deterministic mode the stream depends only on the seed and the input order: reading the
    stats or taking a checkpoint mid-epoch leaves the later epochs as they were, and the resumed
    run continues that same stream (docs/dali.md). Both give released copies back to the cache's
    allocator early, and a put once took the slot on top of a free list whose order depended on
    when that happened, so the next epochs drew other samples (from batch 10 on)."""

    def loader(**kw):
        pipe = echo_pipe(files, batch_size=BATCH, echo_factor=2, deterministic=True,
                         enable_checkpointing=True, reader_kw={"random_shuffle": True},
                         **kw)  # fmt: skip
        it = DALIGenericIterator(pipe, ["data", "label"], reader_name="Reader",
                                 last_batch_policy=LBP.PARTIAL, auto_reset=True)  # fmt: skip
        return pipe, it

    def batches(it, epochs: int, at: int = -1, call=None) -> list[tuple[list[int], np.ndarray]]:
        out = []
        for _ in range(epochs):
            for b in it:
                out.append((b[0]["label"].reshape(-1).tolist(), b[0]["data"].numpy().copy()))
                if len(out) == at:
                    call()
        return out

    def first_difference(got, want) -> int | None:
        for i, (g, w) in enumerate(zip(got, want, strict=False)):
            if g[0] != w[0] or not np.array_equal(g[1], w[1]):
                return i
        return None if len(got) == len(want) else min(len(got), len(want))

    pipe, it = loader()
    with pipe:
        ref = batches(it, 3)
    assert len(ref) == 30
    pipe, it = loader()
    with pipe:
        after_stats = batches(it, 3, at=3, call=pipe.stats)
    checkpoint = []
    pipe, it = loader()
    with pipe:
        after_checkpoint = batches(it, 3, at=3, call=lambda: checkpoint.extend(it.checkpoints()))
    pipe, it = loader(checkpoint=checkpoint[0])
    with pipe:
        resumed = batches(it, 3)  # the rest of the epoch, then two whole ones
    differ = {
        name: first_difference(got, want)
        for name, got, want in [
            ("stats() at batch 3", after_stats, ref),
            ("checkpoints() at batch 3", after_checkpoint, ref),
            ("resumed from that checkpoint", resumed, ref[3:]),
        ]
    }
    assert all(at is None for at in differ.values()), f"first differing batch: {differ}"


def test_echo_iterator_len_is_exact_for_a_fractional_factor(files: list[str]) -> None:
    with echo_pipe(files, batch_size=BATCH, echo_factor=1.3,
                   reader_kw={"random_shuffle": True}) as pipe:  # fmt: skip
        it = edali.EchoIterator(pipe, ["data", "label"], auto_reset=True)
        assert pipe.epoch_copies() == copies_per_epoch(1.3, N) == 26
        assert len(it) == math.ceil(26 / BATCH)
        for _ in range(2):
            assert sum(1 for _ in it) == len(it)


def test_one_iterator_over_all_shards(files: list[str]) -> None:
    """DALI's single-process multi-pipeline form: one iterator over a pipeline per shard
    (shards of equal size, as DALI's iterator requires of echo pipelines' reported sizes)."""
    eighteen = files[:18]
    kw = {"random_shuffle": True}
    pipes = [
        echo_pipe(eighteen, shard, 3, batch_size=BATCH, echo_factor=2, reader_kw=kw)
        for shard in range(3)
    ]
    it = DALIGenericIterator(
        pipes, ["data", "label"], reader_name="Reader", last_batch_policy=LBP.PARTIAL,
        auto_reset=True,
    )  # fmt: skip
    for _ in range(3):
        labels = [x for step in it for out in step for x in out["label"].reshape(-1).tolist()]
        assert Counter(labels) == {i: 2 for i in range(18)}
    for pipe in pipes:
        pipe.close()


def test_a_free_running_upstream_checkpoint_resumes_the_epoch_exactly(files: list[str]) -> None:
    """Not deterministic (the upstream runs on its thread): the resumed epoch holds the rest of
    the epoch's copies, so both parts together hold each file twice; the next epoch is whole."""

    def loader(**kw):
        pipe = echo_pipe(files, batch_size=BATCH, echo_factor=2, enable_checkpointing=True,
                         reader_kw={"random_shuffle": True}, **kw)  # fmt: skip
        it = DALIClassificationIterator(
            pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL, auto_reset=True
        )
        return pipe, it

    pipe, it = loader()
    before = [x for _, b in zip(range(3), it, strict=False) for x in b[0]["label"].reshape(-1)]
    (checkpoint,) = it.checkpoints()
    pipe.close()
    pipe, it = loader(checkpoint=checkpoint)
    with pipe:
        rest = [x for b in it for x in b[0]["label"].reshape(-1).tolist()]
        assert Counter([int(x) for x in before] + rest) == {i: 2 for i in range(N)}
        assert Counter(x for b in it for x in b[0]["label"].reshape(-1).tolist()) == {
            i: 2 for i in range(N)
        }


# ---- checkpoints at an epoch's end, and batch echo under DALI's iterators -----------------------


@pytest.mark.parametrize("saved_after", [9, 10])
def test_a_state_saved_in_an_epochs_last_batches_resumes(files: list[str], saved_after) -> None:
    """After 9 or 10 of the epoch's 10 batches every copy was drawn (the rest is stashed or
    delivered): the restored pipeline hands out the stash and ends the epoch without a draw
    (one would meet only the end, with no sample to pad), then runs the next epoch whole.
    After 10, len() steps, the epoch is over (Lightning never asks for an 11th batch): the
    next iter() starts the next epoch."""

    def iterator(pipe):
        return edali.EchoIterator(pipe, ["data", "label"], reader_name="Reader",
                                  last_batch_policy=LBP.PARTIAL, auto_reset=True)  # fmt: skip

    first = echo_pipe(files, batch_size=BATCH, echo_factor=2, enable_checkpointing=True)
    it = iterator(first)
    got = [b[0]["label"].reshape(-1).tolist() for b in itertools.islice(it, saved_after)]
    state = it.state_dict()
    first.close()
    second = echo_pipe(files, batch_size=BATCH, echo_factor=2, enable_checkpointing=True)
    it = iterator(second)
    it.load_state_dict(state)
    if saved_after < len(it):
        got += _epochs(it, 1)[0]
    assert Counter(_flat(got)) == {i: 2 for i in range(N)}
    assert Counter(_flat(_epochs(it, 1)[0])) == {i: 2 for i in range(N)}
    second.close()


def test_a_state_saved_after_an_epochs_end_resets_into_the_next(files: list[str]) -> None:
    """auto_reset=False: saved after the StopIteration, restored, then reset() as the loop of
    a training program does: the next epoch has every copy (it had none)."""

    def iterator(pipe):
        return edali.EchoIterator(pipe, ["data", "label"], reader_name="Reader",
                                  last_batch_policy=LBP.PARTIAL)  # fmt: skip

    first = echo_pipe(files, batch_size=BATCH, echo_factor=2, enable_checkpointing=True)
    it = iterator(first)
    assert Counter(_flat(b[0]["label"].reshape(-1).tolist() for b in it)) == {
        i: 2 for i in range(N)
    }
    state = it.state_dict()
    first.close()
    second = echo_pipe(files, batch_size=BATCH, echo_factor=2, enable_checkpointing=True)
    it = iterator(second)
    it.load_state_dict(state)
    it.reset()
    assert Counter(_flat(b[0]["label"].reshape(-1).tolist() for b in it)) == {
        i: 2 for i in range(N)
    }
    second.close()


def test_batch_echo_under_dalis_iterators_needs_whole_upstream_batches(files: list[str]) -> None:
    """20 files in upstream batches of 8: the short last unit's padding is marked only in
    `info`, which DALI's iterators do not read, so they are refused with the way out."""
    pipe = echo_pipe(files, batch_size=8, echo_factor=2, mode="batch",
                     upstream_batch_size=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"20 samples .* upstream batches of 8.*EchoIterator"):
        DALIGenericIterator(pipe, ["data", "label"], reader_name="Reader")
    pipe.close()


def test_a_factor_set_between_auto_reset_epochs_makes_the_whole_next_epoch(files) -> None:
    """EchoIterator(auto_reset=True) starts the next pass at the next next(), not at the end
    of the epoch: a set_echo_factor(3) between the epochs gives epoch 1 three copies of every
    file and as many steps as len() says (a pass started at the end of epoch 0 put samples at
    the old e = 2 while the caller validated, so the ranks of a job took different steps)."""
    pipe = echo_pipe(files, batch_size=BATCH, echo_factor=2, cache_samples=3 * BATCH)
    with pipe:
        it = edali.EchoIterator(
            pipe, reader_name="Reader", last_batch_policy=LBP.PARTIAL, auto_reset=True
        )
        resets: list[int] = []
        finish = pipe.finish_pass
        pipe.finish_pass = lambda: (resets.append(1), finish())[1]  # type: ignore[method-assign]
        first = [b[0]["label"].reshape(-1).tolist() for b in it]
        assert resets == []  # nothing of the next pass before the caller's next()
        pipe.set_echo_factor(3)
        steps = len(it)
        second = [b[0]["label"].reshape(-1).tolist() for b in it]
        assert resets == [1]
    assert Counter(_flat(first)) == dict.fromkeys(range(len(files)), 2)
    assert Counter(_flat(second)) == dict.fromkeys(range(len(files)), 3)
    assert len(second) == steps
