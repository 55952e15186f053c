"""An echoed DALI pipeline as a Lightning ``train_dataloader()``: real ``Trainer.fit`` on CPU.

The program (tests/pipeline_support/dali_lightning_program.py) reads 24 flat-grey JPEGs with a
padded, sharded reader, echoes them twice (e = 2) and validates with the same function without
the echo point under DALI's iterator. Each test counts, by content, what every epoch trained on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
import torch

pytest.importorskip("nvidia.dali")
lightning = pytest.importorskip("lightning")
pytestmark = [
    pytest.mark.dali,
    # Lightning 2.6 uses torch's pytree LeafSpec, which torch 2.13 deprecates: theirs, not ours.
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),  # (no callbacks)
]

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from nvidia.dali.plugin.pytorch import LastBatchPolicy  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from pipeline_support.dali_lightning_program import (  # noqa: E402
    CloseOnException,
    EchoedFit,
    create_pipeline,
    greys,
    identify,
    make_jpegs,
    trainer,
)
from pipeline_support.train_runs import run_own_group  # noqa: E402

PROGRAM = Path(__file__).parent / "pipeline_support" / "dali_lightning_program.py"
STEPS = 12  # 24 files, e = 2, batches of 4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple[str, int]]]:
    root = tmp_path_factory.mktemp("dali_lightning")
    return str(root), make_jpegs(root)


def _per_epoch(batches, files) -> dict[int, Counter]:
    """Copies of each file per epoch, checking that every label travelled with its image."""
    counts: dict[int, Counter] = {}
    for epoch, _, samples in batches:
        for grey, label in samples:
            assert files[grey][1] == label
            counts.setdefault(epoch, Counter())[grey] += 1
    return counts


@pytest.mark.parametrize("iterator", ["dali", "echo"])
def test_fit_runs_each_epoch_with_each_file_twice(data, iterator: str) -> None:
    """Lightning reads len() and takes exactly that many batches, never the one that would end
    the epoch: EchoIterator's next iter() must still start the next epoch (it gave none)."""
    root, files = data
    module = EchoedFit(root, iterator)
    fit = trainer()
    fit.fit(module)
    module.close()
    assert module.lengths == [STEPS, STEPS] and fit.global_step == 2 * STEPS
    train = greys(files, "train")
    assert _per_epoch(module.batches, files) == {0: dict.fromkeys(train, 2),
                                                 1: dict.fromkeys(train, 2)}  # fmt: skip
    val = greys(files, "val")
    validated = {e: dict(c) for e, c in module.validated.items()}
    assert validated == {0: dict.fromkeys(val, 1), 1: dict.fromkeys(val, 1)}


def test_loops_that_stop_at_len_or_iterate_again_get_whole_epochs(data) -> None:
    """Without Lightning: ``islice(it, len(it))`` (DROP, 48 copies in batches of 5: 9 steps,
    3 copies dropped each epoch) and a second ``for`` without auto_reset, as DALI's iterators
    allow; both gave an empty epoch after each full one."""
    root, files = data
    train = greys(files, "train")
    kw = dict(num_threads=1, device_id=None, seed=3, shard_id=0, num_shards=1,
              data_dir=os.path.join(root, "train"))  # fmt: skip
    with create_pipeline(batch_size=5, **kw) as pipe:
        it = edali.EchoIterator(pipe, reader_name="Reader", auto_reset=True,
                                last_batch_policy=LastBatchPolicy.DROP)  # fmt: skip
        assert len(it) == 9
        for epoch in range(3):
            got = Counter(g for b in islice(it, len(it)) for g in identify(b[0]["data"]))
            assert got.total() == 45 and set(got) <= train and set(got.values()) <= {1, 2}
            assert it.stats.epochs == epoch and it.stats.dropped == 3 * epoch
    with create_pipeline(batch_size=4, **kw) as pipe:
        it = edali.EchoIterator(pipe, reader_name="Reader")  # auto_reset=False
        for _ in range(2):
            assert Counter(g for b in it for g in identify(b[0]["data"])) == dict.fromkeys(train, 2)


def test_resumed_fits_continue_their_epoch_exactly(data, tmp_path: Path) -> None:
    """Lightning saves EchoIterator's state in every checkpoint and loads it with
    ``torch.load(weights_only=True)``; resumed mid-epoch, at an epoch's last batch or from the
    epoch-end checkpoint, the two runs together train each file twice per epoch."""
    root, files = data
    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1,
                                 filename="{step}")  # fmt: skip
    at_end = ModelCheckpoint(dirpath=tmp_path, save_on_train_epoch_end=True, save_top_k=-1,
                             filename="end-{epoch}")  # fmt: skip
    first = EchoedFit(root, enable_checkpointing=True)
    saving = trainer(callbacks=[every_step, at_end], enable_checkpointing=True, limit_val_batches=0)
    saving.fit(first)
    first.close()
    for step in range(1, 2 * STEPS + 1):  # the prepared batches it holds were numpy before
        state = torch.load(tmp_path / f"step={step}.ckpt", weights_only=True)
        assert len(state["loops"]["fit_loop"]["state_dict"]["combined_loader"]) == 1
    train = greys(files, "train")
    for name, done in (("step=5", 5), ("step=12", 12), ("end-epoch=0", 12), ("step=18", 18)):
        resumed = EchoedFit(root, enable_checkpointing=True)
        again = trainer(limit_val_batches=0)
        again.fit(resumed, ckpt_path=tmp_path / f"{name}.ckpt")
        resumed.close()
        assert again.global_step == 2 * STEPS, name
        assert resumed.batches[0][:2] == (done // STEPS, done % STEPS), name
        assert _per_epoch(first.batches[:done] + resumed.batches, files) == {
            0: dict.fromkeys(train, 2), 1: dict.fromkeys(train, 2)
        }, name  # fmt: skip


@pytest.mark.parametrize("where", ["on_exception", "on_train_end"])
def test_closing_the_pipeline_in_a_hook_leaves_fit_alone(data, where: str) -> None:
    """Lightning's teardown reads the loader's len() after on_exception and on_train_end, the
    natural hooks to close the pipeline in; it raised 'closed' over the user's own error, or
    over a finished fit."""
    root, _ = data

    class CloseAtEnd(lightning.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            pl_module.close()

    stop = (0, 2, ValueError("the user's error")) if where == "on_exception" else None
    module = EchoedFit(root, stop=stop)
    fit = trainer(callbacks=[CloseOnException() if stop else CloseAtEnd()])
    if stop is None:
        fit.fit(module)
        assert fit.global_step == 2 * STEPS
    else:
        with pytest.raises(ValueError, match="the user's error"):
            fit.fit(module)
    assert all(not pipe.upstream_alive for pipe in module.pipes if hasattr(pipe, "upstream_alive"))


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """The program in its own process group, killed whole (Lightning's rank 1 too) on a hang."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return run_own_group([sys.executable, str(PROGRAM), *args], env, timeout_s, " ".join(args))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["error", "interrupt"])
def test_an_interrupted_fit_exits(data, tmp_path: Path, mode: str) -> None:
    """An exception or KeyboardInterrupt in training_step: the process ends (the echo cache
    and DALI's threads do not hold it), with the error, although nothing closed the pipeline."""
    out = tmp_path / "raised"
    done = _run([mode, data[0], str(out), "echo"], timeout_s=240)
    assert done.returncode != 0
    assert out.read_text() == ("RuntimeError" if mode == "error" else "SystemExit")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("iterator", ["dali", "echo"])
def test_ddp_ranks_take_equal_steps_over_their_shards(data, tmp_path: Path, iterator) -> None:
    """strategy="ddp", 2 CPU processes: each rank its half (shard_id=global_rank), 6 steps per
    epoch on both, each of its files twice; the halves are disjoint and cover the data."""
    root, files = data
    out = tmp_path / "rank"
    done = _run(["ddp", root, str(out), iterator], timeout_s=400)
    assert done.returncode == 0, done.stdout[-3000:]
    train, val = greys(files, "train"), greys(files, "val")
    for epoch in (0, 1):
        halves = []
        for rank in (0, 1):
            report = json.loads(Path(f"{out}.{rank}").read_text())
            assert report["lengths"] == [STEPS // 2, STEPS // 2]
            counts = _per_epoch([b for b in report["batches"] if b[0] == epoch], files)[epoch]
            assert set(counts.values()) == {2} and len(counts) == len(train) // 2
            halves.append(set(counts))
            assert len(report["validated"][str(epoch)]) == len(val) // 2
        assert halves[0] | halves[1] == train and not halves[0] & halves[1]
