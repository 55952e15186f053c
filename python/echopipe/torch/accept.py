"""What the reader thread of :class:`echopipe.torch.EchoLoader` calls for every batch it read:
the batch's layout checked against the pass's (the first batch of a pass sets it) and the echo
cache, made once for that layout and kept while the layout stays."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..echo import CacheClosedError, EchoCache
from . import batch_layout as bl
from . import passes
from .delivery import Assembler

if TYPE_CHECKING:
    from .loader import EchoLoader

__all__ = ["accept_layout"]


def accept_layout(
    loader: EchoLoader, layout: bl.Layout, rows: int, stop: threading.Event
) -> EchoCache:
    """Checks a batch of ``rows`` samples in ``layout`` and returns the cache to put it in."""
    with loader._shared.lock:
        if stop.is_set() or loader._closed:
            raise CacheClosedError("EchoLoader is closed")
        if loader._layout is None:  # the first batch of a pass
            bl.check_saved(layout, loader._saved_layout)
            prior = loader._prior_layout not in (None, layout.signature())
            if prior or (loader._stream is not None and layout != loader._stream):
                passes.drop_cache(loader)  # a new layout (fresh epoch: the cache is drained)
            loader._decode = Assembler(layout, loader._pin)  # first: the consumer reads both
            loader._layout = loader._stream = layout
            loader._saved_layout = loader._prior_layout = None
        else:
            bl.check_same(loader._layout, layout)
        if loader._batch_size is None:
            loader._batch_size = rows
        if loader._shared.cache is None:
            if loader._cache_config is None:
                loader._cache_config = passes.cache_config(
                    layout, loader._batch_size, loader._shuffle_buffer, loader._capacity_bytes,
                    loader._seed, loader._epoch_samples)  # fmt: skip
            loader._shared.cache = EchoCache(
                echo_factor=loader._factor, memory="pageable", **loader._cache_config
            )
        return loader._shared.cache
