"""What the echo cache hands back: its errors, counters, emitted samples and gathered batches.

Public through :mod:`echopipe.echo`; see there for how they are made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "CacheClosedError",
    "CacheForkedError",
    "CacheStateError",
    "CacheTooSmallError",
    "EchoBatch",
    "EchoCacheError",
    "EchoSample",
    "EchoStats",
    "InputEndedError",
    "SampleTooLargeError",
]


class EchoCacheError(Exception):
    """Base of every error the echo cache raises on its own account (not TimeoutError, and not
    the ValueError of a bad argument). Catch a subclass to handle one case: no caller needs to
    read a message."""


class CacheClosedError(EchoCacheError, RuntimeError):
    """Raised by blocking calls on a cache that was closed (possibly while they waited)."""


class CacheForkedError(EchoCacheError, RuntimeError):
    """Raised by any use of a cache, an ``EchoLoader`` or an ``EchoPipeline`` in a process forked
    from the one that made it (a ``DataLoader`` worker of the ``fork`` start method, an
    ``os.fork()`` child). The fork's copy is private to it: each forked process would hand out
    the same samples again, and the threads that fed the copy do not exist there. Make the
    object in the process that uses it, after the fork, or keep it in the main process around
    the ``DataLoader``. ``creator_pid`` and ``pid`` name the two processes (None where the
    error was rebuilt from its message, as torch does with a worker's error)."""

    def __init__(
        self, message: str, creator_pid: int | None = None, pid: int | None = None
    ) -> None:
        super().__init__(message)
        self.creator_pid = creator_pid
        self.pid = pid


class InputEndedError(EchoCacheError, RuntimeError):
    """Raised by :meth:`EchoCache.put` after :meth:`EchoCache.end_of_input`."""


class SampleTooLargeError(EchoCacheError, ValueError):
    """A sample larger than the cache's arena: it can never be stored (raised by the native
    core, which the bindings map to this class).

    Attributes:
        sample_bytes: The sample's size in the arena (each field rounded up to 64 bytes).
        capacity_bytes: The arena's size (``capacity_bytes`` of the cache).
    """

    def __init__(self, message: str, sample_bytes: int, capacity_bytes: int) -> None:
        super().__init__(message)
        self.sample_bytes = int(sample_bytes)
        self.capacity_bytes = int(capacity_bytes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.sample_bytes, self.capacity_bytes))


class CacheTooSmallError(EchoCacheError, ValueError):
    """A deterministic reader's cache (a DALI pipeline's with ``deterministic=True``, an
    ``EchoLoader(deterministic=True)``) is full by bytes while it holds fewer samples than a
    draw waits for: the draw can never start, and the reader waits for it.

    Attributes:
        resident: Samples the cache held.
        wanted: Samples the draw waits for.
        need_bytes: A ``capacity_bytes`` that would hold them (estimated from the samples'
            sizes).
    """

    def __init__(self, message: str, resident: int, wanted: int, need_bytes: int) -> None:
        super().__init__(message)
        self.resident, self.wanted, self.need_bytes = int(resident), int(wanted), int(need_bytes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.resident, self.wanted, self.need_bytes))


class CacheStateError(EchoCacheError, ValueError):
    """A saved state the cache cannot load: corrupt or truncated, another format version, a
    mode, ``batch_size`` or ``capacity_samples`` other than the cache's, too large for its
    arena, or a cache that is not empty (raised by the native core)."""


@dataclass(frozen=True)
class EchoStats:
    """Counters of one cache at one moment (see ``docs/echo_cache.md`` for definitions)."""

    fresh_in: int
    emitted: int
    resident: int
    resident_with_tickets: int
    tickets_left: int
    retired: int
    bytes_used: int
    capacity_bytes: int
    capacity_samples: int
    probe_slots: int
    emit_histogram: list[int]
    mean_reuse_distance: float
    reuse_pairs: int
    memory_kind: str
    puts_blocked: int
    producers_waiting: int
    put_blocked_seconds: float
    takes_waited: int
    take_wait_seconds: float
    closed: bool
    input_ended: bool

    @property
    def echo_ratio(self) -> float:
        """Copies emitted per fresh sample so far."""
        return self.emitted / self.fresh_in if self.fresh_in else 0.0


class EchoSample:
    """One emitted copy of a sample: zero-copy, read-only views of its fields.

    The views (and this object) keep the sample's slot leased; the cache reuses the memory only
    after every copy of the sample was emitted and every view of it was dropped.
    """

    __slots__ = ("_arrays", "_lease")

    def __init__(self, lease: Any) -> None:
        self._lease = lease
        self._arrays: tuple[np.ndarray, ...] | None = None

    @property
    def sample_id(self) -> int:
        """Id the cache gave the sample when it was put (0, 1, 2, ... in commit order)."""
        return int(self._lease.sample_id)

    @property
    def emission(self) -> int:
        """Which copy this is, 0 .. tickets-1."""
        return int(self._lease.emission)

    @property
    def tickets(self) -> int:
        """How many copies of this sample are emitted in total."""
        return int(self._lease.tickets)

    @property
    def index_in_batch(self) -> int:
        """Position inside its echoed batch (batch mode; always 0 in example mode)."""
        return int(self._lease.index_in_unit)

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """Read-only numpy views of every field (bfloat16 fields appear as uint16)."""
        if self._arrays is None:
            self._arrays = tuple(self._lease.array(i) for i in range(self._lease.num_fields))
        return self._arrays

    def __len__(self) -> int:
        return int(self._lease.num_fields)

    def __getitem__(self, field: int) -> np.ndarray:
        return self.arrays[field]

    @property
    def array(self) -> np.ndarray:
        """The first field (the whole sample when it has a single field)."""
        return self.arrays[0]

    def dtype(self, field: int = 0) -> str:
        """The stored dtype name of a field (e.g. ``"bfloat16"``, which numpy shows as uint16)."""
        return str(self._lease.dtype(field))

    def torch(self, field: int = 0) -> Any:
        """A torch CPU tensor holding a *copy* of a field (pinned when the cache is pinned).

        The cache's memory is shared by every copy of the sample still to be emitted, and torch
        has no read-only tensors, so a zero-copy tensor would let an in-place op (``sub_``,
        ``clamp_``...) silently change the copies emitted later. This copy can be written freely.
        For zero-copy reads use :attr:`arrays` (read-only numpy views: a write raises) or
        :meth:`EchoCache.take_batch`.
        """
        import torch

        out = torch.from_numpy(np.array(self.arrays[field], copy=True))
        if self._lease.device_ptr(field) != 0:  # a GPU-mapped (pinned) arena: keep it pinned
            out = out.pin_memory()
        if self.dtype(field) == "bfloat16":
            out = out.view(torch.bfloat16)
        return out

    def __repr__(self) -> str:
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in self.arrays)
        return f"EchoSample(id={self.sample_id}, copy={self.emission}/{self.tickets}, {shapes})"


@dataclass
class EchoBatch:
    """A gathered batch: each field in one new contiguous array.

    ``fields[f]`` has shape ``(N, *shape)`` when all samples agree on the field's shape; otherwise
    it is flat and ``offsets[f]`` (int64, N + 1 element offsets) delimits the samples, whose shapes
    are in ``shapes[i][f]``.
    """

    fields: list[np.ndarray]
    offsets: list[np.ndarray | None]
    dtypes: list[str]
    shapes: list[tuple[tuple[int, ...], ...]]
    sample_ids: np.ndarray
    emissions: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample(self, index: int, field: int = 0) -> np.ndarray:
        """Field ``field`` of sample ``index`` as an array of its own shape (a view)."""
        arr = self.fields[field]
        offs = self.offsets[field]
        if offs is None:
            return arr[index]
        return arr[offs[index] : offs[index + 1]].reshape(self.shapes[index][field])
