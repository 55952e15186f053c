"""The image check when a rank's check fails or a file never finishes, and files that are not
regular files: every rank ends naming the rank and file, nothing waits forever.

The ranks are two plain processes joined over gloo (no torchrun agent that would stop the
survivor when the failing rank exits): what a rank prints is its own. Each child runs under a
timeout, so a check that still hangs fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_support import train_runs as tr
from pipeline_support.jpegs import two_class_folder

# Rank 1's check of one file either raises (as a decode that runs out of memory does) or reads
# a FIFO whose writer never writes (as a file on a hanging network mount does).
_RANK = """
import os, sys
import echopipe.data.folder_check as folder_check
import echopipe.data.image_folder as image_folder
from echopipe.cli import main

how, fifo = sys.argv[1], sys.argv[2]
real = image_folder.check_image_file
folder_check.FILE_TIMEOUT_S = 0.5

def failing(path, check="header"):
    if os.environ["RANK"] == "1" and path.endswith(os.path.join("cat", "03.JPEG")):
        if how == "raise":
            raise MemoryError("no memory left for the decode")
        with open(fifo, "rb") as f:  # blocks in the kernel: no writer ever opens the FIFO
            f.read()
    return real(path, check)

image_folder.check_image_file = failing
sys.exit(main(sys.argv[3:]))
"""


def _two_ranks(tmp_path: Path, how: str, rank1: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """``(status, stderr)`` of two ranks of ``echopipe train`` on ``tmp_path/data`` (made when
    missing) whose rank 1 fails as ``how`` says, run under the command ``rank1``; a rank still
    running after 120 s fails the test."""
    data = tmp_path / "data"
    if not data.exists():
        two_class_folder(data)
    fifo = tmp_path / "stuck.JPEG"
    os.mkfifo(fifo)
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    port = tr.free_port()
    procs = []
    for rank in range(2):
        env = dict(tr.child_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        cmd = [*(rank1 if rank else ()), sys.executable, str(script), how, str(fifo), "train",
               "--data", str(data),
               "--output", str(tmp_path / "run"), "--check", "decode", "--no-progress",
               "--dist-timeout-s", "600"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    out = []
    try:
        for proc in procs:
            err = proc.communicate(timeout=120)[1]
            out.append((proc.returncode, err))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return out


def _the_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("echopipe train:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.distributed
def test_a_check_that_raises_on_one_rank_ends_every_rank_naming_it(tmp_path: Path) -> None:
    bad = str(tmp_path / "data" / "train" / "cat" / "03.JPEG")
    for status, err in _two_ranks(tmp_path, "raise"):
        assert status == 1, err
        line = _the_line(err)
        assert "rank 1:" in line and repr(bad) in line, line
        assert "MemoryError: no memory left for the decode" in line, line


@pytest.mark.distributed
def test_a_file_that_never_finishes_on_one_rank_ends_every_rank_naming_it(
    tmp_path: Path,
) -> None:
    bad = str(tmp_path / "data" / "train" / "cat" / "03.JPEG")
    for status, err in _two_ranks(tmp_path, "hang"):
        assert status == 1, err
        line = _the_line(err)
        assert "rank 1:" in line and repr(bad) in line and "did not finish within 0.5 s" in line


@pytest.mark.distributed
def test_a_folder_one_rank_cannot_list_ends_every_rank_naming_it(tmp_path: Path) -> None:
    sub = two_class_folder(tmp_path / "data") / "train" / "cat" / "sub"
    sub.mkdir()
    shutil.copy(sub.parent / "00.JPEG", sub / "a.JPEG")
    sub.chmod(0)  # rank 1 runs without the capabilities that let root read any folder
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv: rank 1 cannot be denied the folder")
    try:
        ranks = _two_ranks(
            tmp_path, "none", ("setpriv", "--bounding-set=-dac_override,-dac_read_search")
        )
    finally:
        sub.chmod(0o755)
    for status, err in ranks:
        assert status == 1, err
        line = _the_line(err)
        assert "rank 1: cannot list the data folder" in line and repr(str(sub)) in line, line
        assert "Permission denied" in line and "every rank stops" in line, line


_HEADER = """
import sys
from echopipe.data import CorruptImageError, check_image_file
for path in sys.argv[1:]:
    for check in ("header", "decode"):
        try:
            check_image_file(path, check)
        except CorruptImageError as exc:
            print(exc.reason)
"""


def test_the_check_refuses_a_fifo_socket_or_device_unopened(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.JPEG"
    os.mkfifo(fifo)  # a blocking open waits for a writer that never comes
    sock_path = tmp_path / "s.JPEG"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        cmd = [sys.executable, "-c", _HEADER, str(fifo), str(sock_path), "/dev/zero"]
        done = subprocess.run(cmd, env=tr.child_env(), capture_output=True, text=True,
                              timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    reasons = done.stdout.splitlines()
    kinds = ["a named pipe (FIFO)"] * 2 + ["a socket"] * 2 + ["a character device"] * 2
    assert len(reasons) == len(kinds), done.stdout
    for reason, kind in zip(reasons, kinds, strict=True):
        assert reason.startswith(f"is {kind}, not a regular file"), reason


_SCAN = """
import sys
from echopipe.data import CorruptImageError, scan_image_folder
for check in ("none", "header", "decode"):
    index = scan_image_folder(sys.argv[1], check=check, on_corrupt="skip")
    print(len(index.files), *index.skipped[0])
    try:
        scan_image_folder(sys.argv[1], check=check)
    except CorruptImageError as exc:
        print(exc.path, exc.reason)
"""


def test_a_fifo_named_like_an_image_is_named_by_the_scan_never_opened(tmp_path: Path) -> None:
    root = two_class_folder(tmp_path / "data") / "train"
    fifo = root / "ant" / "00b.JPEG"  # second in scan order: a good file comes before it
    os.mkfifo(fifo)
    cmd = [sys.executable, "-c", _SCAN, str(root)]
    done = subprocess.run(cmd, env=tr.child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    why = "is a named pipe (FIFO), not a regular file"
    lines = done.stdout.splitlines()
    assert len(lines) == 6, done.stdout
    for kept, stopped in zip(lines[::2], lines[1::2], strict=True):
        assert kept.startswith(f"12 {fifo} {why}"), kept  # left out, named
        assert stopped.startswith(f"{fifo} {why}"), stopped  # or the run stops at it
