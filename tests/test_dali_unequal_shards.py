"""Echo pipelines over shards of unequal size take the same steps per epoch on every shard.

DALI's reader with ``pad_last_batch=True`` pads every shard's epoch to the largest shard's
batches, so the ranks of a DDP job take equal steps (DDP's all-reduce waits for every rank),
and its iterators trim the padding under PARTIAL. An echo pipeline stores no padding, so each
pass is padded the same way, to the batches of the largest shard's copies. Checked per shard
in one process (22 files over 3 shards: 7, 7, 8; 21 over 2: 10, 11; e = 1, 2, 3; batch 4 and
5; PARTIAL, FILL and DROP; DALI's iterator and EchoIterator; two epochs) and in a real
2-process Gloo DDP run of the ResNet-50 example's reader.

Every image is one flat colour, unique per file, so each delivered sample names its file by
content (and its label must agree).
"""

from __future__ import annotations

import json
import linecache
import math
import os
import socket
import subprocess
import sys
import warnings
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import fn, pipeline_def  # noqa: E402
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

LBP = LastBatchPolicy
FILES = 22
WORKER = Path(__file__).parent / "pipeline_support" / "dist_unequal_shards_worker.py"


def grey(i: int) -> int:
    return 8 * i + 4


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return solid_jpegs(tmp_path_factory.mktemp("unequal_shards"), FILES, lambda i: (8, 8), grey)


def _reader(files, shard, shards, stick):
    return fn.readers.file(
        files=files, labels=list(range(len(files))), shard_id=shard, num_shards=shards,
        random_shuffle=True, pad_last_batch=True, stick_to_shard=stick, name="Reader",
    )  # fmt: skip


@edali.echo_pipeline_def(num_threads=1, device_id=None)
def echo_pipe(files, shard, shards, stick):
    jpegs, labels = _reader(files, shard, shards, stick)
    images, labels = edali.echo(fn.decoders.image(jpegs, device="cpu"), labels)
    return images, labels


@pipeline_def(num_threads=1, device_id=None)
def plain_pipe(files, shard, shards, stick):
    jpegs, labels = _reader(files, shard, shards, stick)
    return fn.decoders.image(jpegs, device="cpu"), labels


def shard_sizes(n: int, shards: int) -> list[int]:
    """DALI's split: shard k holds files [floor(k n / S), floor((k + 1) n / S))."""
    return [(k + 1) * n // shards - k * n // shards for k in range(shards)]


def _files_of(batch) -> list[int]:
    """The file of each sample, by its colour; its label must name the same file."""
    images, labels = batch[0]["data"], batch[0]["label"].reshape(-1)
    files = ((images.float().mean(dim=(1, 2, 3)) - 4) / 8).round().long().tolist()
    assert files == labels.tolist()
    return files


def _run(loader, epochs: int = 2) -> list[list[list[int]]]:
    return [[_files_of(batch) for batch in loader] for _ in range(epochs)]


def _loader(pipe, iterator: str, policy: LastBatchPolicy):
    make = DALIGenericIterator if iterator == "dali" else edali.EchoIterator
    return make(
        pipe, ["data", "label"], reader_name="Reader", last_batch_policy=policy, auto_reset=True
    )


def _shape(loader, epochs) -> tuple:
    """What plain DALI's epochs are compared on: lengths and batch sizes."""
    return len(loader), loader.size, [[len(b) for b in epoch] for epoch in epochs]


def _leaked(own: int, most: int, batch: int) -> int:
    """Padding copies DALI's PARTIAL hands out per epoch on a shard whose copies end more than
    a batch before the largest shard's (its trim is one number; see scaled_meta)."""
    steps, rest = math.ceil(most / batch), own % batch
    if own >= (steps - 1) * batch or rest == 0:
        return 0
    return min(rest, batch - rest)


@pytest.mark.parametrize("iterator", ["dali", "echo"])
@pytest.mark.parametrize("policy", [LBP.PARTIAL, LBP.FILL, LBP.DROP])
@pytest.mark.parametrize("batch", [4, 5])
@pytest.mark.parametrize("e", [1, 2, 3])
@pytest.mark.parametrize(("n", "shards"), [(22, 3), (21, 2)])
def test_every_shard_takes_the_same_steps_and_each_file_e_times(
    jpegs, n, shards, e, batch, policy, iterator
) -> None:
    """DALI's iterator over ``stick_to_shard=True`` (its PARTIAL trims by one shard's size);
    EchoIterator over the example's moving shards (each epoch a shard reads the next one)."""
    files, sizes = jpegs[:n], shard_sizes(n, shards)
    stick = iterator == "dali"
    most, least = e * max(sizes), e * min(sizes)
    steps = least // batch if policy == LBP.DROP else math.ceil(most / batch)
    runs = []
    for k in range(shards):
        pipe = echo_pipe(files, k, shards, stick, batch_size=batch, echo_factor=e, seed=3 + k)
        with pipe, warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always", edali.UntrimmedPaddingWarning)
            loader = _loader(pipe, iterator, policy)
            epochs = _run(loader)
            runs.append((_shape(loader, epochs), epochs, [str(w.message) for w in warned]))
            stats = getattr(loader, "stats", None)
        if e == 1:  # plain DALI's lengths, sizes and batch sizes
            plain = _loader(plain_pipe(files, k, shards, stick, batch_size=batch), "dali", policy)
            assert runs[-1][0] == _shape(plain, _run(plain))
        if stats is not None:  # EchoIterator knows the padding; PARTIAL hands none out
            owns = [e * sizes[(k + t) % shards] for t in range(2)]
            padded = sum(steps * batch - own for own in owns) if policy == LBP.FILL else 0
            dropped = sum(own - steps * batch for own in owns) if policy == LBP.DROP else 0
            assert (stats.padded, stats.dropped) == (padded, dropped)
    for t in range(2):
        together: Counter[int] = Counter()
        for k, ((length, size, _), epochs, warned) in enumerate(runs):
            got = epochs[t]
            own = e * sizes[k if stick else (k + t) % shards]
            assert length == len(got) == steps  # every shard, every epoch
            assert size == (least if policy == LBP.DROP else most)
            counts = Counter(f for b in got for f in b)
            together += counts
            leaked = _leaked(own, most, batch) if iterator == "dali" else 0
            assert len(warned) == (leaked > 0 and policy == LBP.PARTIAL)
            if policy == LBP.PARTIAL:
                assert sum(counts.values()) == own + leaked
                assert all(len(b) == batch for b in got[: own // batch])
            else:
                assert all(len(b) == batch for b in got)
        extra = together - Counter({f: e for f in range(n)})
        if policy == LBP.PARTIAL:  # each file e times, plus what DALI cannot trim
            assert set(together) == set(range(n))
            assert sum(extra.values()) == sum(
                _leaked(e * size, most, batch) for size in sizes if iterator == "dali"
            )
            assert min(together.values()) == e
        elif policy == LBP.FILL:
            assert min(together.values()) == e
            assert sum(extra.values()) == shards * steps * batch - e * n
        else:
            assert max(together.values()) <= e


@pytest.mark.parametrize("policy", [LBP.FILL, LBP.DROP])
def test_dalis_fill_and_drop_follow_shards_that_move(jpegs, policy) -> None:
    """FILL and DROP need no per-shard trim, so DALI's iterators take moving shards of unequal
    size (the ResNet-50 example's reader as it is): the same steps every epoch on each."""
    files, sizes = jpegs[:21], shard_sizes(21, 2)
    steps = 2 * min(sizes) // 4 if policy == LBP.DROP else math.ceil(2 * max(sizes) / 4)
    runs = []
    for k in range(2):
        with echo_pipe(files, k, 2, False, batch_size=4, echo_factor=2, seed=k) as pipe:
            runs.append(_run(_loader(pipe, "dali", policy), epochs=3))
    for t in range(3):
        assert [len(run[t]) for run in runs] == [steps, steps]
        assert all(len(b) == 4 for run in runs for b in run[t])
        together = Counter(f for run in runs for b in run[t] for f in b)
        if policy == LBP.FILL:  # each file twice, and padding (a repeated sample) after it
            assert min(together.values()) == 2 and len(together) == 21
        else:
            assert max(together.values()) <= 2


def test_dalis_partial_over_moving_shards_is_refused_in_one_line(jpegs) -> None:
    refusal = r"21 samples over 2 shards .* stick_to_shard=True"
    pipe = echo_pipe(jpegs[:21], 0, 2, False, batch_size=4, echo_factor=2)
    with pipe, pytest.raises(ValueError, match=refusal):
        _loader(pipe, "dali", LBP.PARTIAL)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("iterator", ["dali", "echo"])
def test_a_state_saved_after_the_smaller_shards_last_copy_keeps_the_steps(
    jpegs, iterator, deterministic
) -> None:
    """Shard 0 of 21 files (10) has 20 copies at e = 2, 5 batches of 4, and owes one
    padding-only batch to take shard 1's 6 steps. A state saved after its last copy carries
    that batch: the restored source has drawn nothing, so it has no sample to pad with."""
    files = jpegs[:21]
    opts = dict(batch_size=4, echo_factor=2, seed=3, deterministic=deterministic)
    pipe = echo_pipe(files, 0, 2, True, enable_checkpointing=True, **opts)
    with pipe:
        loader = _loader(pipe, iterator, LBP.PARTIAL)
        first = [_files_of(next(loader)) for _ in range(5)]
        state = loader.checkpoints()[0] if iterator == "dali" else loader.state_dict()
    restored = dict(checkpoint=state) if iterator == "dali" else {}
    with echo_pipe(files, 0, 2, True, enable_checkpointing=True, **opts, **restored) as pipe:
        loader = _loader(pipe, iterator, LBP.PARTIAL)
        if iterator == "echo":
            loader.load_state_dict(state)
        rest, following = _run(loader)
    assert [len(b) for b in first + rest] == [4, 4, 4, 4, 4, 0] == [len(b) for b in following]
    for epoch in (first + rest, following):
        counts = Counter(f for b in epoch for f in b)
        assert len(counts) == 10 and set(counts.values()) == {2}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("iterator", ["dali", "echo"])
def test_a_state_saved_between_epochs_holds_no_padding_of_the_next_pass(
    jpegs, iterator, deterministic
) -> None:
    """Shard 0 of 21 files (10) owes one padding-only batch after its 20 copies. A state saved
    after an epoch and its reset, before the next pass began (DALI's ``checkpoints()`` after an
    epoch; EchoIterator's ``state_dict()`` after ``reset()``), ran the next pass's 6 owed
    batches into the stash: the next epoch, live or restored, began with them (DALI: 20 copies
    of one file; EchoIterator: 6 empty batches before 5 real ones)."""
    files = jpegs[:21]
    opts = dict(batch_size=4, echo_factor=2, seed=3, deterministic=deterministic)
    with echo_pipe(files, 0, 2, True, enable_checkpointing=True, **opts) as pipe:
        loader = _loader(pipe, iterator, LBP.PARTIAL)
        epochs = _run(loader, 1)
        if iterator == "echo":
            loader.reset()
        state = loader.checkpoints()[0] if iterator == "dali" else loader.state_dict()
        epochs += _run(loader)
    restored = dict(checkpoint=state) if iterator == "dali" else {}
    with echo_pipe(files, 0, 2, True, enable_checkpointing=True, **opts, **restored) as pipe:
        loader = _loader(pipe, iterator, LBP.PARTIAL)
        if iterator == "echo":
            loader.load_state_dict(state)
        epochs += _run(loader)
    shard = {f for b in epochs[0] for f in b}  # (the reader's shuffled split)
    assert len(shard) == 10
    for epoch in epochs:
        assert [len(b) for b in epoch] == [4, 4, 4, 4, 4, 0]
        assert Counter(f for b in epoch for f in b) == dict.fromkeys(shard, 2)


# ---- with main's pass handling: resets, factor changes, loops that stop at len() --------------


def _expect_whole_epochs(runs, n: int, shards: int, e: int, steps: int, start: int = 0) -> None:
    """``runs[k][t]``, shard k's epoch t, reads shard ``(k + start + t) % shards`` (the reader
    moves): it takes ``steps`` steps, as on every shard, with each of that shard's files e
    times, and the shards' epochs t together hold every file e times."""
    sizes = shard_sizes(n, shards)
    for t in range(len(runs[0])):
        together: Counter[int] = Counter()
        for k, epochs in enumerate(runs):
            assert len(epochs[t]) == steps, (k, t)
            counts = Counter(f for b in epochs[t] for f in b)
            assert len(counts) == sizes[(k + start + t) % shards] and set(counts.values()) == {e}
            together += counts
        assert together == dict.fromkeys(range(n), e), t


def _expect_dropped_epochs(runs, batch: int, steps: int) -> None:
    """DROP: every shard's epochs take ``steps`` whole batches, no file more than twice."""
    for t in range(len(runs[0])):
        assert all(len(epochs[t]) == steps for epochs in runs)
        assert all(len(b) == batch for epochs in runs for b in epochs[t])
        assert max(Counter(f for epochs in runs for b in epochs[t] for f in b).values()) <= 2


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    ("batch", "after", "policy"),
    [(4, 1, LBP.PARTIAL), (4, 3, LBP.PARTIAL), (5, 2, LBP.PARTIAL), (5, 3, LBP.PARTIAL),
     (5, 1, LBP.DROP)],
)  # fmt: skip
def test_a_reset_inside_an_epoch_gives_every_shard_whole_equal_epochs(
    jpegs, batch, after, policy, deterministic
) -> None:
    """22 files on 3 shards that move (7, 7, 8), e = 2, EchoIterator: a reset() after ``after``
    steps drops the rest of the pass on each shard (``copies_discarded``), and the next two
    epochs take the largest shard's steps on every shard, each file of the shard twice (DROP:
    the smallest shard's whole batches). At batch 5 a 7-file shard's 14 copies are out after 3
    of 4 steps: a reset there meets a pass that owes only its padding-only batch."""
    sizes = shard_sizes(FILES, 3)
    drop = policy == LBP.DROP
    steps = 2 * min(sizes) // batch if drop else math.ceil(2 * max(sizes) / batch)
    runs = []
    for k in range(3):
        opts = dict(batch_size=batch, echo_factor=2, seed=3 + k, deterministic=deterministic)
        with echo_pipe(jpegs, k, 3, False, **opts) as pipe:
            it = _loader(pipe, "echo", policy)
            handed = sum(len(_files_of(next(it))) for _ in range(after))
            it.reset()
            runs.append(_run(it))
            assert pipe.copies_discarded == 2 * sizes[k] - handed
            assert pipe.stats().fresh_in == FILES  # three whole reader epochs of 3 shards
    if drop:
        _expect_dropped_epochs(runs, batch, steps)
    else:
        _expect_whole_epochs(runs, FILES, 3, 2, steps, start=1)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("batch", [4, 5])
def test_a_factor_set_between_epochs_gives_every_shard_the_new_steps(
    jpegs, batch, deterministic
) -> None:
    """set_echo_factor(3) after an epoch at e = 2 (EchoIterator with auto_reset: the next pass
    starts at the next next()): len() becomes the largest shard's 24 copies' steps, and every
    shard's pass is padded to them, each file of its shard 3 times."""
    sizes = shard_sizes(FILES, 3)
    runs = []
    for k in range(3):
        opts = dict(batch_size=batch, echo_factor=2, seed=3 + k, deterministic=deterministic)
        with echo_pipe(jpegs, k, 3, False, **opts) as pipe:
            it = _loader(pipe, "echo", LBP.PARTIAL)
            first = _run(it, 1)
            pipe.set_echo_factor(3)
            assert len(it) == math.ceil(3 * max(sizes) / batch)
            runs.append((first, _run(it)))
    _expect_whole_epochs([r[0] for r in runs], FILES, 3, 2, math.ceil(2 * max(sizes) / batch))
    _expect_whole_epochs([r[1] for r in runs], FILES, 3, 3, len(it), start=1)


def test_dalis_iterator_kept_after_a_factor_change_is_refused_on_every_shard(jpegs) -> None:
    """DALI's iterators count the largest shard's copies: 16 at e = 2 over 22 files on 3 shards
    that stick (7, 7, 8), 4 steps of 4. At e = 2.07 the 8-file shard has 17 copies (5 steps)
    and the 7-file shards still 14: a kept iterator would take 4 steps where every shard's pass
    now takes 5, so each shard refuses it, naming the 16 it was told and the 17 now (the
    7-file shards compared their own 14 and went on); one created again takes 5 steps."""
    for k in range(3):
        with echo_pipe(jpegs, k, 3, True, batch_size=4, echo_factor=2, seed=3 + k) as pipe:
            it = _loader(pipe, "dali", LBP.FILL)
            assert [len(epoch) for epoch in _run(it, 1)] == [4]
            pipe.set_echo_factor(2.07)
            # The caller's own look at the sizes is not the kept iterator being told them
            # (plain DALI's figure: the largest shard's, times the shards).
            assert pipe.epoch_size("Reader") == 3 * 17
            with pytest.raises(edali.EpochSizeChangedError) as err:
                next(it)
            assert (err.value.told, err.value.copies) == (16, 17), k
            it = _loader(pipe, "dali", LBP.FILL)
            (epoch,) = _run(it, 1)
        counts = Counter(f for b in epoch for f in b)
        assert len(epoch) == len(it) == 5 and all(len(b) == 4 for b in epoch)
        assert len(counts) == shard_sizes(FILES, 3)[k] and min(counts.values()) >= 2


@pytest.mark.parametrize("policy", [LBP.PARTIAL, LBP.DROP])
@pytest.mark.parametrize("batch", [4, 5])
def test_a_loop_that_stops_at_len_gives_every_shard_whole_equal_epochs(
    jpegs, batch, policy
) -> None:
    """Lightning's loop: iter(), then len() batches, never the end. Every shard's epochs take
    the same len() steps, each file of the shard twice (PARTIAL; at batch 5 a 7-file shard's
    last step is its padding-only batch), or DROP's whole batches, the rest dropped."""
    sizes = shard_sizes(FILES, 3)
    drop = policy == LBP.DROP
    steps = 2 * min(sizes) // batch if drop else math.ceil(2 * max(sizes) / batch)
    runs = []
    for k in range(3):
        with echo_pipe(jpegs, k, 3, False, batch_size=batch, echo_factor=2, seed=3 + k) as pipe:
            it = _loader(pipe, "echo", policy)
            runs.append([[_files_of(b) for b in islice(it, len(it))] for _ in range(3)])
            assert it.stats.epochs == 2  # the third one's end is not drawn yet
            owns = [2 * sizes[(k + t) % 3] for t in range(2)]
            assert it.stats.dropped == (sum(own - steps * batch for own in owns) if drop else 0)
    if drop:
        _expect_dropped_epochs(runs, batch, steps)
    else:
        _expect_whole_epochs(runs, FILES, 3, 2, steps)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(("n", "shards"), [(22, 3), (22, 2)])
def test_a_loop_that_stops_at_len_takes_a_factor_set_between_epochs(
    jpegs, n, shards, deterministic
) -> None:
    """Lightning's loop with set_echo_factor(3) between epochs (on_train_epoch_end, say): the
    epoch at e = 2 took its len() steps, fewer than len() at e = 3, and the next iter() still
    starts the next epoch (it went on with the old pass instead: an epoch of 0 steps, on
    shards of equal size too). Every shard then takes the new len() steps, each file 3 times."""
    sizes = shard_sizes(n, shards)
    runs = []
    for k in range(shards):
        opts = dict(batch_size=4, echo_factor=2, seed=3 + k, deterministic=deterministic)
        with echo_pipe(jpegs[:n], k, shards, False, **opts) as pipe:
            it = _loader(pipe, "echo", LBP.PARTIAL)
            first = [_files_of(b) for b in islice(it, len(it))]
            pipe.set_echo_factor(3)
            assert len(it) == math.ceil(3 * max(sizes) / 4)
            runs.append(([first], [[_files_of(b) for b in islice(it, len(it))] for _ in range(2)]))
    _expect_whole_epochs([r[0] for r in runs], n, shards, 2, math.ceil(2 * max(sizes) / 4))
    _expect_whole_epochs([r[1] for r in runs], n, shards, 3, len(it), start=1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_state_saved_after_a_factor_set_at_the_epochs_end_resumes_a_whole_epoch(
    jpegs, deterministic
) -> None:
    """Lightning's order at an epoch's end: the loop stops at len() steps, an epoch-end hook
    calls set_echo_factor(3), then ModelCheckpoint saves. The restored iterator must know the
    epoch took its len() steps at e = 2 (fewer than len() at e = 3): it went on with the old,
    drained pass instead, an epoch of 0 steps."""
    files = jpegs[:21]
    opts = dict(batch_size=4, echo_factor=2, seed=3, deterministic=deterministic)
    with echo_pipe(files, 0, 2, True, enable_checkpointing=True, **opts) as pipe:
        it = _loader(pipe, "echo", LBP.PARTIAL)
        first = [_files_of(b) for b in islice(it, len(it))]
        pipe.set_echo_factor(3)
        state = it.state_dict()
    shard = {f for b in first for f in b}
    assert len(shard) == 10 and Counter(f for b in first for f in b) == dict.fromkeys(shard, 2)
    with echo_pipe(files, 0, 2, True, enable_checkpointing=True, **opts) as pipe:
        it = _loader(pipe, "echo", LBP.PARTIAL)
        it.load_state_dict(state)  # (the factor, 3, comes with it)
        steps = len(it)
        assert steps == math.ceil(3 * 11 / 4)  # the largest shard's copies at e = 3
        epoch = [_files_of(b) for b in islice(it, steps)]
    assert len(epoch) == steps
    assert Counter(f for b in epoch for f in b) == dict.fromkeys(shard, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.distributed
def test_two_gloo_ranks_train_two_epochs_with_ddp(jpegs, tmp_path: Path) -> None:
    """Two processes, a model in DistributedDataParallel, each rank its shard of 21 files
    (10 and 11) echoed twice: both finish two epochs of the same steps under DALI's
    DALIClassificationIterator and EchoIterator. Unequal steps would leave one rank's
    all-reduce waiting: Gloo's 60 s timeout (or a closed peer) fails it, never a hang."""
    data = tmp_path / "jpegs"
    data.mkdir()
    for path in jpegs[:21]:
        (data / Path(path).name).symlink_to(path)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    import echopipe

    # The package this test imported (the installed one in CI, the tree in a dev checkout).
    python_dir = Path(echopipe.__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(python_dir), env.get("PYTHONPATH")] if p)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(WORKER), str(data),
        str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("dali", "echo"):
        ranks = [json.loads((out / f"rank{r}_{name}.json").read_text()) for r in range(2)]
        # 10 and 11 files, e = 2, batch 4: 6 steps each (20 and 22 copies)
        assert [r["steps"] for r in ranks] == [[6, 6], [6, 6]]
        assert [r["len"] for r in ranks] == [6, 6]
        for epoch in range(2):
            seen = Counter(
                f for r in ranks for batch in r["seen"][6 * epoch : 6 * epoch + 6] for f in batch
            )
            assert seen == {f: 2 for f in range(21)}


# ---- DALI's iterators given size= (older DALI programs), and where warnings point ------------


def _sized(pipe, size: int, policy: LastBatchPolicy):
    return DALIGenericIterator(
        pipe, ["data", "label"], size=size, last_batch_policy=policy, auto_reset=True
    )


def _fill_steps(size: int, batch: int, epochs: int) -> list[int]:
    """DALI's count of FILL's batches per epoch with size= (and no last_batch_padded): each
    epoch starts at what the last one took beyond ``size`` (``counter % size``)."""
    counter, steps = 0, []
    for _ in range(epochs):
        steps.append(math.ceil((size - counter) / batch))
        counter = (counter + steps[-1] * batch) % size
    return steps


@pytest.mark.filterwarnings("ignore:Please set `reader_name`")  # DALI's, for any size=
@pytest.mark.parametrize("policy", [LBP.PARTIAL, LBP.FILL, LBP.DROP])
@pytest.mark.parametrize("batch", [4, 5])
@pytest.mark.parametrize("e", [1, 2])
@pytest.mark.parametrize(("n", "shards"), [(22, 3), (21, 2)])
def test_dalis_size_from_epoch_size_counts_whole_passes_as_plain_dali(
    jpegs, n, shards, e, batch, policy
) -> None:
    """An older DALI program: ``size=pipe.epoch_size("Reader") // num_shards`` and no
    reader_name, over the example's moving shards. Plain DALI's epoch_size is the largest
    shard's files times the shards, so each epoch is one padded reader epoch; the echoed
    pipeline reported its own pass as the whole data set, and the division made every epoch
    1/shards of a pass (e = 1: 5 samples where plain DALI hands out 11), a smaller shard's
    padding batches among them. Now: at e = 1 plain DALI's lengths, sizes and batch sizes; at
    e = 2 each epoch is one pass on every rank (PARTIAL: the largest shard's copies, each file
    twice over the ranks, the rest padding: e times plain DALI's)."""
    files, sizes = jpegs[:n], shard_sizes(n, shards)
    epochs, most = 3, e * max(sizes)
    shapes, runs = [], []
    for k in range(shards):
        plain = plain_pipe(files, k, shards, False, batch_size=batch, seed=3 + k)
        plain.build()
        plain_it = _sized(plain, plain.epoch_size("Reader") // shards, policy)
        plain_shape = _shape(plain_it, _run(plain_it, epochs))
        with echo_pipe(
            files, k, shards, False, batch_size=batch, echo_factor=e, seed=3 + k
        ) as pipe:
            pipe.build()
            assert pipe.epoch_size("Reader") == shards * most
            it = _sized(pipe, pipe.epoch_size("Reader") // shards, policy)
            runs.append(_run(it, epochs))
        shape = _shape(it, runs[-1])
        shapes.append(shape)
        if e == 1:
            assert shape == plain_shape
        assert shape[1] == most
        if policy == LBP.FILL:  # DALI's own count of FILL's epochs, as on a plain pipeline
            assert [len(epoch) for epoch in shape[2]] == _fill_steps(most, batch, epochs)
        elif policy == LBP.DROP:
            assert shape[2] == [[batch] * (most // batch)] * epochs
        else:
            assert [sum(epoch) for epoch in shape[2]] == [most] * epochs
            assert [len(epoch) for epoch in shape[2]] == [math.ceil(most / batch)] * epochs
    assert len(set(map(str, shapes))) == 1  # every rank: the same steps in every epoch
    for t in range(epochs if policy == LBP.PARTIAL else 0):
        together = Counter(f for run in runs for b in run[t] for f in b)
        assert set(together) == set(range(n)) and min(together.values()) == e


@pytest.mark.filterwarnings("ignore:Please set `reader_name`")
@pytest.mark.parametrize("e", [1, 2])
def test_dalis_size_of_a_plain_figure_is_warned_about_at_the_users_line(jpegs, e) -> None:
    """A size computed for plain DALI (the largest shard's files, 11 of 21 on 2 shards) counts
    half a pass at e = 2 (3 of 6 batches): the epochs cannot hold each file twice, whatever
    the pipeline does, so creating the iterator warns once, naming size= and what to pass,
    at this file's line; at e = 1 the stream is plain DALI's, and nothing is said."""
    pipe = echo_pipe(jpegs[:21], 0, 2, False, batch_size=4, echo_factor=e, seed=3)
    with pipe, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", edali.CountedSizeWarning)
        _run(_sized(pipe, 11, LBP.PARTIAL), 2)
    ours = [w for w in warned if issubclass(w.category, edali.CountedSizeWarning)]
    if e == 1:
        assert ours == []
        return
    (w,) = ours
    assert w.filename == __file__ and "\n" not in str(w.message)
    assert "DALIGenericIterator(" in linecache.getline(__file__, w.lineno)  # (in _sized)
    assert "size=11" in str(w.message) and "reader_name='Reader'" in str(w.message)
    assert "size=pipe.epoch_size('Reader') // 2 (= 22)" in str(w.message)


def test_untrimmed_padding_warning_points_at_the_users_line(jpegs) -> None:
    """22 files on 3 shards that stick (7, 7, 8), e = 2, batch 5: shard 0's 14 copies end two
    batches before the largest shard's 16, which DALI's PARTIAL cannot trim exactly; the
    warning named echopipe's own code (a fixed stacklevel) instead of the line that created
    the iterator."""
    pipe = echo_pipe(jpegs, 0, 3, True, batch_size=5, echo_factor=2, seed=3)
    with pipe, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", edali.UntrimmedPaddingWarning)
        DALIGenericIterator(pipe, ["d", "l"], reader_name="Reader", last_batch_policy=LBP.PARTIAL)
    (w,) = [w for w in warned if issubclass(w.category, edali.UntrimmedPaddingWarning)]
    assert w.filename == __file__
    assert "DALIGenericIterator(pipe, " in linecache.getline(__file__, w.lineno)
