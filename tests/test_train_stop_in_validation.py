"""A stop (SIGTERM) during an epoch's validation keeps the epoch just trained; one after it
keeps the validated epoch.

Real ``echopipe train`` processes on the tiny JPEG set, stopped by a real SIGTERM sent when the
run prints ``validating epoch ...``, then resumed with ``--resume``: the resume validates the
trained epoch instead of training it again, and the run ends with the rows, steps and summary
of an uninterrupted run. The first validation batch waits for the stop (at most 120 s, ended
by the signal's handler), so the stop always lands inside validation, not after it. For a stop
after validation's last collective, the epoch line holds the run until the stop has reached the
process's handler (an event, not a time).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from echopipe.training.checkpoints import read_checkpoint
from pipeline_support import train_runs as tr

pytestmark = pytest.mark.dali

ARGS = ["--batch-size", "8", "--image-size", "32", "--no-progress", "--warmup-epochs", "0",
        "--stages", "1", "--echo", "2", "--epochs", "2"]  # fmt: skip

# Runs echopipe's CLI with the first validation batch held until a stop arrives.
HOLD = """\
import sys, time
from echopipe.cli import main
from echopipe.pipeline.engine import StalePipeline

evaluate = StalePipeline.evaluate
held = []

def held_evaluate(self, x, batch_size=None):
    if not held:
        held.append(True)
        end = time.monotonic() + 120
        while time.monotonic() < end:  # the stop's handler raises out of this wait
            time.sleep(0.01)
    return evaluate(self, x, batch_size)

StalePipeline.evaluate = held_evaluate
sys.exit(main(sys.argv[1:]))
"""

# Runs echopipe's CLI held after the first epoch line (validation's collectives are over, the
# epoch-end checkpoint not yet written) until a stop has reached the handler in place there.
HOLD_AFTER = """\
import signal, sys, time
from echopipe.cli import main
from echopipe.training.progress import Progress

end_epoch = Progress.end_epoch
held = []

def held_end_epoch(self, row, eta_s):
    end_epoch(self, row, eta_s)
    if held:
        return
    held.append(True)
    stops, handlers = [], {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def seen(number, frame):
        stops.append(number)
        handlers[number](number, frame)  # the run's own handler: it raises, or holds the stop

    try:
        for sig in handlers:
            signal.signal(sig, seen)
        print("held after validation", file=sys.stderr, flush=True)
        end = time.monotonic() + 120
        while not stops and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

Progress.end_epoch = held_end_epoch
sys.exit(main(sys.argv[1:]))
"""


def _cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "echopipe.cli", *argv], env=tr.child_env(),
                          capture_output=True, text=True, timeout=180)  # fmt: skip


def _stop_at(cmd: list[str], when: str = "validating epoch 1/", times: int = 1) -> tuple[int, str]:
    """Run ``cmd``; SIGTERM it when it has said ``when`` (``times`` times: once per rank), by
    default when validation started; its status and stderr. Counted anywhere in the text: the
    ranks share torchrun's stderr, so one rank's line can land inside another's ("... ETA
    0:00held after validation"), and a count of line starts then waited for ever."""
    return tr.stop_when(cmd, lambda text: text.count(when) >= times)


def test_a_sigterm_during_validation_keeps_the_trained_epoch(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Stopped in epoch 1's validation (after its 8 steps), the run writes the checkpoint of
    the trained epoch and names it; the resume validates epoch 1 first, then trains epoch 2:
    --deterministic, so the same input gives every step the uninterrupted run's loss."""
    argv = ["train", "--data", str(tiny_imagenet), *ARGS, "--deterministic"]
    ref = tmp_path / "ref"  # (a process as the others: the same threads, the same sums)
    assert _cli([*argv, "--output", str(ref)]).returncode == 0
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.pt"
    hold = tmp_path / "hold.py"
    hold.write_text(HOLD)
    code, err = _stop_at([sys.executable, str(hold), *argv, "--output", str(run)])
    assert code == 143, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"echopipe train: interrupted at step 8; --resume --output {run} continues from {last} "
        "(step 8, epoch 1 trained, not validated)"
    ), err
    saved = read_checkpoint(last)["run"]
    assert (saved["global_step"], saved["epoch"], saved["step_in_epoch"]) == (8, 0, 8)
    assert saved["rows"] == []

    done = _cli(["train", "--output", str(run), "--resume"])
    assert done.returncode == 0, done.stderr
    assert (
        f"resume: {last} (step 8, epoch 1 trained, not validated: it is validated first)"
        in done.stderr
    ), done.stderr
    assert "validating epoch 1/2 at step 8" in done.stderr
    assert tr.rows(run) == tr.rows(ref)
    assert [r["step"] for r in tr.rows(run)] == [8, 16]
    losses = tr.step_losses(run)
    assert losses == tr.step_losses(ref) and sorted(losses) == list(range(1, 17))
    summary = json.loads((run / "metrics.json").read_text())["summary"]
    want = json.loads((ref / "metrics.json").read_text())["summary"]
    for key in ("steps", "epochs", "top1", "fresh_samples", "echoed_samples"):
        assert summary[key] == want[key], key
    assert len((run / "metrics.csv").read_text().splitlines()) == 3
    config = json.loads((run / "config.json").read_text())
    (restart,) = config["restarts"]
    assert restart["from"] == {"checkpoint": str(last), "epoch": 0, "step": 8}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sigterm_to_torchrun_during_validation_keeps_the_epoch_on_both_ranks(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """torchrun, 2 Gloo processes: SIGTERM to torchrun during epoch 1's validation (it sends
    SIGTERM to both ranks) ends the job without a hang; both ranks hold the trained epoch's
    checkpoint of one step, and the resumed job validates it and ends as a whole run.

    Then the ranks as a stop that reached rank 0 after its validation leaves them: rank 0 with
    the validated end of epoch 1 (and the trained one as prev.pt), rank 1 with the trained one.
    Both are step 4, yet not the same state: resumed together, rank 0 trained on while rank 1
    validated (their collectives crossed until --dist-timeout-s). They agree on the trained
    epoch instead, and the job ends with the same rows."""
    hold = tmp_path / "hold.py"
    hold.write_text(HOLD)
    run = tmp_path / "run"
    ranks = [run / "checkpoints" / f"rank{r}" for r in (0, 1)]

    def torchrun(script: list[str], *extra: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                "--nproc_per_node=2", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{tr.free_port()}", "--monitor-interval=0.2", *script,
                "train", "--data", str(tiny_imagenet), *ARGS, "--deterministic",
                "--dist-timeout-s", "30", "--output", str(run), *extra]  # fmt: skip

    def resume() -> subprocess.CompletedProcess[str]:
        done = subprocess.run(torchrun(["-m", "echopipe.cli"], "--resume"), env=tr.child_env(),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        doc = json.loads((run / "metrics.json").read_text())
        assert [r["step"] for r in doc["epochs"]] == [4, 8]
        assert [r["epoch"] for r in doc["epochs"]] == [1, 2]
        assert all(r["val_images"] == 8 for r in doc["epochs"])
        assert doc["summary"]["steps"] == 8 and doc["summary"]["epochs"] == 2
        assert sorted(tr.step_losses(run)) == list(range(1, 9))
        for folder in ranks:
            saved = read_checkpoint(folder / "last.pt")["run"]
            assert (saved["global_step"], saved["epoch"]) == (8, 2)
        return done

    code, err = _stop_at(torchrun([str(hold)]))
    assert code != 0, err
    assert (
        f"interrupted at step 4; --resume --output {run} continues from {ranks[0] / 'last.pt'} "
        "(step 4, epoch 1 trained, not validated)"
    ) in err, err[-3000:]
    trained = []
    for folder in ranks:
        saved = read_checkpoint(folder / "last.pt")["run"]
        assert (saved["global_step"], saved["epoch"], saved["step_in_epoch"]) == (4, 0, 4)
        trained.append((folder / "last.pt").read_bytes())
    done = resume()
    assert "epoch 1 trained, not validated: it is validated first" in done.stderr
    rows = tr.rows(run)

    # Rank 0: the validated end of epoch 1 (last.pt) and the trained epoch (prev.pt); rank 1:
    # the trained epoch only.
    (ranks[0] / "prev.pt").replace(ranks[0] / "last.pt")
    (ranks[0] / "prev.pt").write_bytes(trained[0])
    (ranks[1] / "last.pt").write_bytes(trained[1])
    (ranks[1] / "prev.pt").unlink()
    assert read_checkpoint(ranks[0] / "last.pt")["run"]["epoch"] == 1
    done = resume()
    assert (
        "the ranks' checkpoints differ (rank 0: step 4, rank 1: step 4 (not validated)): all "
        "resume from step 4 (not validated), the newest step every rank holds" in done.stderr
    ), done.stderr[-3000:]
    assert tr.rows(run) == rows


def test_a_sigterm_after_validation_keeps_the_validated_epoch(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Stopped after epoch 1's validation (its epoch line printed, its checkpoint not yet
    written), the run writes the validated end of epoch 1 and names it; the resume trains
    epoch 2 at once and ends with the uninterrupted run's rows, steps and summary."""
    argv = ["train", "--data", str(tiny_imagenet), *ARGS, "--deterministic"]
    ref = tmp_path / "ref"
    assert _cli([*argv, "--output", str(ref)]).returncode == 0
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.pt"
    hold = tmp_path / "hold.py"
    hold.write_text(HOLD_AFTER)
    cmd = [sys.executable, str(hold), *argv, "--output", str(run)]
    code, err = _stop_at(cmd, when="held after validation")
    assert code == 143, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"echopipe train: interrupted at step 8; --resume --output {run} continues from {last} "
        "(step 8, end of epoch 1)"
    ), err
    saved = read_checkpoint(last)["run"]
    assert (saved["global_step"], saved["epoch"], saved["step_in_epoch"]) == (8, 1, 0)
    assert [r["step"] for r in saved["rows"]] == [8]

    done = _cli(["train", "--output", str(run), "--resume"])
    assert done.returncode == 0, done.stderr
    assert f"resume: {last} (step 8, end of epoch 1)" in done.stderr, done.stderr
    assert "validating epoch 1/" not in done.stderr
    assert tr.rows(run) == tr.rows(ref)
    assert [r["step"] for r in tr.rows(run)] == [8, 16]
    losses = tr.step_losses(run)
    assert losses == tr.step_losses(ref) and sorted(losses) == list(range(1, 17))
    summary = json.loads((run / "metrics.json").read_text())["summary"]
    want = json.loads((ref / "metrics.json").read_text())["summary"]
    for key in ("steps", "epochs", "top1", "fresh_samples", "echoed_samples"):
        assert summary[key] == want[key], key
    assert len((run / "metrics.csv").read_text().splitlines()) == 3


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sigterm_to_torchrun_after_validation_keeps_the_validated_epoch_on_both_ranks(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """torchrun, 2 Gloo processes, both held after epoch 1's validation: SIGTERM to torchrun
    leaves both ranks with the validated end of epoch 1 (one step, one kind), and the resumed
    job trains epoch 2 at once and ends with an uninterrupted job's rows and steps."""
    hold = tmp_path / "hold.py"
    hold.write_text(HOLD_AFTER)

    def torchrun(script: list[str], out: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                "--nproc_per_node=2", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{tr.free_port()}", "--monitor-interval=0.2", *script,
                "train", "--data", str(tiny_imagenet), *ARGS, "--deterministic",
                "--dist-timeout-s", "30", "--output", str(out), *extra]  # fmt: skip

    def job(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(cmd, env=tr.child_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    ref, run = tmp_path / "ref", tmp_path / "run"
    job(torchrun(["-m", "echopipe.cli"], ref))
    cmd = torchrun([str(hold)], run)
    code, err = _stop_at(cmd, when="held after validation", times=2)
    assert code != 0, err
    ranks = [run / "checkpoints" / f"rank{r}" for r in (0, 1)]
    assert (
        f"interrupted at step 4; --resume --output {run} continues from {ranks[0] / 'last.pt'} "
        "(step 4, end of epoch 1)"
    ) in err, err[-3000:]
    for folder in ranks:
        saved = read_checkpoint(folder / "last.pt")["run"]
        assert (saved["global_step"], saved["epoch"], saved["step_in_epoch"]) == (4, 1, 0)
    done = job(torchrun(["-m", "echopipe.cli"], run, "--resume"))
    assert "the ranks' checkpoints differ" not in done.stderr, done.stderr[-3000:]
    assert "validating epoch 1/" not in done.stderr, done.stderr[-3000:]
    assert tr.rows(run) == tr.rows(ref)
    assert [r["step"] for r in tr.rows(run)] == [4, 8]
    losses = tr.step_losses(run)
    assert losses == tr.step_losses(ref) and sorted(losses) == list(range(1, 9))
