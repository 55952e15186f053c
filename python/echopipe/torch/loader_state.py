"""The checks of a saved :class:`~echopipe.torch.EchoLoader` state, and its restored cache.

A state usually comes back from a file (``torch.load`` of a training checkpoint), so every
field is checked for type, range and agreement with the others here, and
``EchoLoader.load_state_dict`` restores nothing unless all of it passes: a refused state leaves
the loader as it was, and every refusal is one exception type, :class:`LoaderStateError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..echo import EchoCache
from ..echo.config import (
    MAX_CAPACITY_SAMPLES,
    MAX_EPOCH_SIZE,
    MAX_SEED,
    EchoConfigError,
    check_factor,
)
from ..echo.controller import EchoController

__all__ = [
    "STATE_VERSION",
    "EpochPosition",
    "LoaderStateError",
    "check_loader_state",
    "check_position",
    "check_shard",
    "restored_batching",
    "restored_cache",
    "shard",
]

STATE_VERSION = 1
"""The version of the state :meth:`EchoLoader.state_dict` writes."""

_BIG = 1 << 62
_POSITION = (
    "batches_done",
    "rows_in_flight",
    "fresh_samples_epoch",
    "delivered_batches_epoch",
    "delivered_samples_epoch",
)
_CACHE_CONFIG = ("capacity_bytes", "capacity_samples", "min_fill", "seed", "epoch_size")
_REQUIRED = {
    "version", "epoch", "mid_epoch", *_POSITION, "totals", "echo_factor", "echo_history",
    "controller", "cache", "cache_config", "layout", "batch_size",
}  # fmt: skip


@dataclass(frozen=True)
class EpochPosition:
    """Where a state is saved in the epoch: the wrapped loader's position and the epoch's
    counts (``COUNTS`` order), or between epochs. ``ended``: the running epoch has delivered
    everything (a caller that knows the length, as Lightning does, never asks for the batch
    that would end it), so the state is the one after its end. ``sampler_epoch``: the epoch of
    the wrapped loader's epoch-seeded sampler whose order the position counts in (mid-epoch);
    ``order_rng``: the states its order generators had when that pass began, ``order_new``:
    whether that pass made the DataLoader's iterator (mid-epoch)."""

    mid_epoch: bool
    batches_done: int = 0
    rows_in_flight: int = 0
    counts: tuple[int, ...] = (0, 0, 0, 0)
    ended: bool = False
    sampler_epoch: int | None = None
    order_rng: list[bytes] | None = None
    order_new: bool | None = None

    def order(self) -> dict[str, Any]:
        """The state's fields of the wrapped loader's order."""
        return {"sampler_epoch": self.sampler_epoch, "order_rng": self.order_rng,
                "order_new": self.order_new}  # fmt: skip


def epoch_position(producer: Any, counts: tuple[int, ...], resume: dict[str, Any] | None,
                   cache: EchoCache | None) -> EpochPosition:  # fmt: skip
    """The position of a running epoch (``producer``, its ``counts``), else of a restored
    one not started yet (``resume``), else between epochs."""
    if producer is not None:
        stats = cache.stats() if cache is not None else None
        # Fewer copies left than a dropped short batch takes (drop_last) is none left.
        if producer.error is None and stats is not None and stats.input_ended and (
                stats.tickets_left < max(1, producer.drop_below)):  # fmt: skip
            return EpochPosition(False, counts=counts, ended=True)
        return EpochPosition(True, producer.batches_done, producer.rows_in_flight, counts,
                             sampler_epoch=producer.sampler_epoch, order_rng=producer.order_rng,
                             order_new=producer.order_new)  # fmt: skip
    if resume is not None:
        counts = tuple(resume[k] for k in _POSITION if k != "rows_in_flight")  # COUNTS order
        return EpochPosition(True, resume["batches_done"], resume["rows_in_flight"], counts,
                             sampler_epoch=resume["sampler_epoch"], order_rng=resume["order_rng"],
                             order_new=resume["order_new"])  # fmt: skip
    return EpochPosition(False)


class LoaderStateError(ValueError):
    """An ``EchoLoader`` state that cannot be restored (names the field); nothing was changed."""


def _int(value: Any, where: str, low: int = 0, high: int = _BIG) -> int:
    if type(value) is not int or not low <= value <= high:
        shown = repr(value)[:40] if isinstance(value, int | float | bool | type(None)) else None
        raise LoaderStateError(
            f"EchoLoader state {where} is {shown or 'a ' + type(value).__name__}, not an "
            f"integer in [{low}, {high}]"
        )
    return value


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise LoaderStateError(f"EchoLoader state {what}")


def _factor(value: Any, where: str) -> float:
    _need(type(value) in (int, float), f"{where} is not an echo factor (a number)")
    try:
        return float(check_factor(value, where))
    except EchoConfigError as exc:
        raise LoaderStateError(f"EchoLoader state {exc}") from None


def check_loader_state(
    state: Any, *, version: int, counts: tuple[str, ...], auto: bool, memory_bytes: int
) -> dict[str, Any]:
    """The fields of ``state`` checked and normalised (plain ints, floats, lists); nothing is
    restored here.

    Args:
        state: what ``EchoLoader.state_dict`` returned (or a file's claim to be that).
        version: the state version the loader writes.
        counts: the names of the loader's running counters (``totals``).
        auto: whether the loader restoring it has ``echo_factor="auto"`` (a controller).
        memory_bytes: the most a restored cache may reserve.

    Raises:
        LoaderStateError: names the first field of the wrong type, out of range, or in
            disagreement with another.
    """
    got = state.get("version") if isinstance(state, dict) else type(state).__name__
    if not isinstance(state, dict) or type(got) is not int or got != version:
        raise LoaderStateError(f"not an EchoLoader state of version {version}: {str(got)[:40]!r}")
    missing = sorted(_REQUIRED - set(state))
    _need(not missing, f"lacks {missing[0]!r}" if missing else "")
    out: dict[str, Any] = {"epoch": _int(state["epoch"], "'epoch'")}
    _need(isinstance(state["mid_epoch"], bool), "'mid_epoch' is not true/false")
    out["mid_epoch"] = state["mid_epoch"]
    for key in _POSITION:
        out[key] = _int(state[key], repr(key))
        _need(out["mid_epoch"] or out[key] == 0, f"{key!r} is not 0 between epochs")
    totals = state["totals"]
    _need(isinstance(totals, dict) and set(totals) == set(counts),
          f"'totals' is not a dict of {', '.join(counts)}")  # fmt: skip
    out["totals"] = {k: _int(totals[k], f"totals {k!r}") for k in counts}
    for batches, samples in (("fresh_batches", "fresh_samples"),
                             ("delivered_batches", "delivered_samples")):  # fmt: skip
        if samples not in out["totals"] or batches not in out["totals"]:
            continue
        _need(out["totals"][samples] >= out["totals"][batches],
              f"totals {samples!r} is fewer than {batches!r}")  # fmt: skip
    _need(out["delivered_samples_epoch"] >= out["delivered_batches_epoch"],
          "'delivered_samples_epoch' is fewer than 'delivered_batches_epoch'")  # fmt: skip
    out["echo_factor"] = _factor(state["echo_factor"], "'echo_factor'")
    out["echo_history"] = _history(state["echo_history"])
    same_mode = (state["controller"] is not None) == auto
    _need(same_mode, "was saved with a different echo_factor mode (auto/fixed)")
    _need(state["controller"] is None or isinstance(state["controller"], dict),
          "'controller' is not a dict")  # fmt: skip
    out["controller"] = state["controller"]
    batch = state["batch_size"]
    out["batch_size"] = None if batch is None else _int(batch, "'batch_size'", 1, 1 << 24)
    if batch is not None:
        _need(out["rows_in_flight"] < max(batch, 1) * 65536, "'rows_in_flight' is out of range")
        _need(out["delivered_samples_epoch"] <= out["delivered_batches_epoch"] * batch,
              "'delivered_samples_epoch' exceeds its batches of 'batch_size'")  # fmt: skip
    layout = state["layout"]
    _need(layout is None or (isinstance(layout, str) and len(layout) < 1 << 16),
          "'layout' is not a layout signature")  # fmt: skip
    out["layout"] = layout
    out["cache_config"] = _cache_config(state["cache_config"], memory_bytes)
    cache = state["cache"]
    _need(cache is None or isinstance(cache, bytes | bytearray), "'cache' is not bytes")
    _need(cache is None or out["cache_config"] is not None, "has a cache without 'cache_config'")
    out["cache"] = None if cache is None else bytes(cache)
    sampler_epoch = state.get("sampler_epoch")  # (states of earlier versions have none)
    out["sampler_epoch"] = None if sampler_epoch is None else _int(sampler_epoch, "'sampler_epoch'")
    _need(out["mid_epoch"] or out["sampler_epoch"] is None, "'sampler_epoch' is set between epochs")
    out["order_rng"] = _order_rng(state.get("order_rng"))  # (earlier versions have none)
    _need(out["mid_epoch"] or out["order_rng"] is None, "'order_rng' is set between epochs")
    out["order_new"] = state.get("order_new")  # (earlier versions have none)
    _need(out["order_new"] is None or isinstance(out["order_new"], bool),
          "'order_new' is not true/false")  # fmt: skip
    _need(out["mid_epoch"] or out["order_new"] is None, "'order_new' is set between epochs")
    size = state.get("input_batch_size")  # (earlier versions have none)
    out["input_batch_size"] = None if size is None else _int(size, "'input_batch_size'", 1)
    saved = state.get("shard")
    pair = isinstance(saved, list) and len(saved) == 2 and all(type(v) is int for v in saved)
    _need(saved is None or pair, "'shard' is not [rank, world_size]")
    _need(saved is None or 0 <= saved[0] < saved[1], "'shard' rank is not below its world size")
    # None is one process (the whole dataset); states of earlier versions have no 'shard'.
    out["shard"], out["shard_known"] = saved, "shard" in state
    return out


def check_shard(clean: dict[str, Any], here: list[int] | None) -> None:
    """A mid-epoch state's position (the batches its pass had read) and cached samples are
    those of the shard of the data that saved it (``[rank, world_size]``, None for one
    process). Another world size shards the epoch otherwise, so skipping that many batches
    there would lose some samples and repeat others: refused, as is another rank's cache."""
    if not clean["mid_epoch"] or not clean["shard_known"]:
        return
    saved = clean["shard"]
    was, now = (1 if s is None else s[1] for s in (saved, here))
    if was != now:
        told = ["one process" if s is None else f"rank {s[0]} of {s[1]}" for s in (saved, here)]
        raise LoaderStateError(
            f"EchoLoader state was saved mid-epoch at world size {was} ({told[0]}), and this "
            f"loader runs at world size {now} ({told[1]}): its position and cached samples "
            f"belong to one of {was} shards of that epoch, which {now} shard otherwise (samples "
            f"would be lost or repeated); load it at world size {was}, or load a state saved "
            "between epochs (the next epoch is sharded anew for any world size)"
        )
    if clean["cache"] is not None and saved != here:
        where = "one process" if here is None else f"rank {here[0]} of {here[1]}"
        raise LoaderStateError(
            f"EchoLoader state was saved by rank {saved[0]} of {saved[1]} processes mid-epoch "
            f"and holds that rank's cached samples, but this loader is {where}: rank 0's state "
            "holds every rank's only when every rank called state_dict() at that step "
            "(Lightning does); otherwise each rank loads the state its own EchoLoader saved"
        )


def shard() -> list[int] | None:
    """``[rank, world_size]`` under several torch.distributed processes, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return [dist.get_rank(), dist.get_world_size()]
    return None


def _history(history: Any) -> list[tuple[int, float]]:
    _need(isinstance(history, list | tuple) and 0 < len(history) <= 1 << 20,
          "'echo_history' is not a non-empty list")  # fmt: skip
    out: list[tuple[int, float]] = []
    for entry in history:
        _need(isinstance(entry, list | tuple) and len(entry) == 2,
              "'echo_history' holds an entry that is not (step, factor)")  # fmt: skip
        step = _int(entry[0], "echo_history step")
        _need(not out or step >= out[-1][0], "'echo_history' steps go backwards")
        out.append((step, _factor(entry[1], "echo_history factor")))
    return out


def _order_rng(states: Any) -> list[bytes] | None:
    """Generator states as :meth:`torch.Generator.get_state` gives them, each tried on a
    scratch generator (a wrong one would raise only when the resumed pass starts)."""
    if states is None:
        return None
    _need(isinstance(states, list) and 0 < len(states) <= 8
          and all(isinstance(s, bytes | bytearray) for s in states),
          "'order_rng' is not a list of bytes")  # fmt: skip
    for saved in states:
        try:
            torch.Generator().set_state(torch.frombuffer(bytearray(saved), dtype=torch.uint8))
        except (RuntimeError, ValueError):
            raise LoaderStateError("EchoLoader state 'order_rng' is not generator states") from None
    return [bytes(s) for s in states]


def _cache_config(config: Any, memory_bytes: int) -> dict[str, int] | None:
    if config is None:
        return None
    _need(isinstance(config, dict) and set(config) == set(_CACHE_CONFIG),
          f"'cache_config' is not a dict of {', '.join(_CACHE_CONFIG)}")  # fmt: skip
    out = {
        "capacity_bytes": _int(config["capacity_bytes"], "cache capacity_bytes", 1, memory_bytes),
        # The cache allocates its per-sample table (about 32 bytes a sample) when created,
        # before the saved contents are checked: a state may not ask for more than 128 MiB of it.
        "capacity_samples": _int(
            config["capacity_samples"], "cache capacity_samples", 1, MAX_CAPACITY_SAMPLES
        ),
        "seed": _int(config["seed"], "cache seed", 0, MAX_SEED),
    }
    out["min_fill"] = _int(config["min_fill"], "cache min_fill", 0, out["capacity_samples"])
    out["epoch_size"] = _int(config["epoch_size"], "cache epoch_size", 0, MAX_EPOCH_SIZE)
    return out


def check_position(
    clean: dict[str, Any], loader: Any, input_batch_size: int | None, samples: int | None
) -> None:
    """A mid-epoch state's position must lie inside the wrapped loader's epoch, when the loader
    has a length: past its end, the resumed epoch would silently deliver nothing. And it counts
    batches of the wrapped loader's batch size (``input_batch_size`` now, where both tell) in an
    epoch of its samples (``samples`` now, where both tell; a folder that gained files): skipping
    as many batches of another size or of another epoch would miss samples or read some twice."""
    was = (clean["cache_config"] or {}).get("epoch_size") or None
    if clean["mid_epoch"] and None not in (was, samples) and was != samples:
        raise LoaderStateError(
            f"EchoLoader state was saved mid-epoch in an epoch of {was} samples of the wrapped "
            f"loader, which now has {samples} per epoch: the batches it would skip as read are "
            "another epoch's (samples would be missed or read twice); load it where the "
            "dataset is as it was, or load a state saved between epochs"
        )
    saved = clean["input_batch_size"]
    if clean["mid_epoch"] and None not in (saved, input_batch_size) and saved != input_batch_size:
        raise LoaderStateError(
            f"EchoLoader state was saved mid-epoch after {clean['batches_done']} batches of "
            f"{saved} samples of the wrapped loader, whose batches now hold {input_batch_size}: "
            "skipping that many would miss samples or read some twice; resume with "
            f"batch_size={saved}, or load a state saved between epochs"
        )
    try:
        length = len(loader)
    except TypeError:  # an iterable without a length: checked as it is read
        return
    _need(
        not clean["mid_epoch"] or clean["batches_done"] <= length,
        f"'batches_done' is {clean['batches_done']}, past the wrapped loader's {length} batches",
    )


def restored_batching(
    clean: dict[str, Any], batch_size: int | None, explicit: bool, told: int | None
) -> tuple[int | None, dict[str, int] | None]:
    """The output batch size and cache config after loading ``clean`` into a loader whose batch
    size is ``batch_size`` (``explicit``: given to it; ``told``: the wrapped loader's). A
    mid-epoch state keeps the saved ones (its position and counts are in them); a state saved
    between epochs holds no samples, so the wrapped loader's batch size, where it tells one,
    stays (a run resumed with another batch size), and the cache is sized anew for it."""
    saved = clean["batch_size"]
    if saved is not None and not explicit and (clean["mid_epoch"] or told is None):
        batch_size = saved
    same = clean["mid_epoch"] or saved is None or saved == batch_size
    return batch_size, clean["cache_config"] if same else None


def restored_cache(clean: dict[str, Any], controller: EchoController | None) -> EchoCache | None:
    """The cache of the checked state ``clean``, restored into a new one (None when the state
    holds none), after the ``"auto"`` ``controller``'s state was tried on a scratch one: all or
    nothing, so a refusal (:class:`LoaderStateError`) changes neither."""
    cache = None
    try:
        if controller is not None:
            EchoController(1.0, e_max=controller.e_max).load_state_dict(clean["controller"])
        if clean["cache"] is not None:
            cache = EchoCache(
                echo_factor=clean["echo_factor"], memory="pageable", **clean["cache_config"]
            )
            cache.load_state_dict(clean["cache"])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            RuntimeError) as exc:  # fmt: skip
        if cache is not None:
            cache.close()
        raise LoaderStateError(f"EchoLoader state does not restore: {exc}") from None
    return cache
