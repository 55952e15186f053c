"""The order a resumed pass of :class:`echopipe.torch.EchoLoader` re-reads: whether the wrapped
DataLoader's pass makes its iterator, and the draws that keep a resumed pass's order the saved
one's when it starts the other way (:class:`SeedDraw`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from .wrapped import innermost_dataloader

__all__ = ["SeedDraw", "new_iterator"]


def new_iterator(loader: Any) -> bool | None:
    """Whether the wrapped DataLoader's next pass makes a new iterator, which draws its workers'
    base seed from the DataLoader's ``generator`` before the sampler draws its order, rather
    than resetting the one its persistent workers keep (the order alone); None where no plain
    ``DataLoader.__iter__`` makes the pass."""
    dl = innermost_dataloader(loader)
    if dl is None or type(dl).__iter__ is not DataLoader.__iter__:
        return None
    return not (dl.persistent_workers and dl.num_workers > 0) or dl._iterator is None


class SeedDraw:
    """Lets a resumed pass draw its order from the restored generator states as the saved pass
    did (``saved``: :func:`new_iterator` then), when it starts otherwise (``now``): a persistent
    DataLoader's first pass draws the base seed from the generator that a ``shuffle=True,
    generator=g`` DataLoader's sampler shares, its later passes do not; so a fresh process
    resuming one of those shifted the order by a draw. :meth:`done` once the pass has begun."""

    def __init__(self, loader: Any, saved: bool | None, now: bool | None) -> None:
        dl = innermost_dataloader(loader)
        self.dl, self.gen = dl, getattr(dl, "generator", None)
        self.swapped = False
        cpu = isinstance(self.gen, torch.Generator) and self.gen.device.type == "cpu"
        if not cpu or None in (saved, now) or saved == now:
            return
        if saved:  # the saved pass's base seed came first: drawn here, as it was
            torch.empty((), dtype=torch.int64).random_(generator=self.gen)
        else:  # this one's base seed comes from a copy, leaving the restored state to the order
            scratch = torch.Generator()
            scratch.set_state(self.gen.get_state())
            self.dl.generator, self.swapped = scratch, True

    def done(self) -> None:
        """Gives the DataLoader its own generator back (once its iterator was made)."""
        if self.swapped:
            self.dl.generator, self.swapped = self.gen, False
