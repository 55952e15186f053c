"""A mid-epoch Lightning checkpoint under DDP resumes every rank where it was.

Lightning calls every rank's ``EchoLoader.state_dict()`` when it saves but writes rank 0's
alone, and loads that one into every rank. The program
(tests/pipeline_support/echo_loader_lightning_ddp_program.py) runs ``Trainer(accelerator="cpu",
devices=2, strategy="ddp" over gloo)`` in its own process group, killed whole on a hang: a fit
that stops at ``max_steps=5`` (mid-epoch 0 of 8 steps) with a ``ModelCheckpoint`` there, then a
fit of 2 epochs resumed from it. Before, rank 1's resume stopped with ``LoaderStateError`` (the
checkpoint held rank 0's cached samples only).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

pytest.importorskip("lightning")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

from pipeline_support.echo_loader_lightning_ddp_program import SEED, STOP, Ids  # noqa: E402
from pipeline_support.train_runs import run_own_group  # noqa: E402

PROGRAM = Path(__file__).parent / "pipeline_support" / "echo_loader_lightning_ddp_program.py"
HANG_S = 300.0


def _fit(mode: str, out: Path) -> None:
    """Runs the program (its DDP ranks in one session, killed whole on a hang)."""
    import echopipe

    python_dir = str(Path(echopipe.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [python_dir, env.get("PYTHONPATH")] if p)
    args = [sys.executable, str(PROGRAM), mode, str(out)]
    done = run_own_group(args, env, HANG_S, f"the {mode} fit", cwd=out)
    assert done.returncode == 0, done.stdout[-3000:]


def _share(rank: int, epoch: int) -> Counter[int]:
    """Each sample of the rank's DistributedSampler share, twice (e = 2)."""
    sampler = DistributedSampler(Ids(), num_replicas=2, rank=rank, seed=SEED)
    sampler.set_epoch(epoch)
    return Counter({i: 2 * n for i, n in Counter(sampler).items()})


def test_a_mid_epoch_checkpoint_resumes_every_rank_with_the_samples_it_had_left(tmp_path):
    _fit("save", tmp_path)
    assert (tmp_path / "mid.ckpt").exists()
    _fit("resume", tmp_path)
    for rank in range(2):
        saved = json.loads((tmp_path / f"save.rank{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resume.rank{rank}.json").read_text())
        assert saved["steps"] == {"0": STOP} and resumed["steps"] == {"0": 8 - STOP, "1": 8}
        before, after = Counter(saved["seen"]["0"]), Counter(resumed["seen"]["0"])
        # The resumed rest of epoch 0 is exactly what this rank had left: with the batches
        # before the checkpoint, every sample of its share twice, none of the other rank's.
        assert before + after == _share(rank, 0), rank
        assert Counter(resumed["seen"]["1"]) == _share(rank, 1), rank
