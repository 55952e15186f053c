"""The one-line warnings :class:`~.iterator.EchoIterator` gives where a loop would otherwise
count its epochs or its samples wrong without a word (found under Lightning's ``Trainer``)."""

from __future__ import annotations

import warnings

import torch


class EpochContinuedWarning(UserWarning):
    """``iter()`` went on with an epoch that the loop had stopped at a ``len()`` told before
    ``set_echo_factor`` raised the factor (Lightning reads ``len()`` once per fit): the loop's
    next epoch begins with the rest of this pass."""


class EchoedEvaluationWarning(UserWarning):
    """An echoing epoch began with gradients off (an evaluation or prediction loop): each sample
    is handed out about ``e`` times, so metrics and predictions count it that often."""


def warn_continued_epoch(taken: int, steps: int, stacklevel: int = 3) -> None:
    """Warns that ``iter()`` after ``taken`` of an epoch's ``steps``, a number of steps an
    earlier ``len()`` told, goes on with that epoch (as DALI's iterators do)."""
    warnings.warn(
        f"EchoIterator: the loop stopped this epoch after {taken} of its {steps} steps, the "
        "len() it read before set_echo_factor() raised the factor, so its next epoch takes the "
        f"last {steps - taken} first; Lightning reads len() once per fit: set the factor in "
        "on_train_epoch_end and pass reload_dataloaders_every_n_epochs=1",
        EpochContinuedWarning,
        stacklevel=stacklevel,
    )


def warn_if_evaluating(factor: float, stacklevel: int = 4) -> None:
    """Warns when an echoing epoch (``factor`` > 1) starts with gradients off, as Lightning's
    ``validate``, ``test`` and ``predict`` (under ``inference_mode``) and ``torch.no_grad()``
    evaluation loops run; it goes on, since a pass without gradients can be legitimate."""
    if factor > 1 and not torch.is_grad_enabled():
        warnings.warn(
            f"EchoIterator (echo_factor={factor:g}) starts an epoch with gradients off (an "
            "evaluation or prediction loop?): it hands out each sample about e times, so "
            "metrics and predictions count it that often; evaluate on the pipeline function "
            "without the echo point (a plain DALI pipeline)",
            EchoedEvaluationWarning,
            stacklevel=stacklevel,
        )
