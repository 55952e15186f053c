"""What ranks agree on for :class:`DistributedStalePipeline`: the automatic balance, the steps
of an epoch, an evaluation's forward and accuracy, and the metric the schedulers step on.

These give the distributed engine the same calls as :class:`StalePipeline` (``run_epoch``,
``accuracy``, ``balance="auto"``). They are collective: every rank calls them, and only stage 0
of each replica reads data. The number of steps of an epoch is agreed first (the smallest
``len(loader)`` over the stage-0 ranks, so data-parallel replicas stay in step), and every other
message follows the point-to-point order of the pipeline itself (see ``p2p.py``: no tags, so
each pair of ranks receives in the order it sends). Each function is given what it uses (the
rank's topology, its link, the engine's ``evaluate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .balance import partition_balance
from .modes import eval_mode
from .p2p import TAG_EVAL, TAG_TARGET, PeerLink
from .ranks import StageTopology
from .results import StepResult, as_logits, concat_outputs, output_to_cpu, unpack_batch

__all__ = [
    "agree_steps", "agreed_auto_balance", "agreed_metric", "agreed_save", "feed_steps",
    "pipeline_accuracy", "pipeline_evaluate",
]  # fmt: skip

# The result the last stage sends when the model's output is not logits (an accuracy is in
# [0, 1] or NaN): every rank then raises, where the others would wait for a result.
_NOT_LOGITS = -1.0

_NO_LIMIT = 2**62
_UNSIZED = -1  # a stage-0 loader without len(), in agree_steps


def agreed_auto_balance(
    module: nn.Sequential, sample_input: torch.Tensor | None, num_stages: int | None, **kw: Any
) -> list[int]:
    """``balance="auto"`` on every rank: rank 0 chooses (``partition_balance``), all adopt it.

    Measured timings differ between ranks, so each rank choosing for itself could split the
    model differently and deadlock the pipeline; rank 0's choice is broadcast instead. Only
    rank 0 reads ``sample_input`` and ``num_stages`` (the others may pass ``None``, as stage 0
    alone passes data elsewhere); when rank 0 cannot choose, every rank raises its
    ``ValueError`` instead of waiting for the broadcast.
    """
    choice: list[Any] = [None]
    failed: ValueError | None = None
    if dist.get_rank() == 0:
        try:
            if sample_input is None or num_stages is None:
                raise ValueError(
                    "balance='auto' needs sample_input (a representative batch) and "
                    "num_stages on rank 0"
                )
            choice[0] = list(partition_balance(module, sample_input, num_stages, **kw))
        except ValueError as exc:
            failed, choice[0] = exc, str(exc)
    dist.broadcast_object_list(choice, src=0)
    if failed is not None:
        raise failed
    if isinstance(choice[0], str):
        raise ValueError(f"rank 0 could not choose the balance: {choice[0]}")
    return [int(v) for v in choice[0]]


def agree_steps(
    loader: Iterable[Any] | None, steps: int | None, is_first: bool, link: PeerLink
) -> int:
    """Minibatches in this epoch: ``steps`` if given, else the smallest ``len(loader)`` over the
    stage-0 ranks (collective: one ``all_reduce`` on every rank, bounded by ``link``'s
    timeout)."""
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        return steps
    mine = _NO_LIMIT
    unsized = is_first and (loader is None or not hasattr(loader, "__len__"))
    if is_first and not unsized:
        mine = len(loader)  # type: ignore[arg-type]
    # A stage-0 rank without a length sends -1 (the minimum) rather than raising alone: every
    # rank raises, instead of the others waiting in this all_reduce for the process group's
    # timeout, or pairing it with the next collective of a rank that caught the error.
    count = _all_reduced(
        [_UNSIZED if unsized else mine], torch.int64, link,
        "run_epoch's agreement on the step count", dist.ReduceOp.MIN,
    )  # fmt: skip
    if int(count.item()) == _UNSIZED:
        raise TypeError(
            f"run_epoch on stage 0 needs a loader with len() (DALI's and echopipe's iterators, "
            f"torch DataLoader) or steps=; {'this rank' if unsized else 'a stage-0 rank'} "
            "passed none"
        )
    return int(count.item())


def _all_reduced(
    values: list[float], dtype: torch.dtype, link: PeerLink, what: str, op: Any = None
) -> torch.Tensor:
    """``values`` reduced over every rank (``op``, a sum by default) in one ``all_reduce``,
    on the rank's GPU under NCCL, else the CPU, waited for within ``link``'s timeout."""
    on_gpu = link.device.type == "cuda" and "nccl" in str(dist.get_backend())
    reduced = torch.tensor(values, dtype=dtype, device=link.device if on_gpu else "cpu")
    work = dist.all_reduce(reduced, op=dist.ReduceOp.SUM if op is None else op, async_op=True)
    link.wait_collective(work, what)
    return reduced


def agreed_metric(metrics: float | None, is_last: bool, link: PeerLink) -> float | None:
    """The metric every rank's scheduler steps on (collective: one ``all_reduce``, bounded by
    ``link``'s timeout).

    It is the last stage's (the mean over the replicas' last-stage ranks): the loss and the
    outputs of ``evaluate`` exist only there, so the ranks of other stages may pass ``None`` or
    any value, and every stage's ``ReduceLROnPlateau`` still steps on the same figure. ``None``
    when no rank passed one; a ``ValueError`` on every rank when some did but a last-stage rank
    did not (a rank deciding alone would drain while the others train on).
    """
    given = metrics is not None
    mine = float(metrics) if given and is_last else 0.0  # type: ignore[arg-type]
    flags = [mine, float(given and is_last), float(given), float(is_last)]
    agreed = _all_reduced(flags, torch.float64, link, "step_schedulers' agreement on the metric")
    total, last_given, any_given, lasts = agreed.tolist()
    if any_given == 0:
        return None
    if last_given < lasts:
        raise ValueError(
            f"step_schedulers(metrics): {int(lasts - last_given)} of the {int(lasts)} last-stage "
            "rank(s) passed no metric; the schedulers step on the last stage's value"
        )
    return total / last_given


def feed_steps(
    train_step: Callable[[torch.Tensor | None, torch.Tensor | None], StepResult],
    loader: Iterable[Any] | None,
    count: int,
    output_map: Sequence[str],
    rank: int,
) -> tuple[int, list[float]]:
    """Call ``train_step`` ``count`` times (collective), with the batches of ``loader`` on
    stage-0 ranks and ``None`` elsewhere; returns the samples fed and the losses finished."""
    batches = iter(loader) if loader is not None else None
    samples = 0
    losses: list[float] = []
    for step in range(count):
        x = target = None
        if batches is not None:
            try:
                x, target = unpack_batch(next(batches), output_map)
            except StopIteration:
                raise RuntimeError(
                    f"rank {rank}: the loader ended after {step} of the {count} steps "
                    "agreed for this epoch"
                ) from None
            samples += int(x.shape[0])
        losses.extend(train_step(x, target).losses)
    return samples, losses


def agreed_save(save: Callable[[], object] | None, link: PeerLink) -> None:
    """Runs this rank's checkpoint write (``None``: it writes nothing), then agrees with every
    rank that all writes succeeded (collective: one ``all_reduce``, bounded by ``link``'s
    timeout).

    A rank whose write failed raises its own error, and every other rank an ``OSError``: a
    barrier there would keep the ranks that did not write waiting for the failed ones.
    """
    failed: Exception | None = None
    if save is not None:
        try:
            save()
        except Exception as exc:
            failed = exc
    failures = _all_reduced(
        [float(failed is not None)], torch.float64, link,
        "save_checkpoint's agreement on the writes' outcome",
    )  # fmt: skip
    if failed is not None:
        raise failed
    if failures.item() > 0:
        raise OSError(
            f"the checkpoint is incomplete: {int(failures.item())} rank(s) failed to write "
            "their stage's file (see their errors)"
        )


def pipeline_accuracy(
    topology: StageTopology,
    link: PeerLink,
    evaluate: Callable[[torch.Tensor | None, int | None], Any],
    x: torch.Tensor | None,
    target: torch.Tensor | None,
    batch_size: int,
) -> float:
    """Top-1 accuracy of ``evaluate(x, batch_size)`` (an eval-mode forward through the stages),
    computed by the last stage and sent to every rank of the replica.

    Collective, on a drained pipeline: stage 0 passes ``x`` and ``target``, the others
    ``None``; ``link`` carries the messages in the pipeline's order.
    """
    send, recv = link.send, link.recv
    if topology.is_first:
        if x is None or target is None:
            raise ValueError("stage 0 needs x and target in accuracy")
        target = target.reshape(-1)
        if not topology.is_last:
            send(target, topology.last_rank, TAG_TARGET)
    elif topology.is_last:
        target = recv(topology.base, TAG_TARGET)  # stage 0 sends it first
    output = evaluate(x, batch_size)
    result = torch.zeros(1, dtype=torch.float64)
    failure: TypeError | None = None
    if topology.is_last:
        assert target is not None
        logits: torch.Tensor | None = None
        try:
            logits = as_logits(output)
        except TypeError as exc:  # several heads: the other ranks wait for a result all the same
            failure = exc
        if logits is None:
            result[0] = _NOT_LOGITS
        elif logits.shape[0] > 0:
            result[0] = (logits.argmax(dim=1) == target.cpu().long()).double().mean()
        else:
            result[0] = math.nan
        for peer in range(topology.base, topology.last_rank):
            send(result, peer, TAG_EVAL)
    else:
        result = recv(topology.last_rank, TAG_EVAL)
        if float(result[0]) == _NOT_LOGITS:
            failure = TypeError(
                "accuracy needs the model to output logits, its last stage outputs several "
                "(a tuple, list or dict): score evaluate()'s outputs instead"
            )
    link.reap_sends(wait_all=True)
    if failure is not None:
        raise failure
    return float(result.cpu()[0])


def pipeline_evaluate(
    topology: StageTopology,
    link: PeerLink,
    stage: nn.Module,
    device: torch.device,
    x: torch.Tensor | None,
    batch_size: int | None = None,
) -> Any:
    """An eval-mode forward of ``x`` through the stages of a drained pipeline (collective),
    in chunks of ``batch_size`` rows (``None``: one chunk): stage 0 passes ``x``; the last
    stage returns the output on CPU, concatenated over the chunks in the structure of the
    stage's output (as :meth:`StalePipeline.evaluate` returns it), the other ranks ``None``.

    Stage 0 sends the chunk count down the pipeline ahead of the chunks: only it knows ``x``.
    """
    chunks: list[torch.Tensor] = []
    if topology.is_first:
        if x is None:
            raise ValueError("stage 0 needs x in evaluate")
        chunks = [x] if batch_size is None else list(torch.split(x, batch_size))
    count = torch.tensor([len(chunks)], dtype=torch.int64)
    if not topology.is_first:
        assert topology.prev is not None
        count = link.recv(topology.prev, TAG_EVAL)
    if not topology.is_last:
        assert topology.next is not None
        link.send(count, topology.next, TAG_EVAL)
    outputs: list[Any] = []
    with torch.no_grad(), eval_mode([stage]):
        for i in range(int(count.item())):
            if topology.is_first:
                h = chunks[i].to(device)
            else:
                assert topology.prev is not None
                h = link.recv(topology.prev, TAG_EVAL)
            h = stage(h)
            if topology.is_last:
                outputs.append(output_to_cpu(h))
            else:
                assert topology.next is not None
                link.send(h, topology.next, TAG_EVAL)
    link.reap_sends(wait_all=True)
    if not topology.is_last:
        return None
    return concat_outputs(outputs) if outputs else torch.empty(0)
