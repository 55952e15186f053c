"""The device gather of :meth:`echopipe.EchoCache.gather_to_device`: checks, launch, leases.

Everything here runs before or right after the native launch: bad arguments become one clear
``ValueError``/``TypeError`` naming the value before CUDA is touched, and after the launch the
samples' leases are kept (:mod:`echopipe.echo.inflight`) until an event recorded behind the kernel
has fired, so the cache cannot reuse a slot the kernel is still reading.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..native import core
from . import inflight
from .transfer import torch_module
from .values import EchoSample


def check_samples(samples: Sequence[Any], field: Any, sample_type: type) -> tuple[list[Any], int]:
    """The samples as a list and the field index, or a clear TypeError/ValueError."""
    samples = list(samples)
    if not samples:
        raise ValueError("samples is empty: nothing to gather")
    for i, s in enumerate(samples):
        if not isinstance(s, sample_type):
            raise TypeError(f"samples[{i}] must be an EchoSample, got {type(s).__name__}")
    if isinstance(field, bool) or not isinstance(field, (int, np.integer)):
        raise TypeError(f"field must be an int, got {field!r}")
    field = int(field)
    for i, s in enumerate(samples):
        if not 0 <= field < len(s):
            raise ValueError(
                f"field={field} is out of range for samples[{i}], which has {len(s)} field(s)"
            )
    return samples, field


def _shape(sample: Any, field: int) -> tuple[int, ...]:
    """A field's shape from the lease, which also a device arena (no host view) answers."""
    return tuple(int(d) for d in sample._lease.shape(field))


def check_plain_out(torch: Any, samples: list[Any], field: int, out: Any) -> None:
    """``out`` must hold exactly the samples' field, back to back, in the field's dtype."""
    dtypes = {s.dtype(field) for s in samples}
    if len(dtypes) != 1:
        raise ValueError(f"samples have different dtypes for field {field}: {dtypes}")
    want = getattr(torch, dtypes.pop())  # dtype names match torch's
    if out.dtype != want:
        raise ValueError(f"out has dtype {out.dtype} but field {field} is {want}")
    numel = sum(math.prod(_shape(s, field)) for s in samples)
    if out.numel() != numel:
        raise ValueError(
            f"out has {out.numel()} elements but the {len(samples)} samples hold {numel}"
        )


def check_normalize(
    torch: Any, samples: list[Any], field: int, out: Any, normalize: Any, layout: str
) -> tuple[list[float], list[float]]:
    """(mean, std) for uint8 HWC images of one shape and a float32 ``out`` of the right shape."""
    try:
        mean, std = (tuple(float(v) for v in part) for part in normalize)
    except (TypeError, ValueError):
        raise ValueError(
            f"normalize must be (mean, std), two sequences of numbers, got {normalize!r}"
        ) from None
    shapes = [_shape(s, field) for s in samples]
    dtypes = {s.dtype(field) for s in samples}
    shape = shapes[0]
    if dtypes != {"uint8"} or len(shape) != 3:
        raise ValueError(
            f"normalize needs uint8 HWC images, got {sorted(dtypes)} with shape {tuple(shape)}"
        )
    bad = next((i for i, a in enumerate(shapes) if a != shape), None)
    if bad is not None:
        raise ValueError(
            f"normalize needs equal image shapes: samples[0] is {tuple(shape)}, "
            f"samples[{bad}] is {shapes[bad]}"
        )
    h, w, c = shape
    if not 1 <= c <= 4 or len(mean) != c or len(std) != c:
        raise ValueError(
            f"normalize needs one mean and one std per channel ({c}), got "
            f"{len(mean)} and {len(std)}"
        )
    if any(v == 0 or not math.isfinite(v) for v in std) or not all(math.isfinite(v) for v in mean):
        raise ValueError(f"normalize needs finite mean and non-zero std, got {normalize!r}")
    if out.dtype != torch.float32:
        raise ValueError(f"normalize writes float32, but out has dtype {out.dtype}")
    n = len(samples)
    want_shape = (n, c, h, w) if layout == "CHW" else (n, h, w, c)
    if tuple(out.shape) != want_shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, layout={layout!r} needs {want_shape}")
    return list(mean), list(std)


def resolve_stream(torch: Any, stream: Any, device: Any) -> Any:
    """The ``torch.cuda.Stream`` the gather runs on (``None``: torch's current one on ``device``).

    A raw ``cudaStream_t`` int becomes an ``ExternalStream`` (0 is the legacy default stream),
    so an event can be recorded on it and the output can be marked as used by it.
    """
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        handle = int(stream)
        current = torch.cuda.current_stream(device)
        if handle == current.cuda_stream:
            return current
        if handle == 0:
            return torch.cuda.default_stream(device)
        return torch.cuda.ExternalStream(handle, device=device)
    raise TypeError(
        f"stream must be a torch.cuda.Stream, an int handle or None, got {type(stream).__name__}"
    )


def keep_until_done(torch: Any, stream: Any, out: Any, leases: list[Any]) -> None:
    """After the launch on ``stream``: keep ``leases`` until the stream has passed the kernel.

    The output is also marked as used by ``stream``, so freeing ``out`` early cannot hand its
    memory to another tensor while the kernel still writes it. This is done whatever the
    current stream is: a caller's ``out`` may come from another stream than the current one,
    and for the stream that allocated it torch's allocator ignores the mark.
    """
    out.record_stream(stream)
    # A blocking-sync event: the keeper's wait sleeps instead of spinning a core.
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    inflight.hold_until(event.synchronize, leases)


def gather(
    native: Any,
    samples: Sequence[Any],
    field: int,
    out: Any,
    stream: Any,
    normalize: tuple[Sequence[float], Sequence[float]] | None,
    layout: str,
) -> Any:
    """:meth:`EchoCache.gather_to_device <echopipe.echo.EchoCache.gather_to_device>` from the
    arena of the native cache ``native``; returns ``out``."""
    torch = torch_module()
    if torch is None or not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if layout not in ("HWC", "CHW"):
        raise ValueError(f"layout must be 'HWC' or 'CHW', got {layout!r}")
    if layout == "CHW" and normalize is None:
        raise ValueError("layout='CHW' needs normalize=(mean, std) (the fused kernel permutes)")
    samples, field = check_samples(samples, field, EchoSample)
    if normalize is None:
        check_plain_out(torch, samples, field, out)
    else:
        mean, std = check_normalize(torch, samples, field, out, normalize, layout)
    if out.device.type != "cuda":
        raise ValueError(f"out must be a CUDA tensor, got one on device '{out.device}'")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    _check_mapped(native)
    stream_obj = resolve_stream(torch, stream, out.device)
    leases = [s._lease for s in samples]
    with torch.cuda.device(out.device):
        if normalize is None:
            core.gather_to_device(leases, field, out.data_ptr(), stream_obj.cuda_stream)
        else:
            core.gather_normalize_to_device(
                leases, field, mean, std, layout == "CHW", out.data_ptr(),
                stream_obj.cuda_stream,
            )  # fmt: skip
        keep_until_done(torch, stream_obj, out, leases)
    return out


def _check_mapped(native: Any) -> None:
    """The arena must be readable by the GPU: pinned and mapped, or device memory."""
    kind = str(native.memory_kind)
    if kind not in ("pinned", "device"):
        raise RuntimeError(
            f"gather_to_device needs a pinned, GPU-mapped or a device cache, but cache "
            f"{native.name!r} is {kind!r} (create it with memory='pinned' or "
            "'auto' on a GPU machine)"
        )
    if int(native.arena_device_ptr) == 0:
        raise RuntimeError(
            f"cache {native.name!r} is pinned but not mapped into the GPU's address space: "
            "cudaHostGetDevicePointer failed when its arena was allocated (no unified "
            "addressing on this device?); gather on the host with take_batch instead"
        )
