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
import math
import os
import socket
import subprocess
import sys
import warnings
from collections import Counter
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
    python_dir = Path(__file__).resolve().parent.parent / "python"
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
