"""Checkpoints of an :class:`~echopipe.dali.EchoPipeline`: what ``state_dict`` holds and how
``load_state_dict`` checks and applies it, as functions of the parts they read and write.

The state holds the cache contents, the upstream position, the batches DALI had prepared but
nobody consumed, the pass's counters and, with ``enable_checkpointing=True``, DALI's own
checkpoints of both pipelines (see docs/dali.md, "Checkpoints").
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .config import EchoPipelineConfig
from .epochs import ReaderEpochs
from .queue import DownstreamQueue
from .state_check import check_dali_checkpoint
from .upstream import UpstreamRunner

# 2: the config holds the echo configuration as its own "echo" entry.
_STATE_VERSION = 2


class DaliCheckpointNeededError(ValueError):
    """A state saved inside the upstream reader's epoch without DALI's own checkpoint (the
    pipeline was built without ``enable_checkpointing=True``): a restored reader would start
    its epoch again from the first file while the echo state goes on, so files would be
    repeated and missed."""


class CheckpointShardError(ValueError):
    """A state saved by a pipeline whose reader reads another shard than the pipeline
    restoring it (another shard_id or number of shards, or a data set of another size): its
    cache and stashed batches hold the other shard's samples, which this shard would train on
    until its pass ends, and its position counts the other shard's batches."""


def _compared(config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint and the pipeline restoring it must agree on."""
    return {
        "mode": config["echo"]["mode"],
        "batch_size": config["batch_size"],
        "upstream_batch_size": config["upstream_batch_size"],
        "epochs": config["epochs"],
    }


def capture_state(
    *,
    config: EchoPipelineConfig,
    num_fields: int,
    cache: Any,
    runner: UpstreamRunner,
    queue: DownstreamQueue,
    upstream_wait_s: float,
    dali_pipelines: tuple[Any, Any] | None,
    reader: ReaderEpochs | None = None,
    pass_pending: bool = False,
) -> dict[str, Any]:
    """The echo state of a started pipeline, aligned with the batches handed out so far;
    ``dali_pipelines`` (upstream, downstream) adds DALI's own checkpoints of both. Without
    them, a pipeline whose upstream ``reader`` stands inside an epoch is refused
    (:class:`DaliCheckpointNeededError`). ``pass_pending``: a reset ended the last pass and
    the next starts at the next draw."""
    # Take DALI's prepared batches out first, while the upstream still feeds the cache. An
    # upstream iteration blocked on a cache full by bytes reaches its end only after more draws:
    # while it is, downstream batches go into the stash too.
    queue.take_prepared()

    def draw_if_blocked() -> None:
        if cache.stats().producers_waiting:
            queue.stash_one()

    runner.pause(while_waiting=draw_if_blocked)
    try:
        if dali_pipelines is None and reader is not None:
            _refuse_inside_a_reader_epoch(runner, reader, config.upstream_batch_size)
        if runner.ended and cache.stats().tickets_left == 0 and not pass_pending:
            # (A pending pass was reset: its padding was handed out or dropped, and what the
            # queue would owe now is the next pass's, which starts at the next draw.)
            queue.stash_padding()
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "config": asdict(config),
            "num_fields": num_fields,
            "cache": cache.state_dict(),
            "layouts": cache.layouts,
            "quota": cache.quota,
            "runner": runner.state(),
            "stash": [([a.copy() for a in arrays], info.copy()) for arrays, info in queue.stash],
            "input_done": queue.input_done,
            "handed": queue.handed,
            "batches": queue.batches,
            "pass_pending": pass_pending,
            "upstream_wait_s": upstream_wait_s,
            "downstream_wait_s": queue.wait_s,
        }
        if reader is not None:
            state["reader"] = {"name": reader.name, "shard_id": reader.shard_id,
                               "shards": reader.shards, "size": reader.size}  # fmt: skip
        if dali_pipelines is not None:
            state["dali_upstream"] = dali_pipelines[0].checkpoint()
            state["dali_downstream"] = dali_pipelines[1].checkpoint()
    finally:
        runner.resume()
    return state


def _refuse_inside_a_reader_epoch(
    runner: UpstreamRunner, reader: ReaderEpochs, upstream_batch_size: int
) -> None:
    """A fresh reader starts at the first file of its first epoch: right only where the saved
    one stood at an epoch's start, with a shard of that epoch's size."""
    at = runner.iter_in_epoch
    moved = not reader.fixed_size and runner.epoch_index % reader.shards != 0
    if at == 0 and not moved:
        return
    where = (
        f"{at} of its epoch's {reader.iterations(upstream_batch_size)} batches in"
        if at
        else f"at epoch {runner.epoch_index}, on a shard of another size"
    )
    raise DaliCheckpointNeededError(
        f"state_dict(): the upstream reader {reader.name!r} stands {where}, and without DALI's "
        "own checkpoint a restored reader starts from the first file of its first epoch "
        "(files repeated and missed); build the pipeline with enable_checkpointing=True"
    )


def check_state(
    state: dict[str, Any], config: EchoPipelineConfig, enable_checkpointing: bool
) -> float:
    """Checks that ``state`` fits a pipeline of ``config`` (epochs resolved); returns the
    checkpoint's echo factor, which is runtime state the restored pipeline adopts."""
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"unsupported echo state version {state.get('version')!r}")
    saved = state["config"]
    mine = _compared(asdict(config))
    for key, value in _compared(saved).items():
        if value != mine[key]:
            raise ValueError(
                f"checkpoint has {key}={value!r} but this pipeline has {key}={mine[key]!r}"
            )
    if enable_checkpointing and "dali_upstream" not in state:
        raise ValueError(
            "this pipeline has enable_checkpointing=True but the checkpoint carries no DALI "
            "state (it was saved with enable_checkpointing=False)"
        )
    for key in ("dali_upstream", "dali_downstream"):
        if key in state:  # (DALI itself would refuse a malformed one with a RuntimeError)
            check_dali_checkpoint(state[key], f"echo state {key!r}", _num_fields(state))
    if not enable_checkpointing and "dali_upstream" in state:
        # Its reader would start from the first file while the echo state goes on from the
        # saved batch (files repeated and missed); plain DALI refuses such a restore too.
        raise ValueError(
            "the checkpoint carries DALI's own state (saved with enable_checkpointing=True) but "
            "this pipeline was created without it, so its reader would start again from the "
            "first file; create the pipeline with enable_checkpointing=True"
        )
    return float(saved["echo"]["factor"])


def _num_fields(state: dict[str, Any]) -> int:
    """The state's fields per sample, or 0 (not compared) where it holds no sensible count."""
    num = state.get("num_fields")
    return num if type(num) is int and 0 < num < 1 << 16 else 0


def check_shard(state: dict[str, Any], reader: ReaderEpochs | None) -> None:
    """Refuses a state saved by a pipeline whose ``reader`` read another shard
    (:class:`CheckpointShardError`). A state from before the shard was saved is not checked;
    plain DALI's reader state holds no shard either, but its restore mixes no samples."""
    saved = state.get("reader")
    if saved is None or reader is None:
        return
    mine = (reader.shard_id, reader.shards)
    if (saved["shard_id"], saved["shards"]) != mine:
        raise CheckpointShardError(
            f"this checkpoint was saved by shard {saved['shard_id']} of {saved['shards']} of "
            f"reader {saved['name']!r}, but this pipeline reads shard {mine[0]} of {mine[1]}; "
            "its cached samples are the other shard's, so restore each shard (each rank) from "
            "a checkpoint it saved itself"
        )
    if saved.get("size", reader.size) != reader.size:
        raise CheckpointShardError(
            f"this checkpoint was saved over reader {saved['name']!r} of {saved['size']} "
            f"samples, but this pipeline's reader {reader.name!r} has {reader.size}; its cached "
            "samples and position belong to the other data set, so resume over the data set "
            "it was saved over"
        )


def apply_state(
    state: dict[str, Any], cache: Any, runner: UpstreamRunner, queue: DownstreamQueue
) -> float:
    """Restores a checked ``state`` into the built, not yet started parts; returns the
    upstream wait it carried."""
    cache.load_state_dict(state["cache"])
    cache.layouts = list(state["layouts"])
    cache.quota = int(state["quota"])
    runner.load(state["runner"])
    queue.restore(
        state["stash"],
        state["input_done"],
        state["handed"],
        state["downstream_wait_s"],
        state.get("batches", 0),
    )
    if runner.ended:
        cache.end_of_input()
        if cache.stats().tickets_left == 0 and not state.get("pass_pending", False):
            # Every copy of the pass was drawn before the save: what is left of it is the
            # stash. A draw now would meet only the end, with no sample to pad the batch.
            # (A pending pass was reset: the next draw starts the next one.)
            queue.input_done = queue.exhausted = True
    return float(state["upstream_wait_s"])
