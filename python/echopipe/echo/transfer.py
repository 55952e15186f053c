"""The data path of :class:`~echopipe.echo.EchoCache`: host arrays in, samples and batches out.

Each function takes the native cache it works on (``EchoCache``'s ``core.EchoCache``); the
:class:`~echopipe.echo.EchoCache` methods of the same names are these functions on its own.

Puts read numpy arrays, torch CPU tensors, ``__dlpack__`` or buffer-protocol objects and Python
scalars in place and hand raw pointers to the native cache, which copies once; takes return
zero-copy :class:`EchoSample` views, an :class:`EchoBatch` gathered into fresh arrays, or copy
into the caller's own buffers (``take_batch_into``: the one copy out).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..native import core
from .values import CacheClosedError, EchoBatch, EchoCacheError, EchoSample, InputEndedError

__all__ = [
    "check_n",
    "put",
    "put_batch",
    "take",
    "take_batch",
    "take_batch_into",
    "torch_module",
    "wait_for_room",
]


def _as_host_array(value: Any, index: int) -> tuple[Any, int, str, tuple[int, ...]]:
    """Returns (keepalive, data pointer, dtype name, shape) of a C-contiguous host array.

    Accepts numpy arrays, torch CPU tensors, anything with ``__dlpack__`` or the buffer protocol,
    and Python scalars. Contiguous inputs are read in place (no copy here; the cache copies once).
    """
    torch = torch_module()
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(
                f"field {index}: EchoCache.put needs host tensors, got one on {value.device}"
            )
        # A negative-bit view (``z.conj().imag``) stores its values unnegated: its raw bytes are
        # not the values it reads as, and the cache copies raw bytes.
        t = value.detach().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        return (
            t,
            t.data_ptr(),
            core.normalize_dtype(_TORCH_ALIASES.get(dtype, dtype)),
            tuple(t.shape),
        )
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
        name = str(core.normalize_dtype(dtype.name))
    except ValueError as exc:
        raise ValueError(f"field {index}: {exc}") from None
    _DTYPE_NAMES[dtype] = name
    return name


def torch_module() -> Any:
    """torch if the application already imported it (never imported just for a type check)."""
    return sys.modules.get("torch")


def _timeout_arg(timeout: float | None) -> float:
    if timeout is None:
        return -1.0
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    return t


# Python runs signal handlers (Ctrl-C's KeyboardInterrupt) in the main thread only, between
# bytecodes: one native wait with the GIL released would hold Ctrl-C back until it ends, for
# ever with no timeout. So the main thread waits in slices of this many seconds. A wait that
# times out has claimed and stored nothing, so the next slice just waits again.
SIGNAL_SLICE_S = 0.1


def _interruptible(
    call: Callable[[float], Any],
    timeout: float | None,
    progressed: Callable[[Any], bool] | None = None,
) -> Any:
    """``call(t)`` (``t`` the native timeout argument) once, or in slices on the main thread
    until it does not time out or ``timeout`` has passed since the last ``progressed`` result."""
    t = _timeout_arg(timeout)
    if 0 <= t <= SIGNAL_SLICE_S or threading.current_thread() is not threading.main_thread():
        return call(t)
    deadline = None if t < 0 else time.monotonic() + t
    while True:
        left = SIGNAL_SLICE_S
        if deadline is not None:
            left = min(left, max(0.0, deadline - time.monotonic()))
        result = call(left)
        if (result if isinstance(result, str) else result[0]) != "timeout":
            return result
        if deadline is not None:
            if progressed is not None and progressed(result):
                deadline = time.monotonic() + t
            elif time.monotonic() >= deadline:
                return result


def put(native: Any, sample: Any, timeout: float | None = None) -> None:
    """:meth:`EchoCache.put <echopipe.echo.EchoCache.put>` on the native cache ``native``."""
    parts = sample if isinstance(sample, (tuple, list)) else (sample,)
    if not 1 <= len(parts) <= 4:
        raise ValueError(f"a sample has 1..4 fields, got {len(parts)}")
    converted = [_as_host_array(p, i) for i, p in enumerate(parts)]
    ptrs, dtypes = [c[1] for c in converted], [c[2] for c in converted]
    shapes = [list(c[3]) for c in converted]
    status = _interruptible(lambda t: native.put_raw(ptrs, dtypes, shapes, t), timeout)
    del converted  # keepalive until the native copy returned
    _raise_put(native, status, timeout)


def put_batch(native: Any, samples: Any, timeout: float | None = None) -> int:
    """:meth:`EchoCache.put_batch <echopipe.echo.EchoCache.put_batch>` on ``native``."""
    parts = samples if isinstance(samples, (tuple, list)) else (samples,)
    if not 1 <= len(parts) <= 4:
        raise ValueError(f"a sample has 1..4 fields, got {len(parts)}")
    converted = [_as_host_array(p, i) for i, p in enumerate(parts)]
    rows = {c[3][0] if c[3] else -1 for c in converted}
    if len(rows) != 1 or -1 in rows:
        shapes = [c[3] for c in converted]
        raise ValueError(f"put_batch needs arrays with one common first dimension, got {shapes}")
    n = rows.pop()
    ptrs, dtypes = [c[1] for c in converted], [c[2] for c in converted]
    shapes = [list(c[3][1:]) for c in converted]
    row_bytes = [c[0].nbytes // n if n else 0 for c in converted]
    done = 0

    def put_rest(t: float) -> tuple[str, int]:
        nonlocal done
        status, got = native.put_rows_raw(
            [p + done * b for p, b in zip(ptrs, row_bytes, strict=True)],
            dtypes,
            shapes,
            n - done,
            t,
        )
        done += int(got)
        return status, int(got)

    status, _ = _interruptible(put_rest, timeout, lambda r: r[1] > 0)
    del converted
    try:
        _raise_put(native, status, timeout)
    except (TimeoutError, EchoCacheError) as exc:
        exc.rows_put = int(done)  # type: ignore[attr-defined]
        raise
    return int(done)


def wait_for_room(native: Any, n: int, timeout: float | None = None) -> None:
    """:meth:`EchoCache.wait_for_room <echopipe.echo.EchoCache.wait_for_room>` on ``native``."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    status = _interruptible(lambda t: native.wait_for_room(int(n), t), timeout)
    if status == "timeout":
        raise TimeoutError(f"EchoCache.wait_for_room: no room for {n} within {timeout}s")
    _raise_put(native, status, timeout)


def _raise_put(native: Any, status: str, timeout: float | None) -> None:
    if status == "ok":
        return
    if status == "timeout":
        raise TimeoutError(f"EchoCache.put: no space within timeout={timeout}s")
    if status == "closed":
        raise CacheClosedError(f"echo cache '{native.name}' is closed")
    raise InputEndedError(
        f"echo cache '{native.name}': put after end_of_input() (call reset_input() first)"
    )


def check_n(n: int, unit: int) -> int:
    """``n`` as a count of copies to take: positive, and in batch mode (``unit`` the echoed
    batch's size, 1 in example mode) a whole number of echoed batches."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if n % unit:
        raise ValueError(f"batch mode: n must be a multiple of batch_size={unit}, got {n!r}")
    return int(n)


def _raise_take(native: Any, status: str, timeout: float | None) -> None:
    if status == "timeout":
        raise TimeoutError(f"EchoCache.take: no samples within timeout={timeout}s")
    if status == "closed":
        raise CacheClosedError(f"echo cache '{native.name}' is closed")


@contextlib.contextmanager
def _naming_n(n: int) -> Iterator[None]:
    """A take reserves room for ``n`` copies before it claims any (so nothing is lost), and a
    mistyped ``n`` fails there: name it instead of C++'s bare ``std::bad_alloc``."""
    try:
        yield
    except MemoryError as exc:
        raise MemoryError(f"n={n}: no memory to take that many copies at once ({exc})") from exc


def take(native: Any, n: int, unit: int, timeout: float | None = None) -> list[EchoSample]:
    """:meth:`EchoCache.take <echopipe.echo.EchoCache.take>` on ``native`` (``unit``: see
    :func:`check_n`)."""
    n = check_n(n, unit)
    with _naming_n(n):
        status, leases = _interruptible(lambda t: native.take(n, t), timeout)
    if status in ("ok", "end"):
        return [EchoSample(lease) for lease in leases]
    _raise_take(native, status, timeout)
    raise AssertionError(status)  # pragma: no cover


def take_batch(native: Any, n: int, unit: int, timeout: float | None = None) -> EchoBatch | None:
    """:meth:`EchoCache.take_batch <echopipe.echo.EchoCache.take_batch>` on ``native``."""
    n = check_n(n, unit)
    with _naming_n(n):
        status, fields, dtypes, shapes, ids, emissions = _interruptible(
            lambda t: native.take_batch(n, t), timeout
        )
    if status == "end":
        return None
    if status != "ok":
        _raise_take(native, status, timeout)
    return EchoBatch(
        fields=[f[0] for f in fields],
        offsets=[f[1] for f in fields],
        dtypes=list(dtypes),
        shapes=shapes,  # already tuples; one shared tuple per sample when all agree
        sample_ids=ids,
        emissions=emissions,
    )


def take_batch_into(
    native: Any,
    out: Sequence[Any],
    unit: int,
    n: int | None = None,
    timeout: float | None = None,
    start: int = 0,
) -> int | None:
    """:meth:`EchoCache.take_batch_into <echopipe.echo.EchoCache.take_batch_into>` on
    ``native``."""
    rows, ptrs, row_bytes, keep = _out_buffers(out)
    if start != 0 or type(start) is not int:
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not (
            0 <= start < rows):  # fmt: skip
            raise ValueError(f"start must be a row of the buffers (0..{rows - 1}), got {start!r}")
        ptrs = [p + start * b for p, b in zip(ptrs, row_bytes, strict=True)]
    n = check_n(rows - start if n is None else n, unit)
    if n > rows - start:
        raise ValueError(f"n={n} copies do not fit in rows {start}..{rows - 1} of the buffers")
    status, count = _interruptible(
        lambda t: native.take_batch_into(ptrs, row_bytes, rows - start, n, t), timeout
    )
    del keep  # the buffers stay alive until the copies are done
    if status == "end" and count == 0:
        return None
    if status not in ("ok", "end"):
        _raise_take(native, status, timeout)
    return int(count)


def _out_buffers(out: Sequence[Any]) -> tuple[int, list[int], list[int], list[Any]]:
    """Rows, data pointers, bytes per row and keepalives of take_batch_into's buffers."""
    if not isinstance(out, (list, tuple)) or not 1 <= len(out) <= 4:
        raise ValueError(f"out must be a list of 1..4 buffers (one per field), got {out!r:.80}")
    torch = torch_module()
    rows = None
    ptrs, row_bytes = [], []
    for i, buf in enumerate(out):
        if torch is not None and isinstance(buf, torch.Tensor):
            # A negative-bit view would read the raw bytes written into it negated.
            if not buf.is_cpu or not buf.is_contiguous() or buf.dim() == 0 or buf.is_neg():
                neg = " (a negative-bit view)" if buf.is_neg() else ""
                raise ValueError(
                    f"out[{i}]: needs a contiguous CPU tensor with a row dimension, got "
                    f"{tuple(buf.shape)} on {buf.device}{neg}"
                )
            ptr, count, nbytes = buf.data_ptr(), len(buf), buf.nbytes
        elif isinstance(buf, np.ndarray):
            if not buf.flags.c_contiguous or not buf.flags.writeable or buf.ndim == 0:
                raise ValueError(
                    f"out[{i}]: needs a C-contiguous, writable numpy array with a row dimension,"
                    f" got shape {buf.shape}"
                )
            ptr, count, nbytes = buf.__array_interface__["data"][0], buf.shape[0], buf.nbytes
        else:
            raise ValueError(f"out[{i}]: needs a numpy array or torch tensor, got {type(buf)}")
        if count == 0:
            raise ValueError(f"out[{i}] has no rows")
        if rows is not None and count != rows:
            counts = [len(b) for b in out]
            raise ValueError(f"the out buffers have different numbers of rows: {counts}")
        rows = count
        ptrs.append(ptr)
        row_bytes.append(nbytes // count)
    assert rows is not None
    return rows, ptrs, row_bytes, list(out)
