"""Rank 0's mid-epoch EchoLoader state holds every rank's (``rank_states``), in two real gloo
processes of a plain PyTorch program: each rank resumes from its own state as before, and from
rank 0's too (a checkpoint that rank 0 alone writes, as Lightning's); a rank that does not call
``state_dict()`` at that step ends rank 0's in one ``RankStatesError`` after ``state_timeout``,
not in a hang. One process needs no torch.distributed."""

from __future__ import annotations

import collections
import json
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from echopipe.torch import EchoLoader, RankStatesError
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
        # Rank 1 does not call state_dict() at this step: rank 0's waits state_timeout.
        with _loader(state_timeout=0.5) as el:
            batches = iter(el)
            next(batches)
            if rank == 0:
                try:
                    el.state_dict()
                    report["alone"] = "no error"
                except RankStatesError as exc:
                    report["alone"] = str(exc)
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
    alone = reports[0]["alone"]
    assert "waited 0.5 s (state_timeout) for the state of rank 1" in alone, alone
    assert "every rank calls state_dict() at the same step" in alone


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
