"""What both pipeline engines return, and how they read a loader's batches.

:class:`~echopipe.pipeline.StalePipeline` and
:class:`~echopipe.pipeline.DistributedStalePipeline` share these types, so code written against
one runs against the other. :func:`unpack_batch` lets ``run_epoch`` take what data loaders
yield: ``(x, target)`` pairs, and DALI-style ``[{"data": x, "label": y}]`` lists of dicts
(``DALIGenericIterator``, ``DALIClassificationIterator``, ``EchoIterator``), whose class labels
come as ``(N, 1)`` int32.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .stream import StreamEvent

__all__ = [
    "EpochResult",
    "LossRecord",
    "StepResult",
    "as_logits",
    "check_minibatch",
    "checked_batch_size",
    "concat_outputs",
    "output_to_cpu",
    "refilled",
    "unpack_batch",
]

#: Default names of the input and the target in dict batches (DALI's and echopipe's iterators).
DEFAULT_OUTPUT_MAP = ("data", "label")


@dataclass
class LossRecord:
    """The loss of one finished minibatch (resolved lazily so CUDA streams are not synced)."""

    index: int
    tensor: torch.Tensor
    ready: StreamEvent = field(default_factory=StreamEvent)

    @property
    def value(self) -> float:
        """The loss as a Python float (waits for the stage's stream on CUDA)."""
        self.ready.synchronize()
        return float(self.tensor.item())


@dataclass
class StepResult:
    """What ``train_step`` reports.

    Attributes:
        index: 0-based index of the minibatch just fed.
        finished: losses of minibatches whose forward on the last stage completed since the
            previous call, oldest first. With ``K`` stages a minibatch's loss appears about
            ``K-1`` steps after it was fed. In the distributed engine only the last stage's
            ranks see losses (elsewhere the list is empty).
    """

    index: int
    finished: list[LossRecord]

    @property
    def losses(self) -> list[float]:
        """The finished losses as floats."""
        return [r.value for r in self.finished]


@dataclass
class EpochResult:
    """Summary of ``run_epoch``."""

    steps: int
    samples: int
    losses: list[float]
    seconds: float

    @property
    def mean_loss(self) -> float:
        """Mean of the losses that finished during the epoch (nan if none did)."""
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")


def unpack_batch(
    batch: Any, output_map: Sequence[str] = DEFAULT_OUTPUT_MAP
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, target)`` from a loader's batch.

    Accepts an ``(x, target, ...)`` tuple or list, a dict, or a list holding one dict (DALI's
    iterators yield one dict per pipeline); ``output_map`` names the input and the target keys.
    Integer class labels of shape ``(N, 1)`` become ``(N,)`` int64, which classification losses
    expect; other targets pass unchanged. TypeError / KeyError name what was found instead.
    """
    if isinstance(output_map, str) or len(output_map) != 2:
        raise ValueError(f"output_map must name (input, target), got {output_map!r}")
    if isinstance(batch, list) and len(batch) == 1 and isinstance(batch[0], dict):
        batch = batch[0]
    if isinstance(batch, dict):
        missing = [k for k in output_map if k not in batch]
        if missing:
            raise KeyError(
                f"batch has keys {sorted(batch)}, but output_map asks for {list(output_map)}"
            )
        x, target = batch[output_map[0]], batch[output_map[1]]
    elif isinstance(batch, tuple | list) and len(batch) >= 2:
        x, target = batch[0], batch[1]
    else:
        raise TypeError(
            "loader must yield (x, target) pairs or dicts (DALI style, keys from output_map), "
            f"got {type(batch).__name__}"
            + (f" of {len(batch)} items" if isinstance(batch, tuple | list) else "")
        )
    if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(
            f"batch must hold tensors, got {type(x).__name__} and {type(target).__name__}"
        )
    return x, as_class_target(target)


def as_class_target(target: torch.Tensor) -> torch.Tensor:
    """Integer labels of shape (N, 1) as (N,) int64; anything else unchanged."""
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        return target
    if target.dim() == 2 and target.shape[1] == 1:
        target = target.reshape(-1)
    return target if target.dtype == torch.int64 else target.long()


def check_minibatch(x: object, target: object) -> None:
    """``train_step``'s ``x`` and ``target``: tensors, made outside ``torch.inference_mode()``.

    An inference tensor has no version counter, which the pipeline reads to name a buffer
    refilled after ``train_step``, and autograd cannot save it for backward.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(
            f"train_step needs tensors (x, target), got {type(x).__name__}, {type(target).__name__}"
        )
    for name, tensor in (("x", x), ("target", target)):
        if tensor.is_inference():
            raise TypeError(
                f"train_step: {name} is an inference tensor (made under "
                "torch.inference_mode()), which training cannot use: make it outside "
                f"inference mode, or pass {name}.clone() made outside it"
            )


def refilled(
    tensors: Iterable[tuple[str, torch.Tensor | None, int | None]],
    index: int,
    before: str,
    reads: str,
) -> str | None:
    """The error line for the first of ``(name, tensor, version at train_step)`` that was
    modified in place since (its version counter moved), else ``None``.

    ``train_step`` returns before the stages are done with ``x`` and the target: a caller that
    refills one buffer per minibatch (as a plain loop may) would train on the next minibatch's
    values. ``before`` and ``reads`` say when the engine asking reads it (the threaded engine:
    when a stage takes the minibatch; the distributed one: until its backward on rank 0).
    """
    for name, tensor, version in tensors:
        if tensor is not None and version is not None and tensor._version != version:
            return (
                f"the {name} of minibatch {index} was modified in place after train_step, "
                f"before {before} (a reused buffer?): the pipeline reads it {reads}, so feed "
                "a new tensor per minibatch (or a .clone())"
            )
    return None


def checked_batch_size(batch_size: object) -> int:
    """``batch_size`` of ``evaluate`` / ``accuracy`` as a positive int (``ValueError`` names it;
    ``torch.split`` would fail on 0, a negative or a float with its own words)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size


def _rebuild(like: Any, items: list[Any]) -> Any:
    if isinstance(like, dict):
        return dict(zip(like, items, strict=True))
    if hasattr(like, "_fields"):  # a namedtuple takes its fields as arguments
        return type(like)(*items)
    return type(like)(items)


def _parts(output: Any) -> list[Any] | None:
    if isinstance(output, dict):
        return list(output.values())
    if isinstance(output, tuple | list):
        return list(output)
    return None


def output_to_cpu(output: Any) -> Any:
    """The model's output on the CPU: a tensor, or the tensors inside tuples, lists and dicts
    (a last stage may return several heads, as Inception's auxiliary logits)."""
    if isinstance(output, torch.Tensor):
        return output.cpu()
    parts = _parts(output)
    return output if parts is None else _rebuild(output, [output_to_cpu(p) for p in parts])


def concat_outputs(outputs: Sequence[Any]) -> Any:
    """Outputs of consecutive chunks as one: each tensor concatenated along dim 0, in the
    structure of the first chunk (values that are not tensors come from the first chunk)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs))
    parts = _parts(first)
    if parts is None:
        return first
    columns = zip(*(_parts(o) or () for o in outputs), strict=True)
    return _rebuild(first, [concat_outputs(list(c)) for c in columns])


def as_logits(output: Any) -> torch.Tensor:
    """``output`` if it is one tensor of logits, which ``accuracy`` scores; a ``TypeError``
    naming what the model returns otherwise (several heads: score ``evaluate()``'s outputs)."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"accuracy needs the model to output logits, it outputs a {type(output).__name__}: "
            "score evaluate()'s outputs instead"
        )
    return output
