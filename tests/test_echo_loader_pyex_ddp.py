"""pytorch/examples ``imagenet/main.py`` run the way most of its users run it, with
``--multiprocessing-distributed`` (two gloo ranks from ``mp.spawn``, a real
``DistributedDataParallel`` model, ``--workers 2``, ``pin_memory=True`` without CUDA), and the
two-line EchoLoader wrap of its train loader (``tests/pyex_ddp_program.py``).

Each run is a child process in a session of its own: a hang (ranks that take different numbers
of steps wait in DDP's all-reduce) fails the test at gloo's timeout or at ``HANG_S``, and the
whole session is killed. Samples are identified by their bytes: what each rank's model trained
on, per epoch, is checked against its ``DistributedSampler`` shard.
"""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

import echopipe
from echopipe.data import make_synthetic_imagenet

PROGRAM = Path(__file__).with_name("pyex_ddp_program.py")
HANG_S = 300.0  # a run that has not ended by then hangs (gloo's own timeout is 30 s)
WORLD = 2


def session(sid: int) -> set[int]:
    """Pids of the running processes of session ``sid`` (the program, its ranks, their
    DataLoader workers: an orphan keeps its session)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.add(int(entry))
    return found


def ended(sid: int, within: float) -> set[int]:
    """Waits until session ``sid`` has no process left (at most ``within`` s); what is left."""
    deadline = time.monotonic() + within
    while (left := session(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class Job:
    """``pyex_ddp_program.py --multiprocessing-distributed ...`` in a session of its own."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.record = tmp / "records"
        self.record.mkdir(exist_ok=True)
        store = tmp / f"store{time.monotonic_ns()}"
        # PYTHONFAULTHANDLER: a rank that aborts (one gloo rank once died of "terminate called
        # without an active exception" at the end of a resumed run) leaves its threads' stacks.
        env = dict(os.environ, PYTHONPATH=str(Path(echopipe.__file__).parents[1]),
                   PYTHONWARNINGS="default", PYTHONFAULTHANDLER="1")  # fmt: skip
        self.err_path = tmp / f"stderr{time.monotonic_ns()}.txt"
        command = [
            sys.executable, str(PROGRAM), "--multiprocessing-distributed", "--world-size", "1",
            "--rank", "0", "--dist-url", f"file://{store}", "--dist-timeout", "30",
            "--record", str(self.record), *flags,
        ]  # fmt: skip
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                command, cwd=tmp, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                start_new_session=True,
            )  # fmt: skip
        self.out: list[str] = []

    def wait_for(self, word: str, count: int) -> None:
        """Reads stdout until ``word`` was printed ``count`` times; a job that ends or hangs
        first is ended whole and its exit status named, so no process or pipe outlives the test.
        The ranks share the pipe and print at the same moment (after the same DDP step), so one
        rank's word can land in the middle of another's line ("running 1running 0"): the
        word is counted anywhere in a line (a line-start count missed it, and the job then ran
        to its end)."""
        assert self.proc.stdout is not None
        # Ends a job that hangs before ``word``: the read below then sees the pipe's end.
        watchdog = threading.Timer(HANG_S, os.killpg, (self.proc.pid, signal.SIGKILL))
        watchdog.start()
        try:
            for line in self.proc.stdout:
                self.out.append(line)
                count -= line.count(word)
                if count <= 0:
                    return
        finally:
            watchdog.cancel()
        self.kill_left()
        pytest.fail(
            f"the job ended (status {self.proc.returncode}) before {count} more {word!r} lines;"
            f" stdout: {''.join(self.out)[-1000:]!r}; stderr: {self.stderr()[-3000:]}"
        )

    def wait(self) -> int | None:
        """The launcher's exit status, None if it did not end within HANG_S."""
        try:
            out, _ = self.proc.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            return None
        self.out.append(out)
        return self.proc.returncode

    def kill_left(self) -> None:
        """Kills whatever of the job's session is left (a failed test leaves nothing behind)."""
        for pid in session(self.proc.pid):
            os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def finish(self) -> int | None:
        try:
            return self.wait()
        finally:
            self.kill_left()

    def stderr(self) -> str:
        return self.err_path.read_text()

    def run(self) -> str:
        status = self.finish()
        err = self.stderr()
        assert status == 0, f"exit status {status}: {err[-3000:]}"
        assert "Traceback" not in err, err[-3000:]
        return err

    def epoch(self, rank: int, name: str) -> dict:
        return json.loads((self.record / f"rank{rank}_{name}.json").read_text())


def shard(n: int, rank: int, epoch: int) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=WORLD, rank=rank)  # type: ignore[arg-type]
    sampler.set_epoch(epoch)
    return list(sampler)


def check_epoch(job: Job, n: int, epoch: int, e: float, batch: int) -> int:
    """Each rank's epoch: every step's targets are its images', the progress total is the
    steps run, each sample of the rank's shard (padded by DistributedSampler) got ``floor(e)``
    or ``ceil(e)`` copies per place in the shard; returns the steps (equal on the ranks)."""
    steps = set()
    for rank in range(WORLD):
        got = job.epoch(rank, f"train{epoch}")
        for ids, targets in zip(got["ids"], got["targets"], strict=True):
            assert [got["labels"][i] for i in ids] == targets
        assert got["steps"] == got["len"] == len(got["ids"])
        places = collections.Counter(shard(n, rank, epoch))
        seen = collections.Counter(i for ids in got["ids"] for i in ids)
        assert set(seen) == set(places), f"rank {rank} epoch {epoch}: not its shard"
        for i, k in places.items():
            assert math.floor(e) * k <= seen[i] <= math.ceil(e) * k, (rank, epoch, i)
        per_rank = math.ceil(n / WORLD)
        copies = math.floor(e) * per_rank + math.floor((e % 1) * per_rank + 0.5)
        assert sum(seen.values()) == copies
        assert got["steps"] == math.ceil(copies / batch)
        steps.add(got["steps"])
    assert len(steps) == 1
    return steps.pop()


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """21 training JPEGs (3 classes of 7: not a multiple of 2 ranks x 4), 6 for validation."""
    root = tmp_path_factory.mktemp("pyex") / "data"
    return make_synthetic_imagenet(root, classes=3, per_class=7, size=(16, 24), val_per_class=2)


@pytest.mark.parametrize("e", [1.5, 2.0])
def test_two_gloo_ranks_take_equal_steps_over_padded_shards(jpegs, tmp_path, e) -> None:
    """21 images on 2 ranks in batches of 4: DistributedSampler pads rank 1's shard to 11,
    drop_last is False, so each rank's last batch is short. Both ranks must take the same
    number of DDP steps (a rank with one more would wait in the all-reduce), each equal to
    ``len(train_loader)``, over two epochs with ``set_epoch``."""
    job = Job(tmp_path, str(jpegs), "--epochs", "2", "-b", "4", "--echo-factor", str(e))
    err = job.run()
    for epoch in range(2):
        check_epoch(job, 21, epoch, e, 4)
    assert "EchoLoader" not in err, err  # no warning of its own (torch's pin_memory one is)


@pytest.mark.parametrize("with_state", [False, True])
def test_resume_from_the_epoch_end_checkpoint_runs_whole_epochs(tmp_path, with_state) -> None:
    """``--resume`` from the ``torch.save`` checkpoint rank 0 writes after each epoch, loaded
    with torch's default ``weights_only``: without the EchoLoader state in it (the example as
    it is), and with ``train_loader.state_dict()`` in it loaded by every rank. The epochs after
    the resume are whole and their steps equal on both ranks."""
    flags = ["--dummy", "--dummy-size", "53", "-b", "4", "--echo-factor", "1.5",
             "--val-workers", "0"]  # fmt: skip
    first = Job(tmp_path, *flags, "--epochs", "1", "--save-loader-state")
    first.run()
    check_epoch(first, 53, 0, 1.5, 4)
    load = ["--load-loader-state"] if with_state else []
    second = Job(tmp_path, *flags, "--epochs", "3", "--resume", "checkpoint.pth.tar", *load)
    err = second.run()
    for epoch in (1, 2):
        check_epoch(second, 53, epoch, 1.5, 4)
    assert "EchoLoader" not in err, err


def test_evaluate_reads_validation_once_and_not_the_echoed_loader(tmp_path) -> None:
    """``--evaluate``: the validation loader (``DistributedSampler(shuffle=False,
    drop_last=True)`` plus the example's tail ``Subset``) is not echoed: every validation
    image is seen once across the ranks' shards, and the EchoLoader is never iterated."""
    job = Job(tmp_path, "--dummy", "--dummy-size", "53", "-b", "4", "--evaluate")
    job.run()
    n_val = 53 // 2 + 1
    covered = n_val // WORLD * WORLD
    main = collections.Counter()
    for rank in range(WORLD):
        got = job.epoch(rank, "val")
        assert got["echo_epochs"] == 0
        ids = [i for step in got["ids"] for i in step]
        main.update(i for i in ids if i < covered)
        assert sorted(i for i in ids if i >= covered) == list(range(covered, n_val))
    assert main == collections.Counter(range(covered))


def _running_job(tmp_path: Path, *flags: str) -> Job:
    job = Job(tmp_path, "--dummy", "--dummy-size", "4000", "-b", "4", "--epochs", "50",
              "--read-delay", "0.02", "-p", "100000", "--val-workers", "0", *flags)  # fmt: skip
    job.wait_for("running", WORLD)
    # the launcher, its 2 ranks and their 2 DataLoader workers each
    assert len(session(job.proc.pid)) >= 1 + WORLD * 3
    return job


def test_ctrl_c_ends_the_spawned_job_and_all_its_processes(tmp_path) -> None:
    """A terminal's Ctrl-C (SIGINT to the process group): the ranks leave their loops (mp.spawn's
    wrapper takes their KeyboardInterrupt), the launcher's join is interrupted, and no rank or
    DataLoader worker is left in the session."""
    job = _running_job(tmp_path)
    os.killpg(job.proc.pid, signal.SIGINT)
    try:
        status = job.wait()
        left = ended(job.proc.pid, 30.0)
    finally:
        job.kill_left()
    assert status is not None, f"the job did not end: {job.stderr()[-3000:]}"
    assert not left, f"processes left after Ctrl-C: {job.stderr()[-3000:]}"


@pytest.mark.parametrize("group", [True, False])
def test_sigterm_ends_the_spawned_job_and_all_its_processes(tmp_path, group) -> None:
    """SIGTERM to the whole process group, or to the launcher alone (a scheduler's kill of the
    pid it started): the ranks get mp.spawn's parent-death SIGINT, and nothing of the job is
    left."""
    job = _running_job(tmp_path)
    if group:
        os.killpg(job.proc.pid, signal.SIGTERM)
    else:
        job.proc.send_signal(signal.SIGTERM)
    try:
        status = job.wait()
        left = ended(job.proc.pid, 30.0)
    finally:
        job.kill_left()
    assert status == -signal.SIGTERM, job.stderr()[-3000:]
    assert not left, f"processes left after SIGTERM: {job.stderr()[-3000:]}"
