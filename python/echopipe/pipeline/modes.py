"""Train/eval modes of the pipeline's modules: switched for evaluation and profiling with each
module's own mode restored afterwards, and checked against the modes a minibatch was fed with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import nn

__all__ = [
    "FedModes",
    "ModeSnapshot",
    "ModuleModes",
    "check_modes",
    "eval_mode",
    "module_modes",
    "restore_modes",
    "set_modes",
]

ModuleModes = list[tuple[nn.Module, bool]]

ModeSnapshot = tuple[tuple[bool, ...], ...]
"""Per stage, the ``training`` flag of each of its modules (``stage.modules()`` order)."""


def module_modes(stages: Iterable[nn.Module]) -> ModeSnapshot:
    """The train/eval mode of every module of ``stages``, as the caller feeds a minibatch."""
    return tuple(tuple(m.training for m in s.modules()) for s in stages)


class FedModes:
    """The modes minibatches are fed with. They may change only while the pipeline is drained
    (a stage finding them changed at a forward fails), so those read at the first minibatch
    after a drain are every later minibatch's: one walk of the modules per drain, not one per
    ``train_step`` besides each stage's own at its forward."""

    def __init__(self) -> None:
        self._snapshot: ModeSnapshot | None = None

    def of(self, stages: Iterable[nn.Module]) -> ModeSnapshot:
        """The modes a minibatch fed now carries (read if none was fed since the last drain)."""
        if self._snapshot is None:
            self._snapshot = module_modes(stages)
        return self._snapshot

    def forget(self) -> None:
        """A drain: the modes may change until the next minibatch, which reads them again."""
        self._snapshot = None


def check_modes(stage: int, module: nn.Module, index: int, fed: ModeSnapshot) -> None:
    """Raise ``RuntimeError`` if ``module`` (stage ``stage``) is not in the modes ``fed`` had.

    ``model.eval()`` right after an epoch (torchgpipe's evaluation loop) runs the forwards of
    the minibatches still in flight in eval mode: running statistics not updated, no dropout,
    and different weights afterwards, with nothing said.
    """
    if fed and module_modes([module])[0] != fed[stage]:
        raise RuntimeError(
            f"stage {stage}: its modules' train/eval modes changed while minibatch {index} was "
            "in flight (model.eval() or .train() without pipe.drain() first): drain before "
            "switching modes, or evaluate with pipe.evaluate(), which drains and restores them"
        )


def set_modes(stages: Iterable[nn.Module], *, training: bool) -> ModuleModes:
    """Every module of ``stages`` in ``training`` mode; returns the modes they had."""
    was = [(m, m.training) for s in stages for m in s.modules()]
    for m, _ in was:
        m.training = training
    return was


def restore_modes(was: ModuleModes) -> None:
    """Each module back in its own mode (``train(mode)`` on a parent would set one for all)."""
    for m, mode in was:
        m.training = mode


@contextlib.contextmanager
def eval_mode(stages: Iterable[nn.Module]) -> Iterator[None]:
    """``stages`` in eval mode, and afterwards every module in the mode it had: a BatchNorm
    the user froze with ``.eval()`` stays frozen (``train(mode)`` on a stage would reset it)."""
    was = set_modes(stages, training=False)
    try:
        yield
    finally:
        restore_modes(was)
