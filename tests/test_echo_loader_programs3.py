"""More programs around EchoLoader, as users write them: a shuffling DataLoader seeded with
``generator=`` resumed mid-epoch (plain PyTorch and Lightning's ``max_steps`` then
``fit(ckpt_path="last")``), an unseeded one resumed, and an EchoLoader handed to Lightning's
``validate``/``test``/``predict``. Samples are identified by value."""

from __future__ import annotations

import collections
import dataclasses
import math
import multiprocessing
import threading
import time
import warnings

import lightning  # in the test extra: a missing Lightning fails here rather than skipping
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from echopipe.echo import CacheTooSmallError, EchoCacheError
from echopipe.torch import EchoLoader
from echopipe.torch.loader_state import LoaderStateError

# Lightning 2.6 uses torch's pytree LeafSpec, which torch 2.13 deprecates: theirs, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning")


class Ids(Dataset):
    """Sample i is a row of 4 values i, its label i % 3."""

    def __init__(self, n: int = 45) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), i % 3


def _shuffled(workers: int, seed: int | None = 7, persistent: bool = False) -> DataLoader:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return DataLoader(Ids(), batch_size=6, shuffle=True, generator=gen, num_workers=workers,
                      persistent_workers=persistent, timeout=60 if workers else 0)  # fmt: skip


def _ids(batch) -> list[int]:
    return [int(v) for v in batch[0][:, 0]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_seeded_shuffle_resumed_mid_epoch_delivers_each_sample_e_times(workers) -> None:
    """The resumed process's generator starts at its seed, i.e. at epoch 0's order: re-reading
    epoch 1 in that order skipped other batches than the ones read (7 to 11 of 45 samples
    missed, as many 4 times, before the generators' states went into the state)."""
    first = EchoLoader(_shuffled(workers), echo_factor=2.0, seed=1)
    seen: collections.Counter = collections.Counter()
    with first:
        assert sum(1 for _ in first) == 15  # epoch 0
        for i, batch in enumerate(first):
            seen.update(_ids(batch))
            if i == 6:
                state = first.state_dict()
                break
    with EchoLoader(_shuffled(workers), echo_factor=2.0, seed=1) as resumed:
        resumed.load_state_dict(state)
        for batch in resumed:
            seen.update(_ids(batch))
    assert sorted(seen) == list(range(45)) and set(seen.values()) == {2}
    # the generator went on from the restored epoch, as an uninterrupted run's after 2 epochs
    plain = _shuffled(workers)
    for _ in range(2):
        assert sum(1 for _ in plain) == 8
    assert torch.equal(resumed.generator.get_state(), plain.generator.get_state())


def test_a_seeded_shuffle_with_persistent_workers_resumed_mid_epoch_rereads_its_order() -> None:
    """A persistent DataLoader draws its workers' base seed from the generator its sampler
    shares in its first pass only: a fresh process resuming epoch 1 made a new iterator, whose
    base seed took the restored state's first draw, and re-read another order (9 of 45 samples
    missed, 9 delivered 4 times). The other way round, a state of a first pass loaded where the
    DataLoader's iterator lives on (the same DataLoader, a later EchoLoader) missed the draw."""
    seen: collections.Counter = collections.Counter()
    with EchoLoader(_shuffled(2, persistent=True), echo_factor=2.0, seed=1) as first:
        assert sum(1 for _ in first) == 15  # epoch 0
        for i, batch in enumerate(first):
            seen.update(_ids(batch))
            if i == 6:
                state = first.state_dict()
                break
    assert state["order_new"] is False
    with EchoLoader(_shuffled(2, persistent=True), echo_factor=2.0, seed=1) as resumed:
        resumed.load_state_dict(state)
        for batch in resumed:
            seen.update(_ids(batch))
    assert sorted(seen) == list(range(45)) and set(seen.values()) == {2}
    plain = _shuffled(2, persistent=True)  # the generator went on as an uninterrupted run's
    for _ in range(2):
        assert sum(1 for _ in plain) == 8
    assert torch.equal(resumed.generator.get_state(), plain.generator.get_state())

    kept = _shuffled(2, persistent=True)  # one DataLoader, its workers kept across EchoLoaders
    seen.clear()
    first = EchoLoader(kept, echo_factor=2.0, seed=1)
    for i, batch in enumerate(first):
        seen.update(_ids(batch))
        if i == 6:
            state = first.state_dict()
            break
    assert state["order_new"] is True
    resumed = EchoLoader(kept, echo_factor=2.0, seed=1)
    resumed.load_state_dict(state)
    with resumed:
        for batch in resumed:
            seen.update(_ids(batch))
    assert sorted(seen) == list(range(45)) and set(seen.values()) == {2}


def test_a_saved_order_that_does_not_fit_the_loader_is_refused() -> None:
    with EchoLoader(_shuffled(0), echo_factor=2.0) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    plain = DataLoader(Ids(), batch_size=6)  # no generator to restore the order into
    with pytest.raises(LoaderStateError, match="order_rng"):
        EchoLoader(plain, echo_factor=2.0).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="order_rng"):
        EchoLoader(_shuffled(0)).load_state_dict({**state, "order_rng": [b"\0" * 7]})


def test_an_unseeded_shuffle_resumed_mid_epoch_warns_that_it_cannot_reread_the_order() -> None:
    with EchoLoader(_shuffled(0, seed=None), echo_factor=2.0) as loader:
        it = iter(loader)
        for _ in range(4):
            next(it)
        state = loader.state_dict()
    with pytest.warns(RuntimeWarning, match="generator=torch.Generator"):
        EchoLoader(_shuffled(0, seed=None), echo_factor=2.0).load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a seeded one re-reads its order: nothing to say
        EchoLoader(_shuffled(0), echo_factor=2.0).load_state_dict(state | {"order_rng": None})


class Module(lightning.LightningModule):
    """Counts the samples each epoch trains on; a seeded shuffling loader with workers."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.evaluated: collections.Counter = collections.Counter()
        self.loaders: list[EchoLoader] = []

    def train_dataloader(self) -> EchoLoader:
        self.loaders.append(EchoLoader(_shuffled(2), echo_factor=2.0))
        return self.loaders[-1]

    def training_step(self, batch, batch_idx):
        self.seen[self.current_epoch].update(_ids(batch))
        return nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Evaluated(Module):
    """Counts the samples its evaluation steps see."""

    def validation_step(self, batch, batch_idx) -> None:
        self.evaluated.update(_ids(batch))

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        self.evaluated.update(_ids(batch))
        return batch[0]


def _trainer(**kw) -> lightning.Trainer:
    return lightning.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, **kw,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_lightning_max_steps_mid_epoch_then_fit_from_last_trains_each_sample_e_times(
    tmp_path,
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def saving() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path, save_last=True)

    first = Module()
    _trainer(max_steps=20, callbacks=[saving()]).fit(first)  # 15 steps an epoch: 5 into epoch 1
    resumed = Module()
    again = _trainer(max_steps=30, callbacks=[saving()])
    again.fit(resumed, ckpt_path="last")
    assert again.global_step == 30 and set(resumed.seen) == {1}
    epoch1 = first.seen[1] + resumed.seen[1]
    assert sorted(epoch1) == list(range(45)) and set(epoch1.values()) == {2}
    for module in (first, resumed):
        for loader in module.loaders:
            loader.close()


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_lightning_evaluating_on_an_echoloader_warns_that_each_sample_counts_e_times(stage):
    """Lightning evaluates whatever loader it is given: every sample twice at e = 2, silently,
    before the warning."""
    module = Evaluated()
    loader = EchoLoader(DataLoader(Ids(12), batch_size=4), echo_factor=2.0)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False,
                                enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with loader, pytest.warns(RuntimeWarning, match="gradients off"):
        getattr(trainer, stage)(module, dataloaders=loader)
    assert module.evaluated == dict.fromkeys(range(12), 2)


def test_training_and_e_1_evaluation_do_not_warn(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        module = Module()
        _trainer(max_epochs=1, default_root_dir=tmp_path).fit(module)
        module.loaders[0].close()
        loader = EchoLoader(DataLoader(Ids(12), batch_size=4), echo_factor=1.0)
        with loader, torch.no_grad():
            assert sum(len(b[0]) for b in loader) == 12
    assert sum(module.seen[0].values()) == 2 * 45


class Slow(Dataset):
    """Sample i: a row of 2 values i and its file name; sleeps ``delay`` s per sample."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay)  # another pace for the reader: the batches must not change
        return {"x": torch.full((2,), float(i)), "name": f"img_{i}.jpg"}


def _run(workers: int, delay: float, e: float, drop_last: bool) -> list[list[tuple[str, ...]]]:
    data = DataLoader(Slow(40, delay), batch_size=6, shuffle=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(5), drop_last=drop_last)  # fmt: skip
    epochs = []
    with EchoLoader(data, echo_factor=e, seed=9, deterministic=True) as loader:
        for _ in range(2):
            names = []
            for batch in loader:
                assert batch["name"] == [f"img_{int(v)}.jpg" for v in batch["x"][:, 0]]
                names.append(tuple(batch["name"]))
                time.sleep(delay)
            epochs.append(names)
    return epochs


@pytest.mark.parametrize(("e", "drop_last"), [(2.0, False), (1.5, True)])
def test_deterministic_runs_give_the_same_batches_whatever_the_workers_and_pace(e, drop_last):
    """Without ``deterministic`` the draws depend on how far the reader thread got, and two
    runs with the same seeds gave other batch sequences (every time, at 45 samples)."""
    first = _run(0, 0.0, e, drop_last)
    assert first == _run(2, 0.002, e, drop_last) == _run(0, 0.001, e, drop_last)
    assert first[0] != first[1]  # epochs differ: the generator and the draws go on
    copies = collections.Counter(n for batch in first[0] for n in batch)
    assert set(copies.values()) <= {math.floor(e), math.ceil(e)}


def test_deterministic_needs_a_fixed_factor() -> None:
    with pytest.raises(ValueError, match="fixed echo_factor"):
        EchoLoader(DataLoader(Ids()), echo_factor="auto", deterministic=True)
    with pytest.raises(TypeError, match="deterministic"):
        EchoLoader(DataLoader(Ids()), deterministic="yes")


def test_a_deterministic_cache_too_small_in_bytes_for_a_draw_is_named() -> None:
    """About 4 samples of 4 KB fit in 20 kB: a free-running loader takes short parts while its
    reader waits, a deterministic one would wait for a fill that cannot come."""
    data = DataLoader(TensorDataset(torch.zeros(45, 1000)), batch_size=6)
    loader = EchoLoader(data, deterministic=True, capacity_bytes=20000, shuffle_buffer=12)
    with loader, pytest.raises(CacheTooSmallError, match="capacity_bytes") as refused:
        next(iter(loader))
    assert not [t for t in threading.enumerate() if t.name.startswith("echopipe-echoloader")]
    small = refused.value
    assert isinstance(small, EchoCacheError)  # one class with a DALI pipeline's refusal
    assert small.wanted == 6 and small.resident < 6 and small.need_bytes > 20000
    # The size it names is enough: the same loader with it draws its first batch.
    roomy = EchoLoader(data, deterministic=True, capacity_bytes=small.need_bytes, shuffle_buffer=12)
    with roomy:
        (first,) = next(iter(roomy))
    assert first.shape == (6, 1000)


class Encoding(collections.UserDict):
    """Shaped like Hugging Face's ``BatchEncoding`` (a ``UserDict``, not a dict), which a
    ``DataCollatorWithPadding`` returns and training loops move with ``batch.to(device)``."""

    def __getattr__(self, name: str):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device: str) -> Encoding:
        return Encoding({k: v.to(device) if torch.is_tensor(v) else v for k, v in self.items()})


@pytest.mark.parametrize("names", [False, True])  # the direct take path, and the decoding one
def test_a_batchencoding_like_mapping_comes_back_as_its_own_class(names) -> None:
    """It came back as a plain dict: ``batch.to(device)`` raised AttributeError."""

    def collate(items) -> Encoding:
        out = Encoding(input_ids=torch.stack([x for x, _ in items]),
                       labels=torch.tensor([y for _, y in items]))  # fmt: skip
        if names:
            out["names"] = [f"s{int(x[0])}" for x, _ in items]
        return out

    model = nn.Linear(4, 3)
    data = DataLoader(Ids(20), batch_size=4, shuffle=True, collate_fn=collate)
    seen: collections.Counter = collections.Counter()
    with EchoLoader(data, echo_factor=2.0) as loader:
        for batch in loader:
            batch = batch.to("cpu")
            assert type(batch) is Encoding and torch.equal(batch.labels, batch.input_ids[:, 0] % 3)
            nn.functional.cross_entropy(model(batch.input_ids), batch.labels).backward()
            seen.update(int(v) for v in batch["input_ids"][:, 0])
    assert seen == dict.fromkeys(range(20), 2)


def test_the_train_echoloader_also_given_as_the_validation_loader_is_named(tmp_path) -> None:
    """Lightning's mid-epoch validation (``val_check_interval=0.5``) calls ``iter()`` on the
    loader the training epoch still reads: a DataLoader runs two iterators side by side, an
    EchoLoader one epoch at a time, and the training iterator failed with "replaced by a newer
    one", which did not say why."""

    class SameForValidation(Evaluated):
        def val_dataloader(self) -> EchoLoader:
            return self.train_dataloader()  # Lightning asks for it after train_dataloader

        def train_dataloader(self) -> EchoLoader:
            if not self.loaders:
                self.loaders.append(EchoLoader(_shuffled(0), echo_factor=2.0))
            return self.loaders[-1]

    module = SameForValidation()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, max_epochs=1, val_check_interval=0.5,
        num_sanity_val_steps=0, default_root_dir=tmp_path,
    )  # fmt: skip
    raised = pytest.raises(RuntimeError, match="Is it also the validation loader")
    with raised, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a shuffling validation loader, an echoing evaluation
        trainer.fit(module)
    module.loaders[0].close()


@dataclasses.dataclass(frozen=True)
class Batch:
    """A collate_fn's dataclass batch; ``rows`` is computed, not taken by ``__init__``."""

    images: torch.Tensor
    labels: torch.Tensor
    names: list[str]
    rows: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", len(self.labels))


def test_a_collate_fn_returning_a_dataclass_is_echoed_into_that_dataclass() -> None:
    """It was refused (``LayoutError``: "field batch is a Batch"), where a DataLoader and
    Lightning's ``apply_to_collection`` take dataclass batches."""

    def collate(items) -> Batch:
        images = torch.stack([x for x, _ in items])
        return Batch(images, torch.tensor([y for _, y in items]),
                     [f"s{int(x[0])}" for x, _ in items])  # fmt: skip

    data = DataLoader(Ids(21), batch_size=4, num_workers=2, collate_fn=collate)
    seen: collections.Counter = collections.Counter()
    with EchoLoader(data, echo_factor=1.5) as loader:
        for batch in loader:
            assert type(batch) is Batch and batch.rows == len(batch.images)
            assert batch.names == [f"s{int(v)}" for v in batch.images[:, 0]]
            assert torch.equal(batch.labels, batch.images[:, 0].long() % 3)
            seen.update(int(v) for v in batch.images[:, 0])
    assert sorted(seen) == list(range(21)) and sum(seen.values()) == 32  # 1.5 * 21, rounded


@dataclasses.dataclass
class Optional3:
    """A dataclass batch with optional fields its collate_fn leaves at None."""

    images: torch.Tensor
    labels: torch.Tensor
    masks: torch.Tensor | None = None
    weights: torch.Tensor | None = None


def test_none_fields_of_a_collate_fn_come_back_as_none_through_a_resume() -> None:
    """A batch with a None field (a dataclass's optional field, ``"mask": None`` in a dict) was
    refused (``LayoutError``: "field batch.masks is a NoneType"), where a DataLoader hands it on
    and the training step tests ``if batch.masks is not None``."""

    def collate(items) -> dict:
        images = torch.stack([x for x, _ in items])
        names = [f"s{int(x[0])}" for x, _ in items]
        batch = Optional3(images, torch.tensor([y for _, y in items]))
        return {"batch": batch, "meta": {"names": names, "crop": None}, "extra": (None, images)}

    def check(got) -> list[int]:
        batch = got["batch"]
        assert type(batch) is Optional3 and batch.masks is None and batch.weights is None
        assert got["meta"]["crop"] is None and got["extra"][0] is None
        assert torch.equal(got["extra"][1], batch.images)
        ids = [int(v) for v in batch.images[:, 0]]
        assert got["meta"]["names"] == [f"s{i}" for i in ids]
        return ids

    def data() -> DataLoader:
        return DataLoader(Ids(21), batch_size=4, num_workers=2, collate_fn=collate, timeout=60)

    seen: collections.Counter = collections.Counter()
    with EchoLoader(data(), echo_factor=2.0) as loader:
        it = iter(loader)
        for _ in range(4):
            seen.update(check(next(it)))
        state = loader.state_dict()
    with EchoLoader(data(), echo_factor=2.0) as loader:
        loader.load_state_dict(state)
        for got in loader:
            seen.update(check(got))
    assert sorted(seen) == list(range(21)) and set(seen.values()) == {2}


class FirstWaitsForLast(Dataset):
    """Sample i: 4 values i, label i % 3. The first batch's samples wait until the last sample
    was read, so a DataLoader with ``in_order=False`` hands on its short last batch first."""

    def __init__(self, n: int = 21) -> None:
        self.n, self.last = n, multiprocessing.get_context("fork").Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.n - 1:
            self.last.set()
        elif i < 4:
            assert self.last.wait(60), "the last sample was never read"
        return torch.full((4,), float(i)), i % 3


def test_a_dataloader_handing_on_batches_as_they_come_is_echoed_and_warned_on_resume() -> None:
    """``DataLoader(in_order=False)`` hands on its workers' batches as they come, so its short
    last batch can come first: that was refused with a LayoutError ("its fields have 1 rows,
    but the wrapped DataLoader's batch 3 holds 4 samples"), depending on timing. A mid-epoch
    resume of it skips other batches than the ones read: warned, as for an unseeded shuffle."""
    data = DataLoader(FirstWaitsForLast(), batch_size=4, num_workers=2, in_order=False,
                      multiprocessing_context="fork", timeout=60)  # fmt: skip
    sizes = [len(y) for _x, y in data]
    assert sorted(sizes) == [1, 4, 4, 4, 4, 4] and sizes[-1] == 4  # the short batch came early
    data.dataset.last.clear()
    seen: collections.Counter = collections.Counter()
    with EchoLoader(data, echo_factor=2.0) as loader:
        assert len(loader) == 11
        for i, batch in enumerate(loader):
            seen.update(_ids(batch))
            if i == 2:
                state = loader.state_dict()
    assert sorted(seen) == list(range(21)) and set(seen.values()) == {2}
    assert state["mid_epoch"] and state["batches_done"] > 0
    with pytest.warns(RuntimeWarning, match=r"in_order=False"):
        EchoLoader(data, echo_factor=2.0).load_state_dict(state)
