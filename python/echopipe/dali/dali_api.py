"""The part of ``nvidia.dali.Pipeline``'s interface that DALI's framework iterators use.

With it, ``DALIGenericIterator`` and ``DALIClassificationIterator`` from
``nvidia.dali.plugin.pytorch`` (and DALI's other framework plugins, which share the same base
iterator) accept an :class:`~echopipe.dali.EchoPipeline` unchanged. The route is a proxy: the
scheduling calls go to the downstream DALI pipeline (with echopipe's ``info`` output removed,
and the upstream filled first in deterministic mode), and ``reader_meta`` / ``epoch_size``
report the upstream reader's figures scaled by the echo factor, so ``reader_name=`` gives an
epoch of e times the reader's samples. Checkpoints go through DALI's own route
(``enable_checkpointing=True``, ``iterator.checkpoints()``, then ``checkpoint=`` when creating
the pipeline again) and carry the whole echo state (see :mod:`.state_codec`).

:class:`~echopipe.dali.EchoPipeline` has the methods DALI calls; the functions here are what
they compute, each given what it needs.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from typing import Any

from nvidia.dali.plugin.base_iterator import LastBatchPolicy

from . import state_codec
from .epochs import PassSpan, ReaderEpochs, pass_span

__all__ = [
    "CountedSizeWarning",
    "UntrimmedPaddingWarning",
    "asking_iterator",
    "asking_iterator_policy",
    "counted_size_warning",
    "decode_checkpoint",
    "encode_checkpoint",
    "scaled_meta",
    "user_stacklevel",
]


class UntrimmedPaddingWarning(UserWarning):
    """DALI's ``PARTIAL`` policy will hand out some padding copies each epoch on this shard
    (see :func:`scaled_meta`); :class:`~echopipe.dali.EchoIterator` trims them."""


class CountedSizeWarning(UserWarning):
    """DALI's iterator was given ``size=`` (no ``reader_name``) that does not count one echoed
    pass per epoch (see :func:`counted_size_warning`)."""


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    import contextlib
    import os

    import nvidia.dali

    echopipe_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dali_dir = os.path.dirname(os.path.abspath(nvidia.dali.__file__))
    return (echopipe_dir + os.sep, dali_dir + os.sep, contextlib.__file__)


def user_stacklevel() -> int:
    """The ``stacklevel`` with which the caller's ``warnings.warn`` names the innermost line
    outside echopipe, DALI and contextlib: the user's line that created the iterator (or drew
    the batch) the warning is about, however many library frames lie between."""
    library = _library_dirs()
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(library):
        frame, level = frame.f_back, level + 1
    return level


def asking_iterator() -> Any:
    """The DALI iterator whose constructor (or batch) called into the pipeline, or None when
    the caller is not one of DALI's iterators.

    Why the stack: DALI's iterators take an epoch's length and where it ends from
    ``reader_meta`` alone (or from their own ``size=``, which the pipeline is never told), and
    ``DROP`` must be told the smallest shard's copies where ``PARTIAL`` must be told this
    shard's own (it trims the last batch by them); no one figure serves both when the shards'
    copies differ by more than one, and DALI passes nothing else. The iterator is ``self`` in
    the frames of its constructor, a few calls up."""
    from nvidia.dali.plugin.base_iterator import _DaliBaseIterator

    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _DaliBaseIterator):
            return owner
        frame = frame.f_back
    return None


def asking_iterator_policy() -> Any:
    """The ``LastBatchPolicy`` of the DALI iterator whose constructor is reading the reader's
    metadata (see :func:`asking_iterator`), or None when the caller is not one of DALI's
    iterators."""
    iterator = asking_iterator()
    return None if iterator is None else getattr(iterator, "_last_batch_policy", None)


def counted_size_warning(
    size: int, batch_size: int, span: PassSpan, config: Any, reader: ReaderEpochs
) -> str | None:
    """Why DALI's iterator given ``size`` (and no ``reader_name``) will not hand out one whole
    echoed pass per epoch, or None when it will.

    DALI counts ``size`` samples per epoch over the stream, in whole batches, and hands out
    whatever the pipeline yields. A pass is ``span.batches`` batches on every shard (the
    largest shard's copies, the smaller shards padded to them), so ``ceil(size / batch)`` must
    be that. A plain-DALI figure (the reader's files per shard) counts 1/e of a pass: each
    epoch then holds part of the files, and a smaller shard's padding-only batches land among
    them as full batches. At e = 1 the echoed stream is plain DALI's, so any size matches."""
    e = float(config.echo.factor)
    steps = span.batches(batch_size)
    if e == 1 or math.ceil(size / batch_size) == steps:
        return None
    padding = " and a smaller shard's padding batches reach the loop" * (span.most > span.least)
    return (
        f"DALI's iterator was given size={size}: it counts {size} samples "
        f"({math.ceil(size / batch_size)} batches) per epoch, but an epoch of this echoed "
        f"pipeline (e = {e:g}) is a pass of {steps} batches of {batch_size} on every shard, so "
        f"its epochs will not hold each file e times{padding}; pass "
        f"reader_name={reader.name!r} instead of size=, or "
        f"size=pipe.epoch_size({reader.name!r}){f' // {reader.shards}' * (reader.shards > 1)} "
        f"(= {span.most})"
    )


def scaled_meta(
    meta: dict[str, Any],
    config: Any,
    reader: ReaderEpochs | None,
    unaligned_reader: str | None,
    policy: Any = None,
) -> dict[str, Any]:
    """The reader's metadata ``meta`` as DALI's iterators should see it for a pipeline with
    the resolved ``config``: an epoch-aligned stream reports its own shard's pass as a whole
    data set, padded to the largest shard's (for ``policy`` DROP: the smallest shard's); a
    free-running one the reader's sizes times the echo factor."""
    if unaligned_reader is not None:
        raise ValueError(
            f"reader {unaligned_reader!r} has no pad_last_batch=True, so its epochs cannot be "
            "aligned with echoing, and DALI's iterator would count epochs over a "
            "free-running stream whose copies cross epochs; create the reader with "
            "pad_last_batch=True, or pass epochs=None to the pipeline to accept that"
        )
    span = pass_span(config, reader)
    if span is not None and reader is not None:
        return {**meta, **_pass_meta(config, reader, span, policy)}
    e = float(config.echo.factor)
    out = dict(meta)
    for key in ("epoch_size", "epoch_size_padded"):
        if key in out:
            out[key] = max(1, round(int(out[key]) * e))
    return out


def _pass_meta(config: Any, reader: ReaderEpochs, span: PassSpan, policy: Any) -> dict[str, Any]:
    """The figures of an epoch-aligned pass for DALI's iterator (see :func:`scaled_meta`).

    DALI's iterators split a reported data set over the shards themselves
    (``floor(k * size / shards)``), which for e copies of shards of unequal size gives the wrong
    lengths (20 files, 3 shards, e = 2: 13, 13, 14 instead of 12, 14, 14). So each pipeline
    reports its own shard as a whole data set: ``epoch_size_padded`` is the largest shard's
    pass, so every rank's iterator counts the same steps, as over DALI's padded shards, and
    ``epoch_size`` is where ``PARTIAL`` trims this shard's last batch; ``DROP``, which stops at
    ``epoch_size``, is told the smallest shard's pass.
    """
    b, up = config.batch_size, config.upstream_batch_size
    if not reader.fixed_size and policy in (None, LastBatchPolicy.PARTIAL):
        raise ValueError(
            f"reader {reader.name!r}: {reader.size} samples over {reader.shards} shards give "
            "shards of unequal size, and without stick_to_shard=True the reader moves to the "
            "next shard every epoch, while DALI's PARTIAL policy trims every epoch's last batch "
            "by the first one's copies; pass stick_to_shard=True to the reader, or iterate with "
            "echopipe.dali.EchoIterator (it trims by the data)"
        )
    short = [k for k in range(reader.shards) if reader.shard_files(k) % up]
    if config.echo.mode == "batch" and short:
        # A short last unit makes short batches within the epoch, padded with repeats that
        # only `info` marks, which DALI's iterators do not read: they would hand them out.
        raise ValueError(
            "batch echoing under DALI's iterators needs every shard to be whole upstream "
            f"batches, but shard {short[0]} has {reader.shard_files(short[0])} samples in "
            f"upstream batches of {up}; use shard sizes that are multiples of it, example "
            "echoing, or echopipe.dali.EchoIterator (it reads info)"
        )
    if policy == LastBatchPolicy.DROP:
        trim = padded = span.least
    else:  # FILL trims nothing; PARTIAL (or a caller that is no iterator) by this shard
        trim, padded = _partial_trim(span, b, reader, policy == LastBatchPolicy.PARTIAL), span.most
    return {
        "epoch_size": trim,
        "epoch_size_padded": padded,
        "number_of_shards": 1,
        "shard_id": 0,
        "stick_to_shard": 1,
        "pad_last_batch": 1,
    }


def _partial_trim(span: PassSpan, batch_size: int, reader: ReaderEpochs, warn: bool) -> int:
    """The ``epoch_size`` that ``PARTIAL`` trims this shard's batches by: its own copies.

    DALI hands out the first ``epoch_size - (step - 1) * batch`` samples of each batch from the
    one where that falls below a batch on. That is exact while this shard's copies reach the
    last batch, as DALI's own padded shards always do (they differ by one file). With e copies
    per file they may end two batches before the largest shard's: the batch after the partial
    one then hands out as many samples again (a negative slice), ``R = copies % batch`` of
    padding, and rounding ``epoch_size`` up to whole batches hands out ``batch - R`` of padding
    in the partial one instead. No ``epoch_size`` gives exactly the copies, so the smaller leak
    is taken and, for ``warn``, named in an :class:`UntrimmedPaddingWarning`."""
    own, steps = span.own, span.batches(batch_size)
    rest = own % batch_size
    if own >= (steps - 1) * batch_size or rest == 0:
        return own
    leaked = min(rest, batch_size - rest)
    if warn:
        warnings.warn(
            UntrimmedPaddingWarning(
                f"reader {reader.name!r}, shard {reader.shard_id}: its {own} copies per epoch "
                f"end more than a batch before the largest shard's {span.most}, which DALI's "
                f"PARTIAL policy cannot trim exactly: {leaked} padding copies per epoch reach "
                "the batches; echopipe.dali.EchoIterator trims them (it reads which copies are "
                "padding)"
            ),
            stacklevel=user_stacklevel(),
        )
    return own if rest <= batch_size - rest else own - rest + batch_size


def encode_checkpoint(state: dict[str, Any], iterator_data: str) -> bytes:
    """The whole echo state plus DALI's iterator data, as bytes (see :mod:`.state_codec`)."""
    return state_codec.encode({**state, "iterator_data": iterator_data})


def decode_checkpoint(blob: bytes | str) -> tuple[dict[str, Any], str]:
    """The echo state and DALI's iterator data of :func:`encode_checkpoint`'s bytes."""
    state = state_codec.decode(blob)
    iterator_data = state.pop("iterator_data", "")
    return state, iterator_data
