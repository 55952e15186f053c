"""Batch echoing with a short last upstream batch takes the same steps in every pass.

A pass of ``mode="batch"`` hands out whole upstream batches (units), ``batch_size /
upstream_batch_size`` per downstream batch; the last unit of a shard's epoch is short. A batch
that drew the short unit used to take another unit into the room it left, so the steps of a
pass depended on which draws met the short unit (10 files in upstream batches of 4, batch 8,
e = 3: 4 or 5 steps by the seed, with ``len()`` 4), and the ranks of a DDP job could take
different steps. Now such a batch ends short: every pass takes ``ceil(unit copies / units per
batch)`` steps, which ``len()`` says. Real DALI pipelines over real JPEGs, many seeds, two
epochs each, every shard of a 2-shard reader.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import fn  # noqa: E402
from nvidia.dali.plugin.pytorch import LastBatchPolicy  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

FILES = 21
SEEDS = range(12)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return solid_jpegs(tmp_path_factory.mktemp("batch_echo"), FILES, lambda i: (8, 8),
                       lambda i: 10 * i)  # fmt: skip


@edali.echo_pipeline_def(num_threads=1, device_id=None)
def echo_pipe(files: list[str], shard_id: int, num_shards: int):  # type: ignore[no-untyped-def]
    jpegs, labels = fn.readers.file(
        files=files, labels=list(range(len(files))), shard_id=shard_id, num_shards=num_shards,
        random_shuffle=True, pad_last_batch=True, stick_to_shard=True, name="Reader",
    )  # fmt: skip
    images, labels = edali.echo(fn.decoders.image(jpegs), labels)
    return images, labels


@pytest.mark.parametrize("policy", [LastBatchPolicy.PARTIAL, LastBatchPolicy.DROP])
@pytest.mark.parametrize(
    ("shards", "up", "batch", "e"),
    [(1, 4, 8, 2.0), (1, 4, 8, 3.0), (1, 4, 12, 3.0), (1, 4, 8, 2.5), (2, 4, 8, 3.0)],
)
def test_every_pass_takes_len_steps_whatever_the_draws(
    files: list[str], shards: int, up: int, batch: int, e: float, policy: LastBatchPolicy
) -> None:
    """21 files (one shard, or 10 and 11 on two): over 12 seeds and two epochs, every pass
    takes exactly ``len()`` steps, the same for every seed and on every shard, each file is
    delivered floor(e) or ceil(e) times. Under DROP every pass keeps the fewest full batches
    any draw leaves (each copy of the short unit in a batch of its own), all of them full."""
    per_batch = batch // up
    sizes = [(k + 1) * FILES // shards - k * FILES // shards for k in range(shards)]
    units = max(math.ceil(n / up) for n in sizes)  # the largest shard's units
    whole = math.floor(e)
    copies = whole * units + math.floor((e - whole) * units + 0.5)  # the cache's unit tickets
    want = math.ceil(copies / per_batch)
    if policy == LastBatchPolicy.DROP:
        want = copies // per_batch - math.ceil(e)  # (every shard here has a short last unit)
    steps = set()
    for shard in range(shards):
        for seed in SEEDS:
            pipe = echo_pipe(files, shard, shards, batch_size=batch, upstream_batch_size=up,
                             echo_factor=e, mode="batch", seed=seed)  # fmt: skip
            with pipe:
                it = edali.EchoIterator(pipe, reader_name="Reader", auto_reset=True,
                                        last_batch_policy=policy)  # fmt: skip
                for _ in range(2):
                    told = len(it)
                    labels = [b[0]["label"].reshape(-1).tolist() for b in it]
                    steps.add((told, len(labels)))
                    got = Counter(x for b in labels for x in b)
                    if policy == LastBatchPolicy.DROP:
                        assert all(len(b) == batch for b in labels)
                        continue
                    assert len(got) == sizes[shard]
                    assert set(got.values()) <= {whole, math.ceil(e)}
    assert steps == {(want, want)}, (steps, want)
