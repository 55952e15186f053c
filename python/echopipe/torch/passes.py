"""The parts of :class:`echopipe.torch.EchoLoader` around its batches: the cache its options
size (checked in :mod:`.arguments`), one pass over the loader (:class:`EpochIterator`), the
timing that feeds the ``"auto"`` controller, and the exact counts (:class:`EchoLoaderStats`)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..echo import EchoStats
from ..echo import config as echo_config
from . import batch_layout as bl
from . import wrapped
from .loader_state import LoaderStateError, check_position, check_shard, epoch_position, shard
from .shared import shutdown

if TYPE_CHECKING:
    from .loader import EchoLoader
    from .reader import Producer

__all__ = [
    "COUNTS", "EchoLoaderStats", "EpochIterator", "cache_config", "check_resume_order",
    "drop_cache", "fresh_epoch", "observe", "replaced", "warn_evaluation",
]  # fmt: skip

COUNTS = ("fresh_batches", "fresh_samples", "delivered_batches", "delivered_samples")


@dataclass(frozen=True)
class EchoLoaderStats:
    """Exact counts: fresh samples read from the wrapped loader and echoed copies delivered.

    ``*_epoch`` count the current (or last finished) epoch, the others every epoch so far.
    """

    epoch: int
    fresh_batches: int
    fresh_samples: int
    delivered_batches: int
    delivered_samples: int
    fresh_batches_epoch: int
    fresh_samples_epoch: int
    delivered_batches_epoch: int
    delivered_samples_epoch: int
    echo_factor: float
    echo_history: list[tuple[int, float]]
    cache: EchoStats | None


class FactorReplacedWarning(RuntimeWarning):
    """``load_state_dict`` replaced the loader's fixed ``echo_factor`` with the saved one."""


def warn_factor_restored(current: float, saved: float, auto: bool) -> None:
    """Warns when ``load_state_dict`` replaces a fixed ``e`` the loader has with another saved
    one (the saved state wins, as a torch optimizer's saved learning rate does)."""
    if not auto and current != saved:
        warnings.warn(f"EchoLoader: the loaded state's echo_factor {saved:g} replaces this "
                      f"loader's {current:g}; call set_echo_factor({current:g}) after "
                      "load_state_dict() to keep it",
                      FactorReplacedWarning, stacklevel=3)  # fmt: skip


class EpochIterator:
    """One pass over an :class:`EchoLoader`; dropping or closing it mid-epoch ends the pass."""

    def __init__(self, loader: EchoLoader, serial: int) -> None:
        self._loader: EchoLoader | None = loader
        self._serial = serial

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        if loader is None:
            raise StopIteration
        try:
            batch = loader._next(self._serial)
        except BaseException:
            self._finish(abort=True)
            raise
        if batch is None:
            self._finish(abort=False)
            raise StopIteration
        return batch

    def close(self) -> None:
        """Ends this pass now: stops the reader and the wrapped loader's workers."""
        self._finish(abort=True)

    def _finish(self, abort: bool) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:
            loader._end_epoch(self._serial, abort)

    def __del__(self) -> None:
        self._finish(abort=True)


def cut_short(producer: Any, cache: Any, epoch: int, delivered_batches: int) -> str | None:
    """What an epoch ended early (a break, ``close()``, an exception) still held, or None.

    Called before the epoch's reader and cache are shut down: a ``state_dict()`` taken after
    that describes the state after the epoch, so the copies still in the cache (and the fresh
    samples not read yet) are not in it, and a resume from it does not deliver them."""
    if producer is None:
        return None
    if not epoch_position(producer, (0, 0, 0, 0), None, cache).mid_epoch:
        return None  # every copy was delivered: nothing is left out
    return (f"epoch {epoch} was ended after {delivered_batches} batches, before its last "
            "copies were delivered (a break, close() or an exception left the loop)")  # fmt: skip


def kept_stream(loader: Any) -> str | None:
    """The iterator the wrapped loader (or one it wraps through ``.loader``) keeps between
    passes and takes every pass from, as ``Class.attribute``, or None: timm's
    ``MultiEpochsDataLoader`` makes one in ``__init__`` (a ``DataLoader``'s persistent
    ``_iterator`` is not one: its next ``iter()`` starts a new pass of the sampler)."""
    for obj in wrapped.dataloaders(loader):
        for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
            if name != "_iterator" and hasattr(type(value), "__next__"):
                return f"{type(obj).__name__}.{name}"
    return None


def warn_kept_stream(loader: EchoLoader) -> None:
    """Warns once per loader, as the pass after an epoch left early starts, when the wrapped
    loader takes every pass from one stream: the reader read ahead of the batches delivered,
    and those batches' copies not yet delivered are not in the stream any more (the plain
    loader's next pass would start with them)."""
    if loader._cut_short is None or getattr(loader, "_kept_stream_warned", False):
        return
    stream = kept_stream(loader._loader)
    if stream is None:
        return
    loader._kept_stream_warned = True
    warnings.warn(f"EchoLoader: {loader._cut_short}; the wrapped loader takes every pass from "
                  f"one stream it keeps ({stream}, as timm's MultiEpochsDataLoader), so the "
                  f"{loader._last_epoch[0]} batches the reader had read from it in that epoch "
                  "are not read again: the copies of their samples not yet delivered are lost "
                  "(the plain loader's next pass would have started with them). Let each "
                  "epoch run to its end, or use a DataLoader with persistent_workers=True",
                  RuntimeWarning, stacklevel=4)  # fmt: skip


def warn_cut_short(note: str | None) -> None:
    """Warns that a ``state_dict()`` leaves out what the last epoch still held."""
    if note is not None:
        warnings.warn(f"EchoLoader: {note}; this state is the one after that epoch, so a "
                      "resume from it does not deliver the copies the epoch still held. To keep "
                      "the position, take state_dict() inside the loop, before leaving it",
                      RuntimeWarning, stacklevel=3)  # fmt: skip


def cache_config(
    layout: bl.Layout, batch_size: int, shuffle_buffer: int | None,
    capacity_bytes: int | None, seed: int, epoch_samples: int | None,
) -> dict[str, int]:  # fmt: skip
    """The echo cache's arguments for a stream of ``layout`` (LayoutError: a buffer too small)."""
    buffer = shuffle_buffer or echo_config.DEFAULT_SHUFFLE_BATCHES * batch_size
    if buffer < 2 * batch_size:
        raise bl.LayoutError(
            f"shuffle_buffer={buffer} holds fewer than two batches of {batch_size}"
        )
    if buffer > echo_config.MAX_CAPACITY_SAMPLES:  # only the default can be: the option is checked
        raise bl.LayoutError(
            f"batch_size={batch_size} is too large: its default shuffle_buffer of "
            f"{echo_config.DEFAULT_SHUFFLE_BATCHES} batches "
            f"({buffer} samples) is more than an echo cache holds "
            f"({echo_config.MAX_CAPACITY_SAMPLES}); give a smaller batch_size or a shuffle_buffer"
        )
    per_sample = sum(
        64 * math.ceil(sum(layout.leaves[i].nbytes for i in g) / 64) + 64 for g in layout.groups
    )
    per_sample += (2 * 64 + 1024 * len(layout.strings)) if layout.strings else 0
    return {
        "capacity_bytes": capacity_bytes or buffer * per_sample + (4 << 20),
        "capacity_samples": buffer,
        "min_fill": buffer // 2,
        "seed": seed,
        "epoch_size": epoch_samples or 0,
    }


def observe(loader: EchoLoader, producer: Producer, busy: float) -> None:
    """Feeds the controller (``"auto"``) and applies its factor every ``echo_interval``."""
    if loader._controller is None:
        return
    up, count = producer.up_seconds, producer.up_batches
    if count > loader._observed[1]:
        t_up = (up - loader._observed[0]) / (count - loader._observed[1])
        loader._observed = (up, count)
        step = loader._totals["delivered_batches"] + loader._delivered_epoch[0]
        loader._controller.observe(t_up, max(busy, 1e-9), step)
    step = loader._totals["delivered_batches"] + loader._delivered_epoch[0]
    # The first decision (after the controller's warm-up) applies at once: waiting for the
    # interval would run those batches at e = 1, the time "auto" loses most.
    first = len(loader._history) == 1
    wanted = loader._controller.factor
    if wanted != loader._factor and (first or step % loader._interval == 0):
        rises = wanted > loader._factor
        loader.set_echo_factor(wanted)
        cache = loader._shared.cache
        if rises and cache is not None:
            # Tickets are fixed when a sample is put: the samples in the cache, put at the lower
            # factor (at first the warm-up's, at e = 1), would be used fewer times than those
            # after them, and the next steps would wait for the reader instead.
            cache.top_up()


def check_auto_alone(auto: bool) -> None:
    """``"auto"`` follows this process's own timings: under several torch.distributed
    processes each would choose its own e and run another number of steps per epoch, and the
    first collective of a rank that ran out (DDP's all-reduce) would wait for ever."""
    here = shard()
    if auto and here is not None:
        raise ValueError(
            f"EchoLoader: echo_factor='auto' decides e from this process's timings, but "
            f"{here[1]} torch.distributed processes run and each would decide "
            "its own (and take another number of steps); pass a number, the same on every "
            "rank (e.g. rank 0's EchoController.factor, broadcast and set with "
            "set_echo_factor between epochs)"
        )


def warn_evaluation(factor: float, auto: bool) -> None:
    """Warns when an echoing epoch starts with gradients off: an evaluation or prediction loop
    (Lightning's ``validate``/``test``/``predict`` run under ``inference_mode``) would count
    each sample about ``e`` times in its metrics and predictions, with no error."""
    if (factor > 1 or auto) and not torch.is_grad_enabled():
        e = "auto" if auto else f"{factor:g}"
        warnings.warn(
            f"EchoLoader(echo_factor={e}) starts an epoch with gradients off (an evaluation or "
            "prediction loop?): it delivers each sample about e times, so metrics and "
            "predictions count it that often; evaluate on the plain DataLoader",
            RuntimeWarning, stacklevel=4,
        )  # fmt: skip


def check_resume_order(clean: dict[str, Any], loader: Any) -> None:
    """A mid-epoch state re-reads its epoch in the saved order: it must be of the shard this
    loader reads (world size and rank: :func:`.loader_state.check_shard`), its position inside
    the wrapped loader's epoch, the saved generator states must fit the wrapped loader's
    (LoaderStateError), and an unseeded shuffle, whose order a new process cannot draw again,
    or batches handed on as they come, are warned about (the skipped batches are another
    order's)."""
    check_shard(clean, wrapped.data_shard(loader))
    # An epoch-seeded sampler set to another epoch may have another length then (a curriculum).
    same = clean["sampler_epoch"] in (None, wrapped.sampler_epoch(loader))
    samples = wrapped.samples_per_epoch(loader) if same else None
    check_position(clean, loader, wrapped.input_batch_size(loader), samples)
    if not clean["mid_epoch"]:
        return
    have = len(wrapped.order_generators(loader))
    if clean["order_rng"] is not None and len(clean["order_rng"]) != have:
        raise LoaderStateError(
            f"EchoLoader state 'order_rng' holds {len(clean['order_rng'])} generator states, but "
            f"the wrapped loader draws its order from {have}"
        )
    unseeded = wrapped.unseeded_shuffle(loader)
    if unseeded is not None:
        why = f"shuffles with a {unseeded} without a generator"
        fix = "generator=torch.Generator().manual_seed(seed)"
    elif wrapped.out_of_order(loader):
        why, fix = "hands on its workers' batches as they come (in_order=False)", "in_order=True"
    else:
        return
    if clean["batches_done"] or clean["rows_in_flight"]:
        warnings.warn(
            f"EchoLoader: resuming mid-epoch, but the wrapped loader {why}, so the epoch is "
            "re-read in another order and the batches skipped as already read are not the ones "
            "that were: some samples of this epoch are missed, others repeated. Build the "
            f"DataLoader with {fix}",
            RuntimeWarning, stacklevel=3,
        )  # fmt: skip


def replaced(epoch: int) -> RuntimeError:
    """The error of an iterator whose epoch a newer ``iter()`` ended: one epoch runs at a time
    (one cache, one reader), where a ``DataLoader`` without persistent workers lets two
    iterators run side by side."""
    return RuntimeError(
        f"this EchoLoader iterator's epoch was ended by a newer iter() of the same EchoLoader "
        f"(now at epoch {epoch}): an EchoLoader runs one epoch at a time. Is it also the "
        "validation loader (val_dataloaders=, or val_dataloader() returning it)? Validate "
        "on the plain DataLoader it wraps"
    )


def fresh_epoch(loader: EchoLoader) -> None:
    """Readies the drained cache for a new (not resumed) epoch: replaced where the epoch size
    changed (the sampler's; exact totals), its input reopened, and the layout forgotten, so
    that the epoch's first batch may bring another one (a transform set between epochs,
    progressive resizing): :meth:`EchoLoader._accept_layout` then replaces the cache."""
    loader._fresh_base, loader._delivered_epoch = 0, [0, 0]
    config = loader._cache_config
    if config is not None and config.get("epoch_size", 0) != (loader._epoch_samples or 0):
        config["epoch_size"] = loader._epoch_samples or 0
        shutdown(loader._shared, loader._close_timeout)  # between epochs: the cache is drained
    if loader._shared.cache is not None:
        loader._shared.cache.reset_input()
    # Before the reader starts: the consumer waits for the first batch's layout and cache.
    loader._layout, loader._decode = None, None


def drop_cache(loader: EchoLoader) -> None:
    """Closes the drained cache of another layout (the reader, under the loader's lock, before
    it publishes the new layout: the consumer reads the layout first, then the cache)."""
    if loader._shared.cache is not None:
        loader._shared.cache.close()
    loader._shared.cache, loader._cache_config = None, None


def delivered_batches(loader: EchoLoader) -> int:
    """Batches delivered so far: the totals, plus a running or restored epoch's."""
    if loader._shared.producer is not None:
        return loader._totals["delivered_batches"] + loader._delivered_epoch[0]
    restored = loader._resume["delivered_batches_epoch"] if loader._resume is not None else 0
    return loader._totals["delivered_batches"] + restored


def check_epoch_samples(read: int, expected: int | None, epoch: int) -> None:
    """Warns when a finished epoch read another number of samples than the wrapped loader's
    length said (``expected``; None: it did not say)."""
    if expected is not None and read != expected:
        warnings.warn(f"EchoLoader: the wrapped loader yielded {read} samples in epoch {epoch}, "
                      f"not the {expected} its length said: len() was off",
                      RuntimeWarning, stacklevel=5)  # the user's loop  # fmt: skip
