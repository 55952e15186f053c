"""Which files a padded slot holds when shards of unequal size move, pass after pass.

Plain DALI's reader with ``pad_last_batch=True`` pads a shard's epoch to the largest shard's
batches with repeats of the last sample it returned in that epoch (``last_sample_ptr_tmp`` in
its loader), so every slot of a rank's epoch, padding included, holds a file of the shard the
reader reads in that epoch. Its iterators count that padding under ``FILL`` (handed out in full
batches), trim it under ``PARTIAL`` and drop the short batch under ``DROP``. An echo pass pads
the same way; its padding-only batches repeat one sample of the pass. They repeated the first
sample the source ever drew, so once the reader had moved to another shard, a later pass's
padding was a file of another shard (21 files on 2 shards, e = 2, batch 4: rank 1's second pass
reads the 10-file shard and ended with 4 copies of a file of the 11-file shard).

Every image is one flat colour, unique per file, so each delivered sample names its file. The
readers do not shuffle: on a data set this small DALI's shuffle buffer (``initial_fill``) spans
several epochs, so a shuffled epoch is not one index range of the files; the echo cache shuffles
the copies of a pass anyway.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import fn, pipeline_def  # noqa: E402
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

LBP = LastBatchPolicy
FILES, SHARDS, BATCH, PASSES = 21, 2, 4, 3


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return solid_jpegs(tmp_path_factory.mktemp("shard_padding"), FILES, lambda i: (8, 8), grey)


def grey(i: int) -> int:
    return 8 * i + 4


def _reader(files, shard):
    return fn.readers.file(
        files=files, labels=list(range(len(files))), shard_id=shard, num_shards=SHARDS,
        random_shuffle=False, pad_last_batch=True, stick_to_shard=False, name="Reader",
    )  # fmt: skip


@edali.echo_pipeline_def(num_threads=1, device_id=None)
def echo_pipe(files, shard):
    jpegs, labels = _reader(files, shard)
    return edali.echo(fn.decoders.image(jpegs, device="cpu"), labels)


@pipeline_def(num_threads=1, device_id=None)
def plain_pipe(files, shard):
    jpegs, labels = _reader(files, shard)
    return fn.decoders.image(jpegs, device="cpu"), labels


def shard_files(k: int) -> set[int]:
    """DALI's split: shard k holds files [floor(k n / S), floor((k + 1) n / S))."""
    return set(range(k * FILES // SHARDS, (k + 1) * FILES // SHARDS))


def _files_of(batch) -> list[int]:
    images, labels = batch[0]["data"], batch[0]["label"].reshape(-1)
    files = ((images.float().mean(dim=(1, 2, 3)) - 4) / 8).round().long().tolist()
    assert files == labels.tolist()
    return files


def _passes(pipe, iterator: str, policy: LastBatchPolicy) -> list[list[list[int]]]:
    make = DALIGenericIterator if iterator == "dali" else edali.EchoIterator
    loader = make(
        pipe, ["data", "label"], reader_name="Reader", last_batch_policy=policy, auto_reset=True
    )
    return [[_files_of(b) for b in loader] for _ in range(PASSES)]


def _expect_own_shard(runs, e: int, policy: LastBatchPolicy) -> None:
    """The rule: rank k's pass t holds only files of shard (k + t) % S, the padding included.
    FILL counts the padding (every batch full, each file at least e times); PARTIAL trims it
    (each file e times); DROP drops the short batches (every batch full, no file more than e
    times, no padding)."""
    for k, passes in enumerate(runs):
        for t, batches in enumerate(passes):
            shard = shard_files((k + t) % SHARDS)
            counts = Counter(f for b in batches for f in b)
            assert set(counts) <= shard, (k, t, sorted(set(counts) - shard))
            if policy == LBP.FILL:
                assert all(len(b) == BATCH for b in batches)
                assert set(counts) == shard and min(counts.values()) == e
            elif policy == LBP.DROP:
                assert all(len(b) == BATCH for b in batches)
                assert max(counts.values()) <= e
            else:
                assert counts == dict.fromkeys(shard, e)


def _steps(e: int, policy: LastBatchPolicy) -> int:
    """Batches of every rank's pass: the largest shard's copies, DROP the smallest's whole
    batches."""
    sizes = [len(shard_files(k)) for k in range(SHARDS)]
    if policy == LBP.DROP:
        return e * min(sizes) // BATCH
    return -(-e * max(sizes) // BATCH)


@pytest.mark.parametrize("policy", [LBP.FILL, LBP.PARTIAL, LBP.DROP])
def test_plain_dali_pads_each_epoch_with_a_file_of_the_shard_it_reads(jpegs, policy) -> None:
    """The reference: plain DALI over the moving shards, 10 and 11 files, batch 4: 3 batches
    each epoch; FILL hands out 2 and 1 padding copies, PARTIAL trims them, DROP takes 2."""
    runs = []
    for k in range(SHARDS):
        pipe = plain_pipe(jpegs, k, batch_size=BATCH, seed=3 + k)
        runs.append(_passes(pipe, "dali", policy))
    assert [[len(p) for p in passes] for passes in runs] == [[_steps(1, policy)] * PASSES] * 2
    _expect_own_shard(runs, 1, policy)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(("iterator", "policy"), [
    ("dali", LBP.FILL), ("dali", LBP.DROP), ("echo", LBP.FILL), ("echo", LBP.PARTIAL),
    ("echo", LBP.DROP),
])  # fmt: skip
@pytest.mark.parametrize("e", [2, 3])
def test_echoed_padding_of_a_later_pass_is_a_file_of_that_passs_shard(
    jpegs, e, iterator, policy, deterministic
) -> None:
    """e = 2: the 10-file shard's 20 copies fill 5 batches, then one padding-only batch to
    take the 11-file shard's 6 steps; e = 3: 30 copies (7 batches and 2 of padding), then one
    padding-only batch for ceil(33 / 4) = 9 steps. The shards move every pass, so each rank
    reads the 10-file shard in a pass that is not its first."""
    runs = []
    for k in range(SHARDS):
        opts = dict(batch_size=BATCH, echo_factor=e, seed=3 + k, deterministic=deterministic)
        with echo_pipe(jpegs, k, **opts) as pipe:
            runs.append(_passes(pipe, iterator, policy))
    steps = _steps(e, policy)
    assert [[len(p) for p in passes] for passes in runs] == [[steps] * PASSES] * SHARDS
    _expect_own_shard(runs, e, policy)
