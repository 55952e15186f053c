"""Argument checks, stream choice and lease keeping of :meth:`echopipe.EchoCache.gather_to_device`.

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

from . import inflight


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

    When ``stream`` is not the one torch allocates ``out`` on (the current stream), the output
    is also marked as used by ``stream``, so freeing ``out`` early cannot hand its memory to
    another tensor while the kernel still writes it.
    """
    if stream != torch.cuda.current_stream(out.device):
        out.record_stream(stream)
    # A blocking-sync event: the keeper's wait sleeps instead of spinning a core.
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    inflight.hold_until(event.synchronize, leases)
