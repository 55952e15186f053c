"""The reader thread of :class:`echopipe.torch.EchoLoader`: one epoch of the wrapped loader
into the echo cache, stoppable at any point, with the wrapped loader's workers ended with it.

It holds the loader only weakly and shares a small :class:`.shared.Shared` record with it, so
that the loader can be garbage collected (its finalizer then stops the reader and closes the
cache).
"""

from __future__ import annotations

import threading
import time
import traceback
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..echo import CacheClosedError
from . import batch_layout as bl
from . import order, workers, wrapped
from .workers import release_iterator

if TYPE_CHECKING:
    from .loader import EchoLoader

POLL_S = 0.2  # longest single wait; closing or an error ends every wait sooner
_BLOCKED_S = 0.005  # a put that took longer waited for space (copying a batch takes less)


class LoaderError(RuntimeError):
    """The wrapped loader raised; the message names the batch, ``__cause__`` is the original."""


class Lockstep:
    """The hand-over of a deterministic ``EchoLoader``: the consumer draws a batch only once the
    reader has put every fresh sample the cache has room for (or the input is over), and the
    reader puts again only after that batch; so every draw sees resident samples that depend on
    the seed and the input order alone, not on how far the reader thread got."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.takes = 0  # batches the consumer drew
        self.settled = -1  # the ``takes`` after which the reader found the cache full
        self.over = False  # the reader puts nothing more this epoch

    def seen(self) -> int:
        """Reader: the draws so far, read before a put (a draw after it frees more room)."""
        with self.cond:
            return self.takes

    def settle(self, seen: int, stop: threading.Event) -> None:
        """Reader: the cache was full after ``seen`` draws; waits for the next one."""
        with self.cond:
            self.settled = seen
            self.cond.notify_all()
            while self.takes == seen and not stop.is_set():
                self.cond.wait(POLL_S)

    def finish(self) -> None:
        """Reader: the epoch's input ended (or failed, or was stopped)."""
        with self.cond:
            self.over = True
            self.cond.notify_all()

    def ready(self) -> bool:
        """Consumer: whether it may draw now."""
        return self.over or self.settled == self.takes

    def wait(self) -> bool:
        """Consumer: waits at most one poll slice for :meth:`ready`."""
        with self.cond:
            if not self.ready():
                self.cond.wait(POLL_S)
            return self.ready()

    def took(self) -> None:
        """Consumer: a batch was drawn (its copies' slots are free again)."""
        with self.cond:
            self.takes += 1
            self.cond.notify_all()


class Producer(threading.Thread):
    """Reads one epoch of the wrapped loader into the cache (one thread per epoch)."""

    def __init__(self, owner: EchoLoader, epoch: int, resume: dict[str, Any] | None) -> None:
        """``resume``: the checked state of a mid-epoch position to continue from, or None."""
        super().__init__(name=f"echopipe-echoloader-{epoch}", daemon=True)
        self.source = owner._loader
        self.shared = owner._shared
        self.owner_ref = weakref.ref(owner)
        self.epoch = epoch
        self.skip_batches = resume["batches_done"] if resume is not None else 0
        self.skip_rows = resume["rows_in_flight"] if resume is not None else 0
        self.stop = threading.Event()
        self.ready = threading.Event()  # the cache exists and the batches' layout is known
        self.lock = threading.Lock()  # held while samples go in: state_dict() waits on it
        # The wrapped loader's iterator while the reader waits in its next() (else None; set
        # under wake_lock): shutdown() wakes that wait (see .workers.wake).
        self.wake_lock = threading.Lock()
        self.waiting_in: Any = None
        self.error: BaseException | None = None
        self.batches_done = self.skip_batches  # whole batches in the cache (this epoch)
        # Rows of the next batch already in the cache: a resumed epoch starts with the saved
        # ones (a state saved while the reader still skips the batches before them keeps them).
        self.rows_in_flight = self.skip_rows
        self.samples_put = 0
        self.up_seconds = 0.0  # time in the wrapped loader, for batches it had to make
        self.up_batches = 0
        # While a full cache blocks the reader, a loader with worker processes fills its
        # prefetch queue and then idles: the queued batches arrive at once (t_up would look too
        # small) and the next one takes a whole batch's latency, not the workers' interval
        # (too large). Those batches are left out of t_up; while the cache stays full (the
        # trainer is the bottleneck, e >= R) t_up is not observable and e stays.
        n_workers = getattr(self.source, "num_workers", 0) or 0
        self.prefetched = n_workers * ((getattr(self.source, "prefetch_factor", 0) or 0) + 1)
        self.taint = 0  # batches still to leave out of t_up
        self.layout: bl.Layout | None = None  # the stream's, once a batch was accepted
        # (samples, batch size) where the DataLoader's batching fixes every batch's rows
        self.batching = wrapped.batch_rows(self.source)
        self.drop_last = wrapped.drops_last(self.source)
        # The epoch of the wrapped loader's epoch-seeded sampler whose order this pass reads:
        # known once its first batch came (the sampler's order is fixed by then); a resumed
        # pass starts with the saved one.
        self.sampler_epoch: int | None = resume["sampler_epoch"] if resume is not None else None
        # The states of the generators the pass draws its order from (a shuffling DataLoader
        # with generator=), taken before it starts; a resumed pass starts from the saved ones.
        self.order_rng: list[bytes] | None = resume["order_rng"] if resume is not None else None
        # Whether that pass made the DataLoader's iterator (:func:`.wrapped.new_iterator`).
        self.order_new: bool | None = resume["order_new"] if resume is not None else None
        self.lockstep = Lockstep() if owner._deterministic else None
        # The output batch size comes from the first batch (nothing else tells it), so a batch
        # sampler with a schedule of sizes is warned about once (see _note_size).
        self.first_rows_size = (
            not owner._explicit_batch and wrapped.input_batch_size(self.source) is None
        )

    def run(self) -> None:
        it: Any = None
        draw: order.SeedDraw | None = None
        finished = False
        try:
            if self.sampler_epoch is not None:
                # A resumed pass re-reads the order its state was saved in, whatever the sampler
                # was set to since (Lightning's set_epoch comes after the first batch when the
                # loader has no len()).
                wrapped.set_sampler_epoch(self.source, self.sampler_epoch)
            generators = wrapped.order_generators(self.source)
            restore = self.order_rng is not None and len(self.order_rng) == len(generators)
            if restore:
                for gen, saved in zip(generators, self.order_rng or [], strict=True):
                    gen.set_state(torch.frombuffer(bytearray(saved), dtype=torch.uint8))
            now = order.new_iterator(self.source)
            with self.lock:
                self.order_rng = [bytes(g.get_state().numpy()) for g in generators] or None
                self.order_new = now if self.order_new is None else self.order_new
            draw = order.SeedDraw(self.source, self.order_new if restore else None, now)
            it = iter(self.source)
            index = 0
            while True:
                with self.wake_lock:  # stop checked under it: shutdown() sees the wait or stop
                    if self.stop.is_set():
                        break
                    self.waiting_in = it
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    finished = True
                    break
                except Exception as exc:
                    raise LoaderError(
                        f"EchoLoader: the wrapped loader raised at batch {index} of epoch "
                        f"{self.epoch}: {type(exc).__name__}: {_summary(exc)}"
                    ) from exc
                finally:
                    self.waiting_in = None
                    draw.done()
                if index == 0 and self.sampler_epoch is None:
                    with self.lock:
                        self.sampler_epoch = wrapped.sampler_epoch(self.source)
                if index < self.skip_batches:  # read before a resume: only checked
                    self._put(batch, index, 0, skip=True)
                else:
                    if self.taint:
                        self.taint -= 1
                    else:
                        self.up_seconds += time.perf_counter() - t0
                        self.up_batches += 1
                    t1 = time.perf_counter()
                    self._put(batch, index, self.skip_rows if index == self.skip_batches else 0)
                    if time.perf_counter() - t1 > _BLOCKED_S:
                        self.taint = self.prefetched
                index += 1
            if not self.stop.is_set():
                cache = self.shared.cache
                if cache is not None:
                    cache.end_of_input()
        except CacheClosedError:
            pass  # closed by close() or an aborted epoch
        except BaseException as exc:
            self.error = exc
            if self.stop.is_set():
                # Nobody takes the error of a reader told to stop (wake's, say): its frames
                # would keep the wrapped iterator, its queues and their threads alive.
                _drop_frames(exc)
            # A reader left behind by close() (its wrapped loader did not return in time) must
            # not end the input of the cache a later epoch made.
            cache = self.shared.cache
            if cache is not None and not self.stop.is_set():
                cache.end_of_input()  # wakes the consumer, which raises self.error
        finally:
            if draw is not None:
                draw.done()
            release_iterator(it, finished)
            it = None
            self.ready.set()
            if self.lockstep is not None:
                self.lockstep.finish()

    def _put(self, batch: Any, index: int, start: int, skip: bool = False) -> None:
        try:
            known = bl.match(self.layout, batch) if self.layout is not None else None
            if known is None:
                layout, leaves, rows = bl.describe(batch)
            else:
                layout, (leaves, rows) = self.layout, known
            self._check_rows(index, rows)
            owner = self.owner_ref()
            if owner is None:
                raise CacheClosedError("EchoLoader was garbage collected")
            cache = owner._accept_layout(layout, rows, self.stop)
            if self.first_rows_size:
                self._note_size(index, rows, owner._batch_size)
        except bl.ShapeChangeError as exc:
            raise bl.ShapeChangeError(
                f"EchoLoader: batch {index} of epoch {self.epoch}: {exc} "
                f"({wrapped.shape_source(self.source)} gave it): pad or resize to a fixed shape "
                "in the dataset or collate_fn (a multi-scale schedule can resize the echoed "
                "batches in the training step), or change the shape only between epochs"
            ) from None
        except bl.LayoutError as exc:
            raise bl.LayoutError(
                f"EchoLoader: batch {index} of epoch {self.epoch}: {exc}"
            ) from None
        del owner
        if self.layout is None:
            self.ready.set()  # (Event.set takes a lock and notifies: once is enough)
        self.layout = layout
        if skip or rows == 0:
            return
        fields = bl.encode(layout, leaves, rows)
        done = start
        step = self.lockstep
        wait = POLL_S if step is None else 0.0  # in lockstep a full cache waits for a draw
        while done < rows:
            if self.stop.is_set():
                raise CacheClosedError("stopped")
            seen = step.seen() if step is not None else 0
            full = False
            with self.lock:
                before = done
                if layout.strings:
                    texts, lengths = bl.encode_strings(layout, leaves, done)
                    try:
                        cache.put((*(f[done] for f in fields), texts, lengths), timeout=wait)
                        done += 1
                    except TimeoutError:
                        full = True
                else:
                    try:
                        done += cache.put_batch([f[done:] for f in fields], timeout=wait)
                    except TimeoutError as exc:  # the cache stayed full: retry the rest
                        done += exc.rows_put
                        full = True
                self.samples_put += done - before
                self.rows_in_flight = done
                if done == rows:
                    self.batches_done = index + 1
                    self.rows_in_flight = 0
            if full and step is not None:
                step.settle(seen, self.stop)

    def _note_size(self, index: int, rows: int, size: int | None) -> None:
        """Warns once when a batch of the wrapped loader is larger than the output batches
        (``size``, its first batch's): every sample is still echoed ``e`` times, but in batches
        of the first size, which a schedule of batch sizes may start small. Smaller batches are
        not warned about: a last batch, or each worker's last batch of an iterable dataset."""
        if size is None or rows <= size:
            return
        self.first_rows_size = False
        warnings.warn(
            f"EchoLoader: {wrapped.shape_source(self.source)} gives batches of different "
            f"sizes ({size} samples in the first, {rows} in batch {index} of epoch "
            f"{self.epoch}); every EchoLoader batch holds {size} samples: pass batch_size= to "
            "EchoLoader to choose the size",
            RuntimeWarning,
            stacklevel=1,
        )

    def _check_rows(self, index: int, rows: int) -> None:
        """A batch's rows against the samples the DataLoader's batching gives batch ``index``:
        a batch that is a list of per-sample tensors (``collate_fn=list``, a detection-style
        ``tuple(zip(*batch))``) would otherwise be read as fields whose rows are the samples'
        first dimension, and echo mixed-up samples without an error."""
        if self.batching is None:
            return
        samples, size = self.batching
        full, rest = divmod(samples, size)
        want = size if index < full else rest if index == full and rest else None
        if want is not None and rows != want:
            raise bl.LayoutError(
                f"its fields have {rows} rows, but the wrapped DataLoader's batch {index} holds "
                f"{want} samples (batch_size={size}, {samples} per epoch); EchoLoader needs "
                "one row per sample in every tensor (a collate_fn that returns a list of "
                "per-sample tensors gives none: stack or pad them into one tensor; one that "
                "puts several views of a sample in rows of their own, as timm's fast_collate "
                "with augmentation splits, gives more: echo the wrapped loader without them)"
            )

    @property
    def drop_below(self) -> int:
        """An epoch's last batch with fewer samples is dropped (0: none is): the batch size where
        the wrapped loader drops its own short batch (:func:`.wrapped.drops_last`)."""
        owner = self.owner_ref()
        size = owner.batch_size if owner is not None and self.drop_last else None
        return size or 0

    def shutdown(self, timeout: float) -> None:
        """Stops reading; returns once the thread ended (or ``timeout`` passed, with a warning)."""
        self.stop.set()
        if self.is_alive() and threading.current_thread() is not self:
            with self.wake_lock:
                waiting_in = self.waiting_in
            workers.join_waking(self, waiting_in, self.source, timeout)
            if self.is_alive():
                warnings.warn(
                    f"EchoLoader: the wrapped loader did not return within {timeout:g}s of "
                    "close(); its reader thread is left running (a daemon thread)",
                    RuntimeWarning,
                    stacklevel=3,
                )


def _drop_frames(exc: BaseException | None) -> None:
    """Clears the finished frames of ``exc`` and of the exceptions it chains to."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _summary(exc: BaseException) -> str:
    """First and last line: a worker's error arrives as a header, a traceback and its line."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} ... {lines[-1].strip()}"
