"""Echo state as bytes for DALI's checkpoint route, without pickle.

DALI's iterators hand each pipeline's checkpoint to the user as an opaque serialized string and
take it back as ``checkpoint=`` when the pipeline is created again. An :class:`EchoPipeline`
state holds numpy arrays (stashed batches), bytes (the cache and DALI's own checkpoints) and plain
JSON values, so it is stored as one ``.npz`` archive: the arrays as members, everything else as
JSON that refers to them. Loading uses ``allow_pickle=False``, so a checkpoint file from elsewhere
can carry data but never code.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from ..filecheck import FileCheckError, read_npz
from .state_check import check_echo_state

MAGIC = b"ECHOPIPE-DALI-STATE-1\n"


def encode(state: Any) -> bytes:
    """``state`` (nested dicts/lists/tuples of JSON values, numpy arrays and bytes) as bytes."""
    arrays: dict[str, np.ndarray] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            key = f"a{len(arrays)}"
            arrays[key] = value
            return {"__array__": key}
        if isinstance(value, (bytes, bytearray, memoryview)):
            key = f"a{len(arrays)}"
            arrays[key] = np.frombuffer(bytes(value), np.uint8)
            return {"__bytes__": key}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"state keys must be str, got {list(value)!r}")
            return {"__dict__": {k: walk(v) for k, v in value.items()}}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        if isinstance(value, np.generic):
            return value.item()
        return value

    tree = json.dumps(walk(state))
    buf = io.BytesIO()
    np.savez(buf, __tree__=np.frombuffer(tree.encode(), np.uint8), **arrays)
    return MAGIC + buf.getvalue()


def decode(blob: bytes | str) -> Any:
    """Inverse of :func:`encode` for an :class:`EchoPipeline` state, read with bounded memory
    and checked field by field (DALI's own checkpoints in it too) before anything uses it.

    The archive's members must be stored uncompressed and each ``.npy`` header must match its
    member's length, so a blob cannot make the process allocate more than a small multiple of
    its own size.

    Raises:
        ValueError: ``blob`` is not an echopipe DALI state, or it is malformed (says how).
    """
    if isinstance(blob, str):
        blob = blob.encode("latin-1")
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise ValueError(f"a DALI checkpoint is bytes, not a {type(blob).__name__}")
    blob = bytes(blob)
    if not blob[: len(MAGIC)] == MAGIC:
        raise ValueError(
            "this checkpoint is not an echopipe EchoPipeline state (it lacks the "
            f"{MAGIC.strip().decode()} header); was it saved from a plain DALI pipeline?"
        )
    try:
        arrays = read_npz(blob[len(MAGIC) :])
    except FileCheckError as exc:
        raise ValueError(f"this echopipe DALI checkpoint {exc}") from None
    tree_bytes = arrays.pop("__tree__", None)
    try:
        if tree_bytes is None or tree_bytes.dtype != np.uint8 or tree_bytes.ndim != 1:
            raise ValueError("it has no state tree")
        tree = json.loads(tree_bytes.tobytes().decode())
        state = _Rebuild(arrays, budget=2 * len(blob)).walk(tree, 0)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(f"this echopipe DALI checkpoint is malformed: {exc}") from None
    check_echo_state(state, "DALI checkpoint")
    return state


class _Rebuild:
    """The state tree with its array references resolved, copying at most ``budget`` bytes."""

    def __init__(self, arrays: dict[str, np.ndarray], budget: int) -> None:
        self.arrays = arrays
        self.budget = budget

    def array(self, key: Any) -> np.ndarray:
        if not isinstance(key, str) or key not in self.arrays:
            raise ValueError(f"it refers to a missing array {str(key)[:40]!r}")
        return self.arrays[key]

    def walk(self, value: Any, depth: int) -> Any:
        if depth > 64:
            raise ValueError("it is nested too deeply")
        if isinstance(value, dict):
            if "__array__" in value:
                return self.array(value["__array__"])
            if "__bytes__" in value:
                data = self.array(value["__bytes__"])
                self.budget -= data.nbytes
                if self.budget < 0 or data.dtype != np.uint8:
                    raise ValueError("its byte strings are repeated beyond its own size")
                return data.tobytes()
            items = value.get("__dict__")
            if not isinstance(items, dict):
                raise ValueError("it has an entry that is neither an array, bytes nor a dict")
            return {k: self.walk(v, depth + 1) for k, v in items.items()}
        if isinstance(value, list):
            return [self.walk(v, depth + 1) for v in value]
        return value
