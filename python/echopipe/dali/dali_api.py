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
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from . import state_codec
from .queue import DownstreamQueue


class DaliPipelineApi(ABC):
    """Mixin for :class:`EchoPipeline`: the DALI ``Pipeline`` methods its iterators call."""

    # Set by EchoPipeline.__init__ / _build; declared here for readers and type checkers.
    config: Any
    downstream: Any
    upstream: Any
    _queue: DownstreamQueue | None  # the downstream's scheduling state, made by the build
    _device_id: int | None
    _started: bool
    _enable_checkpointing: bool

    def _init_dali_api(self) -> None:
        self._is_restored = False
        self._iterator_data = ""

    @abstractmethod
    def _running_queue(self) -> DownstreamQueue:
        """The downstream queue of the started pipeline (starting it if need be)."""

    # -- attributes DALI's iterators read --

    @property
    def max_batch_size(self) -> int:
        """The downstream batch size (what each iteration returns)."""
        return int(self.config.batch_size)

    @property
    def batch_size(self) -> int:
        """Same as :attr:`max_batch_size`."""
        return int(self.config.batch_size)

    @property
    def device_id(self) -> int | None:
        """The CUDA device of both DALI pipelines (None for CPU-only pipelines)."""
        return self._device_id

    @property
    def exec_dynamic(self) -> bool:
        self.build()
        return bool(self.downstream.exec_dynamic)

    @property
    def is_restored_from_checkpoint(self) -> bool:
        """True when created with ``checkpoint=`` (DALI's restore route)."""
        return self._is_restored

    @property
    def _first_iter(self) -> bool:
        return not self._started

    @contextlib.contextmanager
    def _check_api_type_scope(self, api_type: Any) -> Iterator[None]:
        self.build()
        with self.downstream._check_api_type_scope(api_type):
            yield

    def build(self) -> None:
        """Builds both DALI pipelines (idempotent; nothing runs)."""
        self._build()  # type: ignore[attr-defined]

    # -- epoch size: the reader's, times the echo factor --

    def reader_meta(self, name: str | None = None) -> dict[str, Any]:
        """The upstream reader's metadata with ``epoch_size`` and ``epoch_size_padded`` scaled
        by the echo factor (e fresh-sample epochs' worth of emitted samples per epoch).

        Read once by DALI's iterators when they are created: after ``set_echo_factor`` create
        the iterator again, or use :class:`EchoIterator`, whose epoch follows the factor.
        """
        self.build()
        if name is not None:
            return self._scaled_meta(self.upstream.reader_meta(name))
        return {k: self._scaled_meta(m) for k, m in self.upstream.reader_meta().items()}

    def epoch_size(self, name: str | None = None) -> int | dict[str, int]:
        """Like ``Pipeline.epoch_size``: the scaled ``epoch_size_padded`` of the reader(s)."""
        if name is not None:
            return int(self.reader_meta(name)["epoch_size_padded"])
        return {k: int(m["epoch_size_padded"]) for k, m in self.reader_meta().items()}

    def _scaled_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        unaligned = self.unaligned_reader  # type: ignore[attr-defined]
        if unaligned is not None:
            raise ValueError(
                f"reader {unaligned!r} has no pad_last_batch=True, so its epochs cannot be "
                "aligned with echoing, and DALI's iterator would count epochs over a "
                "free-running stream whose copies cross epochs; create the reader with "
                "pad_last_batch=True, or pass epochs=None to the pipeline to accept that"
            )
        if self.finite:  # type: ignore[attr-defined]
            # This pipeline's own epoch, exactly: DALI's iterators split a reported data set
            # over the shards themselves (floor(k * size / shards)), which for e copies of
            # shards of unequal size gives the wrong lengths (20 files, 3 shards, e = 2: 13, 13,
            # 14 instead of 12, 14, 14). So each pipeline reports its own shard as a whole data
            # set; an epoch then ends exactly where its copies end, and the padding after them
            # is never counted.
            reader = self.reader_epochs  # type: ignore[attr-defined]
            if not reader.fixed_size:
                raise ValueError(
                    f"reader {reader.name!r}: {reader.size} samples over {reader.shards} shards "
                    "give shards of unequal size, and without stick_to_shard=True the reader "
                    "moves to the next shard every epoch, so the epoch length changes while "
                    "DALI's iterators keep the first one; pass stick_to_shard=True to the reader, "
                    "or iterate with echopipe.dali.EchoIterator (its epochs end with the data)"
                )
            self.counted_epochs = True
            copies = self.epoch_copies()  # type: ignore[attr-defined]
            return {
                **meta,
                "epoch_size": copies,
                "epoch_size_padded": copies,
                "number_of_shards": 1,
                "shard_id": 0,
                "stick_to_shard": 1,
                "pad_last_batch": 1,
            }
        e = float(self.config.echo.factor)
        out = dict(meta)
        for key in ("epoch_size", "epoch_size_padded"):
            if key in out:
                out[key] = max(1, round(int(out[key]) * e))
        return out

    # -- scheduling: the downstream queue's --

    def schedule_run(self) -> None:
        """Schedules downstream iterations up to the prefetch depth (fills the cache first in
        deterministic mode)."""
        self._running_queue().schedule_run()

    def share_outputs(self) -> tuple[Any, ...]:
        """The next batch's outputs (without echopipe's ``info``); StopIteration at the end of
        a finite stream. Batches restored from a checkpoint come first."""
        return self._running_queue().share_outputs()

    def release_outputs(self) -> None:
        """Returns the buffers of the last :meth:`share_outputs` to DALI."""
        if self._queue is not None:
            self._queue.release_outputs()

    def outputs(self) -> tuple[Any, ...]:
        """Like ``Pipeline.outputs``: the next scheduled batch, released on the next call."""
        self.release_outputs()
        return self.share_outputs()

    def run(self) -> tuple[Any, ...]:
        """Like ``Pipeline.run``: schedules an iteration and returns the next batch."""
        self.schedule_run()
        return self.outputs()

    def empty(self) -> bool:
        """True when no batch is scheduled or restored and waiting to be taken."""
        return self._queue is None or self._queue.empty()

    # -- DALI's checkpoint route --

    def _get_checkpoint(self, iterator_data: str = "") -> bytes:
        """The whole echo state plus DALI's iterator data, as bytes (see :mod:`.state_codec`)."""
        if not self._enable_checkpointing:
            raise ValueError(
                "create the pipeline with enable_checkpointing=True to take DALI checkpoints"
            )
        state = self.state_dict()  # type: ignore[attr-defined]
        state["iterator_data"] = iterator_data
        return state_codec.encode(state)

    def checkpoint(self, filename: str | None = None) -> bytes:
        """Like ``Pipeline.checkpoint``: the state as bytes, also written to ``filename``."""
        blob = self._get_checkpoint()
        if filename is not None:
            with open(filename, "wb") as f:
                f.write(blob)
        return blob

    def _restore_checkpoint(self, blob: bytes | str) -> None:
        state = state_codec.decode(blob)
        self._iterator_data = state.pop("iterator_data", "")
        self.load_state_dict(state)  # type: ignore[attr-defined]
        self._is_restored = True
