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
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..native import core
from . import device_gather
from .config import check_factor
from .transfer import CacheIO, torch_module
from .values import EchoSample, EchoStats, SampleTooLargeError

__all__ = ["EchoCache", "copies_per_epoch"]


def copies_per_epoch(echo_factor: float, samples: int) -> int:
    """Copies an ``EchoCache(epoch_size=samples)`` emits for one full block of ``samples``
    units at a constant ``echo_factor``: ``floor(e) * N + floor(frac(e) * N + 1/2)``, computed as
    the native core does (the same double arithmetic)."""
    whole = math.floor(echo_factor)
    return int(whole * samples + math.floor((echo_factor - whole) * samples + 0.5))


def _close_native(native: Any, name: str) -> None:
    native.close()
    core.remove_cache(name)


# Every open cache, so that interpreter exit can close them all.
_OPEN_CACHES: weakref.WeakSet[EchoCache] = weakref.WeakSet()


def _close_all_caches() -> None:
    """Closes every open cache, waking each thread blocked in put/take (they raise
    CacheClosedError). Runs at interpreter exit *before* Python joins non-daemon threads
    (threading's pre-join exit hook): a thread blocked in ``take()`` with no timeout would
    otherwise keep the process alive for ever, and ``weakref.finalize``/``atexit`` run too late,
    after that join."""
    for cache in list(_OPEN_CACHES):
        cache.close()


def _register_exit_hook() -> None:
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has had it since 3.9
        import atexit

        atexit.register(_close_all_caches)
        return
    # RuntimeError: imported while the interpreter is already shutting down.
    with contextlib.suppress(RuntimeError):
        register(_close_all_caches)


_register_exit_hook()


class EchoCache(CacheIO):
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
        for arg, value in (
            ("capacity_bytes", capacity_bytes),
            ("capacity_samples", capacity_samples),
            ("min_fill", min_fill),
            ("seed", seed),
            ("epoch_size", epoch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{arg} must be a non-negative integer, got {value!r}")
        e = float(check_factor(echo_factor, "echo_factor"))
        if mode not in ("example", "batch"):
            raise ValueError(f"mode must be 'example' or 'batch', got {mode!r}")
        if mode == "batch":
            if batch_size is None or int(batch_size) < 1:
                raise ValueError(f"mode='batch' needs batch_size >= 1, got {batch_size!r}")
        elif batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self._batch_size = int(batch_size) if batch_size is not None else 1
        self._mode = mode
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
        self._name: str = self._native.name
        # Closes the native cache (waking blocked threads) at garbage collection; at interpreter
        # exit _close_all_caches closes it earlier, before non-daemon threads are joined.
        self._finalizer = weakref.finalize(self, _close_native, self._native, self._name)
        _OPEN_CACHES.add(self)

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

    # ---- lifecycle ----
    def close(self) -> None:
        """Wakes every blocked put/take (they raise CacheClosedError) and unregisters the cache.

        Idempotent. Samples already taken stay readable until their views are dropped.
        Interpreter exit closes every open cache before it joins non-daemon threads, so join
        your own producer and consumer threads before the main thread returns.
        """
        self._finalizer()
        _OPEN_CACHES.discard(self)

    def __enter__(self) -> EchoCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        torch = torch_module()
        if torch is None or not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if layout not in ("HWC", "CHW"):
            raise ValueError(f"layout must be 'HWC' or 'CHW', got {layout!r}")
        if layout == "CHW" and normalize is None:
            raise ValueError("layout='CHW' needs normalize=(mean, std) (the fused kernel permutes)")
        samples, field = device_gather.check_samples(samples, field, EchoSample)
        if normalize is None:
            device_gather.check_plain_out(torch, samples, field, out)
        else:
            mean, std = device_gather.check_normalize(torch, samples, field, out, normalize, layout)
        if out.device.type != "cuda":
            raise ValueError(f"out must be a CUDA tensor, got one on device '{out.device}'")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if self.memory_kind not in ("pinned", "device"):
            raise RuntimeError(
                f"gather_to_device needs a pinned, GPU-mapped or a device cache, but cache "
                f"{self._name!r} is {self.memory_kind!r} (create it with memory='pinned' or "
                "'auto' on a GPU machine)"
            )
        if self.arena_device_ptr == 0:
            raise RuntimeError(
                f"cache {self._name!r} is pinned but not mapped into the GPU's address space: "
                "cudaHostGetDevicePointer failed when its arena was allocated (no unified "
                "addressing on this device?); gather on the host with take_batch instead"
            )
        stream_obj = device_gather.resolve_stream(torch, stream, out.device)
        leases = [s._lease for s in samples]
        with torch.cuda.device(out.device):
            if normalize is None:
                core.gather_to_device(leases, field, out.data_ptr(), stream_obj.cuda_stream)
            else:
                core.gather_normalize_to_device(
                    leases, field, mean, std, layout == "CHW", out.data_ptr(),
                    stream_obj.cuda_stream,
                )  # fmt: skip
            device_gather.keep_until_done(torch, stream_obj, out, leases)
        return out

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
