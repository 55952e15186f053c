"""Rank 0's mid-epoch EchoLoader state holds every rank's (``rank_states``), in two real gloo
processes of a plain PyTorch program: each rank resumes from its own state as before, and from
rank 0's too (a checkpoint that rank 0 alone writes, as Lightning's); a rank that does not call
``state_dict()`` at that step leaves rank 0's holding its own samples, warned once per save,
after one ``state_timeout`` for the first save and none for later ones: not a hang, and not an
error that would end a program that saves on rank 0 alone. One process needs no
torch.distributed."""

from __future__ import annotations

import collections
import json
import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from echopipe.torch import EchoLoader, RankStatesWarning
from echopipe.torch.loader_state import LoaderStateError


class Ids(Dataset):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int):
        return torch.full((2,), float(i)), i


def _loader(**kw: Any) -> EchoLoader:
    sampler = DistributedSampler(Ids(), seed=3)  # the process group's rank and world size
    return EchoLoader(DataLoader(Ids(), batch_size=4, sampler=sampler), 2.0, **kw)


def _ids(batches) -> collections.Counter:
    return collections.Counter(int(v) for _, y in batches for v in y)


def _resumed(state: dict[str, Any]) -> collections.Counter | str:
    """What a new loader that loads ``state`` delivers in the rest of its epoch (or its
    refusal)."""
    with _loader() as el:
        try:
            el.load_state_dict(state)
        except LoaderStateError as exc:
            return str(exc)
        return _ids(iter(el))


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=2, rank=rank)
    try:
        share = collections.Counter({i: 2 for i in DistributedSampler(Ids(), seed=3)})
        with _loader() as el:
            batches = iter(el)
            before = _ids([next(batches) for _ in range(3)])
            own = el.state_dict()  # every rank at the same step, as Lightning and DDP do
        states: list[Any] = [None, None]
        dist.all_gather_object(states, own)  # rank 0's is the one a single checkpoint holds
        report: dict[str, Any] = {"held": sorted(s["shard"][0] for s in own.get("rank_states", []))}
        for name, state in (("own", own), ("rank0", states[0])):
            got = _resumed(state)
            report[name] = got if isinstance(got, str) else got + before == share
        # Rank 1 does not call state_dict() at this step: rank 0's waits state_timeout once,
        # then keeps its own samples (warned), and its next call does not wait again (a
        # timeout of an hour would fail the test through p.join's limit if it did).
        with _loader(state_timeout=0.5) as el:
            batches = iter(el)
            next(batches)
            if rank == 0:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    alone = el.state_dict()
                    el._ranks._timeout_s = 3600.0
                    next(batches)
                    again = el.state_dict()
                said = [w for w in caught if w.category is RankStatesWarning]
                report["alone"] = [str(w.message) for w in said]
                report["alone_held"] = [len(s.get("rank_states", [])) for s in (alone, again)]
            dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(report, f)


@pytest.mark.distributed
def test_rank_0s_mid_epoch_state_resumes_every_rank_and_a_missing_rank_is_named() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}") for r in range(2)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), outs[r]))
                 for r in range(2)]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        reports = []
        for out in outs:
            with open(out) as f:
                reports.append(json.load(f))
    for report in reports:  # the samples each rank had left, exactly, from either state
        assert report["own"] is True and report["rank0"] is True, report
    assert reports[0]["held"] == [1] and reports[1]["held"] == []
    alone = reports[0]["alone"]  # two saves, two warnings; the second did not wait
    assert len(alone) == 2 and reports[0]["alone_held"] == [0, 0], reports[0]
    assert "got no state from rank 1 (waited 0.5 s; state_timeout 0.5 s)" in alone[0], alone
    assert "(waited 0 s; state_timeout 3600 s)" in alone[1], alone
    assert "call state_dict() on every rank at the same step" in alone[0]


def test_one_process_needs_no_process_group_and_bad_rank_states_are_named() -> None:
    assert not dist.is_initialized()
    data = DataLoader(Ids(), batch_size=4)
    with EchoLoader(data, 2.0) as el:
        batches = iter(el)
        next(batches)
        state = el.state_dict()
    assert state["mid_epoch"] and "rank_states" not in state
    with EchoLoader(data, 2.0) as el, pytest.raises(LoaderStateError, match="'rank_states'"):
        el.load_state_dict({**state, "rank_states": "rank 1's"})
    with pytest.raises(ValueError, match="state_timeout"):
        EchoLoader(data, 2.0, state_timeout=None)  # type: ignore[arg-type]
