"""Every rank's mid-epoch :class:`~echopipe.torch.EchoLoader` state inside the one rank 0 saves.

Under several torch.distributed processes a mid-epoch state holds its rank's cached samples,
and a program that writes one checkpoint for all ranks writes rank 0's: Lightning calls every
rank's ``state_dict()`` (``FitLoop.on_save_checkpoint``, inside ``Trainer.save_checkpoint``,
which every rank runs), writes rank 0's dict alone, and on resume loads that dict into every
rank's loader. So each rank other than 0 hands its state to rank 0 through the process group's
key-value store (no collective: nothing pairs with the program's own collectives, and a rank
that never hands one in is waited for at most ``state_timeout``), and rank 0's mid-epoch state
carries them under ``"rank_states"``; ``load_state_dict`` on rank r takes rank r's.

A program that calls ``state_dict()`` on rank 0 alone (a checkpoint every N steps written under
``if rank == 0``) keeps training: rank 0's state then holds its own samples only, as it did
before states were handed over, with a :class:`RankStatesWarning`, and after one such miss rank
0 no longer waits (it takes what the store holds at that moment), so the save costs the program
one ``state_timeout`` at most, not one per checkpoint.
"""

from __future__ import annotations

import io
import itertools
import time
import warnings
from typing import Any

import torch

from .loader_state import LoaderStateError, shard

__all__ = ["RankStates", "RankStatesError", "RankStatesWarning", "own_state"]

_PREFIX = "echopipe.echo_loader"
_IDENTS = itertools.count()  # EchoLoaders in the order a process makes them, alike on every rank
_POLL_S = 0.02  # between looks at the store: a Ctrl-C is taken within that


class RankStatesError(RuntimeError):
    """The process group's store failed while a rank handed its state over or rank 0 read
    the others'."""


class RankStatesWarning(RuntimeWarning):
    """Rank 0's mid-epoch ``state_dict()`` did not get every other rank's state in time (a rank
    that does not call ``state_dict()`` at that step, or that failed): the state holds rank
    0's samples only, and another rank refuses it (``LoaderStateError``) at a resume."""


class RankStates:
    """One EchoLoader's hand-over of its states: ``ident`` numbers the EchoLoaders of a process
    in the order they were made, which every rank of one program shares."""

    @classmethod
    def made(cls, timeout_s: float) -> RankStates:
        """The next EchoLoader's, numbered in the order this process makes them."""
        return cls(next(_IDENTS), timeout_s)

    def __init__(self, ident: int, timeout_s: float) -> None:
        self._ident, self._timeout_s = ident, timeout_s
        self._published: str | None = None  # this rank's last key: replaced by the next
        self._missed = False  # rank 0 went without some rank's state once: it waits no more

    def gathered(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (this rank's), with, on rank 0 in mid-epoch, every other rank's state at
        the same point (``"rank_states"``, in rank order); another rank hands its state over.
        The point is the batches delivered since the loader's start, the same on every rank of
        one DDP job whether or not its epoch has just ended."""
        here = shard()
        if here is None:
            return state
        rank, world = here
        at = state["totals"]["delivered_batches"] + state["delivered_batches_epoch"]
        store = _store()
        if rank != 0:
            self._publish(store, rank, self._key(at, rank), state)
            return state
        if not state["mid_epoch"]:
            return state
        return self._gathered_or_own(state, store, at, world)

    def _key(self, at: int, rank: int) -> str:
        return f"{self._ident}/{at}/{rank}"

    def _publish(self, store: Any, rank: int, key: str, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        try:
            if self._published not in (None, key):  # rank 0 took it (DDP steps in lockstep)
                store.delete_key(self._published)
            store.set(key, buffer.getvalue())
        except RuntimeError as exc:
            raise RankStatesError(
                f"EchoLoader: rank {rank} could not hand its state to rank 0 through the "
                f"process group's store: {exc}"
            ) from None
        self._published = key

    def _gathered_or_own(self, state: dict[str, Any], store: Any, at: int, world: int) -> dict:
        """Rank 0's ``state`` with every other rank's, or alone (warned) where one is missing."""
        waited = 0.0 if self._missed else self._timeout_s
        keys = [self._key(at, rank) for rank in range(1, world)]
        deadline = time.monotonic() + waited
        try:
            while missing := [r for r, k in enumerate(keys, 1) if not store.check([k])]:
                if time.monotonic() >= deadline:
                    break
                time.sleep(_POLL_S)
            raws = [] if missing else [store.get(key) for key in keys]
            for key in [] if missing else keys:
                store.delete_key(key)
        except RuntimeError as exc:
            raise RankStatesError(
                f"EchoLoader: rank 0 could not read the other ranks' states from the process "
                f"group's store: {exc}"
            ) from None
        if missing:
            self._missed = True
            warnings.warn(
                f"EchoLoader: rank 0's state_dict() after batch {at} got no state from "
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                f"(waited {waited:g} s; state_timeout {self._timeout_s:g} s), so this mid-epoch "
                "state holds rank 0's cached samples only and another rank refuses it: call "
                "state_dict() on every rank at the same step (Lightning does), or save between "
                "epochs",
                RankStatesWarning,
                stacklevel=4,
            )
            return state
        states = [torch.load(io.BytesIO(raw), weights_only=True) for raw in raws]
        return {**state, "rank_states": states}


def _store() -> Any:
    # The default group's store is what every rank of the job reaches (a TCPStore, or a
    # torchrun attempt's prefix of it); torch names no public accessor for it.
    from torch.distributed import distributed_c10d

    return torch.distributed.PrefixStore(_PREFIX, distributed_c10d._get_default_store())


def own_state(state: Any, here: list[int] | None) -> Any:
    """The state this loader (of data shard ``here``) loads from ``state``: rank r's entry of
    rank 0's ``"rank_states"``, else ``state`` itself without them (refused or taken as before
    by the checks that follow)."""
    if not isinstance(state, dict) or "rank_states" not in state:
        return state
    entries = state["rank_states"]
    if (
        not isinstance(entries, list)
        or len(entries) >= 1 << 16
        or not all(isinstance(e, dict) and "rank_states" not in e for e in entries)
    ):
        raise LoaderStateError("EchoLoader state 'rank_states' is not a list of rank states")
    top = {k: v for k, v in state.items() if k != "rank_states"}
    if here is not None and top.get("shard") != here:
        for entry in entries:
            if entry.get("shard") == here:
                return entry
    return top
