"""torchrun restarts and ranks out of step: real 2-process Gloo jobs on the tiny JPEG set.

A rank is ended at a chosen step by ``ECHOPIPE_FAULT_EXIT`` (``os._exit`` after that step, on
the first attempt of the job only), never by a timer.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from echopipe.training.checkpoints import read_checkpoint

pytestmark = [pytest.mark.dali, pytest.mark.distributed, pytest.mark.slow]


def _env(**extra: str) -> dict[str, str]:
    import echopipe

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(echopipe.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(data: Path, out: Path, *args: str, restarts: int = 0, procs: int = 2,
              **env: str) -> subprocess.CompletedProcess[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={procs}",
           f"--max-restarts={restarts}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{_port()}", "--monitor-interval=0.2",
           "-m", "echopipe.cli", "train", "--data", str(data), "--batch-size", "8",
           "--image-size", "32", "--no-progress", "--warmup-epochs", "0", "--stages", "1",
           "--echo", "2", "--checkpoint-every", "1", "--dist-timeout-s", "60",
           "--output", str(out), *args]  # fmt: skip
    return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=400)


def _steps(run: Path) -> list[int]:
    with open(run / "steps.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def test_torchrun_restart_after_a_killed_rank_resumes_and_nothing_is_lost_or_repeated(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Rank 1 dies after step 5 of 8 (mid-epoch 2) on the first attempt; torchrun restarts the
    job, ``--resume auto`` continues from the checkpoint every rank holds, and the run ends with
    the 8 steps of an uninterrupted run (each replica: 16 images, e = 2, batch 8, 2 epochs)."""
    out = tmp_path / "run"
    done = _torchrun(tiny_imagenet, out, "--epochs", "2", "--resume", "auto", restarts=1,
                     ECHOPIPE_FAULT_EXIT="1:5")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("echopipe train: summary") == 1
    assert "resume auto: no checkpoint" in done.stderr  # the first attempt started the run
    doc = json.loads((out / "metrics.json").read_text())
    assert doc["summary"]["steps"] == 8 and doc["summary"]["epochs"] == 2
    assert [r["step"] for r in doc["epochs"]] == [4, 8]
    assert _steps(out) == list(range(1, 9))  # every step once in the per-step log
    (restart,) = json.loads((out / "config.json").read_text())["restarts"]
    assert restart["torchelastic_restart"] == 1 and 4 <= restart["from"]["step"] <= 5
    for rank in (0, 1):
        last = read_checkpoint(out / "checkpoints" / f"rank{rank}" / "last.pt")
        assert last["run"]["global_step"] == 8


def test_ranks_with_checkpoints_of_different_steps_agree_or_stop(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Rank 1's newest checkpoint one step behind rank 0's (killed between the two writes):
    both resume from the newest step both hold. With no step in common: one line naming the
    steps, and nothing trains."""
    out = tmp_path / "run"
    data = tmp_path / "data"  # (a copy: one of its images is damaged for a while below)
    shutil.copytree(tiny_imagenet, data)
    first = _torchrun(data, out, "--epochs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    r0, r1 = (out / "checkpoints" / f"rank{r}" for r in (0, 1))
    shutil.copyfile(r1 / "prev.pt", r1 / "last.pt")  # rank 1 at step 7, rank 0 at 8 (and 7)
    (r1 / "prev.pt").unlink()
    files = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*.pt")}
    # Refused after the ranks agreed on step 7 (another --echo): rank 0's step 8 is kept.
    refused = _torchrun(data, out, "--epochs", "3", "--resume", "--echo", "3")
    assert refused.returncode != 0 and "--echo was 2.0, now 3.0" in refused.stderr
    assert {p: p.read_bytes() for p in (out / "checkpoints").rglob("*.pt")} == files
    # Refused later, in the set-up (a corrupt training image): rank 0's step 8 is kept too.
    victim = next((data / "train").rglob("*.JPEG"))
    whole = victim.read_bytes()
    victim.write_bytes(whole[:300])
    refused = _torchrun(data, out, "--epochs", "3", "--resume")
    assert refused.returncode != 0 and "corrupt image" in refused.stderr, refused.stderr[:3000]
    assert {p: p.read_bytes() for p in (out / "checkpoints").rglob("*.pt")} == files
    victim.write_bytes(whole)
    # --resume CKPT names one rank's file; each rank reads its own, here of another step.
    named = _torchrun(data, out, "--epochs", "3", "--resume", str(r0 / "last.pt"))
    assert named.returncode != 0
    assert (
        "the ranks' files are of different steps (rank 0: step 8, rank 1: step 7)" in named.stderr
    ), named.stderr[-3000:]
    again = _torchrun(data, out, "--epochs", "3", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        "the ranks' checkpoints differ (rank 0: step 8, rank 1: step 7): all resume from step 7"
        in again.stderr
    )
    doc = json.loads((out / "metrics.json").read_text())
    assert doc["summary"]["steps"] == 12 and [r["step"] for r in doc["epochs"]] == [4, 8, 12]
    shutil.copyfile(r1 / "prev.pt", r1 / "last.pt")  # rank 1 at 11; rank 0 at 12 only
    for r in (r0, r1):
        (r / "prev.pt").unlink()
    before = (r0 / "last.pt").read_bytes()
    refused = _torchrun(data, out, "--epochs", "4", "--resume")
    assert refused.returncode != 0
    assert (
        "the ranks' checkpoints are of different steps (rank 0: step 12, rank 1: step 11) and "
        "no step is held by every rank" in refused.stderr
    )
    assert (r0 / "last.pt").read_bytes() == before


@pytest.mark.parametrize(("first", "then"), [(2, 1), (1, 2)])
def test_a_job_back_with_another_world_size_is_refused_in_one_line(
    tiny_imagenet: Path, tmp_path: Path, first: int, then: int
) -> None:
    """An elastic job (torchrun --nnodes 1:2) can come back with fewer or more ranks. Each
    rank's checkpoint holds its own data shard's DALI reader position and echo cache, and the
    steps per epoch are counted for its world size, so ``--resume auto`` at another world size
    is refused, mid-epoch and at an epoch's end: one line per rank naming both world sizes and
    what to do, no file touched; the run then continues at its own world size."""
    out = tmp_path / "run"
    per_epoch = 8 // first  # 32 images shared by the ranks, e = 2, batch 8
    started = _torchrun(tiny_imagenet, out, "--epochs", "2", "--max-steps", "2", procs=first)
    assert started.returncode == 0, started.stderr[-3000:]
    for at in ("mid-epoch", "epoch end"):
        files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        refused = _torchrun(tiny_imagenet, out, "--resume", "auto", procs=then)
        assert refused.returncode != 0, at
        lines = [ln for ln in refused.stderr.splitlines() if "echopipe train: error:" in ln]
        # (one per rank; torchrun may end a rank before it says it)
        assert 1 <= len(lines) <= then, refused.stderr[-3000:]
        for line in lines:
            assert f"at world size {first}" in line and f"has world size {then}" in line, line
            assert f"the run continues only at world size {first}" in line, line
        # no traceback of echopipe's: the one is torchrun's report that a worker failed
        assert refused.stderr.count("Traceback") == refused.stderr.count("ChildFailedError:")
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files, at
        if at == "mid-epoch":
            ended = _torchrun(tiny_imagenet, out, "--resume", "auto", "--max-steps",
                              str(per_epoch), procs=first)  # fmt: skip
            assert ended.returncode == 0, ended.stderr[-3000:]
            doc = json.loads((out / "metrics.json").read_text())
            # (--max-steps 2 validated its part of the epoch: a partial row, which the
            # epoch's own replaced)
            assert [r["step"] for r in doc["epochs"]] == [per_epoch]
            assert doc["summary"]["steps"] == per_epoch
    assert _steps(out) == list(range(1, per_epoch + 1))
    # --resume CKPT into a new folder: the checkpoint's own world size is checked too.
    mine = out / "checkpoints" / ("rank0" if first > 1 else "") / "last.pt"
    refused = _torchrun(tiny_imagenet, tmp_path / "new", "--resume", str(mine), procs=then)
    assert refused.returncode != 0
    assert f"the checkpoint was written at world size {first}, this run has world size " in (
        refused.stderr
    ), refused.stderr[-3000:]


def test_a_refused_resume_is_said_once_per_attempt_and_restarts_end_at_once(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Rank 1's last.pt altered (a crafted file): the first attempt refuses the resume, rank 0
    relaying rank 1's own line as it is (no second prefix). torchrun restarts the job
    (--max-restarts 1); the restarted attempt finds the refusal in the job's store and ends
    before it joins the process group or reads a file: one line, rank 0's, saying so. No file
    of the run changes."""
    out = tmp_path / "run"
    started = _torchrun(tiny_imagenet, out, "--epochs", "2", "--max-steps", "2")
    assert started.returncode == 0, started.stderr[-3000:]
    crafted = out / "checkpoints" / "rank1" / "last.pt"
    body = bytearray(crafted.read_bytes())
    body[len(body) // 2] ^= 0xFF
    crafted.write_bytes(bytes(body))
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    refused = _torchrun(tiny_imagenet, out, "--resume", "auto", restarts=1)
    assert refused.returncode != 0
    prev = shlex.quote(str(crafted.with_name("prev.pt")))
    line = (
        f"echopipe train: error: checkpoint {str(crafted)!r} fails its SHA-256 check (the file "
        f"was altered or damaged); it is not loaded; --resume {prev} continues from the "
        "checkpoint before it"
    )
    again = f"{line} (refused by attempt 0 of this torchrun job; a restart cannot change it)"
    # The first attempt: each rank's line, rank 1's own relayed as it is (torchrun may end a
    # rank before it says it); the restart: rank 0's alone. (Counted in the text: the ranks
    # share torchrun's stderr.)
    said = refused.stderr.count("echopipe train: error:")
    assert refused.stderr.count(again) == 1, refused.stderr[-3000:]
    assert 2 <= refused.stderr.count(line) == said <= 3, refused.stderr[-3000:]
    assert refused.stderr.count("Traceback") == refused.stderr.count("ChildFailedError:")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_a_stopped_rank_is_named_after_the_timeout(tiny_imagenet: Path, tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP) after step 3: rank 0's next collective fails after
    --dist-timeout-s, and its one line names rank 1 instead of a Gloo timeout message."""
    out = tmp_path / "run"
    done = _torchrun(tiny_imagenet, out, "--epochs", "2", "--dist-timeout-s", "5",
                     ECHOPIPE_FAULT_EXIT="1:3:stop")  # fmt: skip
    assert done.returncode != 0
    assert re.search(
        r"echopipe train: error: rank 1 did not answer at step \d+ \(it ended, or hung for "
        r"--dist-timeout-s 5\)",
        done.stderr,
    ), done.stderr[-3000:]
    assert "[rank0]: Traceback" not in done.stderr


def test_a_second_job_into_a_live_runs_folder_leaves_its_files_alone(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """A second torchrun job given the folder of a live run (its lock held) is refused, and
    none of its ranks touches the folder first: rank 1 of the refused job once deleted the live
    run's ``checkpoints/rank1/.last.pt.<random>.tmp`` (a checkpoint being written), and the
    live run died on its ``os.replace``."""
    from filelock import FileLock

    out = tmp_path / "run"
    writing = []
    for rank in (0, 1):
        folder = out / "checkpoints" / f"rank{rank}"
        folder.mkdir(parents=True)
        writing.append(folder / ".last.pt.k3x9q2ab.tmp")  # the live run's write in progress
        writing[-1].write_bytes(b"half a checkpoint")
    with FileLock(str(out / ".echopipe-train.lock")):  # the live run holds its folder
        done = _torchrun(tiny_imagenet, out, "--epochs", "1")
    assert done.returncode != 0
    assert "is in use by another echopipe train" in done.stderr, done.stderr[-3000:]
    assert all(p.is_file() for p in writing), sorted(p.name for p in out.rglob("*"))


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"WORLD_SIZE": "2"}, "RANK expected, but not set"),  # torchrun's variables, half set
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a number"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "waiting for clients"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "taken": "1"},
         "address already in use"),
    ],
)  # fmt: skip
def test_a_launch_that_cannot_join_the_job_is_one_line(
    env: dict[str, str], says: str, tmp_path: Path
) -> None:
    """WORLD_SIZE without the rest of torchrun's variables, a rank alone (its peer never
    starts: it waits --dist-timeout-s), a MASTER_PORT in use: one line and status 1, no
    traceback, no run folder."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = dict(env)
        port = int(taken.getsockname()[1]) if env.pop("taken", None) else _port()
        env.setdefault("MASTER_PORT", str(port))
        for k in ("RANK", "MASTER_ADDR", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
            env.setdefault(k, "")
        run_env = {k: v for k, v in _env(**env).items() if v != ""}
        done = subprocess.run(
            [sys.executable, "-m", "echopipe", "train", "--dist-timeout-s", "2",
             "--no-progress", "--output", str(tmp_path / "run")],
            env=run_env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("echopipe train: error: "), done.stderr[-3000:]
    assert says in lines[0]
    assert not (tmp_path / "run").exists()


def test_ranks_that_read_other_data_folders_are_refused_in_one_line(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Rank 1 given a folder of 3 classes against rank 0's 4: refused before the models are
    built, naming both folders (the first gradient exchange failed inside Gloo before)."""
    from echopipe.data import make_synthetic_imagenet

    other = make_synthetic_imagenet(tmp_path / "other", classes=3, per_class=8, size=(32, 48))
    wrapper = tmp_path / "rank1_other_data.py"
    wrapper.write_text(
        "import os, sys\n"
        "from echopipe.cli import main\n"
        "args = sys.argv[1:]\n"
        "if os.environ['RANK'] == '1':\n"
        f"    args[args.index('--data') + 1] = {str(other)!r}\n"
        "sys.exit(main(args))\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_port()}", str(wrapper), "train",
           "--data", str(tiny_imagenet), "--batch-size", "8", "--image-size", "32",
           "--no-progress", "--stages", "1", "--epochs", "1", "--dist-timeout-s", "60",
           "--output", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode != 0
    assert re.search(
        rf"echopipe train: error: --data: rank 1 finds 3 classes in {re.escape(repr(str(other)))}"
        rf", rank 0 4 in {re.escape(repr(str(tiny_imagenet)))}: every process must read the "
        "same data folder",
        done.stderr,
    ), done.stderr[-3000:]
    assert "EnforceNotMet" not in done.stderr
    # the one traceback is torchrun's own report that a worker failed
    assert done.stderr.count("Traceback") == done.stderr.count("ChildFailedError:") == 1
