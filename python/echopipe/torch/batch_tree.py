"""The batch tree of :mod:`.batch_layout`: its text in a layout's signature, and the function
that rebuilds a batch of the same structure from its leaves' values.

A tree is ``("leaf", index)``, ``("dict", keys, children, cls)`` (``cls``: the mapping's own
class, None for a plain dict, a :class:`DefaultDictOf` for a ``defaultdict``),
``("namedtuple", cls, children)``, ``("dataclass", cls, field names, children)``,
``("tuple", children)``, ``("list", children)`` or ``("none",)`` (a None field, rebuilt as None).
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable
from typing import Any

__all__ = ["DefaultDictOf", "builder", "mapping", "mapping_class", "tree_text"]


@dataclasses.dataclass(frozen=True)
class DefaultDictOf:
    """A ``defaultdict`` (or subclass) node's class and ``default_factory``. The factory is left
    out of the comparison: a collate that makes its factory anew per batch (a lambda) still
    gives one layout; the epoch's first batch's factory is the one rebuilt."""

    cls: type
    factory: Any = dataclasses.field(compare=False)


def mapping_class(obj: Any) -> Any:
    """The class entry of a mapping's node: None for a plain dict, a :class:`DefaultDictOf` for
    a ``defaultdict`` (its constructor wants the factory first), else the class."""
    if type(obj) is dict:
        return None
    if isinstance(obj, collections.defaultdict):
        return DefaultDictOf(type(obj), obj.default_factory)
    return type(obj)


def mapping(cls: Any) -> Callable[[dict[Any, Any]], Any]:
    """How a batch's mapping is rebuilt from a dict: its own class where that class takes one
    (a Hugging Face ``BatchEncoding`` keeps its ``.to()``, a ``UserDict`` or ``OrderedDict``
    its type, a ``defaultdict`` its ``default_factory``), else a dict."""
    if cls is None:
        return dict
    if isinstance(cls, DefaultDictOf):
        return lambda d: cls.cls(cls.factory, d)
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
    if kind == "none":
        return None
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
    if kind == "none":
        return lambda v: None
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
