"""A torchrun stop that straddles the end of an epoch's validation keeps the epoch.

Real 2-process Gloo ``torchrun`` jobs of ``echopipe train`` on the tiny JPEG set. The stop
reaches rank 0 right after validation's last collective returned, before the epoch is
recorded (as a SIGTERM that arrives while the collective runs is handled once it returns):
rank 0 keeps the epoch as trained, not validated. It reaches rank 1 after its epoch line,
inside the recording: rank 1 keeps the validated end of the epoch. Each rank is held at its
point until the stop has reached it (an event: the signal, never a time); the test sends the
SIGTERM to torchrun, which passes it to both ranks, once both have said they are held.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from echopipe.training.checkpoints import read_checkpoint, write_checkpoint
from pipeline_support import train_runs as tr

pytestmark = [pytest.mark.dali, pytest.mark.distributed, pytest.mark.slow]

ARGS = ["--batch-size", "8", "--image-size", "32", "--no-progress", "--warmup-epochs", "0",
        "--stages", "1", "--echo", "2", "--epochs", "2", "--deterministic",
        "--dist-timeout-s", "30"]  # fmt: skip

# Runs echopipe's CLI with rank 0 held after epoch 1's last validation collective (before the
# epoch is recorded) and rank 1 held after its epoch line (recording), each until a stop came.
STRADDLE = """\
import os, signal, sys, time
from echopipe.cli import main
from echopipe.training.epoch import EpochLoop
from echopipe.training.progress import Progress

held = []


def hold(name, seen):
    print(f"held: {name}", file=sys.stderr, flush=True)
    end = time.monotonic() + 120
    while not seen() and time.monotonic() < end:
        time.sleep(0.01)


if os.environ["RANK"] == "0":
    counters = EpochLoop._counters

    def held_counters(self):
        out = counters(self)  # the last collective of the validation
        if not held:
            held.append(True)
            hold("rank 0 after the last collective", lambda: False)  # the stop raises here
        return out

    EpochLoop._counters = held_counters
else:
    end_epoch = Progress.end_epoch

    def held_end_epoch(self, row, eta_s):
        end_epoch(self, row, eta_s)
        if held:
            return
        held.append(True)
        stops = []
        handler = signal.getsignal(signal.SIGTERM)

        def seen(number, frame):
            stops.append(number)
            handler(number, frame)  # the run's own: it holds the stop until the checkpoint

        signal.signal(signal.SIGTERM, seen)
        try:
            hold("rank 1 after validation", lambda: bool(stops))
        finally:
            signal.signal(signal.SIGTERM, handler)

    Progress.end_epoch = held_end_epoch
sys.exit(main(sys.argv[1:]))
"""

# Input state entries that are measured times, and the iterator's place in its epoch.
TIMES = {"/pipeline/runner/seconds", "/pipeline/upstream_wait_s", "/pipeline/downstream_wait_s",
         "/iterator/stats/t_up", "/iterator/stats/t_down",
         "/iterator/stats/upstream_time_s"}  # fmt: skip
POSITION = {"/iterator/step_in_epoch", "/iterator/epoch_steps"}


def _torchrun(script: list[str], data: Path, out: Path, *extra: str,
              args: list[str] = ARGS) -> list[str]:  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{tr.free_port()}",
            "--monitor-interval=0.2", *script, "train", "--data", str(data), *args,
            "--output", str(out), *extra]  # fmt: skip


def _job(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, env=tr.child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _differ(a: Any, b: Any, at: str = "") -> list[str]:
    """Where two checkpoint entries differ (tensors bitwise, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [at]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{at} keys"]
        return [d for k in a for d in _differ(a[k], b[k], f"{at}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{at} length"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differ(x, y, f"{at}/{i}")
        ]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [at]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [at]


def _stop_at(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd``; SIGTERM it once both ranks said they are held (counted in the text: the
    ranks' lines may interleave on torchrun's stderr); its status and stderr."""
    return tr.stop_when(cmd, lambda text: text.count("held: ") == 2)


def test_a_stop_between_the_ranks_ends_of_validation_keeps_the_epoch(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Rank 0 holds epoch 1 trained, not validated, rank 1 its validated end, both step 4 and
    nothing before (no prev.pt): the trained states are the same, and the resumed job
    validates epoch 1 on both ranks and ends with the uninterrupted job's rows, steps.csv
    losses and summary (--deterministic)."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    _job(_torchrun(["-m", "echopipe.cli"], tiny_imagenet, ref))
    hold = tmp_path / "straddle.py"
    hold.write_text(STRADDLE)
    code, err = _stop_at(_torchrun([str(hold)], tiny_imagenet, run))
    assert code != 0, err[-3000:]
    assert (
        f"interrupted at step 4; --resume --output {run} continues from "
        f"{run / 'checkpoints' / 'rank0' / 'last.pt'} (step 4, epoch 1 trained, not validated)"
    ) in err, err[-3000:]
    ranks = [run / "checkpoints" / f"rank{r}" for r in (0, 1)]
    trained, validated = (read_checkpoint(f / "last.pt") for f in ranks)
    at = [(s["run"]["global_step"], s["run"]["epoch"], s["run"]["step_in_epoch"])
          for s in (trained, validated)]  # fmt: skip
    assert at == [(4, 0, 4), (4, 1, 0)], err[-3000:]
    assert not any((f / "prev.pt").exists() for f in ranks)

    # The two kinds hold one trained state: the uninterrupted job's validated end of epoch 1
    # (its prev.pt), to the bit: weights, BatchNorm buffers, optimizers, schedulers, RNGs.
    for rank, saved in enumerate((trained, validated)):
        want = read_checkpoint(ref / "checkpoints" / f"rank{rank}" / "prev.pt")
        assert want["run"]["global_step"] == 4 and want["run"]["epoch"] == 1
        for key in ("pipeline", "rng", "input_factor", "input_counters", "controller"):
            assert _differ(saved[key], want[key]) == [], (rank, key)
        # The input too (the echo cache, DALI's states), but for measured times and, of the
        # trained one, the iterator's place in the epoch, which the next epoch's start zeroes.
        assert set(_differ(saved["input"], want["input"])) <= TIMES | POSITION, rank

    # A validated step 4 that is not the end of the trained epoch (an echo retune since: another
    # factor) is another step; with none older in common, that resume is refused, in one line.
    odd = tmp_path / "odd"
    shutil.copytree(run, odd)
    retuned = {**validated, "input_factor": 1.0}
    retuned["run"] = {**validated["run"], "factors_used": [2.0, 1.0]}
    write_checkpoint(retuned, odd / "checkpoints" / "rank1" / "last.pt")
    cmd = _torchrun(["-m", "echopipe.cli"], tiny_imagenet, odd, "--resume")
    refused = subprocess.run(cmd, env=tr.child_env(), capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert (
        "the ranks' checkpoints are of different steps (rank 0: step 4 (not validated), rank 1: "
        "step 4) and no step is held by every rank" in refused.stderr
    ), refused.stderr[-3000:]

    done = _job(_torchrun(["-m", "echopipe.cli"], tiny_imagenet, run, "--resume"))
    assert (
        "the ranks' checkpoints differ (rank 0: step 4 (not validated), rank 1: step 4): a stop "
        "came between the ranks' ends of the validation at step 4" in done.stderr
    ), done.stderr[-3000:]
    assert "validating epoch 1/2 at step 4" in done.stderr, done.stderr[-3000:]
    assert tr.rows(run) == tr.rows(ref)
    assert [r["step"] for r in tr.rows(run)] == [4, 8]
    assert tr.step_losses(run) == tr.step_losses(ref) and sorted(tr.step_losses(run)) == list(
        range(1, 9)
    )
    summary = json.loads((run / "metrics.json").read_text())["summary"]
    want = json.loads((ref / "metrics.json").read_text())["summary"]
    for key in ("steps", "epochs", "top1", "fresh_samples", "echoed_samples"):
        assert summary[key] == want[key], key
    for folder in ranks:
        saved = read_checkpoint(folder / "last.pt")["run"]
        assert (saved["global_step"], saved["epoch"]) == (8, 2)


def test_a_straddling_stop_with_echo_auto_keeps_the_epoch(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """As above with --echo auto and no --deterministic: after validation, the epoch's end
    also agrees on the next epoch's echo factor and length (the retune). The stop that
    straddles the ranks' ends of the validation still leaves both ranks the step, and the
    resumed job validates it on both and trains every step once."""
    auto = [a for a in ARGS if a != "--deterministic"]
    auto[auto.index("--echo") + 1] = "auto"
    run = tmp_path / "run"
    hold = tmp_path / "straddle.py"
    hold.write_text(STRADDLE)
    code, err = _stop_at(_torchrun([str(hold)], tiny_imagenet, run, args=auto))
    assert code != 0, err[-3000:]
    ranks = [run / "checkpoints" / f"rank{r}" for r in (0, 1)]
    assert all((f / "last.pt").is_file() for f in ranks), err[-3000:]
    step = read_checkpoint(ranks[0] / "last.pt")["run"]["global_step"]
    done = _job(_torchrun(["-m", "echopipe.cli"], tiny_imagenet, run, "--resume", args=auto))
    assert f"validating epoch 1/2 at step {step}" in done.stderr, done.stderr[-3000:]
    rows = tr.rows(run)
    assert [r["epoch"] for r in rows] == [1, 2] and rows[0]["step"] == step, rows
    assert sorted(tr.step_losses(run)) == list(range(1, rows[1]["step"] + 1))
