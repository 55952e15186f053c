"""What :class:`echopipe.torch.EchoLoader` reads from the loader it wraps: samples per epoch,
batch size, the sharding check, and the attributes training programs read and write through it.

Training programs treat their train loader as a ``DataLoader``: ``len(loader)`` for progress
totals and step-counting schedulers, ``loader.sampler.set_epoch(epoch)``, ``loader.dataset``,
wrapper attributes such as timm's ``mixup_enabled``. :class:`PassThrough` forwards every public
attribute :class:`EchoLoader` does not define itself to the wrapped loader, reads and writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ..echo import copies_per_epoch
from .loader_state import shard

__all__ = [
    "PassThrough",
    "UnshardedLoaderError",
    "batch_rows",
    "check_flag",
    "check_sharded",
    "data_shard",
    "dataloaders",
    "drops_last",
    "epoch_batches",
    "innermost_dataloader",
    "input_batch_size",
    "order_generators",
    "out_of_order",
    "sampler_epoch",
    "samples_per_epoch",
    "set_sampler_epoch",
    "unseeded_shuffle",
]

# Wrappers nest (timm's PrefetchLoader around a DataLoader, a user's wrapper around that).
_MAX_DEPTH = 8


class UnshardedLoaderError(RuntimeError):
    """Several torch.distributed processes, but the wrapped loader reads the whole dataset in
    each (its sampler is a plain ``RandomSampler``/``SequentialSampler``)."""


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except (TypeError, NotImplementedError, AttributeError):
        return None


def dataloaders(loader: Any) -> Iterator[Any]:
    """The wrapped object, then each loader it wraps through ``.loader`` with the same length
    (timm's ``PrefetchLoader`` yields its DataLoader's batches one for one)."""
    obj = loader
    for _ in range(_MAX_DEPTH):
        yield obj
        if isinstance(obj, DataLoader):
            return
        inner = getattr(obj, "loader", None)
        if inner is None or not hasattr(inner, "__iter__"):
            return
        if _length(obj) is None or _length(obj) != _length(inner):
            return  # a wrapper that changes the batch count: its samples are not its loader's
        obj = inner


def innermost_dataloader(loader: Any) -> DataLoader | None:
    """The first ``DataLoader`` of :func:`dataloaders`, or None."""
    for obj in dataloaders(loader):
        if isinstance(obj, DataLoader):
            return obj
    return None


def _batching(loader: Any) -> tuple[int | None, int | None, bool, bool] | None:
    """``(samples, batch size, drop_last, map_style)`` of the innermost DataLoader's own
    batching (or its plain ``BatchSampler``), ``None`` for a custom batch sampler or no
    DataLoader."""
    dl = innermost_dataloader(loader)
    if dl is None:
        return None
    if isinstance(dl.dataset, IterableDataset):
        return _length(dl.dataset), dl.batch_size, dl.drop_last, False
    if dl.batch_size is not None:  # the DataLoader made its BatchSampler from these
        return _length(dl.sampler), dl.batch_size, dl.drop_last, True
    if type(dl.batch_sampler) is BatchSampler:
        bs = dl.batch_sampler
        return _length(bs.sampler), bs.batch_size, bs.drop_last, True
    return None


def _kept(batching: tuple[int | None, int | None, bool, bool] | None) -> int | None:
    """Samples a pass of ``batching`` (:func:`_batching`) yields, where it is known."""
    if batching is None:
        return None  # a custom batch sampler: its batch sizes are its own
    n, size, drop, _ = batching
    if n is None or size is None:
        return None
    return n - n % size if drop else n


def drops_last(loader: Any) -> bool:
    """Whether the wrapped loader drops a pass's short last batch: ``drop_last`` of the innermost
    DataLoader or of its batch sampler (timm's training loaders set it, so that every batch is
    full for BatchNorm and pairwise mixup). EchoLoader then drops its own short last batch."""
    b = _batching(loader)
    if b is not None:
        return b[2]
    dl = innermost_dataloader(loader)
    return dl is not None and getattr(dl.batch_sampler, "drop_last", None) is True


def out_of_order(loader: Any) -> bool:
    """Whether the wrapped DataLoader hands on its workers' batches as they come
    (``in_order=False``): a pass's batches, its short last one too, come in an order timing
    decides."""
    dl = innermost_dataloader(loader)
    return dl is not None and dl.num_workers > 0 and getattr(dl, "in_order", True) is False


def batch_rows(loader: Any) -> tuple[int, int] | None:
    """``(samples, batch size)`` where every batch of a pass but the last has exactly
    ``batch size`` rows and the last the rest: a map-style DataLoader's own batching. ``None``
    elsewhere (an iterable dataset's workers each end with a short batch of their own), and for a
    DataLoader subclass with an ``__iter__`` of its own: timm's ``MultiEpochsDataLoader`` takes
    each pass from one stream of batches, so after a pass left early the short batch comes
    mid-pass; and for one with ``in_order=False`` (:func:`out_of_order`)."""
    b = _batching(loader)
    n = _kept(b)
    if b is None or not b[3] or n is None or b[1] is None or out_of_order(loader):
        return None
    if type(innermost_dataloader(loader)).__iter__ is not DataLoader.__iter__:
        return None
    return n, b[1]


def samples_per_epoch(loader: Any) -> int | None:
    """Samples the wrapped loader yields per epoch, or ``None`` when it cannot be known ahead.

    Known for a ``DataLoader`` (and wrappers around one, through ``.loader``) over a map-style
    dataset with its own batching or a plain ``BatchSampler`` (``len(sampler)``, so a
    ``DistributedSampler`` gives this process's share; ``drop_last`` drops the short batch), and
    over an iterable dataset with ``len()``.
    """
    return _kept(_batching(loader))


def _epoch_sampler(loader: Any) -> Any:
    """The wrapped DataLoader's sampler (or batch sampler) that has ``set_epoch`` and an int
    ``epoch`` (a ``DistributedSampler``), or None."""
    dl = innermost_dataloader(loader)
    if dl is None:
        return None
    batch_sampler = getattr(dl, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    for obj in (getattr(dl, "sampler", None), batch_sampler, inner):
        epoch = getattr(obj, "epoch", None)
        if callable(getattr(obj, "set_epoch", None)) and type(epoch) is int:
            return obj
    return None


def sampler_epoch(loader: Any) -> int | None:
    """The ``epoch`` of the wrapped loader's epoch-seeded sampler, or None when it has none."""
    obj = _epoch_sampler(loader)
    return None if obj is None else obj.epoch


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Sets the wrapped loader's epoch-seeded sampler to ``epoch`` (a resumed epoch re-reads the
    order it was saved in, also when the caller's ``set_epoch`` comes after its first batch, as
    Lightning's does on a resume when the loader has no length)."""
    obj = _epoch_sampler(loader)
    if obj is not None and obj.epoch != epoch:
        obj.set_epoch(epoch)


def _random_sampler(loader: Any) -> tuple[DataLoader, Any] | None:
    """The innermost DataLoader and its sampler (or its batch sampler's), where that sampler
    draws its order from a ``generator`` attribute (``RandomSampler``, ``SubsetRandomSampler``,
    ``WeightedRandomSampler``, or a custom one with that attribute)."""
    dl = innermost_dataloader(loader)
    if dl is None or isinstance(dl.dataset, IterableDataset):
        return None
    for obj in (dl.sampler, getattr(dl.batch_sampler, "sampler", None)):
        if obj is not None and hasattr(obj, "generator") and not hasattr(obj, "set_epoch"):
            return dl, obj
    return None


def order_generators(loader: Any) -> list[Any]:
    """The ``torch.Generator`` objects a pass of the wrapped loader draws its order from: its
    random sampler's and the DataLoader's own (its workers' seeds), each once; for an iterable
    dataset read by workers, the DataLoader's own (a webdataset-like shuffle in the workers
    draws from the seeds torch gives them).

    Their states at the start of a pass fix that pass's order, so a resumed pass that starts
    from the saved states re-reads the same batches (and the epochs after it draw what an
    uninterrupted run would have drawn)."""
    found = _random_sampler(loader)
    dl = innermost_dataloader(loader)
    if found is None and (dl is None or not isinstance(dl.dataset, IterableDataset)
                          or not dl.num_workers):  # fmt: skip
        return []
    out: list[Any] = []
    sampler_generator = found[1].generator if found is not None else None
    for gen in (sampler_generator, getattr(dl, "generator", None)):
        cpu = isinstance(gen, torch.Generator) and gen.device.type == "cpu"
        if cpu and all(gen is not g for g in out):
            out.append(gen)
    return out


def unseeded_shuffle(loader: Any) -> str | None:
    """The wrapped loader's random sampler by name when it has no ``generator`` (each pass
    draws its order from torch's global RNG, which a resumed process does not share), else
    None."""
    found = _random_sampler(loader)
    if found is None or found[1].generator is not None:
        return None
    return type(found[1]).__name__


def input_batch_size(loader: Any) -> int | None:
    """The wrapped loader's batch size, where it says so (``batch_size`` of it or its
    ``BatchSampler``, through wrappers)."""
    for obj in dataloaders(loader):
        size = getattr(obj, "batch_size", None)
        if size is None:
            size = getattr(getattr(obj, "batch_sampler", None), "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


def shape_source(loader: Any) -> str:
    """What decides the wrapped loader's batches, for a message about a batch whose shape
    changed: a batch sampler of its own (a multi-scale or batch-size schedule), else the
    DataLoader's dataset and collate_fn, else the loader itself."""
    dl = innermost_dataloader(loader)
    if dl is None:
        return f"the wrapped {type(loader).__name__}"
    sampler = dl.batch_sampler
    if sampler is not None and type(sampler) is not BatchSampler:
        return f"the wrapped DataLoader's batch_sampler {type(sampler).__name__}"
    collate = getattr(dl.collate_fn, "__name__", type(dl.collate_fn).__name__)
    return f"the wrapped DataLoader's dataset {type(dl.dataset).__name__} or collate_fn {collate}"


def check_flag(name: str, value: Any) -> bool:
    """An option that is True or False (``TypeError`` naming it otherwise)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_sharded(loader: Any, sharded: bool = False) -> None:
    """Raises :class:`UnshardedLoaderError` when several torch.distributed processes would
    each read the whole dataset through a plain sampler.

    Lightning replaces the sampler of ``DataLoader`` objects only (``use_distributed_sampler``):
    it leaves an ``EchoLoader`` alone, so the ``DistributedSampler`` has to be in the wrapped
    ``DataLoader`` already. Custom samplers and batch samplers (timm's distributed samplers,
    accelerate's sharding batch sampler) are trusted, and so is every loader with ``sharded``
    (``EchoLoader(sharded=True)``: a dataset built per rank, which nothing here can tell from
    the whole dataset).
    """
    here = shard()
    if here is None or sharded:
        return
    dl = innermost_dataloader(loader)
    if dl is None or isinstance(dl.dataset, IterableDataset):
        return
    if dl.batch_size is not None:
        sampler = dl.sampler
    elif type(dl.batch_sampler) is BatchSampler:
        sampler = dl.batch_sampler.sampler
    else:
        return  # a batch sampler of its own (accelerate's shards one) is trusted like a sampler
    if type(sampler) in (RandomSampler, SequentialSampler):
        raise UnshardedLoaderError(
            f"EchoLoader: {here[1]} torch.distributed processes, but the wrapped "
            f"DataLoader samples with a {type(sampler).__name__}, so each process would read the "
            "whole dataset: build it with sampler=DistributedSampler(dataset) (Lightning's "
            "use_distributed_sampler replaces samplers of DataLoaders only, not inside an "
            "EchoLoader; build the DistributedSampler in train_dataloader()); or, when each "
            "process's dataset is already its own share, pass EchoLoader(..., sharded=True)"
        )


def data_shard(loader: Any) -> list[int] | None:
    """``[rank, world_size]`` of the part of the dataset the wrapped loader reads: its
    sampler's (a ``DistributedSampler`` or any sampler with ``num_replicas`` and ``rank``,
    which may be built without torch.distributed), else the torch.distributed processes'
    (:func:`.loader_state.shard`, e.g. under a batch sampler of its own); None for the whole
    dataset."""
    dl = innermost_dataloader(loader)
    sampler = None
    if dl is not None and not isinstance(dl.dataset, IterableDataset):
        sampler = (
            getattr(dl.batch_sampler, "sampler", None) if dl.batch_size is None else dl.sampler
        )
    replicas, rank = getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)
    if type(replicas) is int and type(rank) is int and 0 <= rank < replicas:
        return [rank, replicas] if replicas > 1 else None
    return shard()


def epoch_batches(loader: Any, echo_factor: float | None, batch_size: int | None) -> int:
    """Batches an epoch of ``EchoLoader`` yields: ``ceil(copies / batch_size)``, exactly
    (``floor`` when the wrapped loader drops its short last batch: :func:`drops_last`).

    ``copies`` is :func:`~echopipe.echo.copies_per_epoch` of ``e`` and :func:`samples_per_epoch`
    (the cache's ``epoch_size`` makes that total exact; only the last batch is short).
    ``TypeError`` when it is not known ahead: ``echo_factor=None`` (``"auto"``: ``e`` changes
    within an epoch), or a loader that does not tell its samples per epoch or batch size.
    """
    if echo_factor is None:
        raise TypeError("EchoLoader(echo_factor='auto') has no fixed epoch length (e follows "
                        "the measured R within an epoch); give a number for a len()")  # fmt: skip
    samples = samples_per_epoch(loader)
    if samples is None or batch_size is None:
        raise TypeError(
            f"EchoLoader: len() needs the samples per epoch and the batch size of the wrapped "
            f"{type(loader).__name__}, which it does not tell (a DataLoader over a sized dataset "
            "with a batch_size, or a wrapper with .loader around one, does)"
        )
    copies = copies_per_epoch(echo_factor, samples)
    return copies // batch_size if drops_last(loader) else -(-copies // batch_size)


class PassThrough:
    """Forwards public attributes the class does not define to ``self._loader``, both ways.

    The subclass's own names (methods, properties) stay its own; names starting with ``_`` are
    never forwarded: they are implementation details of either side.
    """

    _loader: Any

    def __getattr__(self, name: str) -> Any:  # only called when normal lookup failed
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(self.__dict__["_loader"], name)
        except KeyError:
            raise AttributeError(name) from None
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object and the loader it wraps "
                f"({type(self.__dict__['_loader']).__name__}) have no attribute {name!r}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or hasattr(type(self), name):
            object.__setattr__(self, name, value)
        else:
            setattr(self._loader, name, value)

    def __delattr__(self, name: str) -> None:
        if name.startswith("_") or hasattr(type(self), name):
            object.__delattr__(self, name)
        else:
            delattr(self._loader, name)

    def __dir__(self) -> list[str]:
        inner = (n for n in dir(self.__dict__.get("_loader")) if not n.startswith("_"))
        return sorted(set(super().__dir__()) | set(inner))

    def __getstate__(self) -> Any:
        # Spawned processes get what they are given pickled (Lightning's ddp_spawn, the loaders
        # passed to fit()); a reader thread and a native cache cannot travel: say where to make
        # it instead of pickle's "cannot pickle '_thread.lock' object".
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied (it owns a reader thread and a "
            "native cache): make it in the process that iterates it, e.g. in the "
            "LightningModule's or DataModule's train_dataloader(), not passed to fit() under "
            "ddp_spawn"
        )
