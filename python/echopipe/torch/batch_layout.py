"""How :class:`echopipe.torch.EchoLoader` turns batches of any structure into cache samples.

A batch from a PyTorch input pipeline is a tree (dicts, tuples, lists, namedtuples) whose leaves
hold one row per sample: tensors and numpy arrays of shape ``(B, ...)``, and lists of ``B``
strings (file names, captions). :func:`describe` flattens the tree once and records a
:class:`Layout`: the tree, and per leaf its kind, dtype and per-sample shape. :func:`encode` then
cuts a batch into ``B`` samples of at most four byte fields (the cache's limit): fixed-size
leaves as ``(B, nbytes)`` uint8 matrices (one field per leaf while they fit, else several leaves
packed side by side in the last field), strings as one ragged UTF-8 field plus an int64 field of
their lengths. :func:`decode` rebuilds a batch of the same structure, dtypes and shapes from an
:class:`~echopipe.echo.EchoBatch` of such samples.

Every leaf of a stream must keep its per-sample shape: samples of different batches are mixed in
one output batch, so a leaf whose shape changes (padding to the longest sequence of each batch)
cannot be stacked again and is rejected with :class:`LayoutError`, naming the leaf and shapes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .batch_tree import builder, mapping_class, tree_text

__all__ = [
    "Layout", "LayoutError", "ShapeChangeError", "builder", "decode", "decode_many", "describe",
    "encode", "match",
]  # fmt: skip

_MAX_FIELDS = 4  # fields per cache sample (csrc/echo)


class LayoutError(ValueError):
    """A batch that cannot be split into samples, or that changed structure mid-stream."""


class ShapeChangeError(LayoutError):
    """A field's per-sample shape or dtype changed between two batches of one epoch."""


@dataclass(frozen=True)
class Leaf:
    """One leaf of the batch tree: ``kind`` is ``"tensor"``, ``"numpy"`` or ``"str"``."""

    path: str
    kind: str
    dtype: str  # torch dtype name ("float32"), numpy dtype string ("<f4"), or "str"
    shape: tuple[int, ...]  # per sample
    nbytes: int  # per sample; 0 for strings


@dataclass(frozen=True)
class Layout:
    """The structure of a stream's batches, and which leaves go into which cache field."""

    treedef: Any
    leaves: tuple[Leaf, ...]
    groups: tuple[tuple[int, ...], ...]  # fixed-size leaf indices per cache field
    strings: tuple[int, ...]  # string leaf indices (two extra fields when present)
    # Per leaf (type, dtype, per-sample shape) as the batch holds them: match() checks a later
    # batch against these without rebuilding the leaves' descriptions.
    keys: tuple[tuple[Any, Any, Any], ...] = field(default=(), compare=False, repr=False)

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample's fixed-size leaves."""
        return sum(leaf.nbytes for leaf in self.leaves)

    def signature(self) -> str:
        """A JSON description (kept in state dicts to check that a resumed stream matches)."""
        leaves = [[x.path, x.kind, x.dtype, list(x.shape)] for x in self.leaves]
        return json.dumps({"tree": tree_text(self.treedef), "leaves": leaves})


def _flatten(obj: Any, path: str, out: list[tuple[str, Any]]) -> Any:
    if obj is None:  # an optional field left out (a dataclass's default): None in every batch
        return ("none",)
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        out.append((path, obj))
        return ("leaf", len(out) - 1)
    if isinstance(obj, Mapping):  # its own class is rebuilt too (a Hugging Face BatchEncoding)
        keys = tuple(obj)
        children = tuple(_flatten(obj[k], f"{path}[{k!r}]", out) for k in keys)
        return ("dict", keys, children, mapping_class(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # rebuilt by its __init__
        names = tuple(f.name for f in dataclasses.fields(obj) if f.init)
        children = tuple(_flatten(getattr(obj, n), f"{path}.{n}", out) for n in names)
        return ("dataclass", type(obj), names, children)
    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(v, str) for v in obj):
            out.append((path, obj))
            return ("leaf", len(out) - 1)
        if obj and all(v is None for v in obj) and not hasattr(obj, "_fields"):
            # likely one None per sample: its length is the batch's, which echoed batches mix
            raise LayoutError(
                f"field batch{path} is a {type(obj).__name__} of {len(obj)} None; EchoLoader "
                "passes a None field as None, not a list of them: leave the field None"
            )
        children = tuple(_flatten(v, f"{path}[{i}]", out) for i, v in enumerate(obj))
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return ("namedtuple", type(obj), children)
        return ("tuple" if isinstance(obj, tuple) else "list", children)
    raise LayoutError(
        f"field batch{path} is a {type(obj).__name__}; EchoLoader echoes tensors, numpy arrays "
        "and lists of str (nested in dicts, dataclasses, tuples and lists; None passes as None)"
    )


def _leaf(path: str, value: Any, rows: int | None) -> Leaf:
    if isinstance(value, (list, tuple)):
        if rows is not None and len(value) != rows:
            raise LayoutError(f"field batch{path} has {len(value)} strings for {rows} samples")
        return Leaf(path, "str", "str", (), 0)
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
    else:
        if value.dtype.hasobject or value.dtype.kind in "USVOMm":
            raise LayoutError(f"field batch{path} has numpy dtype {value.dtype}, not a number")
        dtype = value.dtype.str
    if value.ndim == 0:
        raise LayoutError(f"field batch{path} is a scalar (0-d); it has no row per sample")
    if rows is not None and value.shape[0] != rows:
        raise LayoutError(
            f"field batch{path} has {value.shape[0]} rows but the batch has {rows} samples"
        )
    shape = tuple(int(s) for s in value.shape[1:])
    per = int(np.prod(shape, dtype=np.int64)) * value.element_size() if isinstance(
        value, torch.Tensor) else int(np.prod(shape, dtype=np.int64)) * value.itemsize  # fmt: skip
    return Leaf(path, "tensor" if isinstance(value, torch.Tensor) else "numpy", dtype, shape, per)


def _not_bytes(value: torch.Tensor) -> str | None:
    """What ``value`` is when its rows cannot be copied out as plain bytes, else None."""
    if value.is_nested:  # checked first: a nested tensor has no sizes to ask anything else of
        return "a nested tensor"
    if value.layout != torch.strided:
        return f"a {value.layout} tensor"
    if value.is_meta:
        return "a meta tensor (it holds no data)"
    if value.is_quantized:  # its bytes alone would come back without their scale and zero point
        return "a quantized tensor"
    return None


def describe(batch: Any) -> tuple[Layout, list[Any], int]:
    """Flattens ``batch``; returns its layout, its leaves and its number of samples."""
    flat: list[tuple[str, Any]] = []
    treedef = _flatten(batch, "", flat)
    for path, value in flat:
        what = _not_bytes(value) if isinstance(value, torch.Tensor) else None
        if what is not None:
            raise LayoutError(f"field batch{path} is {what}; only dense ones")
    rows = next((int(v.shape[0]) for _, v in flat if not isinstance(v, (list, tuple))
                 and v.ndim > 0), None)  # fmt: skip
    if rows is None:
        raise LayoutError(
            "the batch has no tensor or numpy field with a row per sample; nothing to echo"
        )
    leaves = tuple(_leaf(p, v, rows) for p, v in flat)
    fixed = tuple(i for i, x in enumerate(leaves) if x.kind != "str")
    strings = tuple(i for i, x in enumerate(leaves) if x.kind == "str")
    keys = tuple(_key(v) for _, v in flat)
    slots = _MAX_FIELDS - (2 if strings else 0)
    if len(fixed) <= slots:
        groups = tuple((i,) for i in fixed)
    else:  # the first leaves keep a field each (no copy on the way out), the rest share one
        groups = (*((i,) for i in fixed[: slots - 1]), fixed[slots - 1 :])
    return Layout(treedef, leaves, groups, strings, keys), [v for _, v in flat], rows


def _key(value: Any) -> tuple[Any, Any, Any]:
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, value.dtype, tuple(value.shape[1:]))
    if isinstance(value, np.ndarray):
        return (np.ndarray, value.dtype.str, value.shape[1:])
    return (str, None, None)


def match(layout: Layout, batch: Any) -> tuple[list[Any], int] | None:
    """The leaves and rows of a batch that :func:`describe` would give exactly ``layout``.

    The per-batch fast path after a stream's first batch; None for anything else (a different
    structure, dtype or shape, a tensor that is not plain bytes, no rows): :func:`describe` then
    says what differs.
    """
    values: list[Any] = []
    if not _walk(layout.treedef, batch, values):
        return None
    rows = -1
    for value, (kind, dtype, shape) in zip(values, layout.keys, strict=True):
        if kind is torch.Tensor:
            if not isinstance(value, torch.Tensor) or value.dtype is not dtype or _not_bytes(
                value) is not None:  # fmt: skip
                return None
        elif kind is np.ndarray:
            if not isinstance(value, np.ndarray) or value.dtype.str != dtype:
                return None
        else:
            continue
        size = value.shape
        if not size or size[1:] != shape or (rows >= 0 and size[0] != rows):
            return None
        rows = size[0]
    if rows <= 0:
        return None
    for i in layout.strings:
        value = values[i]
        if not isinstance(value, (list, tuple)) or len(value) != rows or not all(
            isinstance(v, str) for v in value):  # fmt: skip
            return None
    return values, int(rows)


def _walk(treedef: Any, obj: Any, out: list[Any]) -> bool:
    """Appends ``obj``'s leaves to ``out`` if its containers are those of ``treedef``."""
    kind = treedef[0]
    if kind == "leaf":
        out.append(obj)
        return True
    if kind == "none":
        return obj is None
    if kind == "dict":
        if not isinstance(obj, Mapping) or tuple(obj) != treedef[1]:
            return False
        return all(_walk(c, obj[k], out) for k, c in zip(treedef[1], treedef[2], strict=True))
    if kind == "dataclass":
        pairs = zip(treedef[2], treedef[3], strict=True)
        return type(obj) is treedef[1] and all(_walk(c, getattr(obj, n), out) for n, c in pairs)
    if kind == "namedtuple":
        ok, children = type(obj) is treedef[1], treedef[2]
    elif kind == "tuple":
        ok, children = isinstance(obj, tuple) and not hasattr(obj, "_fields"), treedef[1]
    else:
        ok, children = isinstance(obj, list), treedef[1]
    return ok and len(obj) == len(children) and all(
        _walk(c, v, out) for c, v in zip(children, obj, strict=True))  # fmt: skip


def check_saved(layout: Layout, saved: str | None) -> None:
    """Raises LayoutError when ``layout`` differs from the signature ``saved`` of a resumed
    stream (None: nothing was saved)."""
    if saved is not None and layout.signature() != saved:
        raise LayoutError(
            f"the batches differ from the saved state's: {layout.signature()} instead of {saved}"
        )


def check_same(layout: Layout, other: Layout) -> None:
    """Raises LayoutError naming the first difference between two batches' layouts."""
    if other is layout:
        return
    if layout.treedef != other.treedef:
        raise LayoutError(
            f"the batch structure changed: {tree_text(other.treedef)} instead of "
            f"{tree_text(layout.treedef)}"
        )
    for a, b in zip(layout.leaves, other.leaves, strict=True):
        if a != b:
            raise ShapeChangeError(
                f"field batch{a.path} changed from {a.kind} {a.dtype}{list(a.shape)} to "
                f"{b.kind} {b.dtype}{list(b.shape)} per sample within the epoch; echoed "
                "batches mix samples of different batches, so every field needs one shape per "
                "sample in an epoch"
            )


def _rows_as_bytes(value: Any, rows: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        # A plain CPU tensor goes through numpy's views: they cost a fraction of torch's calls
        # (measured: 0.6 us for numpy() against 1 us with detach(), which is skipped if possible).
        try:
            value = value.detach().numpy() if value.requires_grad else value.numpy()
        except (RuntimeError, TypeError):  # bfloat16, conj/neg bits, CUDA: torch's own path
            return _tensor_rows_as_bytes(value, rows)
    a = np.ascontiguousarray(value)
    return a.reshape(rows, -1 if a.size else 0).view(np.uint8)


def _tensor_rows_as_bytes(value: torch.Tensor, rows: int) -> np.ndarray:
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(rows, -1 if t.numel() else 0).view(torch.uint8).numpy()


def encode(layout: Layout, leaves: list[Any], rows: int) -> list[np.ndarray]:
    """The batch's fixed-size fields as ``(rows, nbytes)`` uint8 matrices, one per cache field."""
    out = []
    for group in layout.groups:
        parts = [_rows_as_bytes(leaves[i], rows) for i in group]
        out.append(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1))
    return out


def encode_strings(layout: Layout, leaves: list[Any], row: int) -> tuple[np.ndarray, np.ndarray]:
    """One sample's strings: UTF-8 bytes back to back (plus one pad byte) and their lengths.
    ``surrogatepass``: file names not valid UTF-8 on disk come from ``os.listdir`` with lone
    surrogates, which strict UTF-8 refuses; kept as 3 bytes each, decoded back the same way."""
    data = [leaves[i][row].encode("utf-8", "surrogatepass") for i in layout.strings]
    lengths = np.array([len(d) for d in data], dtype=np.int64)
    return np.frombuffer(b"".join(data) + b"\0", dtype=np.uint8), lengths


def _from_bytes(leaf: Leaf, rows: np.ndarray, n: int) -> Any:
    if leaf.kind == "numpy":
        return rows.view(np.dtype(leaf.dtype)).reshape(n, *leaf.shape)
    t = torch.from_numpy(rows)
    if leaf.nbytes:
        t = t.view(getattr(torch, leaf.dtype))
    else:
        t = torch.empty(0, dtype=getattr(torch, leaf.dtype))
    return t.reshape(n, *leaf.shape)


def decode_many(layout: Layout, parts: list[tuple[list[np.ndarray], list[Any], int]]) -> Any:
    """Rebuilds one batch from several gathered parts (``(fields, offsets, n)`` each).

    The parts' fields are joined with numpy (one copy, no intra-op thread pool) and decoded once.
    """
    if len(parts) == 1:
        return decode(layout, *parts[0])
    n = sum(p[2] for p in parts)
    fields = [np.concatenate([p[0][f].reshape(p[2], -1) for p in parts])
              for f in range(len(layout.groups))]  # fmt: skip
    offsets: list[Any] = [None] * len(fields)
    if layout.strings:
        f = len(layout.groups)
        flat, offs, base = [], [np.zeros(1, dtype=np.int64)], 0
        for data, part_offsets, k in parts:
            blob = data[f].reshape(-1)
            o = part_offsets[f]
            if o is None:
                o = np.arange(k + 1, dtype=np.int64) * (blob.size // k)
            flat.append(blob)
            offs.append(np.asarray(o[1:], dtype=np.int64) + base)
            base += blob.size
        fields += [np.concatenate(flat), np.concatenate([p[0][f + 1].reshape(p[2], -1)
                                                         for p in parts])]  # fmt: skip
        offsets += [np.concatenate(offs), None]
    return decode(layout, fields, offsets, n)


def decode(layout: Layout, fields: list[np.ndarray], offsets: list[Any], n: int) -> Any:
    """Rebuilds a batch of ``n`` samples (fields as gathered by ``EchoCache.take_batch``)."""
    return builder(layout.treedef)(_decode_leaves(layout, fields, offsets, n))


def _decode_leaves(
    layout: Layout, fields: list[np.ndarray], offsets: list[Any], n: int
) -> list[Any]:
    values: list[Any] = [None] * len(layout.leaves)
    for f, group in enumerate(layout.groups):
        data = fields[f].reshape(n, -1)
        start = 0
        for i in group:
            leaf = layout.leaves[i]
            # A copy, not ascontiguousarray: numpy calls a 1-row slice contiguous and keeps the
            # field's row stride, which a view as a wider dtype refuses.
            rows = data if len(group) == 1 else data[:, start : start + leaf.nbytes].copy()
            values[i] = _from_bytes(leaf, rows, n)
            start += leaf.nbytes
    if layout.strings:
        values_s = _decode_strings(layout, fields, offsets, n)
        for i, column in zip(layout.strings, values_s, strict=True):
            values[i] = column
    return values


def _decode_strings(
    layout: Layout, fields: list[np.ndarray], offsets: list[Any], n: int
) -> list[list[str]]:
    f = len(layout.groups)
    data, offs = fields[f].reshape(-1), offsets[f]
    lengths = fields[f + 1].reshape(n, -1)
    if offs is None:  # every sample had the same number of bytes
        width = data.size // n if n else 0
        offs = np.arange(n + 1, dtype=np.int64) * width
    columns: list[list[str]] = [[] for _ in layout.strings]
    for row in range(n):
        blob = data[offs[row] : offs[row + 1]].tobytes()
        pos = 0
        for j, length in enumerate(lengths[row].tolist()):
            columns[j].append(blob[pos : pos + length].decode("utf-8", "surrogatepass"))
            pos += length
    return columns
