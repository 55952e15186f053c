"""Echoed DALI pipelines over shards of unequal size under a real Lightning ``Trainer``.

21 files over 2 ranks (shards of 10 and 11), e = 2, batches of 4: every rank's epoch is padded
to the largest shard's 6 steps, so DDP's all-reduce meets on every step. The program
(tests/pipeline_support/dali_lightning_ddp_program.py) runs ``Trainer(accelerator="cpu",
devices=2, strategy="ddp" over gloo, max_epochs=2)`` in its own process group, killed whole
on a hang; ranks that took different steps fail in gloo (a 60 s timeout, or a closed peer).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("nvidia.dali")
pytest.importorskip("lightning")
pytestmark = [pytest.mark.dali, pytest.mark.slow, pytest.mark.distributed]

from pipeline_support.dali_lightning_program import make_jpegs  # noqa: E402
from pipeline_support.train_runs import run_own_group  # noqa: E402

PROGRAM = Path(__file__).parent / "pipeline_support" / "dali_lightning_ddp_program.py"
FILES, STEPS = 21, 6  # ceil(2 * 11 / 4)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple[str, int]]]:
    root = tmp_path_factory.mktemp("dali_lightning_ddp")
    return str(root), make_jpegs(root, train=FILES, val=0)


def _fit(root: str, out: Path, iterator: str, timeout_s: float = 400) -> str:
    """Runs the program (its DDP ranks in one process group, killed whole on a hang)."""
    import echopipe

    # The package this test imported (the installed one in CI, the tree in a dev checkout).
    python_dir = str(Path(echopipe.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [python_dir, env.get("PYTHONPATH")] if p)
    args = [sys.executable, str(PROGRAM), root, str(out), iterator]
    done = run_own_group(args, env, timeout_s, f"the fit ({iterator})")
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


@pytest.mark.parametrize("iterator", ["echo", "dali", "dali_size"])
def test_a_real_trainer_takes_equal_steps_over_unequal_shards(data, tmp_path, iterator) -> None:
    """Both ranks finish both epochs in 6 steps (len() 6 on each), and in every epoch each rank
    trains on each file of its shard exactly twice, the two shards together every file
    (EchoIterator over the example's moving shards: the rank of 10 files reads 11 the next
    epoch; DALI's iterator over shards that stick; DALI's given an older program's
    ``size=pipe.epoch_size("Reader") // world_size``, the largest shard's 22 copies per epoch,
    where the rank of 10 files hands out 2 of padding as plain DALI hands out 1)."""
    root, files = data
    _fit(root, tmp_path, iterator)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["lengths"] == [STEPS, STEPS] and rank["global_step"] == 2 * STEPS
        assert rank["steps"] == {"0": STEPS, "1": STEPS}
    for epoch in ("0", "1"):
        together: Counter[int] = Counter()
        for rank in ranks:
            for grey, label in rank["seen"][epoch]:
                assert files[grey] == ("train", label)  # the label travelled with its image
            counts = Counter(grey for grey, _ in rank["seen"][epoch])
            if iterator == "dali_size":  # DALI counts 22 samples: on 10 files, 2 are padding
                assert sum(counts.values()) == 22 and len(counts) in (10, 11)
            else:
                assert set(counts.values()) == {2} and len(counts) in (10, 11)
            together += counts
        if iterator == "dali_size":
            assert set(together) == set(files) and min(together.values()) == 2, epoch
        else:
            assert together == dict.fromkeys(files, 2), epoch
