"""More of Lightning's ``Trainer`` over an echoed DALI pipeline (``EchoIterator``), on CPU.

The program is tests/pipeline_support/dali_lightning_program.py: 24 flat-grey training JPEGs
(each names its file by content) echoed twice (e = 2) in batches of 4, so a pass is 12 steps;
validation runs the same function without the echo point under DALI's own iterator. Covered:
validation inside the epoch, gradient accumulation, ``limit_train_batches`` with a ``max_steps``
stop and a resume from ``last.ckpt``, two fits over one DataModule, ``validate`` / ``test`` /
``predict`` given the echo iterator, the loaders rebuilt every epoch, and ``set_echo_factor``
from a callback.
"""

from __future__ import annotations

import gc
import os
import threading
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("nvidia.dali")
lightning = pytest.importorskip("lightning")
pytestmark = [
    pytest.mark.dali,
    # Lightning 2.6 uses torch's pytree LeafSpec, which torch 2.13 deprecates: theirs, not ours.
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
]

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from echopipe.dali import EchoedEvaluationWarning, EpochContinuedWarning  # noqa: E402
from pipeline_support.dali_lightning_program import (  # noqa: E402
    EchoedFit,
    greys,
    identify,
    make_jpegs,
    trainer,
)

STEPS = 12  # 24 files, e = 2, batches of 4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple[str, int]]]:
    root = tmp_path_factory.mktemp("dali_lightning3")
    return str(root), make_jpegs(root)


def _per_epoch(batches) -> dict[int, dict[int, int]]:
    counts: dict[int, Counter] = {}
    for epoch, _, samples in batches:
        counts.setdefault(epoch, Counter()).update(g for g, _ in samples)
    return {e: dict(c) for e, c in counts.items()}


def _passes(batches, steps: int = STEPS) -> list[dict[int, int]]:
    """Copies of each file in each run of ``steps`` consecutive batches (one pass each)."""
    return [
        dict(Counter(g for _, _, samples in batches[k : k + steps] for g, _ in samples))
        for k in range(0, len(batches), steps)
    ]


class KeptIterator(EchoedFit):
    """``train_dataloader()`` makes the iterator once and returns it again (a DataModule's
    way, and the one for ``reload_dataloaders_every_n_epochs`` to read a new ``len()``)."""

    iterator_kept = None

    def train_dataloader(self):
        if self.iterator_kept is None:
            self.iterator_kept = super().train_dataloader()
        return self.iterator_kept


def test_validation_at_half_epochs_every_second_epoch(data) -> None:
    """val_check_interval=0.5 with check_val_every_n_epoch=2: DALI's val iterator runs at
    steps 6 and 12 of epochs 1 and 3 while the echo pass is half drawn; training is unchanged."""
    root, files = data

    class Where(EchoedFit):
        def on_validation_start(self) -> None:
            self.where = [*getattr(self, "where", []), (self.current_epoch, len(self.batches))]

    module = Where(root)
    trainer(max_epochs=4, val_check_interval=0.5, check_val_every_n_epoch=2).fit(module)
    module.close()
    train, val = greys(files, "train"), greys(files, "val")
    assert _per_epoch(module.batches) == {e: dict.fromkeys(train, 2) for e in range(4)}
    assert module.where == [(1, 18), (1, 24), (3, 42), (3, 48)]
    assert {e: dict(c) for e, c in module.validated.items()} == {
        1: dict.fromkeys(val, 2), 3: dict.fromkeys(val, 2)
    }  # fmt: skip


def test_accumulating_3_batches_over_an_epoch_of_11(tmp_path: Path) -> None:
    """22 files at e = 2: 11 batches, the last optimizer step of an epoch takes 2 batches."""
    files = make_jpegs(tmp_path, train=22, val=0)
    module = EchoedFit(str(tmp_path))
    fit = trainer(accumulate_grad_batches=3, limit_val_batches=0)
    fit.fit(module)
    module.close()
    assert module.lengths == [11, 11] and fit.global_step == 2 * 4
    assert _per_epoch(module.batches) == {e: dict.fromkeys(files, 2) for e in (0, 1)}


@pytest.mark.parametrize(("limit", "stop"), [(1.0, 18), (0.5, 9), (5, 7)])
def test_limited_epochs_stopped_by_max_steps_resume_from_last_as_one_run(
    data, tmp_path: Path, limit, stop: int
) -> None:
    """limit_train_batches stops each epoch early; the next iter() goes on with the pass, as
    DALI's iterators do (epochs of 5, 5, 2 steps for limit 5, as docs/dali.md says). A fit
    stopped by max_steps inside an epoch and resumed from last.ckpt takes the uninterrupted
    run's epochs and batch indices, each pass every file twice, and nothing warns."""
    root, files = data
    kw = dict(limit_train_batches=limit, limit_val_batches=0, enable_checkpointing=True,
              max_epochs=-1)  # fmt: skip
    runs = []
    for steps, ckpt in ((24, None), (stop, None), (24, "last")):
        module = EchoedFit(root, enable_checkpointing=True)
        saving = ModelCheckpoint(dirpath=tmp_path, save_last=True)
        trainer(max_steps=steps, callbacks=[saving], **kw).fit(module, ckpt_path=ckpt)
        module.close()
        runs.append(module.batches)
    full, first, resumed = runs
    assert resumed[0][:2] == full[stop][:2]  # Lightning resumed inside an epoch
    assert [b[:2] for b in first + resumed] == [b[:2] for b in full]
    train = greys(files, "train")
    assert _passes(first + resumed) == _passes(full) == [dict.fromkeys(train, 2)] * 2
    if limit == 5:
        assert [sum(1 for b in full if b[0] == e) for e in range(6)] == [5, 5, 2, 5, 5, 2]


def test_fit_twice_over_one_datamodule_iterator(data) -> None:
    """A DataModule that keeps its EchoIterator: a second Trainer's fit starts a new pass and
    trains each file twice per epoch again; the same Trainer's fit again trains nothing."""
    root, files = data

    class Data(lightning.LightningDataModule):
        def __init__(self, module: KeptIterator) -> None:
            super().__init__()
            self.module = module

        def train_dataloader(self):
            return self.module.train_dataloader()

        def val_dataloader(self):
            return self.module.val_dataloader()

    module = KeptIterator(root)
    datamodule = Data(module)
    train = greys(files, "train")
    for run in range(2):
        fit = trainer(limit_val_batches=0)
        fit.fit(module, datamodule=datamodule)
        assert _per_epoch(module.batches[run * 2 * STEPS :]) == {
            e: dict.fromkeys(train, 2) for e in (0, 1)
        }  # fmt: skip
    fit.fit(module, datamodule=datamodule)
    assert len(module.batches) == 4 * STEPS
    module.close()


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluating_on_an_echo_iterator_warns_in_one_line(data, stage: str) -> None:
    """Lightning evaluates under inference_mode whatever it is given: each file twice at e = 2
    (and predict returns it twice), before silently, now with an EchoedEvaluationWarning."""
    root, files = data

    class Evaluated(EchoedFit):
        def _echoing(self):
            return self.train_dataloader()

        val_dataloader = test_dataloader = predict_dataloader = _echoing

        def validation_step(self, batch, batch_idx) -> None:
            self.validated[0].update(identify(batch[0]["data"]))

        test_step = validation_step

        def predict_step(self, batch, batch_idx):
            self.validation_step(batch, batch_idx)
            return batch_idx

    module = Evaluated(root)
    with pytest.warns(EchoedEvaluationWarning, match="gradients off") as caught:
        getattr(trainer(), stage)(module)
    module.close()
    ours = [str(w.message) for w in caught if w.category is EchoedEvaluationWarning]
    assert len(ours) == 1 and "\n" not in ours[0]
    assert dict(module.validated[0]) == dict.fromkeys(greys(files, "train"), 2)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _our_shm() -> list[str]:
    """Shared-memory names of echopipe's (other processes of the machine have theirs)."""
    return sorted(n for n in os.listdir("/dev/shm") if "echopipe" in n or str(os.getpid()) in n)


def _upstreams() -> int:
    return sum(t.name.startswith("echopipe-upstream") for t in threading.enumerate())


def test_an_iterator_rebuilt_every_epoch_leaks_nothing(data) -> None:
    """reload_dataloaders_every_n_epochs=1 with a new pipeline each epoch that nothing closes:
    at each epoch's end one upstream thread runs (there were 1, 2, 3, 4: each dropped pipeline
    kept its thread and cache until the cyclic collector ran), and after the fit the threads,
    open files and shared memory are what they were before it."""
    root, files = data

    class Rebuilt(EchoedFit):
        def _pipe(self, split: str, is_training: bool):
            pipe = super()._pipe(split, is_training)
            self.pipes.clear()  # the module keeps none: Lightning's reference is the last
            return pipe

    class Count(lightning.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            # No gc.collect(): a dropped pipeline closes at once (it waited for the collector).
            pl_module.upstreams = [*getattr(pl_module, "upstreams", []), _upstreams()]

    def fit(epochs: int) -> Rebuilt:
        module = Rebuilt(root)
        trainer(max_epochs=epochs, reload_dataloaders_every_n_epochs=1, limit_val_batches=0,
                callbacks=[Count()]).fit(module)  # fmt: skip
        return module

    fit(1)  # DALI's and torch's own threads and libraries, loaded once
    gc.collect()
    before = (threading.active_count(), _fds(), _our_shm())
    module = fit(4)
    assert module.upstreams == [1, 1, 1, 1]
    train = greys(files, "train")
    assert _per_epoch(module.batches) == {e: dict.fromkeys(train, 2) for e in range(4)}
    del module
    gc.collect()
    assert (threading.active_count(), _fds(), _our_shm()) == before


def test_a_factor_raised_in_on_train_epoch_start_is_named(data) -> None:
    """Lightning reads len() once per fit (num_training_batches), before on_train_epoch_start:
    set_echo_factor(3) there gives a pass of 18 steps of which Lightning takes 12, and the next
    epoch takes the other 6. Each pass still trains each file 3 times; the next iter() names
    the cause and the way out (before, silently)."""
    root, files = data

    class Raise(lightning.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 1:
                pl_module.iterator_kept.pipeline.set_echo_factor(3)

    module = KeptIterator(root)
    with pytest.warns(EpochContinuedWarning, match="reload_dataloaders_every_n_epochs=1"):
        trainer(max_epochs=3, limit_val_batches=0, callbacks=[Raise()]).fit(module)
    module.close()
    train = greys(files, "train")
    assert [sum(1 for b in module.batches if b[0] == e) for e in range(3)] == [12, 12, 6]
    assert _passes(module.batches[STEPS:], 18) == [dict.fromkeys(train, 3)]


def test_a_factor_set_at_the_epochs_end_with_reloading_gives_whole_epochs(data) -> None:
    """The way docs/dali.md gives: set_echo_factor in on_train_epoch_end and
    reload_dataloaders_every_n_epochs=1 (the same iterator returned): 12, 18, 18 steps, each
    file 2, 3, 3 times, and no warning."""
    root, files = data

    class Raise(lightning.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 0:
                pl_module.iterator_kept.pipeline.set_echo_factor(3)

    module = KeptIterator(root)
    fit = trainer(max_epochs=3, limit_val_batches=0, reload_dataloaders_every_n_epochs=1,
                  callbacks=[Raise()])  # fmt: skip
    fit.fit(module)
    module.close()
    assert module.lengths == [12, 18, 18] and fit.global_step == 48
    train = greys(files, "train")
    assert _per_epoch(module.batches) == {
        0: dict.fromkeys(train, 2), 1: dict.fromkeys(train, 3), 2: dict.fromkeys(train, 3)
    }  # fmt: skip
