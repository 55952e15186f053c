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
host-to-device copy wants. Interpreter exit closes every open cache before Python joins threads.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _device_gather
from ._native import _C

__all__ = [
    "CacheClosedError",
    "EchoBatch",
    "EchoCache",
    "EchoSample",
    "EchoStats",
    "InputEndedError",
]


class CacheClosedError(RuntimeError):
    """Raised by blocking calls on a cache that was closed (possibly while they waited)."""


class InputEndedError(RuntimeError):
    """Raised by :meth:`EchoCache.put` after :meth:`EchoCache.end_of_input`."""


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
    emit_histogram: list[int]
    mean_reuse_distance: float
    reuse_pairs: int
    memory_kind: str
    puts_blocked: int
    put_blocked_seconds: float
    takes_waited: int
    take_wait_seconds: float
    closed: bool
    input_ended: bool

    @property
    def echo_ratio(self) -> float:
        """Copies emitted per fresh sample so far."""
        return self.emitted / self.fresh_in if self.fresh_in else 0.0


def _as_host_array(value: Any, index: int) -> tuple[Any, int, str, tuple[int, ...]]:
    """Returns (keepalive, data pointer, dtype name, shape) of a C-contiguous host array.

    Accepts numpy arrays, torch CPU tensors, anything with ``__dlpack__`` or the buffer protocol,
    and Python scalars. Contiguous inputs are read in place (no copy here; the cache copies once).
    """
    torch = _torch_module()
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(
                f"field {index}: EchoCache.put needs host tensors, got one on {value.device}"
            )
        t = value.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        return t, t.data_ptr(), _C.normalize_dtype(_TORCH_ALIASES.get(dtype, dtype)), tuple(t.shape)
    if isinstance(value, np.ndarray):
        arr = value
    elif hasattr(value, "__dlpack__") and not isinstance(value, (bytes, bytearray, memoryview)):
        arr = np.from_dlpack(value)
    else:
        arr = np.asarray(value)
    name = _DTYPE_NAMES.get(arr.dtype)
    if name is None:
        name = _numpy_dtype_name(arr.dtype, index)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)  # (never applied to 0-d arrays: it would make them 1-d)
    return arr, arr.__array_interface__["data"][0], name, arr.shape


_TORCH_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
# numpy dtype -> cache dtype name; dtype.name is slow enough to matter at 4 KB samples.
_DTYPE_NAMES: dict[np.dtype, str] = {}


def _numpy_dtype_name(dtype: np.dtype, index: int) -> str:
    if dtype.hasobject or dtype.kind in "USVOMm" or not dtype.isnative:
        raise ValueError(f"field {index}: unsupported dtype '{dtype}'")
    try:
        name = str(_C.normalize_dtype(dtype.name))
    except ValueError as exc:
        raise ValueError(f"field {index}: {exc}") from None
    _DTYPE_NAMES[dtype] = name
    return name


def _torch_module() -> Any:
    """torch if the application already imported it (never imported just for a type check)."""
    return sys.modules.get("torch")


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


def _timeout_arg(timeout: float | None) -> float:
    if timeout is None:
        return -1.0
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    return t


def _close_native(native: Any, name: str) -> None:
    native.close()
    _C.remove_cache(name)


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


def _check_echo_factor(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"echo_factor must be a number >= 1, got {value!r}")
    try:
        e = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"echo_factor must be a number >= 1, got {value!r}") from None
    if not e >= 1 or not math.isfinite(e) or e > 65535:
        raise ValueError(f"echo_factor must be a finite number in [1, 65535], got {value!r}")
    return e


class EchoCache:
    """A bounded, thread-safe data echoing buffer (native; all blocking calls release the GIL).

    Args:
        capacity_bytes: Size of the sample arena; fixed. A sample larger than it is a ValueError.
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
    ) -> None:
        for arg, value in (
            ("capacity_bytes", capacity_bytes),
            ("capacity_samples", capacity_samples),
            ("min_fill", min_fill),
            ("seed", seed),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{arg} must be a non-negative integer, got {value!r}")
        e = _check_echo_factor(echo_factor)
        if mode not in ("example", "batch"):
            raise ValueError(f"mode must be 'example' or 'batch', got {mode!r}")
        if mode == "batch":
            if batch_size is None or int(batch_size) < 1:
                raise ValueError(f"mode='batch' needs batch_size >= 1, got {batch_size!r}")
        elif batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self._batch_size = int(batch_size) if batch_size is not None else 1
        self._mode = mode
        self._native = _C.EchoCache(
            capacity_bytes=int(capacity_bytes),
            capacity_samples=int(capacity_samples),
            echo_factor=e,
            min_fill=int(min_fill),
            seed=int(seed),
            mode=mode,
            batch_size=self._batch_size,
            memory=memory,
            name=name or "",
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
        a finite number in [1, 65535] is a ValueError naming it."""
        return float(self._native.echo_factor)

    @echo_factor.setter
    def echo_factor(self, value: float) -> None:
        self._native.echo_factor = _check_echo_factor(value)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return bool(self._native.closed)

    # ---- producers ----
    def put(self, sample: Any, timeout: float | None = None) -> None:
        """Copies one sample in: an array, or a tuple/list of up to 4 arrays (its fields).

        Blocks while the cache is full. Raises TimeoutError when ``timeout`` seconds pass first,
        :class:`CacheClosedError` if the cache is (or gets) closed, :class:`InputEndedError` after
        :meth:`end_of_input`, ValueError for a bad dtype or a sample larger than the arena.
        """
        parts = sample if isinstance(sample, (tuple, list)) else (sample,)
        if not 1 <= len(parts) <= 4:
            raise ValueError(f"a sample has 1..4 fields, got {len(parts)}")
        converted = [_as_host_array(p, i) for i, p in enumerate(parts)]
        status = self._native.put_raw(
            [c[1] for c in converted],
            [c[2] for c in converted],
            [list(c[3]) for c in converted],
            _timeout_arg(timeout),
        )
        del converted  # keepalive until the native copy returned
        self._raise_put(status, timeout)

    def put_batch(self, samples: Any, timeout: float | None = None) -> int:
        """Puts every row of an array (or of a tuple of arrays with equal first dimension) as
        one sample, in one native call without the GIL (slots are reserved in chunks under one
        allocator lock each). ``timeout`` applies to each wait for space.

        Returns the number of rows put (all of them, unless an exception is raised; the
        exception's ``args[1]`` then holds how many rows went in before it).
        """
        parts = samples if isinstance(samples, (tuple, list)) else (samples,)
        if not 1 <= len(parts) <= 4:
            raise ValueError(f"a sample has 1..4 fields, got {len(parts)}")
        converted = [_as_host_array(p, i) for i, p in enumerate(parts)]
        rows = {c[3][0] if c[3] else -1 for c in converted}
        if len(rows) != 1 or -1 in rows:
            shapes = [c[3] for c in converted]
            raise ValueError(
                f"put_batch needs arrays with one common first dimension, got {shapes}"
            )
        n = rows.pop()
        status, done = self._native.put_rows_raw(
            [c[1] for c in converted],
            [c[2] for c in converted],
            [list(c[3][1:]) for c in converted],
            n,
            _timeout_arg(timeout),
        )
        del converted
        try:
            self._raise_put(status, timeout)
        except (TimeoutError, RuntimeError) as exc:
            exc.args = (*exc.args, int(done))
            raise
        return int(done)

    put_many = put_batch  # the name used before put_batch existed

    def wait_for_room(self, n: int, timeout: float | None = None) -> None:
        """Blocks until at least ``n`` slots are free (``n <= capacity_samples``), without
        polling; meanwhile the caller counts as a blocked producer (consumers may take short
        batches and skip the warm-up). Raises TimeoutError, :class:`CacheClosedError`,
        :class:`InputEndedError` after :meth:`end_of_input`, or ValueError for a bad ``n``."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        status = self._native.wait_for_room(int(n), _timeout_arg(timeout))
        if status == "timeout":
            raise TimeoutError(f"EchoCache.wait_for_room: no room for {n} within {timeout}s")
        self._raise_put(status, timeout)

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

    def _raise_put(self, status: str, timeout: float | None) -> None:
        if status == "ok":
            return
        if status == "timeout":
            raise TimeoutError(f"EchoCache.put: no space within timeout={timeout}s")
        if status == "closed":
            raise CacheClosedError(f"echo cache '{self._name}' is closed")
        raise InputEndedError(
            f"echo cache '{self._name}': put after end_of_input() (call reset_input() first)"
        )

    def end_of_input(self) -> None:
        """Declares the input finished: consumers drain the remaining copies, then stop."""
        self._native.end_of_input()

    def reset_input(self) -> None:
        """Accepts puts again after :meth:`end_of_input` (a new epoch/stream)."""
        self._native.reset_input()

    # ---- consumers ----
    def _check_n(self, n: int) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if self._mode == "batch" and n % self._batch_size:
            raise ValueError(
                f"batch mode: n must be a multiple of batch_size={self._batch_size}, got {n!r}"
            )
        return int(n)

    def _raise_take(self, status: str, timeout: float | None) -> None:
        if status == "timeout":
            raise TimeoutError(f"EchoCache.take: no samples within timeout={timeout}s")
        if status == "closed":
            raise CacheClosedError(f"echo cache '{self._name}' is closed")

    def take(self, n: int = 1, timeout: float | None = None) -> list[EchoSample]:
        """Draws ``n`` random copies (a whole number of echoed batches in batch mode).

        Returns fewer than ``n`` only for the partial last batch after :meth:`end_of_input`, and
        an empty list once everything was emitted. Raises TimeoutError or CacheClosedError.
        """
        n = self._check_n(n)
        status, leases = self._native.take(n, _timeout_arg(timeout))
        if status in ("ok", "end"):
            return [EchoSample(lease) for lease in leases]
        self._raise_take(status, timeout)
        raise AssertionError(status)  # pragma: no cover

    def take_batch(self, n: int, timeout: float | None = None) -> EchoBatch | None:
        """Like :meth:`take`, but gathers each field into one new contiguous array.

        Returns None once everything was emitted.
        """
        n = self._check_n(n)
        status, fields, dtypes, shapes, ids, emissions = self._native.take_batch(
            n, _timeout_arg(timeout)
        )
        if status == "end":
            return None
        if status != "ok":
            self._raise_take(status, timeout)
        return EchoBatch(
            fields=[f[0] for f in fields],
            offsets=[f[1] for f in fields],
            dtypes=list(dtypes),
            shapes=shapes,  # already tuples; one shared tuple per sample when all agree
            sample_ids=ids,
            emissions=emissions,
        )

    def __iter__(self) -> Iterator[EchoSample]:
        """Yields copies one at a time until the input ended and everything was emitted."""
        while True:
            got = self.take(self._batch_size if self._mode == "batch" else 1)
            if not got:
                return
            yield from got

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
        torch = _torch_module()
        if torch is None or not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if layout not in ("HWC", "CHW"):
            raise ValueError(f"layout must be 'HWC' or 'CHW', got {layout!r}")
        if layout == "CHW" and normalize is None:
            raise ValueError("layout='CHW' needs normalize=(mean, std) (the fused kernel permutes)")
        samples, field = _device_gather.check_samples(samples, field, EchoSample)
        if normalize is None:
            _device_gather.check_plain_out(torch, samples, field, out)
        else:
            mean, std = _device_gather.check_normalize(
                torch, samples, field, out, normalize, layout
            )
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
        stream_obj = _device_gather.resolve_stream(torch, stream, out.device)
        leases = [s._lease for s in samples]
        with torch.cuda.device(out.device):
            if normalize is None:
                _C.gather_to_device(leases, field, out.data_ptr(), stream_obj.cuda_stream)
            else:
                _C.gather_normalize_to_device(
                    leases, field, mean, std, layout == "CHW", out.data_ptr(),
                    stream_obj.cuda_stream,
                )  # fmt: skip
            _device_gather.keep_until_done(torch, stream_obj, out, leases)
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
        mode, batch_size and capacity_samples; ValueError names the mismatch. The echo factor is
        runtime state: the cache adopts the saved (current) factor."""
        if not isinstance(state, (bytes, bytearray, memoryview)):
            raise TypeError(f"state must be bytes, got {type(state).__name__}")
        self._native.restore_state(bytes(state))

    def __repr__(self) -> str:
        return (
            f"EchoCache(name={self._name!r}, mode={self._mode!r}, memory={self.memory_kind!r}, "
            f"closed={self.closed})"
        )
