"""The ``len()`` values an :class:`~echopipe.torch.EchoLoader` told, and the warning for a loop
that stopped an epoch at one of them after ``set_echo_factor`` made the epoch longer.

Lightning reads ``len()`` once per fit (``num_training_batches``) and takes that many batches
per epoch. A factor raised after that read (a callback's ``set_echo_factor``) makes a pass of
more batches than Lightning takes, and its next ``iter()`` ends the pass with copies left: those
samples are not trained on in that epoch. The DALI ``EchoIterator`` names the same case
(``EpochContinuedWarning``). A loop that ends for a limit of its own (``max_steps``) where an
older ``len()``'s count happens to fall stopped for another reason, and is not warned.
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
    told at another factor, and the loop went on to another pass: it stopped at a length that
    ``set_echo_factor`` (or a loaded state's factor) had made stale."""


class LengthsTold:
    """Every ``len()`` an EchoLoader told, with the factor it was told at, and the epochs that
    ended early, with copies left, after as many batches as one told at another factor.

    Such an end is where a loop counting from that old ``len()`` stops, and also where a loop
    may stop for a limit of its own (``max_steps``) that falls on that count. Only the first
    goes on to another pass as if the epoch were over: the stale length is named when the next
    pass starts, and from then on at once for an epoch cut at a count already named (the loop's
    last epoch, which no pass follows). A loop counting from the current ``len()`` never stops
    with copies left, since the epoch has exactly that many batches; a ``len()`` that was off
    for the wrapped loader is warned about by itself."""

    def __init__(self) -> None:
        self._told: set[tuple[int, float]] = set()
        self._cut: tuple[int, int] | None = None  # (epoch, batches): named if a pass follows
        self._named: set[int] = set()  # counts a loop went on from

    def tell(self, source: Any, factor: float | None, batch_size: int | None) -> int:
        """The batches of the next epoch over the wrapped loader ``source`` at ``factor``
        (:func:`.wrapped.epoch_batches`: ``TypeError`` when unknown, as for ``"auto"``'s
        ``None``), remembered with the factor."""
        batches = wrapped.epoch_batches(source, factor, batch_size)
        if factor is not None:
            self._told.add((batches, factor))
        return batches

    def epoch_cut(self, loader: EchoLoader) -> None:
        """At the early end of ``loader``'s epoch: one that still held copies (its
        ``_cut_short``) after as many batches as ``len()`` told at another factor than the
        loader's now is named now if a loop already went on from that count, else when the
        next pass starts (:meth:`pass_started`)."""
        epoch, delivered, factor = loader._epoch, loader._delivered_epoch[0], loader._factor
        self._cut = None
        if loader._cut_short is None or not any(
            batches == delivered > 0 and told != factor for batches, told in self._told
        ):
            return
        if delivered in self._named:
            _warn(epoch, delivered, stacklevel=5)
        else:
            self._cut = (epoch, delivered)

    def pass_started(self) -> None:
        """At the first ``next()`` of a pass: the loop went on from an epoch cut at a stale
        count (:meth:`epoch_cut`), which is named."""
        if self._cut is not None:
            (epoch, delivered), self._cut = self._cut, None
            self._named.add(delivered)
            _warn(epoch, delivered, stacklevel=6)

    def forget_cut(self) -> None:
        """A loaded state starts another run: an earlier run's cut epoch is not named."""
        self._cut = None


def _warn(epoch: int, delivered: int, stacklevel: int) -> None:
    warnings.warn(
        f"EchoLoader: the loop stopped epoch {epoch} after {delivered} batches, a len() "
        "read before the factor changed (set_echo_factor(), or a loaded state's), and the "
        "epoch still held copies: those samples are not trained on in it. Lightning reads "
        "len() once per fit, before it loads a checkpoint: set the factor in "
        "on_train_epoch_end and pass reload_dataloaders_every_n_epochs=1",
        StaleLengthWarning,
        stacklevel=stacklevel,
    )
