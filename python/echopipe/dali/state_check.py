"""Checks of a saved :class:`~echopipe.dali.EchoPipeline` state before anything uses it.

A state comes back from a file (``echopipe train --resume``, DALI's ``checkpoint=`` route), so
every field is checked for type and range here, and DALI's own checkpoints are parsed and
checked before DALI sees them: DALI trusts its checkpoints, and a reader whose random-number
state is ``"0"`` or empty makes its restore spin forever without an error.

DALI's checkpoint (as DALI 2.4 writes it) is a protobuf ``PipelineCheckpoint``: repeated operator
checkpoints (field 1: name, data) and an external context (field 2: pipeline data as JSON,
iterator data). An operator's data is empty, a Philox state string (random operators), a
reader's list of ``LoaderStateSnapshot`` messages (field 1 each; in one, field 1 is the
``std::minstd_rand0`` engine as decimal text, 2 the epoch, 3 the age), or the echo source's
own state (its padding template), which the plugin's decoder checks. Anything else is
refused: a DALI release that writes another format needs this module taught it first.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from typing import Any

import numpy as np

from ..echo.config import EchoConfig, EchoConfigError

__all__ = [
    "DaliStateError",
    "check_cache_restores",
    "check_dali_checkpoint",
    "check_echo_state",
    "check_iterator_data",
    "check_iterator_state",
]

_BIG = 1 << 62
_MINSTD_MODULUS = 2**31 - 1  # a minstd state is in [1, m - 1]; 0 is a fixed point
_DALI_SHARDS_MAX = 1 << 31  # DALI's readers keep num_shards in an int
_PHILOX = re.compile(rb"Philox_[0-9A-Fa-f]{16}_[0-9A-Fa-f]{16}:[0-9A-Fa-f]{16}_[0-9]{1,9}")
_ITERATOR_FIELDS = ("_counter", "_counter_per_gpu", "_shard_sizes_per_gpu", "_shards_id", "_size")


class DaliStateError(ValueError):
    """A saved echo-pipeline state or DALI checkpoint that cannot be used (says which field)."""


def _fail(where: str, what: str) -> DaliStateError:
    return DaliStateError(f"{where} {what}")


def _int(value: Any, where: str, low: int = 0, high: int = _BIG) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _fail(where, f"is {_show(value)}, not an integer in [{low}, {high}]")
    return value


def _number(value: Any, where: str, low: float = 0.0, high: float = float(_BIG)) -> float:
    ok = type(value) in (int, float) and math.isfinite(value) and low <= value <= high
    if not ok:
        raise _fail(where, f"is {_show(value)}, not a number in [{low:g}, {high:g}]")
    return float(value)


def _of(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise _fail(where, f"is {_show(value)}, not {names}")
    return value


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, int | float | bool | type(None)) else None
    return text if text is not None and len(text) < 40 else f"a {type(value).__name__}"


def _keys(state: Any, where: str, required: set[str], optional: frozenset[str] = frozenset()):
    _of(state, dict, where)
    missing = sorted(required - set(state))
    unknown = sorted(set(state) - required - optional, key=str)
    if missing or unknown:
        what = f"lacks {missing[0]!r}" if missing else f"has an unknown entry {unknown[0]!r}"
        raise _fail(where, what)


# --------------------------------------------------------------------------------------------
# DALI's checkpoint
# --------------------------------------------------------------------------------------------


def _varint(data: bytes, pos: int, where: str) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise _fail(where, "is not a valid DALI checkpoint (a damaged number)")


def _fields(data: bytes, where: str) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of a protobuf message: varints and length-delimited."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        tag, pos = _varint(data, pos, where)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(data, pos, where)
            out.append((number, value))
        elif wire == 2:
            size, pos = _varint(data, pos, where)
            if pos + size > len(data):
                raise _fail(where, "is not a valid DALI checkpoint (a field runs past its end)")
            out.append((number, data[pos : pos + size]))
            pos += size
        else:
            raise _fail(where, f"is not a valid DALI checkpoint (wire type {wire})")
        if len(out) > 4096:
            raise _fail(where, "is not a valid DALI checkpoint (too many fields)")
    return out


def _check_operator(name: str, data: bytes, where: str, num_fields: int) -> None:
    here = f"{where}: operator {name!r}"
    if not data or _PHILOX.fullmatch(data):
        return
    if _check_source_state(data, here, num_fields):
        return
    if data.startswith(b"Philox"):
        raise _fail(here, "has a damaged random-number state")
    outer = _fields(data, here)
    if not outer or any(number != 1 or not isinstance(v, bytes) for number, v in outer):
        raise _fail(here, "has a state that is not a DALI reader's")
    for _, snapshot in outer:
        _check_snapshot(dict(_fields(snapshot, here)), here)  # type: ignore[arg-type]


def _check_source_state(data: bytes, here: str, num_fields: int) -> bool:
    """True for a valid echo source state; refuses a malformed one."""
    from .plugin import check_source_state

    try:
        is_state, problem = check_source_state(data, num_fields)
    except ImportError:  # no plugin to read it: no pipeline here could restore it either
        return False
    if problem:
        raise _fail(here, f"cannot be restored: {problem}")
    return is_state


def _check_snapshot(snapshot: dict[int, int | bytes], here: str) -> None:
    rng = snapshot.get(1)
    if set(snapshot) - {1, 2, 3} or not isinstance(rng, bytes):
        raise _fail(here, "has a reader state without a random-number state")
    if not re.fullmatch(rb"[1-9][0-9]{0,9}", rng) or int(rng) >= _MINSTD_MODULUS:
        raise _fail(
            here,
            f"has the reader random-number state {rng[:20]!r}, which is not a valid engine "
            f"state (an integer in [1, {_MINSTD_MODULUS - 1}])",
        )
    for number in (2, 3):
        _int(snapshot.get(number, 0), f"{here} field {number}", 0, 1 << 40)


def check_dali_checkpoint(blob: Any, where: str, num_fields: int = 0) -> None:
    """Check one of DALI's serialized pipeline checkpoints before DALI restores from it;
    ``num_fields`` is the echo source's (0: not compared).

    Raises:
        DaliStateError: the blob is not a DALI checkpoint with valid reader and random states.
    """
    _of(blob, bytes, where)
    context = None
    for number, value in _fields(blob, where):
        if number == 1 and isinstance(value, bytes):
            op = dict(_fields(value, where))
            name, data = op.get(1, b""), op.get(2, b"")
            if not isinstance(name, bytes) or not isinstance(data, bytes) or set(op) - {1, 2}:
                raise _fail(where, "is not a valid DALI checkpoint (a damaged operator entry)")
            _check_operator(name.decode("utf-8", "replace")[:80], data, where, num_fields)
        elif number == 2 and isinstance(value, bytes) and context is None:
            context = dict(_fields(value, where))
        else:
            raise _fail(where, f"is not a valid DALI checkpoint (field {number})")
    if context is None or not isinstance(context.get(1), bytes):
        raise _fail(where, "is not a valid DALI checkpoint (no pipeline data)")
    try:
        data = json.loads(context[1])
    except (ValueError, RecursionError):
        raise _fail(where, "has pipeline data that is not JSON") from None
    _keys(data, f"{where} pipeline data", {"iter", "epoch_idx"})
    _int(data["iter"], f"{where} pipeline data 'iter'")
    _int(data["epoch_idx"], f"{where} pipeline data 'epoch_idx'")
    if isinstance(context.get(2), bytes) and context[2]:
        check_iterator_data(context[2].decode("utf-8", "replace"), where)


def check_iterator_data(text: Any, where: str) -> None:
    """Check the DALI iterator's JSON position data (empty, or its five counters)."""
    _of(text, str, f"{where} iterator data")
    if not text:
        return
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise _fail(f"{where} iterator data", "is not JSON") from None
    # DALI saves the fields its iterator has (fewer without reader_name=).
    _keys(data, f"{where} iterator data", set(), frozenset(_ITERATOR_FIELDS))
    for key, value in data.items():
        items = value if isinstance(value, list) and len(value) <= 4096 else [value]
        for item in items:
            _int(item, f"{where} iterator data {key!r}", -_BIG, _BIG)


# --------------------------------------------------------------------------------------------
# The echo pipeline's own state
# --------------------------------------------------------------------------------------------

_CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "batch_size": (int,),
    "echo": (dict,),
    "cache_samples": (int, type(None)),
    "upstream_batch_size": (int, type(None)),
    "epochs": (int, str, type(None)),
    "deterministic": (bool,),
    "seed": (int,),
}
_RUNNER = {"fresh_in": int, "iterations": int, "epoch_index": int, "iter_in_epoch": int}
_STATE_KEYS = {"version", "config", "num_fields", "cache", "layouts", "quota", "runner", "stash"}
_STATE_OPTIONAL = frozenset(
    {
        "input_done",
        "handed",
        "batches",
        "pass_pending",
        "upstream_wait_s",
        "downstream_wait_s",
        "dali_upstream",
        "dali_downstream",
        "reader",
    }
)


def _check_echo_config(echo: dict[str, Any], where: str) -> None:
    """The saved echo configuration: the fields of :class:`~echopipe.echo.EchoConfig`, checked
    by EchoConfig itself (one definition of each bound)."""
    names = {f.name for f in fields(EchoConfig)}
    _keys(echo, where, set(), frozenset(names))
    try:
        EchoConfig(**echo)
    except EchoConfigError as exc:
        raise _fail(where, str(exc)) from None


def check_echo_state(state: Any, where: str = "echo state") -> None:
    """Check an :meth:`EchoPipeline.state_dict` result field by field, DALI's checkpoints in
    it included (see :func:`check_dali_checkpoint`).

    Raises:
        DaliStateError: names the first field of the wrong type or out of range.
    """
    _keys(state, where, _STATE_KEYS, _STATE_OPTIONAL | {"iterator_data"})
    _int(state["version"], f"{where} 'version'", 2, 2)
    config = state["config"]
    _keys(config, f"{where} 'config'", set(), frozenset(_CONFIG_TYPES))
    for key, value in config.items():
        if not isinstance(value, _CONFIG_TYPES[key]) or (
            isinstance(value, bool) and bool not in _CONFIG_TYPES[key]
        ):
            raise _fail(f"{where} config {key!r}", f"is {_show(value)}")
    _check_echo_config(config.get("echo", {}), f"{where} config 'echo'")
    for key in ("batch_size", "upstream_batch_size"):
        _int(config.get(key, 1), f"{where} config {key!r}", 1, 1 << 24)
    num_fields = _int(state["num_fields"], f"{where} 'num_fields'", 1, 64)
    _of(state["cache"], bytes, f"{where} 'cache'")
    for layout in _of(state["layouts"], list, f"{where} 'layouts'"):
        _of(layout, str, f"{where} layout")
    # (None yet where the state was saved before the sink stored a sample: a deterministic
    # pipeline under a DALI iterator that had not handed out a batch.)
    if state["layouts"] and len(state["layouts"]) != num_fields:
        raise _fail(f"{where} 'layouts'", f"has {len(state['layouts'])} entries, not {num_fields}")
    _int(state["quota"], f"{where} 'quota'", -1)
    runner = state["runner"]
    _keys(runner, f"{where} 'runner'", set(_RUNNER) | {"ended"}, frozenset({"seconds", "timed"}))
    for key in _RUNNER:
        _int(runner[key], f"{where} runner {key!r}")
    _of(runner["ended"], bool, f"{where} runner 'ended'")
    _number(runner.get("seconds", 0.0), f"{where} runner 'seconds'")
    if _int(runner.get("timed", 0), f"{where} runner 'timed'") > runner["iterations"]:
        raise _fail(f"{where} runner 'timed'", "exceeds its 'iterations'")
    _check_stash(state["stash"], where)
    _of(state.get("input_done", False), bool, f"{where} 'input_done'")
    _of(state.get("pass_pending", False), bool, f"{where} 'pass_pending'")
    for key in ("handed", "batches"):
        if _of(state.get(key, 0), int, f"{where} {key!r}") < 0:
            raise _fail(f"{where} {key!r}", "is negative")
    for key in ("upstream_wait_s", "downstream_wait_s"):
        _number(state.get(key, 0.0), f"{where} {key!r}")
    for key in ("dali_upstream", "dali_downstream"):
        if key in state:
            check_dali_checkpoint(state[key], f"{where} {key!r}", num_fields)
    if "reader" in state:
        reader = state["reader"]
        _keys(reader, f"{where} 'reader'", {"name", "shard_id", "shards"}, frozenset({"size"}))
        _of(reader["name"], str, f"{where} reader 'name'")
        shards = _int(reader["shards"], f"{where} reader 'shards'", 1, _DALI_SHARDS_MAX)
        _int(reader["shard_id"], f"{where} reader 'shard_id'", 0, shards - 1)
        _int(reader.get("size", 0), f"{where} reader 'size'")
    if "iterator_data" in state:
        check_iterator_data(state["iterator_data"], where)


def _check_stash(stash: Any, where: str) -> None:
    for entry in _of(stash, list, f"{where} 'stash'"):
        if not isinstance(entry, tuple | list) or len(entry) != 2:
            raise _fail(f"{where} stash entry", "is not a pair (arrays, info)")
        arrays, info = entry
        _of(info, np.ndarray, f"{where} stash info")
        if info.ndim != 2 or info.dtype.kind not in "iu" or info.shape[1] < 1:
            raise _fail(f"{where} stash info", f"has shape {info.shape} and dtype {info.dtype}")
        for output in _of(arrays, list, f"{where} stash arrays"):
            samples = output if isinstance(output, list) else [output]
            for sample in samples:
                _of(sample, np.ndarray, f"{where} stash output")
                if sample.dtype.hasobject:
                    raise _fail(f"{where} stash output", "holds Python objects")


def check_iterator_state(state: Any, where: str = "iterator state") -> None:
    """Check an :meth:`EchoIterator.state_dict` result (the pipeline's state and the
    iterator's position and counters)."""
    from .iterator_stats import EchoIteratorStats
    from .torch_copy import tensors_as_arrays

    _keys(state, where, {"pipeline", "iterator"})
    check_echo_state(tensors_as_arrays(state["pipeline"]), f"{where} 'pipeline'")
    it = state["iterator"]
    _keys(it, f"{where} 'iterator'", {"stats", "step_in_epoch", "epoch_done"},
          frozenset({"epoch_steps"}))  # fmt: skip
    _int(it["step_in_epoch"], f"{where} 'step_in_epoch'")
    if it.get("epoch_steps") is not None:
        _int(it["epoch_steps"], f"{where} 'epoch_steps'")
    _of(it["epoch_done"], bool, f"{where} 'epoch_done'")
    names = {f.name: f.type for f in fields(EchoIteratorStats)}
    _keys(it["stats"], f"{where} 'stats'", set(), frozenset(names))
    for key, value in it["stats"].items():
        if names[key] in ("int", int):
            _int(value, f"{where} stats {key!r}")
        elif not (type(value) in (int, float) and (math.isnan(value) or value >= 0)):
            raise _fail(f"{where} stats {key!r}", f"is {_show(value)}")


def check_cache_restores(config: Any, blob: bytes) -> None:
    """Restore the saved echo cache ``blob`` into a scratch pageable cache of the pipeline's
    ``config`` (an :class:`~echopipe.dali.config.EchoPipelineConfig`), so a blob the cache
    refuses is named before training rather than at the first batch. The arena is mapped
    lazily: only the samples cost memory.

    Raises:
        DaliStateError: the cache refuses the blob (says why).
    """
    import dataclasses
    import os

    from .config import make_cache

    scratch = dataclasses.replace(config, echo=dataclasses.replace(config.echo, memory="pageable"))
    cache = make_cache(scratch, f"echopipe-state-check-{os.getpid()}-{id(blob)}")
    try:
        cache.load_state_dict(blob)
    except (ValueError, TypeError) as exc:
        raise DaliStateError(f"the saved echo cache does not restore: {exc}") from None
    finally:
        cache.close()
