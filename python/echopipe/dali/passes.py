"""The passes of an epoch-aligned echo stream: :class:`EpochPasses`, the part of
:class:`~.echo_pair.EchoPair` that says how long a pass is and ends it.

A pass is ``epochs`` reader epochs of this shard, each sample emitted e times (see
:mod:`.epochs`). DALI's reader pads every shard's epoch to as many batches as the largest
shard's (``pad_last_batch``), so that the ranks of a job take equal steps; a pass is padded the
same way, with padding-only batches once this shard's copies are out (the downstream queue
hands them out up to :meth:`EpochPasses.pass_span`'s batches). ``DROP`` ends every shard's
epoch after the smallest shard's whole batches: :meth:`EpochPasses.drop_rest` drops the rest.

A reset ends a pass and the next one starts at the next draw, so that a ``set_echo_factor``
between them reaches the whole next pass (its padding included: the queue reads the pass's
batches at its first one). ``EchoIterator.reset()`` inside an epoch drops the rest of the pass,
so that the next epoch is a whole pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nvidia.dali.plugin.base_iterator import LastBatchPolicy

from .epochs import PassSpan, await_pass_end, drop_rest_of_pass, epoch_copies, pass_span


class EpochPasses:
    """How long a pass is, and its end (a mixin of :class:`~.echo_pair.EchoPair`, whose
    config, reader, cache, built parts and start it uses)."""

    config: Any
    reader_epochs: Any
    cache: Any
    shard_size: int
    batch_size: int
    _started: bool
    _restore: dict[str, Any] | None
    _closed: bool
    # A reset came inside the pass (see reset()); the pass's end was reported since then.
    _pass_goes_on: bool
    _end_reported: bool
    # The pass ended and was reset; the next one starts at the next draw (see reset()).
    _pass_pending: bool
    # A DALI iterator given reader_name= read the pass's length: its resets end passes.
    _passes_counted: bool
    start: Callable[[], None]
    _built_parts: Callable[[], tuple[Any, Any]]
    _running_queue: Callable[[], Any]
    _fill_for_next_run: Callable[[], None]
    _raise_runner_error: Callable[[], None]

    @property
    def finite(self) -> bool:
        """True when the stream ends after ``epochs`` reader epochs (epoch-aligned, the default
        with a reader); False for the free-running stream (``epochs=None``). Builds the DALI
        pipelines (nothing runs)."""
        _ = self.shard_size  # builds: resolves epochs="auto"
        return self.config.epochs is not None

    def epoch_copies(self) -> int:
        """Copies of samples in one pass of an epoch-aligned stream: ``epochs`` times e times
        this shard's size (see :meth:`ReaderEpochs.copies`); 0 for a free-running stream."""
        return epoch_copies(self.config, self.reader_epochs) if self.finite else 0

    def pass_span(self) -> PassSpan | None:
        """The copies of a pass here and on the reader's other shards, from which every
        shard's pass gets the same batches (None for a free-running stream)."""
        return pass_span(self.config, self.reader_epochs) if self.finite else None

    def pass_copies(self, policy: Any = None) -> int:
        """The copies of a pass an iterator with last-batch ``policy`` counts, the same on
        every shard: the largest shard's, which every pass is padded to, and for ``DROP`` the
        smallest shard's (its whole batches are what every shard keeps); 0 for a free-running
        stream."""
        span = self.pass_span()
        if span is None:
            return 0
        return span.least if policy == LastBatchPolicy.DROP else span.most

    def _padded_pass_batches(self) -> int | None:
        # Shards of one size fill the same batches: their passes simply end with the data.
        span = self.pass_span()
        return None if span is None or span.most == span.least else span.batches(self.batch_size)

    def reset(self, drop_rest: bool = False) -> None:
        """Ends this pass of an epoch-aligned stream once it is over: its end was drawn
        (:meth:`next_batch` raised StopIteration), all its copies were handed out, or a DALI
        iterator given ``reader_name=`` counted its epoch (its ``DROP`` ends it before a larger
        shard's last copies, which are dropped). The next pass starts at the next draw, so a
        :meth:`set_echo_factor` before it applies to all of it. Inside a pass, an iterator that
        counts its own epochs (DALI's, given ``size=``) ended one: the stream then goes on into
        the next pass at its end (:meth:`EchoPipeline.share_outputs`); ``drop_rest=True``
        (:meth:`EchoIterator.reset`) drops the rest of the pass instead, so that the next epoch
        is a whole pass."""
        if (not self._started and self._restore is None) or self._pass_pending:
            return
        self.start()  # (idempotent) a restored pass that had ended: its reset starts the next
        if not self.finite:
            return
        runner, queue = self._built_parts()
        over = queue.input_done or queue.handed >= self.epoch_copies() or self._passes_counted
        if over:
            self.finish_pass()
        elif drop_rest:
            queue.end_pass()  # DALI's prepared batches and the stash, counted as discarded
            queue.copies_discarded += drop_rest_of_pass(
                self.cache, self.config.batch_size, **self._pass_waits()
            )
            self._end_pass(runner, queue)
        else:
            self._pass_goes_on = True

    def drop_rest(self) -> int:
        """Draws the copies of this pass not handed out yet and drops them; returns how many
        (``DROP`` ends every shard's epoch after the smallest shard's whole batches). The next
        pass starts at :meth:`finish_pass`."""
        if not self.finite or self._pass_pending:
            return 0
        return self._running_queue().drop_rest()

    def finish_pass(self) -> int:
        """Ends this pass where it stands (:meth:`drop_rest`); the next one starts at the next
        draw. Returns the copies dropped."""
        if not self.finite or self._pass_pending:
            return 0  # (a reset already ended it)
        dropped = self.drop_rest()
        self._end_pass(*self._built_parts())
        return dropped

    def _pass_waits(self) -> dict[str, Any]:
        return {
            "fill": self._fill_for_next_run if self.config.deterministic else None,
            "check_upstream": self._raise_runner_error,
            "closed": lambda: self._closed,
        }

    def _end_pass(self, runner: Any, queue: Any) -> None:
        self._pass_goes_on = self._end_reported = False
        await_pass_end(runner, **self._pass_waits())
        queue.end_pass()
        self._pass_pending = True

    def _begin_pass(self) -> None:
        """Starts the pass a reset ended the last one for. The cache takes puts again before
        the runner may step: a runner that stepped first would put into an ended cache
        (InputEndedError ends the upstream for good)."""
        if self._pass_pending:
            self._pass_pending = False
            self.cache.reset_input()
            self._built_parts()[0].next_pass()
