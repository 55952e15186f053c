"""What the tests that run ``echopipe train`` or a pipeline worker in child processes (torchrun
jobs, stopped runs) share: the environment, a free port, a two-rank worker job, a stop at a
marker, and the records a run leaves."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Row entries an uninterrupted run and a stopped-and-resumed one share (not times, not the
# input's build count, which counts the resume's rebuild).
SAME = ["epoch", "step", "train_loss", "val_top1", "val_loss", "val_top5", "val_images",
        "fresh_samples", "echoed_samples", "echo_factor", "lr", "pipelined"]  # fmt: skip


def child_env() -> dict[str, str]:
    """The environment of a child run: the echopipe this test imported (also a clean install,
    which has no extension in the source tree), one thread per process, unbuffered lines."""
    import echopipe

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(echopipe.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    return env


def free_port() -> int:
    """A port nothing listens on now (a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_worker(worker: Path, out: Path, timeout: float) -> None:
    """Runs the script ``worker`` on two torchrun ranks, with ``out`` as its argument, and
    fails the test with the job's output unless it ends with status 0."""
    import sys

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(worker), str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def run_own_group(
    args: list[str], env: dict[str, str], timeout_s: float, what: str, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Runs ``args`` in a process group of its own (a Lightning DDP program's other ranks too),
    its stdout and stderr together; on a hang the whole group is killed and the test fails with
    ``what`` and the output's end."""
    import pytest

    with subprocess.Popen(args, env=env, text=True, stdout=subprocess.PIPE, cwd=cwd,
                          stderr=subprocess.STDOUT, start_new_session=True) as proc:  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"{what} hung for {timeout_s} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out)


def stop_when(cmd: list[str], ready: Callable[[str], bool]) -> tuple[int, str]:
    """Runs ``cmd`` and sends it SIGTERM once ``ready`` holds for its stderr so far (an event in
    the run's own words, not a time); its status and whole stderr. A run that never gets there
    is killed after 120 s."""
    seen: list[str] = []
    with subprocess.Popen(cmd, env=child_env(), stderr=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, text=True) as proc:  # fmt: skip
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                seen.append(line)
                if ready("".join(seen)):
                    proc.send_signal(signal.SIGTERM)
                    break
            seen.append(proc.stderr.read())
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, "".join(seen)


def rows(run: Path) -> list[dict[str, Any]]:
    """The run's ``metrics.json`` rows, the :data:`SAME` entries of each."""
    doc = json.loads((run / "metrics.json").read_text())
    return [{k: r[k] for k in SAME} for r in doc["epochs"]]


def step_losses(run: Path) -> dict[int, str]:
    """``steps.csv``: each step's training loss (a step written twice fails)."""
    with open(run / "steps.csv") as f:
        found = list(csv.DictReader(f))
    assert len(found) == len({r["step"] for r in found}), "a step appears twice in steps.csv"
    return {int(r["step"]): r["train_loss"] for r in found}
