"""``echopipe train``: DALI input with data echoing feeding a stale-weight pipelined model.

One run (``docs/train.md`` has the details):

1. The data: ``--data`` (an ImageNet-layout folder with ``train/`` and ``val/``) or, by
   default, the synthetic JPEG set from :func:`echopipe.data.ensure_synthetic_imagenet`.
2. The input (:mod:`echopipe.training.input`): DALI reads and decodes JPEGs upstream, the echo
   cache hands each fresh sample out ``e`` times downstream for augmentation, and
   :class:`echopipe.dali.EchoIterator` counts fresh and echoed samples.
3. The model: a flat ``nn.Sequential`` from :func:`echopipe.models.build_model`, split into
   stages by :class:`echopipe.pipeline.StalePipeline` (PPL-SGD) when that measures faster
   (:mod:`echopipe.training.decide`).
4. Under ``torchrun`` each process is a data-parallel replica
   (:mod:`echopipe.training.distributed`).
5. Every epoch ends with a drain, validation, a metrics row, the plot and a checkpoint
   (:mod:`echopipe.training.report`, :mod:`echopipe.training.checkpoints`); the counters live
   in one :class:`echopipe.training.state.RunState`; :mod:`echopipe.training.progress` has the
   live lines and ``steps.csv``.
6. A run has its own folder (:mod:`echopipe.training.runfolder`: dated by default, one run per
   folder) and a resumed run is the same run (:mod:`echopipe.training.resume`: the checkpoint's
   options, the LR schedule continued, the ranks agreeing on a step); :mod:`.start` runs both
   before anything heavy.

The options are defined once, in :class:`echopipe.training.config.TrainConfig`; the CLI is
generated from it. Data flows one way: :mod:`.config` -> :mod:`.trainer` -> (:mod:`.input`, the
pipeline, :mod:`.state`) -> :mod:`.report` and :mod:`.checkpoints`; nothing imports
:mod:`.trainer` back.
"""

from __future__ import annotations

from .checkpoints import (
    CheckpointError,
    export_state_dict,
    read_checkpoint,
    write_checkpoint,
)
from .config import DataError, Interrupted, TrainConfig, TrainError, UsageError
from .distributed import DistContext, default_devices
from .input import evaluate_checkpoint
from .report import TrainSummary, format_summary
from .state import RunState
from .trainer import Trainer, train

__all__ = [
    "CheckpointError",
    "DataError",
    "DistContext",
    "Interrupted",
    "RunState",
    "TrainConfig",
    "TrainError",
    "TrainSummary",
    "Trainer",
    "UsageError",
    "default_devices",
    "evaluate_checkpoint",
    "export_state_dict",
    "format_summary",
    "read_checkpoint",
    "train",
    "write_checkpoint",
]
