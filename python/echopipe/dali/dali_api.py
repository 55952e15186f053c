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

from typing import Any

from . import state_codec
from .epochs import ReaderEpochs, epoch_copies

__all__ = ["decode_checkpoint", "encode_checkpoint", "scaled_meta"]


def scaled_meta(
    meta: dict[str, Any],
    config: Any,
    reader: ReaderEpochs | None,
    unaligned_reader: str | None,
) -> dict[str, Any]:
    """The reader's metadata ``meta`` as DALI's iterators should see it for a pipeline with
    the resolved ``config``: an epoch-aligned stream reports its own shard's copies as a whole
    data set; a free-running one the reader's sizes times the echo factor."""
    if unaligned_reader is not None:
        raise ValueError(
            f"reader {unaligned_reader!r} has no pad_last_batch=True, so its epochs cannot be "
            "aligned with echoing, and DALI's iterator would count epochs over a "
            "free-running stream whose copies cross epochs; create the reader with "
            "pad_last_batch=True, or pass epochs=None to the pipeline to accept that"
        )
    if config.epochs is not None and reader is not None:
        # This pipeline's own epoch, exactly: DALI's iterators split a reported data set
        # over the shards themselves (floor(k * size / shards)), which for e copies of
        # shards of unequal size gives the wrong lengths (20 files, 3 shards, e = 2: 13, 13,
        # 14 instead of 12, 14, 14). So each pipeline reports its own shard as a whole data
        # set; an epoch then ends exactly where its copies end, and the padding after them
        # is never counted.
        if not reader.fixed_size:
            raise ValueError(
                f"reader {reader.name!r}: {reader.size} samples over {reader.shards} shards "
                "give shards of unequal size, and without stick_to_shard=True the reader "
                "moves to the next shard every epoch, so the epoch length changes while "
                "DALI's iterators keep the first one; pass stick_to_shard=True to the reader, "
                "or iterate with echopipe.dali.EchoIterator (its epochs end with the data)"
            )
        up = config.upstream_batch_size
        if config.echo.mode == "batch" and reader.fresh() % up:
            # A short last unit makes short batches within the epoch, padded with repeats that
            # only `info` marks, which DALI's iterators do not read: they would hand them out.
            raise ValueError(
                f"batch echoing under DALI's iterators needs this shard's {reader.fresh()} "
                f"samples to be whole upstream batches of {up}; use a shard size that is a "
                "multiple of it, example echoing, or echopipe.dali.EchoIterator (it reads info)"
            )
        copies = epoch_copies(config, reader)
        return {
            **meta,
            "epoch_size": copies,
            "epoch_size_padded": copies,
            "number_of_shards": 1,
            "shard_id": 0,
            "stick_to_shard": 1,
            "pad_last_batch": 1,
        }
    e = float(config.echo.factor)
    out = dict(meta)
    for key in ("epoch_size", "epoch_size_padded"):
        if key in out:
            out[key] = max(1, round(int(out[key]) * e))
    return out


def encode_checkpoint(state: dict[str, Any], iterator_data: str) -> bytes:
    """The whole echo state plus DALI's iterator data, as bytes (see :mod:`.state_codec`)."""
    return state_codec.encode({**state, "iterator_data": iterator_data})


def decode_checkpoint(blob: bytes | str) -> tuple[dict[str, Any], str]:
    """The echo state and DALI's iterator data of :func:`encode_checkpoint`'s bytes."""
    state = state_codec.decode(blob)
    iterator_data = state.pop("iterator_data", "")
    return state, iterator_data
