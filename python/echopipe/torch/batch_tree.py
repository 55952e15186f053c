"""The batch tree of :mod:`.batch_layout`: its text in a layout's signature, and the function
that rebuilds a batch of the same structure from its leaves' values.

A tree is ``("leaf", index)``, ``("dict", keys, children, cls)`` (``cls``: the mapping's own
class, None for a plain dict), ``("namedtuple", cls, children)``,
``("dataclass", cls, field names, children)``, ``("tuple", children)`` or
``("list", children)``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

__all__ = ["builder", "mapping", "tree_text"]


def mapping(cls: type | None) -> Callable[[dict[Any, Any]], Any]:
    """How a batch's mapping is rebuilt from a dict: its own class where that class takes one
    (a Hugging Face ``BatchEncoding`` keeps its ``.to()``, a ``UserDict`` or ``OrderedDict``
    its type), else a dict (a ``defaultdict`` wants its factory first)."""
    if cls is None:
        return dict
    try:
        cls({})
    except Exception:  # a constructor of its own: the keys and values still arrive, as a dict
        return dict
    return cls


def tree_text(treedef: Any) -> Any:
    """``treedef`` as JSON values, for a layout's signature and its errors (without a mapping's
    class: a state saved by an earlier version, whose layouts had none, still matches)."""
    kind = treedef[0]
    if kind == "leaf":
        return treedef[1]
    if kind == "dict":
        return {"dict": [repr(k) for k in treedef[1]], "of": [tree_text(c) for c in treedef[2]]}
    if kind == "namedtuple":
        return {treedef[1].__qualname__: [tree_text(c) for c in treedef[2]]}
    if kind == "dataclass":
        return {
            treedef[1].__qualname__: dict(zip(treedef[2], map(tree_text, treedef[3]), strict=True))
        }
    return {kind: [tree_text(c) for c in treedef[1]]}


def builder(treedef: Any) -> Callable[[list[Any]], Any]:
    """A function rebuilding the batch tree of ``treedef`` from its leaves' values."""
    kind = treedef[0]
    if kind == "leaf":
        return operator.itemgetter(treedef[1])
    if kind == "dict":
        keys, subs, make = treedef[1], [builder(c) for c in treedef[2]], mapping(treedef[3])
        if make is dict:
            return lambda v: {k: b(v) for k, b in zip(keys, subs, strict=True)}
        return lambda v: make({k: b(v) for k, b in zip(keys, subs, strict=True)})
    if kind == "dataclass":  # its fields that __init__ takes (the others it computes)
        cls, names, subs = treedef[1], treedef[2], [builder(c) for c in treedef[3]]
        return lambda v: cls(**{n: b(v) for n, b in zip(names, subs, strict=True)})
    children = treedef[2] if kind == "namedtuple" else treedef[1]
    if kind == "tuple" and len(children) > 1 and all(c[0] == "leaf" for c in children):
        return operator.itemgetter(*(c[1] for c in children))  # (images, labels): one C call
    subs = [builder(c) for c in children]
    if kind == "namedtuple":
        cls = treedef[1]
        return lambda v: cls(*[b(v) for b in subs])
    if kind == "tuple":
        return lambda v: tuple([b(v) for b in subs])
    return lambda v: [b(v) for b in subs]
