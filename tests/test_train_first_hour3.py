"""Still more of a new user's first hour with ``echopipe train``: a disk that fills while the
run writes its files."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_support.train_runs import child_env

RUN = ["--model", "lenet5", "--image-size", "32", "-b", "8", "--stages", "1", "--echo", "1",
       "--epochs", "2", "--warmup-epochs", "0", "--no-progress"]  # fmt: skip


def _train(args: list[str], file_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        # A file that cannot grow past ``file_limit`` bytes: writes fail with EFBIG, as a
        # full disk's fail with ENOSPC (SIGXFSZ ignored, or it would kill the process).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    cmd = [sys.executable, "-m", "echopipe.cli", "train", *RUN, *args]
    return subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=None if file_limit is None else limit)  # fmt: skip


@pytest.mark.dali
def test_a_checkpoint_the_disk_cannot_hold_names_the_file_and_the_resume(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """A checkpoint write that fails for want of space was ``error: [Errno 27] File too
    large``: no file, no word of what the run kept. The line names the file, the step, and
    the checkpoint ``--resume`` continues from; no temporary file is left, and the resume
    finishes the run once there is room."""
    run = tmp_path / "run"
    data = ["--data", str(tiny_imagenet), "--output", str(run)]
    first = _train([*data, "--max-steps", "4"])
    assert first.returncode == 0, first.stderr
    # The lenet5 checkpoint is about 2 MB; config.json, metrics and steps.csv a few KB.
    full = _train([*data, "--resume"], file_limit=1 << 20)
    assert full.returncode == 1, full.stderr
    assert "Traceback" not in full.stderr
    last = run / "checkpoints" / "last.pt"
    assert full.stderr.strip().splitlines()[-1] == (
        f"echopipe train: error: [Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}: '{last}'; "
        f"stopped at step 8; "
        f"--resume --output {run} continues from {last} (step 4, end of epoch 1)"
    )
    assert not [p.name for p in last.parent.iterdir() if p.name.startswith(".")]
    again = _train([*data, "--resume"])
    assert again.returncode == 0, again.stderr
    assert "(8 steps, 2 epochs" in again.stdout, again.stdout
