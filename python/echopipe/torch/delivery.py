"""The take path of :class:`echopipe.torch.EchoLoader`: output batches out of the echo cache.

Every output batch costs one copy per sample. For the usual streams (tensors and numpy arrays,
no strings) each leaf gets its output buffer first: a tensor of the batch's shape, in pinned
memory when the loader pins, and ``EchoCache.take_batch_into`` copies the samples straight from
the cache's arena into its rows, however many takes a batch needs. Other streams (strings, more
leaves than cache fields) are gathered by ``take_batch`` and rebuilt by
:func:`.batch_layout.decode`, which copies again where leaves share a field.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..echo import CacheClosedError, CacheTooSmallError
from . import batch_layout as bl
from .batch_tree import mapping, mapping_class
from .reader import POLL_S, Producer

if TYPE_CHECKING:
    from .loader import EchoLoader

__all__ = ["Assembler", "map_tensors", "next_batch", "pin_choice"]


def pin_choice(
    device: torch.device | None, pin_memory: bool | None, loader: Any, cuda: bool | None = None
) -> bool:
    """Whether output batches go to pinned memory: when asked, else when ``device`` is CUDA or
    the wrapped ``loader`` pins (``pin_memory=True``: the loop's ``non_blocking`` copy counts on
    it); never without CUDA (``cuda``), with a warning only if asked (torch warns of the other)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if pin_memory and not cuda:
        warnings.warn("EchoLoader: pin_memory=True but CUDA is not available; not pinning",
                      RuntimeWarning, stacklevel=3)  # fmt: skip
    if pin_memory is None:
        pin_memory = (
            getattr(loader, "pin_memory", False) is True or getattr(device, "type", "") == "cuda"
        )
    return bool(pin_memory) and cuda


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in its mappings, dataclasses, tuples and
    lists, each rebuilt as :func:`.batch_tree.builder` builds it: a mapping keeps its class (a
    ``BatchEncoding`` its ``.to()``, a ``defaultdict`` its factory), a dataclass is remade by
    its ``__init__`` from the fields it takes."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        moved = {k: map_tensors(v, fn) for k, v in obj.items()}
        return mapping(mapping_class(obj))(moved)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = (f.name for f in dataclasses.fields(obj) if f.init)
        return type(obj)(**{n: map_tensors(getattr(obj, n), fn) for n in fields})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


class Assembler:
    """Output batches of one layout: buffers to take into (when the layout allows) and the
    rebuilding of the batch tree."""

    def __init__(self, layout: bl.Layout, pin: bool) -> None:
        self.layout = layout
        self.pin = pin
        leaves = layout.leaves
        # Buffers need one leaf per cache field, each with bytes: the cache then holds a leaf's
        # row exactly as the output tensor does.
        self.direct = (
            not layout.strings
            and len(layout.groups) == len(leaves)
            and all(x.nbytes for x in leaves)
        )
        self.build = bl.builder(layout.treedef)
        self.makers = [_maker(leaves[g[0]], pin) for g in layout.groups] if self.direct else []

    def buffers(self, rows: int) -> list[Any]:
        """Fresh output buffers of ``rows`` samples, one per cache field."""
        return [make(rows) for make in self.makers]

    def finish(self, buffers: list[Any], n: int) -> Any:
        """The batch of the first ``n`` rows of ``buffers`` (views, no copy)."""
        rows = buffers[0].shape[0]
        return self.build(buffers if n == rows else [b[:n] for b in buffers])

    def decode(self, parts: list[Any], n: int) -> Any:
        """The batch of gathered ``EchoBatch`` parts (the path without buffers)."""
        if len(parts) == 1:
            batch = bl.decode(self.layout, parts[0].fields, parts[0].offsets, n)
        else:
            batch = bl.decode_many(self.layout, [(g.fields, g.offsets, len(g)) for g in parts])
        return map_tensors(batch, torch.Tensor.pin_memory) if self.pin else batch


def _maker(leaf: bl.Leaf, pin: bool) -> Callable[[int], Any]:
    shape = leaf.shape
    if leaf.kind == "numpy":
        dt = np.dtype(leaf.dtype)
        return lambda rows: np.empty((rows, *shape), dtype=dt)
    td = getattr(torch, leaf.dtype)
    if pin:
        return lambda rows: torch.empty((rows, *shape), dtype=td, pin_memory=True)
    # numpy allocates unpinned memory in about half the time torch.empty takes, and the tensor
    # shares it: this runs for every field of every batch.
    try:
        dt = torch.empty((), dtype=td).numpy().dtype
    except TypeError:  # a dtype numpy has no equivalent for (bfloat16)
        return lambda rows: torch.empty((rows, *shape), dtype=td)
    return lambda rows: torch.from_numpy(np.empty((rows, *shape), dtype=dt))


def next_batch(loader: EchoLoader, producer: Producer) -> tuple[Any, int] | None:
    """The next output batch and its samples, or None at the end of the epoch.

    ``take`` may return a short part before the end (a full, small cache): the rest is taken
    too, so only an epoch's last batch can be short; it is dropped (its copies drawn and not
    delivered) where the wrapped loader drops its own short batch, as a DataLoader does.
    """
    want = loader.batch_size
    assembler = None
    buffers: list[Any] | None = None
    parts: list[Any] = []
    n = 0
    while want is None or n < want:
        if assembler is None and loader._layout is not None and loader._decode is not None:
            assembler = loader._decode
            if assembler.direct and want is not None:
                buffers = assembler.buffers(want)
        got = _take(loader, producer, n, buffers, assembler is not None)
        if got is None:
            break
        if isinstance(got, int):
            n += got
        else:
            parts.append(got)
            n += len(got)
        want = loader.batch_size
    if producer.lockstep is not None:
        producer.lockstep.took()  # (the direct takes released their copies' slots already)
    if n == 0 or n < producer.drop_below:
        return None
    assert assembler is not None
    batch = assembler.finish(buffers, n) if buffers is not None else assembler.decode(parts, n)
    device = loader._device
    if device is not None:
        pinned = assembler.pin
        batch = map_tensors(batch, lambda t: t.to(device, non_blocking=pinned))
    return batch, n


def _take(
    loader: EchoLoader, producer: Producer, have: int, buffers: list[Any] | None, planned: bool
) -> Any:
    """One take: rows written into ``buffers`` (an int), else an ``EchoBatch``; None at the end.

    Without a plan (``planned``: the caller had no layout yet), it returns 0 rows as soon as the
    layout is known, once, so that the caller makes its buffers before the first take.
    """
    timeout = loader._timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    shared = loader._shared
    while True:
        if producer.error is not None:
            raise producer.error
        # The layout first: a pass whose layout changed publishes it after dropping the old
        # cache (.passes.drop_cache), so a layout read here never comes with that cache.
        layout = loader._layout
        cache = shared.cache
        if cache is None or layout is None:
            if loader._closed:
                raise RuntimeError("EchoLoader was closed")
            if producer.ready.is_set() and not producer.is_alive():
                if producer.error is not None:
                    raise producer.error
                return None  # the wrapped loader yielded no batch this epoch
            producer.ready.wait(POLL_S)
            if not planned and loader._layout is not None:
                return 0
        elif producer.lockstep is not None and not producer.lockstep.wait():
            pass  # deterministic: the reader is still filling the cache
        else:
            size = loader.batch_size
            assert size is not None
            try:
                if buffers is not None:
                    got = cache.take_batch_into(buffers, size - have, POLL_S, start=have)
                else:
                    got = cache.take_batch(size - have, timeout=POLL_S)
            except TimeoutError:
                got = False
                _check_stuck(producer, loader)
            except CacheClosedError:
                if producer.error is not None:
                    raise producer.error from None
                raise RuntimeError("EchoLoader was closed") from None
            if producer.error is not None:
                raise producer.error
            if got is not False:
                return got
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"EchoLoader: no batch within timeout={timeout:g}s (epoch {loader._epoch},"
                f" {loader._delivered_epoch[0]} batches delivered, {producer.batches_done} "
                "read from the wrapped loader)"
            )


def _check_stuck(producer: Producer, loader: EchoLoader) -> None:
    """In lockstep a draw that times out while the reader waits on a full cache can never
    start: the cache filled by bytes before it held the samples a draw needs."""
    step = producer.lockstep
    cache = loader._shared.cache
    if step is None or cache is None or not step.ready() or step.over:
        return
    stats = cache.stats()
    wanted = loader.batch_size
    per_sample = max(1, -(-stats.bytes_used // max(stats.resident, 1)))  # the residents' mean
    need = stats.capacity_bytes + (wanted - stats.resident) * per_sample
    raise CacheTooSmallError(
        f"EchoLoader(deterministic=True): capacity_bytes={stats.capacity_bytes} is full with "
        f"{stats.resident} samples of about {per_sample} bytes, fewer than a draw of {wanted}; "
        f"give capacity_bytes of at least {need} (or a smaller shuffle_buffer)",
        stats.resident,
        wanted,
        need,
    )
