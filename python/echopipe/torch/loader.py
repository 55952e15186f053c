"""Data echoing for any PyTorch input pipeline: :class:`EchoLoader` (public as ``echopipe.torch``).

``EchoLoader(loader, echo_factor=2.0)`` wraps any iterable of batches (a ``DataLoader`` with
worker processes, a webdataset pipeline, a Hugging Face dataset formatted for torch). A
background producer thread reads the wrapped loader, splits every batch into samples and puts
them into echopipe's native :class:`~echopipe.echo.EchoCache` (one cache slot per sample, so
this is *example* echoing); iterating the ``EchoLoader`` draws random batches of the same size
and structure from the cache: each fresh sample ``floor(e)`` or ``ceil(e)`` times (mean ``e``).

See ``docs/echo_loader.md`` for the semantics (ordering, accounting, resume) and the limits.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..echo import EchoCache
from ..filecheck import memory_bytes
from . import arguments, passes, workers, wrapped
from . import batch_layout as bl
from . import loader_state as ls
from .accept import accept_layout
from .delivery import Assembler, next_batch, pin_choice
from .lengths import LengthsTold, StaleLengthWarning
from .passes import EchoLoaderStats, FactorReplacedWarning
from .rank_states import RankStates, RankStatesError, RankStatesWarning, own_state
from .reader import LoaderError, Producer
from .shared import FORKED_ADVICE, Shared, join_failed, shutdown
from .wrapped import PassThrough, UnshardedLoaderError

__all__ = [
    "EchoLoader", "EchoLoaderStats", "FactorReplacedWarning", "LayoutError", "LoaderError",
    "RankStatesError", "RankStatesWarning", "ShapeChangeError", "StaleLengthWarning",
    "UnshardedLoaderError",
]  # fmt: skip

LayoutError, ShapeChangeError = bl.LayoutError, bl.ShapeChangeError


class EchoLoader(PassThrough):
    """Example echoing in front of any iterable of batches, through the native echo cache.

    A stand-in for the wrapped ``DataLoader`` in training programs: ``len()`` is the exact
    number of batches the next epoch yields (see :meth:`__len__`), and every public attribute
    this class does not define (``dataset``, ``sampler``, ``batch_sampler``, ``num_workers``,
    ``drop_last``, a wrapper's ``mixup_enabled``...) reads and writes the wrapped loader's.

    Args:
        loader: Any iterable of batches: a ``DataLoader`` (worker processes welcome), a
            webdataset pipeline, a Hugging Face dataset formatted for torch. Each batch is a
            tensor, numpy array, or dicts/tuples/lists/namedtuples of them with one row per
            sample; lists of ``str`` (one per sample) pass through too. Iterated once per epoch.
        echo_factor: ``e >= 1``: each fresh sample is delivered ``floor(e)`` or ``ceil(e)``
            times; or ``"auto"``: start at 1 and follow ``R = t_up / t_down`` with the controller
            ``echopipe train --echo auto`` uses (:class:`echopipe.echo.controller.EchoController`).
        shuffle_buffer: Samples the cache holds (default 4 batches; at least 2 batches). Copies
            of a sample are drawn at random among them.
        batch_size: Samples per output batch (default: the wrapped loader's ``batch_size``,
            else the first input batch's; a larger input batch later warns).
        pin_memory: Output tensors in pinned memory, taken into directly (default: with CUDA,
            when ``device`` is CUDA or the wrapped loader pins, as ``pin_memory=True`` does).
        device: Move output tensors there (``non_blocking`` from pinned memory).
        seed: Seeds the tickets and draws of the cache.
        capacity_bytes: Cache arena size (default: the shuffle buffer's samples plus slack).
        echo_max: Upper bound of ``e`` for ``"auto"``.
        echo_interval: With ``"auto"``: output batches between changes of ``e`` (the first
            change applies right after the controller's warm-up).
        timeout: Longest wait for one output batch, seconds (``None``: no limit; closing and
            errors of the wrapped loader always end a wait).
        close_timeout: How long :meth:`close` waits for the wrapped loader to return.
        deterministic: Each draw waits until the reader filled the cache (or the input ended),
            so that two runs with the same ``seed`` and input order give the same batches
            (a fixed ``echo_factor`` only).
        sharded: The wrapped loader already reads only this process's share of the data (a
            dataset built per rank), so a plain ``RandomSampler`` or ``SequentialSampler`` under
            several torch.distributed processes is not refused (:class:`UnshardedLoaderError`).
        state_timeout: Under several torch.distributed processes, how long rank 0's mid-epoch
            :meth:`state_dict` waits for every other rank's (:class:`RankStatesWarning` after).

    Iterating yields about ``e`` times as many batches per epoch as the wrapped loader. A
    failure of the wrapped loader raises :class:`LoaderError` naming the batch; a batch that
    cannot be split into samples raises :class:`LayoutError` (:class:`ShapeChangeError` for
    a per-sample shape that changed within an epoch); several torch.distributed
    processes reading the whole dataset each raise :class:`UnshardedLoaderError`. In a fork of
    the process that made it (a DataLoader worker) it raises ``echopipe.echo.CacheForkedError``.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        echo_factor: float | str = 2.0,
        *,
        shuffle_buffer: int | None = None,
        batch_size: int | None = None,
        pin_memory: bool | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        capacity_bytes: int | None = None,
        echo_max: float = 4.0,
        echo_interval: int = 50,
        timeout: float | None = None,
        close_timeout: float = 10.0,
        deterministic: bool = False,
        sharded: bool = False,
        state_timeout: float = 60.0,
    ) -> None:
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"loader must be iterable, got {type(loader).__name__}")
        self._loader = loader
        self._factor, self._controller = arguments.check_echo(echo_factor, echo_max)
        self._deterministic = arguments.check_deterministic(deterministic, self._controller)
        self._sharded = wrapped.check_flag("sharded", sharded)
        self._shuffle_buffer = arguments.check_count("shuffle_buffer", shuffle_buffer)
        self._batch_size = arguments.check_count("batch_size", batch_size)
        self._explicit_batch = self._batch_size is not None
        if self._batch_size is None:
            self._batch_size = wrapped.input_batch_size(loader)
        self._epoch_samples: int | None = None  # the wrapped loader's, when it tells
        self._seed = arguments.check_seed(seed)
        self._capacity_bytes = arguments.check_count("capacity_bytes", capacity_bytes)
        self._interval = arguments.check_count("echo_interval", echo_interval) or 1
        self._timeout = arguments.check_seconds("timeout", timeout)
        self._close_timeout = arguments.check_seconds("close_timeout", close_timeout) or 10.0
        wait = arguments.check_seconds("state_timeout", state_timeout, optional=False)
        self._ranks = RankStates.made(float(wait))  # rank 0's holds every rank's
        self._device = arguments.check_device(device)
        self._pin = pin_choice(self._device, pin_memory, loader)
        self._shared = Shared()
        self._layout: bl.Layout | None = None
        self._decode: Assembler | None = None  # output batches of self._layout
        self._saved_layout: str | None = None  # signature a resumed stream must match
        self._prior_layout: str | None = None  # a between-epochs state's: another drops its config
        self._stream: bl.Layout | None = None  # the layout the cache was made for
        self._cache_config: dict[str, int] | None = None
        self._epoch = 0
        self._totals = dict.fromkeys(passes.COUNTS, 0)
        self._last_epoch = (0, 0, 0, 0)
        self._delivered_epoch = [0, 0]  # batches, samples
        self._fresh_base = 0  # fresh samples of this epoch from before a resume
        self._history: list[tuple[int, float]] = [(0, self._factor)]
        self._serial = 0  # numbers the passes; the running one's iterator carries it
        self._current: int | None = None
        self._started = False  # whether the current iterator's epoch began (its first next())
        self._cut_short: str | None = None  # an epoch ended with copies left (see state_dict)
        self._lens_told = LengthsTold()  # a loop stopping at an old one loses copies
        self._resume: dict[str, Any] | None = None
        self._closed = False
        self._last_yield: float | None = None
        self._observed = (0.0, 0)
        self._finalizer = weakref.finalize(self, shutdown, self._shared, self._close_timeout)

    # ---- configuration ----
    @property
    def echo_factor(self) -> float:
        """The current ``e`` (applies to samples read from now on)."""
        return self._factor

    def set_echo_factor(self, value: float) -> None:
        """Changes ``e`` for samples read from now on; samples in the cache keep their tickets.

        With ``echo_factor="auto"`` the controller may change it again later; its rises give the
        samples in the cache the new tickets too (:meth:`echopipe.echo.EchoCache.top_up`).
        """
        e = arguments.check_factor(value)
        self._factor = e
        cache = self._shared.cache
        if cache is not None:
            cache.echo_factor = e
        self._history.append((passes.delivered_batches(self), e))

    def _accept_layout(self, layout: bl.Layout, rows: int, stop: threading.Event) -> EchoCache:
        """Called by the reader for every batch: checks it and returns the cache (made once)."""
        return accept_layout(self, layout, rows, stop)

    # ---- iteration ----
    def __iter__(self) -> Iterator[Any]:
        """An epoch (or the rest of the one restored by :meth:`load_state_dict`).

        A previous iterator still in its epoch is ended first, as with a ``DataLoader``. The
        epoch starts at the first ``next()``: an iterator dropped before it (Lightning makes one
        to check that the loader is iterable) reads nothing and is no epoch.
        """
        if self._closed:
            raise RuntimeError("EchoLoader is closed")
        self._shared.origin.check("EchoLoader", FORKED_ADVICE)
        wrapped.check_sharded(self._loader, self._sharded)
        passes.check_auto_alone(self._controller is not None)
        if self._current is not None:  # an iterator still in its epoch (as DataLoader does)
            self._end_epoch(self._current, abort=True)
        self._serial += 1
        self._current = self._serial
        self._started = False
        return passes.EpochIterator(self, self._serial)

    def _start_epoch(self) -> None:
        join_failed(self._shared, self._close_timeout)  # one reader of the wrapped loader
        passes.warn_kept_stream(self)  # (once) the epoch cut short lost read-ahead batches
        self._lens_told.pass_started()  # the loop went on from a cut epoch: name a stale len()
        resume, self._resume, self._cut_short = self._resume, None, None
        self._epoch_samples = wrapped.samples_per_epoch(self._loader)
        if resume is not None:
            self._fresh_base = resume["fresh_samples_epoch"]
            self._delivered_epoch = [resume["delivered_batches_epoch"],
                                     resume["delivered_samples_epoch"]]  # fmt: skip
        else:
            passes.fresh_epoch(self)
        producer = Producer(self, self._epoch, resume)
        self._shared.producer = producer
        self._last_yield, self._observed = None, (0.0, 0)
        self._started = True
        passes.warn_evaluation(self._factor, self._controller is not None)
        producer.start()

    def __len__(self) -> int:
        """Batches the next epoch yields, exactly (:func:`.wrapped.epoch_batches`).

        ``TypeError`` with ``echo_factor="auto"`` (``e`` changes within an epoch) or a loader
        that does not tell its samples per epoch, as ``len()`` of an unsized iterable; before
        that, ``"auto"`` under several processes gets :meth:`__iter__`'s ``ValueError``.
        """
        passes.check_auto_alone(auto := self._controller is not None)
        wrapped.check_sharded(self._loader, self._sharded)
        factor = None if auto else self._factor
        return self._lens_told.tell(self._loader, factor, self._batch_size)

    @property
    def batch_size(self) -> int | None:
        """Samples per output batch (an epoch's last can be short); set by the constructor."""
        return self._batch_size

    def _next(self, token: int) -> Any:
        if self._closed:
            raise RuntimeError("EchoLoader is closed")
        self._shared.origin.check("EchoLoader", FORKED_ADVICE)
        if token != self._current:
            raise passes.replaced(self._epoch)
        if not self._started:
            self._start_epoch()
        producer = self._shared.producer
        assert producer is not None
        if self._last_yield is not None:
            passes.observe(self, producer, time.perf_counter() - self._last_yield)
        got = next_batch(self, producer)
        if got is None:
            return None
        self._delivered_epoch[0] += 1
        self._delivered_epoch[1] += got[1]
        self._last_yield = time.perf_counter()
        return got[0]

    def _end_epoch(self, token: int, abort: bool) -> None:
        if token != self._current:
            return
        self._current = None
        if not self._started or self._shared.origin.forked():
            return  # never read: not an epoch; or a fork's copy of the parent's epoch
        producer = self._shared.producer
        if abort:
            self._cut_short = passes.cut_short(producer, self._shared.cache, self._epoch,
                                               self._delivered_epoch[0])  # fmt: skip
            self._lens_told.epoch_cut(self)
            # The cache goes (a new epoch makes one); a reader's own error is not held up.
            shutdown(self._shared, self._close_timeout, leave_failed=True)
        elif producer is not None:
            producer.shutdown(self._close_timeout)  # already ended: it ended the input
        self._shared.producer = None
        self._last_epoch = self._epoch_counts(producer)
        for key, value in zip(passes.COUNTS, self._last_epoch, strict=True):
            self._totals[key] += value
        self._epoch += 1
        if not abort:
            passes.check_epoch_samples(self._last_epoch[1], self._epoch_samples, self._epoch - 1)

    def _epoch_counts(self, producer: Producer | None) -> tuple[int, int, int, int]:
        if producer is None:
            return (0, self._fresh_base, *self._delivered_epoch)  # type: ignore[return-value]
        return (producer.batches_done, self._fresh_base + producer.samples_put,
                *self._delivered_epoch)  # type: ignore[return-value]  # fmt: skip

    # ---- accounting and checkpoints ----
    def stats(self) -> EchoLoaderStats:
        """Exact counts so far (the epoch ones: the running epoch, else the last one)."""
        producer = self._shared.producer
        epoch = self._epoch_counts(producer) if producer is not None else self._last_epoch
        totals = [self._totals[k] + (v if producer is not None else 0)
                  for k, v in zip(passes.COUNTS, epoch, strict=True)]  # fmt: skip
        cache = self._shared.cache
        return EchoLoaderStats(
            self._epoch, *totals, *epoch, echo_factor=self._factor,
            echo_history=list(self._history), cache=cache.stats() if cache is not None else None,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue later, mid-epoch too (call it between batches): the cached
        samples with their remaining tickets, the position in the wrapped loader's epoch, the
        counters and the ``"auto"`` controller; plain values and bytes (``torch.save`` it).
        Under several processes rank 0's mid-epoch state holds every rank's, for a checkpoint
        that rank 0 alone writes, as Lightning's (:mod:`echopipe.torch.rank_states`)."""
        self._shared.origin.check("EchoLoader", FORKED_ADVICE)
        producer, cache = self._shared.producer, self._shared.cache
        passes.warn_cut_short(self._cut_short)  # set only between an early end and the next epoch
        guard = producer.lock if producer is not None else threading.Lock()
        with guard:  # the reader is between two puts: the cache matches its position
            counts = self._epoch_counts(producer) if producer is not None else (0, 0, 0, 0)
            at = ls.epoch_position(producer, counts, self._resume, cache)
            blob = cache.state_dict() if at.mid_epoch and cache is not None else None
        mine = at.counts if at.mid_epoch else (0, 0, 0, 0)
        ended = at.counts if at.ended else (0, 0, 0, 0)  # into the totals, as at the epoch's end
        last_layout = self._saved_layout or self._prior_layout
        return self._ranks.gathered({
            "version": ls.STATE_VERSION,
            "epoch": self._epoch + at.ended,
            "mid_epoch": at.mid_epoch,
            "batches_done": at.batches_done,
            "rows_in_flight": at.rows_in_flight,
            "fresh_samples_epoch": mine[1],
            "delivered_batches_epoch": mine[2],
            "delivered_samples_epoch": mine[3],
            "totals": {k: self._totals[k] + v for k, v in zip(passes.COUNTS, ended, strict=True)},
            "echo_factor": self._factor,
            "echo_history": [list(h) for h in self._history],
            "controller": self._controller.state_dict() if self._controller else None,
            "cache": blob,
            "cache_config": dict(self._cache_config) if self._cache_config else None,
            "layout": self._stream.signature() if self._stream else last_layout,
            "batch_size": self._batch_size,
            "input_batch_size": wrapped.input_batch_size(self._loader),
            "shard": wrapped.data_shard(self._loader),
            **at.order(),
        })  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` before iterating; the next ``iter()`` continues there.

        A mid-epoch state re-reads the wrapped loader's epoch from its start and skips the
        batches already read, so the wrapped loader must yield the same batches again (no
        shuffling, or a seeded one). All or nothing: every field is checked, and the cache and
        the controller are restored into new objects, before the loader changes; a state that
        does not fit raises :class:`~.loader_state.LoaderStateError` (a ValueError naming the
        field) and leaves the loader as it was.
        """
        self._shared.origin.check("EchoLoader", FORKED_ADVICE)
        if self._current is not None:
            raise RuntimeError("load_state_dict() during an epoch; call it before iter()")
        clean = ls.check_loader_state(
            own_state(state, wrapped.data_shard(self._loader)),  # rank 0's holds every rank's
            version=ls.STATE_VERSION,
            counts=passes.COUNTS,
            auto=self._controller is not None,
            memory_bytes=memory_bytes(),
        )
        passes.check_resume_order(clean, self._loader)  # (its shard and position too)
        cache = ls.restored_cache(clean, self._controller)
        shutdown(self._shared, self._close_timeout)
        self._epoch, self._totals = clean["epoch"], dict(clean["totals"])
        passes.warn_factor_restored(self._factor, clean["echo_factor"], bool(self._controller))
        self._factor = clean["echo_factor"]
        self._history = list(clean["echo_history"])
        if self._controller is not None:
            self._controller.load_state_dict(clean["controller"])  # passed on the scratch one
        self._batch_size, self._cache_config = ls.restored_batching(
            clean, self._batch_size, self._explicit_batch, wrapped.input_batch_size(self._loader)
        )
        self._layout, self._decode = None, None  # a fresh epoch may bring another layout:
        self._saved_layout = clean["layout"] if clean["mid_epoch"] else None  # a resumed one not
        self._prior_layout = None if clean["mid_epoch"] else clean["layout"]
        self._stream = None  # the restored cache's layout is the saved one
        self._shared.cache = cache  # (None after the shutdown above when there is none)
        self._resume, self._cut_short = (clean if clean["mid_epoch"] else None), None
        self._lens_told.forget_cut()

    # ---- lifecycle ----
    # Lightning's teardown reads _iterator and sets it to None to end a DataLoader's workers.
    _iterator = property(lambda self: None, workers.lightning_reset)

    def close(self) -> None:
        """Stops the reader and the workers of the wrapped loader, also of the DataLoader
        iterators it keeps (:func:`.workers.end_loader_workers`), frees the cache. Idempotent;
        also run (reader part) at garbage collection and exit; in a fork, only marks it closed."""
        self._closed, self._current = True, None
        self._finalizer()
        if not self._shared.origin.forked():
            join_failed(self._shared, self._close_timeout)
            workers.end_loader_workers(self._loader)

    def __enter__(self) -> EchoLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        e = "auto" if self._controller is not None else f"{self._factor:g}"
        return f"EchoLoader(echo_factor={e}, epoch={self._epoch}, closed={self._closed})"
