"""The ``len()`` values an :class:`~echopipe.torch.EchoLoader` told, and the warning for a loop
that stopped an epoch at one of them after ``set_echo_factor`` made the epoch longer.

Lightning reads ``len()`` once per fit (``num_training_batches``) and takes that many batches
per epoch. A factor raised after that read (a callback's ``set_echo_factor``) makes a pass of
more batches than Lightning takes, and its next ``iter()`` ends the pass with copies left: those
samples are not trained on in that epoch. The DALI ``EchoIterator`` names the same case
(``EpochContinuedWarning``); here it went unsaid.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from . import wrapped

if TYPE_CHECKING:
    from .loader import EchoLoader

__all__ = ["LengthsTold", "StaleLengthWarning"]


class StaleLengthWarning(RuntimeWarning):
    """An epoch ended with copies left after exactly as many batches as an earlier ``len()``
    told: the loop stopped at a length that ``set_echo_factor`` (or a loaded state's factor)
    had made stale."""


class LengthsTold:
    """Every ``len()`` an EchoLoader told, with the factor it was told at. An epoch that held
    copies after as many batches as one told at another factor ended where a loop counting
    from that old ``len()`` stops (one counting from the current one never stops with copies
    left, since the epoch has exactly that many batches; a ``len()`` that was off for the
    wrapped loader is warned about by itself)."""

    def __init__(self) -> None:
        self._told: set[tuple[int, float]] = set()

    def tell(self, source: Any, factor: float | None, batch_size: int | None) -> int:
        """The batches of the next epoch over the wrapped loader ``source`` at ``factor``
        (:func:`.wrapped.epoch_batches`: ``TypeError`` when unknown, as for ``"auto"``'s
        ``None``), remembered with the factor."""
        batches = wrapped.epoch_batches(source, factor, batch_size)
        if factor is not None:
            self._told.add((batches, factor))
        return batches

    def warn_if_stale(self, loader: EchoLoader) -> None:
        """Warns when ``loader``'s epoch, ended early, still held copies (its ``_cut_short``)
        after as many batches as ``len()`` told at another factor than the loader's now."""
        epoch, delivered, factor = loader._epoch, loader._delivered_epoch[0], loader._factor
        if loader._cut_short is None or not any(
            batches == delivered > 0 and told != factor for batches, told in self._told
        ):
            return
        warnings.warn(
            f"EchoLoader: the loop stopped epoch {epoch} after {delivered} batches, a len() "
            "read before the factor changed (set_echo_factor(), or a loaded state's), and the "
            "epoch still held copies: those samples are not trained on in it. Lightning reads "
            "len() once per fit, before it loads a checkpoint: set the factor in "
            "on_train_epoch_end and pass reload_dataloaders_every_n_epochs=1",
            StaleLengthWarning,
            stacklevel=4,
        )
