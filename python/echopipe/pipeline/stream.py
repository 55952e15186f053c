"""One stream abstraction for CPU and CUDA, so stage code never branches on the device.

On CUDA a :class:`DeviceStream` wraps a ``torch.cuda.Stream``; on CPU it is a placeholder whose
operations do nothing (CPU work is synchronous in its thread). Every stage owns a compute stream
and a copy stream on its device. A tensor crosses from stage ``k`` to stage ``k+1`` like this:
the sender records an event on its compute stream after producing the tensor; the receiver's
copy stream waits for that event, copies, and records a second event that the receiver's
compute stream waits for. Compute on one stage then overlaps the copies of the next minibatch.
Allocations used on a stream other than the one that made them are marked with
``record_stream`` so the caching allocator does not reuse them too early.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BusyTimer",
    "DeviceStream",
    "KeepAlive",
    "StreamEvent",
    "caller_event",
    "synchronize_devices",
    "transfer",
]


@dataclass
class StreamEvent:
    """A point in a stream's work; ``None`` inside means 'already complete' (CPU)."""

    event: torch.cuda.Event | None = None

    def synchronize(self) -> None:
        """Block the calling thread until the work before this event has finished."""
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        """Whether the work before this event has finished (never blocks)."""
        return self.event is None or bool(self.event.query())


def caller_event(tensor: torch.Tensor) -> StreamEvent:
    """The point in the calling thread's current stream after which ``tensor`` is ready.

    A batch the caller made on a GPU (DALI's output copied on torch's current stream, a cast)
    may still be in flight when it is handed to a stage, whose streams do not wait for the
    caller's stream on their own. Already complete for CPU tensors.
    """
    if not tensor.is_cuda:
        return StreamEvent()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return StreamEvent(event)


def synchronize_devices(devices: list[torch.device]) -> None:
    """Wait for all work queued on the CUDA devices among ``devices`` (weights moved or loaded
    on the caller's stream must be complete before stage streams read them); no-op on CPU."""
    for device in dict.fromkeys(d for d in devices if d.type == "cuda"):
        torch.cuda.synchronize(device)


class KeepAlive:
    """Holds tensors until an event fires.

    ``record_stream`` only covers streams of the tensor's own device. A source tensor read by a
    copy stream on another GPU is kept referenced here until the copy's event completes, so
    the caching allocator cannot hand its memory to new work on the sender's device too early.
    """

    def __init__(self) -> None:
        self._held: list[tuple[torch.Tensor, StreamEvent]] = []

    def hold(self, tensor: torch.Tensor, until: StreamEvent) -> None:
        """Keep ``tensor`` alive until ``until`` has fired."""
        self._held.append((tensor, until))
        self.release_done()

    def release_done(self) -> None:
        """Let go of the tensors whose events have fired (all of them once the streams the
        events are on have been synchronised)."""
        self._held = [(t, e) for t, e in self._held if not e.done()]

    def __len__(self) -> int:
        return len(self._held)


class DeviceStream:
    """A compute or copy stream on ``device``: a CUDA stream, or a no-op on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=device) if device.type == "cuda" else None
        )

    @property
    def is_cuda(self) -> bool:
        """Whether this wraps a real CUDA stream."""
        return self._stream is not None

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Make this the current stream (and device) of the calling thread inside the block."""
        if self._stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            yield

    def record(self) -> StreamEvent:
        """Record an event marking all work queued on this stream so far."""
        if self._stream is None:
            return StreamEvent()
        event = torch.cuda.Event()
        event.record(self._stream)
        return StreamEvent(event)

    def timing_mark(self, clock: Callable[[], float] = time.perf_counter) -> Any:
        """A point to time work from: host seconds from ``clock`` on CPU, a timing event on
        CUDA."""
        if self._stream is None:
            return clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def wait(self, event: StreamEvent) -> None:
        """Make future work on this stream wait for ``event`` (no host blocking)."""
        if self._stream is not None and event.event is not None:
            self._stream.wait_event(event.event)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator that ``tensor`` is used on this stream."""
        if self._stream is not None and tensor.is_cuda:
            tensor.record_stream(self._stream)

    def synchronize(self) -> None:
        """Block the calling thread until all work on this stream has finished."""
        if self._stream is not None:
            self._stream.synchronize()


class BusyTimer:
    """Seconds of work a stream does inside :meth:`span` blocks, without the waits between.

    A stage's busy time per minibatch is the pace its pipeline keeps once the input is instant:
    the training loop cannot see it, because ``train_step`` returns as soon as a minibatch is
    queued and the stages run in their own threads. On CPU a span is host time read from
    ``clock`` (the work is synchronous in the stage's thread); on CUDA it is the time between
    two timing events on the stream, read only once they have completed, so neither side ever
    blocks. Spans are appended by the stage's thread and read by another (deque appends and
    pops are atomic).
    """

    def __init__(
        self, stream: DeviceStream, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._stream = stream
        self._clock = clock
        self._spans: collections.deque[tuple[Any, Any]] = collections.deque()

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        """Time the work queued on the stream inside the block."""
        start = self._stream.timing_mark(self._clock)
        try:
            yield
        finally:
            self._spans.append((start, self._stream.timing_mark(self._clock)))

    def take(self) -> tuple[float, int]:
        """``(seconds, spans)`` of the spans completed since the last call."""
        seconds, count = 0.0, 0
        while self._spans:
            start, end = self._spans[0]
            if isinstance(end, float):
                seconds += end - start
            elif end.query():
                seconds += start.elapsed_time(end) / 1000.0
            else:
                break
            self._spans.popleft()
            count += 1
        return seconds, count


def transfer(
    tensor: torch.Tensor,
    ready: StreamEvent,
    copy_stream: DeviceStream,
    compute_stream: DeviceStream,
    keep_alive: KeepAlive | None = None,
) -> torch.Tensor:
    """Move ``tensor`` (valid once ``ready`` fires) to the stage that owns the two streams.

    The copy runs on ``copy_stream``; the compute stream is made to wait for it. On CPU, or when
    the tensor already lives on the target device, this returns the tensor itself after making
    the compute stream wait for ``ready``.
    """
    target = compute_stream.device
    if tensor.device == target:
        compute_stream.wait(ready)
        compute_stream.keep_alive(tensor)
        return tensor
    if not copy_stream.is_cuda and not tensor.is_cuda:
        return tensor.to(target)
    # Source on some CUDA device or destination on CUDA: copy on the receiver's copy stream.
    # A CUDA-to-CPU copy must finish before CPU compute uses it, so block on that path.
    if tensor.is_cuda and not copy_stream.is_cuda:
        ready.synchronize()
        return tensor.to(target)
    copy_stream.wait(ready)
    with copy_stream.use():
        moved = tensor.to(target, non_blocking=True)
    copied = copy_stream.record()
    if tensor.is_cuda and tensor.device == target:  # pragma: no cover - handled above
        copy_stream.keep_alive(tensor)
    elif tensor.is_cuda and keep_alive is not None:
        keep_alive.hold(tensor, copied)
    elif tensor.is_cuda:
        copied.synchronize()  # no holder given: be safe rather than fast
    compute_stream.wait(copied)
    compute_stream.keep_alive(moved)
    return moved
