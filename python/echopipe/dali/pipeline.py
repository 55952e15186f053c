"""Echoing DALI pipelines: write the pipeline once, mark the echo point, get two pipelines.

``@echo_pipeline_def`` turns a DALI-style pipeline function into an :class:`EchoPipeline` when the
call builds an echo point (:mod:`.tracing`). The function is traced once for each part:

* **upstream** (reader, decode, and whatever precedes :func:`echo`): ``echo(*fields)`` becomes an
  ``echopipe_echo_sink`` that stores each sample in a native echo cache. The upstream pipeline
  runs at ``upstream_batch_size`` on its own thread (or, with ``deterministic=True``, in lock-step
  with the consumer), so the reader keeps its fixed batch size.
* **downstream** (everything after :func:`echo`): ``echo(*fields)`` returns the outputs of an
  ``echopipe_echo_source`` that draws ``batch_size`` samples per iteration from the cache; each
  fresh sample is emitted floor(e) or ceil(e) times. The downstream pipeline therefore runs e
  times as many iterations as the upstream one. An extra output, ``info`` (per sample int64
  ``[valid, sample_id, emission]``), tells the consumer which samples are fresh and where a finite
  stream ends (padded samples have ``valid == 0``).

:class:`EchoPipeline` is an :class:`~.echo_pair.EchoPair` (building, running, passes and
checkpoints, each part given its inputs) plus the methods DALI's iterators call, which compute
with the functions of :mod:`.dali_api`.

Everything that waits (the sink on a full cache, the source on an empty one, the runner thread)
polls for close at least every 100 ms, and every pipeline is closed by ``close()``, by the context
manager, or at interpreter exit (``weakref.finalize``), so nothing hangs.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from .base import PipelineStats, per_batch_seconds
from .dali_api import (
    CountedSizeWarning,
    asking_iterator,
    asking_iterator_policy,
    counted_size_warning,
    decode_checkpoint,
    encode_checkpoint,
    scaled_meta,
    user_stacklevel,
)
from .echo_pair import EchoPair
from .epochs import EpochSizeChangedError


class PipelineNotSerializableError(TypeError):
    """``serialize()`` on an :class:`EchoPipeline`: it is two DALI pipelines joined by an echo
    cache that lives in this process, which no serialized DALI pipeline can carry."""


class EchoPipeline(EchoPair):
    """An upstream and a downstream DALI pipeline joined by a native echo cache.

    Create it with :func:`echo_pipeline_def`. Iterate it with :class:`~echopipe.dali.EchoIterator`
    (PyTorch, with echo statistics), with DALI's own ``DALIGenericIterator`` /
    ``DALIClassificationIterator`` (the methods they call: :mod:`.dali_api`), or
    call :meth:`next_batch` for raw DALI outputs. DALI pipelines are built lazily
    (by :attr:`shard_size` or :meth:`start`, at the latest on the first batch) and nothing runs
    before the first batch, so :meth:`load_state_dict` can restore a checkpoint until then.

    Args:
        on_upstream_error: optional ``callback(error) -> exception or None`` called when the
            upstream DALI pipeline fails; an exception it returns is raised to the consumer
            (chained to ``error``) instead of the default ``RuntimeError``. See
            :meth:`describe_upstream_error`.

    Attributes:
        config: the resolved :class:`EchoPipelineConfig`.
        cache_name: name of the native cache in echopipe's process-wide registry.
        cache: the :class:`echopipe.EchoCache` itself.
        upstream_wait_s: seconds the consumer spent filling the cache itself (deterministic
            mode only; free-running, the upstream runs on its own thread).
    """

    # DALI's checkpoint route: created with checkpoint=, and the iterator's data in it.
    _is_restored = False
    _iterator_data = ""
    # Copies of the pass handed out before the checkpoint it was restored from was taken.
    _restored_handed = 0
    # The copies of a pass reader_meta() last reported (what DALI's iterators count), and the
    # last-batch policy of the iterator that asked (which copies it counts).
    _told_copies: int | None = None
    _told_policy: Any = None
    # The DALI iterator whose size= was checked (each is checked once, when it builds us).
    _size_checked_for: Any = None

    # -- the methods DALI's iterators call (:mod:`.dali_api`) --

    @property
    def max_batch_size(self) -> int:
        """The downstream batch size (what each iteration returns)."""
        return int(self.config.batch_size)

    @property
    def batch_size(self) -> int:
        """Same as :attr:`max_batch_size`."""
        return self.max_batch_size

    def build(self) -> None:
        """Builds both DALI pipelines (idempotent; nothing runs). A DALI iterator being created
        with ``size=`` that will not count one echoed pass per epoch is warned about
        (:class:`~.dali_api.CountedSizeWarning`, at the line that created it)."""
        self._build()
        iterator = asking_iterator()
        checked = self._size_checked_for
        if iterator is not None and (checked is None or checked() is not iterator):
            self._size_checked_for = weakref.ref(iterator)  # (no cycle through the iterator)
            self._check_counted_size(int(getattr(iterator, "_size", -1)))

    def _check_counted_size(self, size: int) -> None:
        if size <= 0:
            return  # (reader_name=, or no size: DALI counts what reader_meta reports)
        span = self.pass_span()
        if span is None or self.reader_epochs is None:
            return  # a free-running stream: any count of samples is an epoch
        why = counted_size_warning(size, self.max_batch_size, span, self.config, self.reader_epochs)
        if why is not None:
            warnings.warn(CountedSizeWarning(why), stacklevel=user_stacklevel())

    @property
    def device_id(self) -> int | None:
        """The CUDA device of both DALI pipelines (None for CPU-only pipelines)."""
        return self._device_id

    @property
    def exec_dynamic(self) -> bool:
        self.build()
        return bool(self.downstream.exec_dynamic)

    @property
    def is_restored_from_checkpoint(self) -> bool:
        """True when created with ``checkpoint=`` (DALI's restore route)."""
        return self._is_restored

    @property
    def _first_iter(self) -> bool:
        return not self._started

    @contextlib.contextmanager
    def _check_api_type_scope(self, api_type: Any) -> Iterator[None]:
        self.build()
        with self.downstream._check_api_type_scope(api_type):
            yield

    def reader_meta(self, name: str | None = None) -> dict[str, Any]:
        """The upstream reader's metadata with ``epoch_size`` and ``epoch_size_padded`` scaled
        by the echo factor (e fresh-sample epochs' worth of emitted samples per epoch); for an
        epoch-aligned stream, this shard's pass padded to the largest shard's, as a whole data
        set (:func:`~.dali_api.scaled_meta`).

        Read once by DALI's iterators when they are created: after ``set_echo_factor`` create
        the iterator again, or use :class:`EchoIterator`, whose epoch follows the factor.
        """
        self.build()
        policy = asking_iterator_policy()
        if policy is not None:
            self._refuse_a_restore_without_counters()
        if name is not None:
            meta: dict[str, Any] = self._scaled_meta(self.upstream.reader_meta(name), policy)
        else:
            meta = {k: self._scaled_meta(m, policy) for k, m in self.upstream.reader_meta().items()}
        # Only a DALI iterator (given reader_name=) that accepted the figures counts whole
        # passes (its reset() ends one) and holds the size it was told; a refused one, or the
        # caller's own look at the sizes, does not.
        if policy is not None:
            self._passes_counted = True
            if self.config.epochs is not None:
                self._told_policy = policy
                self._told_copies = self.pass_copies(policy)
        return meta

    def _refuse_a_restore_without_counters(self) -> None:
        # pipe.checkpoint() holds no DALI iterator's counters: the iterator created on the
        # restore would count a whole epoch from inside the pass, hand out the pass's padding
        # as samples at its end and then ask for batches after it (a ValueError a pass later).
        handed = self._restored_handed
        if self._iterator_data or not 0 < handed < self.epoch_copies():
            return
        raise ValueError(
            f"this pipeline was restored from pipe.checkpoint() taken {handed} copies into a "
            "pass, which holds no DALI iterator's counters, so a DALI iterator created on it "
            "would count a whole epoch from there; take the checkpoint with the iterator's "
            "checkpoints(), or one between two epochs"
        )

    def _end_pass(self, runner: Any, queue: Any) -> None:
        super()._end_pass(runner, queue)
        # The restored pass is over: the next begins whole, where an iterator counts rightly.
        self._restored_handed = 0

    def _scaled_meta(self, meta: dict[str, Any], policy: Any = None) -> dict[str, Any]:
        return scaled_meta(meta, self.config, self.reader_epochs, self.unaligned_reader, policy)

    def epoch_size(self, name: str | None = None) -> int | dict[str, int]:
        """Like ``Pipeline.epoch_size``: the reader's ``epoch_size_padded`` times the echo
        factor, over all its shards, as DALI reports it (for an epoch-aligned stream: the
        number of shards times the largest shard's pass, so that an iterator given
        ``size=pipe.epoch_size("Reader") // num_shards``, as older DALI programs do, counts
        one whole pass per epoch on every rank)."""
        self.build()
        if name is not None:
            return self._whole_epoch_size(name)
        return {k: self._whole_epoch_size(k) for k in self.upstream.reader_meta()}

    def _whole_epoch_size(self, name: str) -> int:
        meta = self.upstream.reader_meta(name)
        span = self.pass_span()
        if span is None:
            return int(self._scaled_meta(meta)["epoch_size_padded"])
        return int(meta["number_of_shards"]) * span.most

    def schedule_run(self) -> None:
        """Schedules downstream iterations up to the prefetch depth (fills the cache first in
        deterministic mode). Nothing between a pass's end and the next draw: DALI's iterators
        schedule at once when they reset, and the next pass starts at the next draw."""
        queue = self._running_queue()
        if not self._pass_pending:
            queue.schedule_run()

    def share_outputs(self) -> tuple[Any, ...]:
        """The next batch's outputs (without echopipe's ``info``); StopIteration at the end of
        a finite stream, unless an iterator that counts its own epochs (DALI's, given
        ``size=``) reset inside this pass: its stream goes on into the next pass. Batches
        restored from a checkpoint come first."""
        queue = self._running_queue()
        if self._pass_pending:
            self._check_told_copies()
            self._begin_pass()
        try:
            return queue.share_outputs()
        except StopIteration:
            self._check_told_copies()
            if not self._pass_goes_on:
                self._refuse_a_second_end()
                raise
        self._end_pass(*self._built_parts())
        self._begin_pass()
        return queue.share_outputs()

    def _check_told_copies(self) -> None:
        # DALI's iterators read the epoch's length once; after set_echo_factor they would end
        # the epoch inside the pass, or ask for batches after its end.
        told, copies = self._told_copies, self.pass_copies(self._told_policy)
        if told is not None and told != copies:
            raise EpochSizeChangedError(
                f"set_echo_factor({self.echo_factor:g}) made an epoch {copies} copies, but DALI's "
                f"iterator was told {told} when it read reader_meta (at its creation): create "
                "the iterator again after set_echo_factor, before its next epoch, or use "
                "echopipe.dali.EchoIterator, whose epoch follows the factor",
                told,
                copies,
            )

    def _refuse_a_second_end(self) -> None:
        # DALI's iterators given a size= longer than a pass draw on after its end without a
        # reset, and would get an empty epoch each time from then on.
        if self._end_reported:
            raise ValueError(
                "a batch was asked for after this epoch-aligned pass of "
                f"{self.epoch_copies()} copies ended, without reset(): call reset() to start "
                "the next pass (a run() loop); DALI's iterators given a size= larger than a "
                "pass do this too: give them size <= the pass's copies, reader_name= (epochs "
                "of exactly a pass), or epochs=None to the pipeline"
            )
        self._end_reported = True

    def reset(self, drop_rest: bool = False) -> None:
        """Like ``Pipeline.reset``: after a pass's end, the next pass starts at the next draw.
        Inside a pass a call of the program's own changes nothing, as ``Pipeline.reset`` does
        nothing inside an epoch: a ``run()`` loop then meets this pass's end (before, the
        stream went on into the next pass without an end between them, which only DALI's
        iterators given ``size=`` want: their reset is told apart by the stack). See
        :meth:`~.passes.EpochPasses.reset`."""
        if not drop_rest and asking_iterator() is None and self._inside_a_pass():
            return
        super().reset(drop_rest)

    def _inside_a_pass(self) -> bool:
        if not self._started or self._pass_pending or not self.finite:
            return False
        queue = self._built_parts()[1]
        return not (queue.input_done or queue.handed >= self.epoch_copies())

    def release_outputs(self) -> None:
        """Returns the buffers of the last :meth:`share_outputs` to DALI."""
        if self._queue is not None:
            self._queue.release_outputs()

    def outputs(self) -> tuple[Any, ...]:
        """Like ``Pipeline.outputs``: the next scheduled batch, released on the next call."""
        self.release_outputs()
        return self.share_outputs()

    def run(self) -> tuple[Any, ...]:
        """Like ``Pipeline.run``: schedules an iteration and returns the next batch."""
        self.schedule_run()
        return self.outputs()

    def empty(self) -> bool:
        """True when no batch is scheduled or restored and waiting to be taken."""
        return self._queue is None or self._queue.empty()

    def _get_checkpoint(self, iterator_data: str = "") -> bytes:
        if not self._enable_checkpointing:
            raise ValueError(
                "create the pipeline with enable_checkpointing=True to take DALI checkpoints"
            )
        return encode_checkpoint(self.state_dict(), iterator_data)

    def checkpoint(self, filename: str | None = None) -> bytes:
        """Like ``Pipeline.checkpoint``: the state as bytes, also written to ``filename``."""
        blob = self._get_checkpoint()
        if filename is not None:
            with open(filename, "wb") as f:
                f.write(blob)
        return blob

    def _restore_checkpoint(self, blob: bytes | str) -> None:
        state, self._iterator_data = decode_checkpoint(blob)
        self.load_state_dict(state)
        self._is_restored = True
        if not state.get("pass_pending", False):
            self._restored_handed = int(state.get("handed", 0))

    def serialize(self, *args: Any, **kwargs: Any) -> bytes:
        """Refused (:class:`PipelineNotSerializableError`): a serialized pipeline, deserialized
        or handed to a server, would be the downstream half alone, drawing from an echo cache
        nobody fills. Before, ``serialize`` was simply missing (an AttributeError)."""
        raise PipelineNotSerializableError(
            "an EchoPipeline cannot be serialized: it is two DALI pipelines joined by an echo "
            "cache in this process, which a serialized pipeline cannot carry (deserialized, its "
            "echo source would wait for samples forever); serialize the pipeline the same "
            "function builds without its echo() point"
        )

    # -- measurements --

    def upstream_time(self) -> tuple[int, float]:
        """``(upstream batches timed, seconds they cost)`` so far, in either mode, each timed by
        the thread that runs it (restored with a checkpoint); see
        :attr:`PipelineStats.upstream_batches`."""
        if self._runner is None:
            return 0, 0.0
        batches, seconds, _ = self._runner.timing()
        return batches, seconds

    def upstream_supply(self) -> tuple[int, float]:
        """``(fresh samples the upstream stored, seconds it waited for room in a full cache)``
        since this pipeline was built: read at both ends of an interval, what the upstream
        read in it and for how long it could have read more."""
        return (0, 0.0) if self._runner is None else self._runner.supply()

    def stats(self) -> PipelineStats:
        """Cache statistics plus upstream counters and timing (see :class:`PipelineStats`)."""
        s = self.cache.stats()
        batches, seconds = self.upstream_time()
        return PipelineStats(
            fresh_in=int(s.fresh_in),
            emitted=int(s.emitted),
            resident=int(s.resident),
            tickets_left=int(s.tickets_left),
            upstream_batches=batches,
            t_up_total_s=seconds,
            t_up_per_batch_s=per_batch_seconds(
                batches, seconds, self.batch_size, self.upstream_batch_size
            ),
            upstream_epochs=0 if self._runner is None else self._runner.epoch_index,
            upstream_wait_s=self.upstream_wait_s,
            downstream_wait_s=self.downstream_wait_s,
            copies_discarded=self.copies_discarded,
            emit_histogram=list(s.emit_histogram),
        )

    def __repr__(self) -> str:
        # DALI's proxy mode (DALIServer) names a pipeline it cannot take by its repr: this says
        # why and what to do instead, in that one line.
        return (
            f"EchoPipeline({self.cache_name!r}, echo_factor={self.config.echo.factor:g}): a pair "
            "of DALI pipelines joined by an echo cache, not one nvidia.dali.Pipeline; DALI's "
            "proxy mode (DALIServer) maps each output batch to one input batch, which echoing "
            "cannot keep; build the proxy pipeline without echo() and wrap the proxy's "
            "DataLoader in echopipe.torch.EchoLoader to echo its batches"
        )
