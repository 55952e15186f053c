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
    """Inverse of :func:`encode`; ValueError when ``blob`` is not an echopipe DALI state."""
    if isinstance(blob, str):
        blob = blob.encode("latin-1")
    if not bytes(blob[: len(MAGIC)]) == MAGIC:
        raise ValueError(
            "this checkpoint is not an echopipe EchoPipeline state (it lacks the "
            f"{MAGIC.strip().decode()} header); was it saved from a plain DALI pipeline?"
        )
    with np.load(io.BytesIO(bytes(blob[len(MAGIC) :])), allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    tree = json.loads(arrays.pop("__tree__").tobytes().decode())

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if "__array__" in value:
                return arrays[value["__array__"]]
            if "__bytes__" in value:
                return arrays[value["__bytes__"]].tobytes()
            return {k: walk(v) for k, v in value["__dict__"].items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(tree)
