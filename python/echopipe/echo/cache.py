"""Data echoing cache: a native shuffle buffer that re-emits every sample ``e`` times on average.

:class:`EchoCache` wraps the C++ cache in ``libechopipe_core.so`` (see ``docs/echo_cache.md``).
Producers :meth:`~EchoCache.put` samples (one array or a tuple of up to 4 arrays: image, label,
metadata...), consumers :meth:`~EchoCache.take` random copies. Each fresh sample gets ``floor(e)``
or ``ceil(e)`` tickets (``ceil`` with probability ``frac(e)``) and is emitted exactly that many
times, uniformly at random among the resident samples, after a ``min_fill`` warm-up. Puts block
while the cache is full; every blocking call takes a timeout and is woken by :meth:`close`.

Reads are zero copy: :class:`EchoSample` fields are read-only numpy views of the cache's arena
(a write raises; :meth:`EchoSample.torch` returns a copy, since torch has no read-only tensors),
and each view keeps its slot leased (not reused) until the view is garbage collected, even after
the cache itself was closed and dropped. The batch path moves a whole batch per call with the GIL
released: :meth:`EchoCache.put_batch` puts the rows of arrays, :meth:`EchoCache.take_batch`
gathers a batch into fresh contiguous arrays (one memcpy per sample), which is what a
host-to-device copy wants, and :meth:`EchoCache.take_batch_into` copies into the caller's own
(pinned, say) buffers instead. Interpreter exit closes every open cache before Python joins threads.
A cache belongs to the process that created it: in a fork of it (a ``DataLoader`` worker) every
use but :meth:`~EchoCache.close` raises :class:`CacheForkedError`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from ..native import core
from . import device_gather, lifetime, transfer
from .config import (
    MAX_CAPACITY_BYTES,
    MAX_CAPACITY_SAMPLES,
    MAX_EPOCH_SIZE,
    MAX_SEED,
    MIN_CAPACITY_BYTES,
    check_factor,
    check_int,
)
from .memory import check_memory
from .values import EchoBatch, EchoSample, EchoStats, SampleTooLargeError

__all__ = ["EchoCache", "copies_per_epoch"]


def copies_per_epoch(echo_factor: float, samples: int) -> int:
    """Copies an ``EchoCache(epoch_size=samples)`` emits for one full block of ``samples``
    units at a constant ``echo_factor``: ``floor(e) * N + floor(frac(e) * N + 1/2)``, computed as
    the native core does (the same double arithmetic)."""
    whole = math.floor(echo_factor)
    return int(whole * samples + math.floor((echo_factor - whole) * samples + 0.5))


class EchoCache:
    """A bounded, thread-safe data echoing buffer (native; all blocking calls release the GIL).

    Args:
        capacity_bytes: Size of the sample arena; fixed. A sample larger than it is a
            :class:`SampleTooLargeError` (a ValueError).
        capacity_samples: Maximum resident samples (slots).
        echo_factor: e >= 1; each sample is emitted floor(e) or ceil(e) times (mean e).
        min_fill: Samples with tickets required before takes start (warm-up, shuffle quality).
            Ignored while a producer is blocked on a full cache or after :meth:`end_of_input`.
        seed: Seeds tickets and draws; one producer and one consumer thread give a reproducible
            stream.
        mode: ``"example"`` echoes samples; ``"batch"`` echoes whole batches of ``batch_size``
            consecutive puts, returned together in put order.
        batch_size: Samples per echoed batch (batch mode only).
        memory: ``"auto"`` (pinned + GPU-mapped when a CUDA device is present), ``"pageable"``,
            ``"pinned"``, or ``"device"`` (GPU memory of the current device: puts and
            :meth:`take_batch` copy through ``cudaMemcpy``, samples have no host view, and
            :meth:`gather_to_device` and the DALI GPU source read it device to device).
        name: Registry name, so the DALI operators can find this cache; unique per process.
            ``None`` picks one (``echo-<n>``).
        epoch_size: 0 draws each sample's extra copy independently (probability ``frac(e)``).
            ``N > 0`` makes the totals exact per epoch: the units put since the last
            :meth:`reset_input` form blocks of ``N``, and in each block exactly
            ``floor(frac(e) * N + 1/2)`` get ``ceil(e)`` copies (a seeded pseudo-random choice),
            so a block yields :func:`copies_per_epoch` copies while ``e`` stays the same.
    """

    def __init__(
        self,
        capacity_bytes: int = 256 << 20,
        capacity_samples: int = 4096,
        echo_factor: float = 2.0,
        min_fill: int = 0,
        seed: int = 0,
        mode: str = "example",
        batch_size: int | None = None,
        memory: str = "auto",
        name: str | None = None,
        epoch_size: int = 0,
    ) -> None:
        check_int("capacity_bytes", capacity_bytes, MIN_CAPACITY_BYTES, MAX_CAPACITY_BYTES)
        check_int("capacity_samples", capacity_samples, 1, MAX_CAPACITY_SAMPLES)
        check_int("min_fill", min_fill, 0, MAX_CAPACITY_SAMPLES)
        check_int("seed", seed, 0, MAX_SEED)
        check_int("epoch_size", epoch_size, 0, MAX_EPOCH_SIZE)
        check_memory(memory)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {name!r} ({type(name).__name__})")
        e = float(check_factor(echo_factor, "echo_factor"))
        if mode not in ("example", "batch"):
            raise ValueError(f"mode must be 'example' or 'batch', got {mode!r}")
        if mode == "batch" and batch_size is None:
            raise ValueError("mode='batch' needs batch_size >= 1, got None")
        if batch_size is not None:
            check_int("batch_size", batch_size, 1, MAX_CAPACITY_SAMPLES)
        self._batch_size = int(batch_size) if batch_size is not None else 1
        self._mode = mode
        # Copies per take: a whole echoed batch in batch mode.
        self._unit = self._batch_size if mode == "batch" else 1
        try:
            self._native = core.EchoCache(
                capacity_bytes=int(capacity_bytes),
                capacity_samples=int(capacity_samples),
                echo_factor=e,
                min_fill=int(min_fill),
                seed=int(seed),
                mode=mode,
                batch_size=self._batch_size,
                memory=memory,
                name=name or "",
                epoch_size=int(epoch_size),
            )
        except MemoryError as exc:  # the core's ArenaAllocationError: mmap, cudaHostAlloc...
            raise MemoryError(
                f"capacity_bytes={int(capacity_bytes)}: no memory for an echo cache arena of "
                f"that many bytes ({exc})"
            ) from exc
        self._name: str = self._native.name
        # Closes the native cache (waking blocked threads) at garbage collection; at interpreter
        # exit _close_all_caches closes it earlier, before non-daemon threads are joined.
        self._finalizer = weakref.finalize(self, lifetime.close_native, self._native, self._name)
        lifetime.OPEN_CACHES.add(self)

    # ---- identity ----
    @property
    def name(self) -> str:
        """Registry name (``echopipe.dali`` operators find the cache by it)."""
        return self._name

    @property
    def handle(self) -> int:
        """Process-unique integer handle of the native cache."""
        return int(self._native.handle)

    @property
    def memory_kind(self) -> str:
        """``"pinned"``, ``"pageable"`` or ``"device"``: what the arena actually is."""
        return str(self._native.memory_kind)

    @property
    def arena_device_ptr(self) -> int:
        """Device address of the GPU-mapped (or device) arena, or 0 when it is pageable."""
        return int(self._native.arena_device_ptr)

    @property
    def echo_factor(self) -> float:
        """Current echo factor e. Setting it (any thread, lock-free) applies to samples
        committed afterwards (batch mode: batches closed afterwards); samples already in the cache
        keep their tickets, so each is still emitted exactly its ticket count. A value that is not
        a finite number in [1, MAX_ECHO_FACTOR] is an EchoConfigError (a ValueError) naming it."""
        return float(self._native.echo_factor)

    @echo_factor.setter
    def echo_factor(self, value: float) -> None:
        self._native.echo_factor = float(check_factor(value, "echo_factor"))

    def top_up(self) -> int:
        """Gives the samples in the cache the copies the current :attr:`echo_factor` gives a
        sample put now, where that is more than they were given; returns the copies added.

        After the factor rose, the samples put at the lower one would otherwise be used fewer
        times than those after them (their tickets are fixed when they are put). Samples whose
        copies were all drawn and released are gone and not brought back. An ``"auto"``
        factor's rises call it (:class:`echopipe.torch.EchoLoader`, ``echopipe train``).
        """
        return int(self._native.top_up())

    @property
    def refused_sample(self) -> SampleTooLargeError | None:
        """The largest sample this cache refused as larger than its arena, as the typed error,
        or None. A refusal inside a DALI pipeline's sink reaches Python only as the operator's
        message; this is how a caller learns which error it was without reading that text."""
        refused: SampleTooLargeError | None = self._native.refused_sample
        return refused

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return bool(self._native.closed)

    def check_process(self) -> None:
        """Raises :class:`CacheForkedError` in a process forked from the one that created the
        cache, as every other use there does (the fork's copy is private to it: each forked
        process would hand out the same samples again). :meth:`close` works there."""
        self._native.check_process()

    # ---- lifecycle ----
    def close(self) -> None:
        """Wakes every blocked put/take (they raise CacheClosedError) and unregisters the cache.

        Idempotent. Samples already taken stay readable until their views are dropped.
        Interpreter exit closes every open cache before it joins non-daemon threads, so join
        your own producer and consumer threads before the main thread returns.
        """
        self._finalizer()
        lifetime.OPEN_CACHES.discard(self)

    def __enter__(self) -> EchoCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- producers (see :mod:`.transfer`) ----
    def put(self, sample: Any, timeout: float | None = None) -> None:
        """Copies one sample in: an array, or a tuple/list of up to 4 arrays (its fields).

        Blocks while the cache is full. Raises TimeoutError when ``timeout`` seconds pass first,
        :class:`CacheClosedError` if the cache is (or gets) closed, :class:`InputEndedError` after
        :meth:`end_of_input`, :class:`SampleTooLargeError` for a sample larger than the arena,
        ValueError for a bad dtype.
        """
        transfer.put(self._native, sample, timeout)

    def put_batch(self, samples: Any, timeout: float | None = None) -> int:
        """Puts every row of an array (or of a tuple of arrays with equal first dimension) as
        one sample, in one native call without the GIL (slots are reserved in chunks under one
        allocator lock each). ``timeout`` applies to each wait for space.

        Returns the number of rows put (all of them, unless an exception is raised: a
        TimeoutError, :class:`CacheClosedError` or :class:`InputEndedError` then carries how many
        rows went in before it as its ``rows_put`` attribute).
        """
        return transfer.put_batch(self._native, samples, timeout)

    def wait_for_room(self, n: int, timeout: float | None = None) -> None:
        """Blocks until at least ``n`` slots are free (``n <= capacity_samples``), without
        polling; meanwhile the caller counts as a blocked producer (consumers may take short
        batches and skip the warm-up). Raises TimeoutError, :class:`CacheClosedError`,
        :class:`InputEndedError` after :meth:`end_of_input`, or ValueError for a bad ``n``."""
        transfer.wait_for_room(self._native, n, timeout)

    @property
    def quota(self) -> int:
        """Fresh samples a DALI sink may still store into this cache (-1: unlimited)."""
        return int(self._native.quota)

    @quota.setter
    def quota(self, remaining: int) -> None:
        self._native.quota = int(remaining)

    @property
    def layouts(self) -> list[str]:
        """Tensor layout of each field as a DALI sink saw it (``""`` where none)."""
        return list(self._native.layouts)

    @layouts.setter
    def layouts(self, value: Sequence[str]) -> None:
        self._native.layouts = [str(v) for v in value]

    def end_of_input(self) -> None:
        """Declares the input finished: consumers drain the remaining copies, then stop."""
        self._native.end_of_input()

    def reset_input(self) -> None:
        """Accepts puts again after :meth:`end_of_input` (a new epoch/stream)."""
        self._native.reset_input()

    # ---- consumers (see :mod:`.transfer`) ----
    def take(self, n: int = 1, timeout: float | None = None) -> list[EchoSample]:
        """Draws ``n`` random copies (a whole number of echoed batches in batch mode).

        Returns fewer than ``n`` only for the partial last batch after :meth:`end_of_input`, and
        an empty list once everything was emitted. Raises TimeoutError or CacheClosedError.
        """
        return transfer.take(self._native, n, self._unit, timeout)

    def take_batch(self, n: int, timeout: float | None = None) -> EchoBatch | None:
        """Like :meth:`take`, but gathers each field into one new contiguous array.

        Returns None once everything was emitted. Strong guarantee: when the copies drawn cannot
        be gathered (samples of one field with different dtypes or field counts: a ValueError
        naming them; no memory: MemoryError), they are handed back to the cache before the error
        is raised, so each is still emitted later (by :meth:`take`, say) and nothing is lost.
        """
        return transfer.take_batch(self._native, n, self._unit, timeout)

    def take_batch_into(
        self,
        out: Sequence[Any],
        n: int | None = None,
        timeout: float | None = None,
        start: int = 0,
    ) -> int | None:
        """Like :meth:`take_batch`, but copies into the caller's buffers: the one copy out.

        ``out`` holds one buffer per field: a C-contiguous, writable numpy array or CPU torch
        tensor (pinned or not) of shape ``(rows, ...)``. Field ``f`` of each copy drawn is
        copied byte for byte into the next row of ``out[f]``, from row ``start`` on; every
        sample's field ``f`` must have exactly the bytes of one row of ``out[f]`` (the dtypes are
        not compared: a ``uint8`` buffer receives any field of that size). ``n`` (default: the
        rows from ``start`` to the end) is the most copies to take.

        Returns the number of rows written (fewer than ``n`` as :meth:`take_batch` returns
        fewer), or None once everything was emitted. The buffers are checked before anything is
        drawn (ValueError naming the buffer); a drawn copy whose fields do not fit the rows is
        handed back to the cache before the ValueError is raised, so nothing is lost.
        """
        return transfer.take_batch_into(self._native, out, self._unit, n, timeout, start)

    def __iter__(self) -> Iterator[EchoSample]:
        """Yields copies one at a time until the input ended and everything was emitted."""
        while True:
            got = self.take(self._unit)
            if not got:
                return
            yield from got

    # ---- introspection / checkpointing ----
    def gather_to_device(
        self,
        samples: Sequence[EchoSample],
        field: int,
        out: Any,
        *,
        stream: Any = None,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        layout: str = "HWC",
    ) -> Any:
        """Gathers field ``field`` of ``samples`` from the GPU-mapped arena into ``out`` (CUDA).

        A kernel reads the pinned, mapped cache memory directly (no staging copy), or with
        ``memory="device"`` the device arena (device to device), and writes the batch back to
        back into ``out``, asynchronously on ``stream``. When ``stream`` is
        not torch's current stream, ``out`` is marked as used by it (``record_stream``).

        Args:
            samples: Copies taken from this cache (:meth:`take`). They may be dropped right
                after the call: their slots stay leased until an event recorded on ``stream``
                behind the kernel has fired (a background thread waits for it), so the cache
                cannot reuse a slot the kernel still reads.
            field: Field index, the same for every sample.
            out: A contiguous CUDA ``torch.Tensor``. Without ``normalize`` its dtype must be the
                field's and its ``numel()`` the sum of the samples' (ragged samples are written
                back to back). With ``normalize`` it is float32 of shape ``(N, H, W, C)``
                (``layout="HWC"``) or ``(N, C, H, W)`` (``layout="CHW"``).
            stream: ``torch.cuda.Stream``, a raw ``cudaStream_t`` int, or ``None`` for torch's
                current stream on ``out``'s device.
            normalize: ``(mean, std)`` with one value per channel: fuses uint8 -> float32
                ``(x - mean[c]) / std[c]`` (and HWC -> CHW with ``layout="CHW"``). Needs
                uint8 HWC images of one shape.
            layout: ``"HWC"`` (as stored) or ``"CHW"`` (only with ``normalize``).

        Returns:
            ``out``.

        Raises:
            TypeError: ``out`` is not a torch.Tensor, a sample is not an :class:`EchoSample`, or
                ``stream`` has the wrong type.
            ValueError: a bad field, layout, shape, dtype, ``normalize`` value, or a non-CUDA or
                non-contiguous ``out`` (the message names the value).
            RuntimeError: the cache is pageable (``memory_kind`` is ``"pageable"``), its
                pinned arena could not be mapped into the GPU's address space
                (``cudaHostGetDevicePointer`` failed), or echopipe was built without CUDA.
        """
        return device_gather.gather(self._native, samples, field, out, stream, normalize, layout)

    def stats(self) -> EchoStats:
        """A snapshot of the cache's counters."""
        return EchoStats(**self._native.stats())

    def state_dict(self) -> bytes:
        """Resident samples with their data and tickets left, plus RNG state and counters.

        Taken under a brief stop-the-world; quiesce producers and consumers first if the
        snapshot must line up with your input stream position.
        """
        return bytes(self._native.save_state())

    def load_state_dict(self, state: bytes | bytearray | memoryview) -> None:
        """Restores :meth:`state_dict` into this cache, which must be empty and use the same
        mode, batch_size and capacity_samples; :class:`CacheStateError` (a ValueError) names the
        mismatch or the corruption, and leaves the cache unchanged. The echo factor is runtime
        state: the cache adopts the saved (current) factor."""
        if not isinstance(state, (bytes, bytearray, memoryview)):
            raise TypeError(f"state must be bytes, got {type(state).__name__}")
        self._native.restore_state(bytes(state))

    def __repr__(self) -> str:
        return (
            f"EchoCache(name={self._name!r}, mode={self._mode!r}, memory={self.memory_kind!r}, "
            f"closed={self.closed})"
        )
