"""The encoding that lets ``torch.load(weights_only=True)`` read every value of a training
checkpoint: ``bytes``, numpy arrays and tuples (the RNG states) become tagged dicts of tensors
and plain values, so no file can make the loader run code."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["decode_state", "encode_state"]

_TAG = "__echopipe_codec__"


def encode_state(obj: Any) -> Any:
    """``obj`` with every value ``torch.load(weights_only=True)`` refuses made loadable.

    ``bytes`` and numpy arrays become uint8 tensors with their dtype and shape, tuples become
    tagged lists, numpy scalars become Python numbers. :func:`decode_state` reverses it.
    """
    if isinstance(obj, np.generic):  # before float: np.float64 is a float subclass
        return obj.item()
    if isinstance(obj, torch.Tensor | str | int | float | bool | type(None)):
        return obj
    if isinstance(obj, bytes | bytearray):
        return {
            _TAG: "bytes",
            "data": torch.frombuffer(bytearray(obj), dtype=torch.uint8)
            if obj
            else torch.empty(0, dtype=torch.uint8),
        }
    if isinstance(obj, np.ndarray):
        raw = np.ascontiguousarray(obj).tobytes()
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
        return {
            _TAG: "ndarray",
            "dtype": obj.dtype.str,
            "shape": list(obj.shape),
            "data": data.to(torch.uint8),
        }
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "items": [encode_state(v) for v in obj]}
    if isinstance(obj, list):
        return [encode_state(v) for v in obj]
    if isinstance(obj, dict):
        return {k: encode_state(v) for k, v in obj.items()}
    raise TypeError(f"checkpoint state holds a {type(obj).__name__}, which is not stored")


def decode_state(obj: Any) -> Any:
    """The inverse of :func:`encode_state`.

    Raises:
        ValueError: a tagged entry is malformed (a file's damage, or a crafted one).
    """
    if isinstance(obj, list):
        return [decode_state(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: decode_state(v) for k, v in obj.items()}
    if tag == "bytes":
        return _byte_tensor(obj.get("data")).numpy().tobytes()
    if tag == "ndarray":
        dtype, shape = obj.get("dtype"), obj.get("shape")
        kind = np.dtype(dtype).kind if isinstance(dtype, str) and len(dtype) <= 8 else ""
        if kind not in _ARRAY_KINDS or np.dtype(dtype).subdtype is not None:
            raise ValueError(f"an array entry has the dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError("an array entry has a damaged shape")
        raw = _byte_tensor(obj.get("data")).numpy()
        if raw.size != np.dtype(dtype).itemsize * int(np.prod(shape, dtype=object)):
            raise ValueError(f"an array entry of shape {shape} holds {raw.size} bytes")
        return np.frombuffer(raw.tobytes(), dtype=np.dtype(dtype)).reshape(shape).copy()
    if tag == "tuple":
        items = obj.get("items")
        if not isinstance(items, list):
            raise ValueError("a tuple entry has no items")
        return tuple(decode_state(v) for v in items)
    raise ValueError(f"an entry has the unknown tag {str(tag)[:20]!r}")


_ARRAY_KINDS = "biufc"


def _byte_tensor(data: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("an encoded entry is not a 1-D uint8 tensor")
    return data.contiguous()
