"""The image check and the data listing when ranks fail or differ: a rank killed during the
check, a train/ or val/ folder one rank cannot list (also under ``--evaluate``), ranks whose
copies of the data list other files. Every rank ends with one line naming the rank and the
folder or file; nothing waits for ``--dist-timeout-s``.

The ranks are two plain processes joined over gloo (no torchrun agent that would stop the
survivor when the other rank ends): what a rank prints is its own. Each runs under a timeout,
so a rank that still waits fails the test instead of hanging it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from echopipe.data import ScanShare
from pipeline_support import train_runs as tr
from pipeline_support.jpegs import two_class_folder

# "kill": rank 1 is killed (SIGKILL, as the OOM killer does) in the check of train/cat/03;
# "data=DIR": rank 1 reads DIR (another node's copy of the data).
_RANK = """
import os, signal, sys
import echopipe.data.image_folder as image_folder
from echopipe.cli import main

how, args = sys.argv[1], sys.argv[2:]
real = image_folder.check_image_file

def killed(path, check="header"):
    if os.environ["RANK"] == "1" and path.endswith(os.path.join("cat", "03.JPEG")):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, check)

if how == "kill":
    image_folder.check_image_file = killed
if how.startswith("data=") and os.environ["RANK"] == "1":
    args[args.index("--data") + 1] = how[5:]
sys.exit(main(args))
"""

_DENIED = ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


def _two_ranks(
    tmp_path: Path, how: str, args: list[str], rank1: tuple[str, ...] = ()
) -> list[tuple[int, str, str]]:
    """``(status, stdout, stderr)`` of two ranks of ``echopipe ARGS``, rank 1 as ``how`` says
    and run under the command ``rank1``; a rank still running after 120 s fails the test."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    port = tr.free_port()
    procs = []
    for rank in range(2):
        env = dict(tr.child_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        cmd = [*(rank1 if rank else ()), sys.executable, str(script), how, *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=120)
            out.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return out


def _train(data: Path, tmp_path: Path) -> list[str]:
    return ["train", "--data", str(data), "--output", str(tmp_path / "run"), "--check", "decode",
            "--no-progress", "--dist-timeout-s", "600"]  # fmt: skip


def _the_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("echopipe train:")]
    assert len(lines) == 1, err
    return lines[0]


def _denied(folder: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv: rank 1 cannot be denied the folder")
    folder.chmod(0)  # rank 1 runs without the capabilities that let root read any folder


@pytest.mark.distributed
def test_a_rank_killed_during_the_check_is_named_by_the_others(tmp_path: Path) -> None:
    data = two_class_folder(tmp_path / "data")
    (survivor, _, err), (killed, _, _) = _two_ranks(tmp_path, "kill", _train(data, tmp_path))
    assert killed == -9
    assert survivor == 1, err
    line = _the_line(err)
    assert "rank 1 did not answer while the ranks checked train/" in line, line
    assert "every rank stops" in line and "Connection reset" not in line, line


@pytest.mark.distributed
@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_folder_one_rank_cannot_list_ends_every_rank_naming_it(
    tmp_path: Path, split: str
) -> None:
    data = two_class_folder(tmp_path / "data")
    _denied(data / split)
    try:
        ranks = _two_ranks(tmp_path, "none", _train(data, tmp_path), _DENIED)
    finally:
        (data / split).chmod(0o755)
    for status, _, err in ranks:
        assert status == 1, err
        line = _the_line(err)
        want = f"--data: rank 1: cannot list the data folder {str(data / split)!r}: Permission"
        assert want in line and line.endswith("; every rank stops"), line


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A data folder and the last checkpoint of a one-epoch lenet5 run on it."""
    from echopipe.cli import main

    root = tmp_path_factory.mktemp("trained")
    data = two_class_folder(root / "data")
    argv = ["train", "--data", str(data), "--output", str(root / "run"), "--model", "lenet5",
            "--epochs", "1", "--stages", "1", "--batch-size", "4", "--image-size", "32",
            "--no-progress", "--warmup-epochs", "0"]  # fmt: skip
    assert main(argv) == 0
    return data, root / "run" / "checkpoints" / "last.pt"


@pytest.mark.distributed
@pytest.mark.parametrize("folder", ["", "val", "train/cat"])
def test_evaluate_under_two_ranks_shares_val_and_names_a_folder_one_cannot_list(
    tmp_path: Path, trained: tuple[Path, Path], folder: str
) -> None:
    """``--evaluate`` joins the job: the ranks share val/ (each prints the totals), and a
    val/ or train/ folder one rank cannot list ends both, naming it."""
    data, last = trained
    args = ["train", "--data", str(data), "--no-progress", "--check", "decode",
            "--dist-timeout-s", "600", "--evaluate", str(last)]  # fmt: skip
    if folder:
        _denied(data / folder)
    try:
        ranks = _two_ranks(tmp_path, "none", args, _DENIED)
    finally:
        if folder:
            (data / folder).chmod(0o755)
    for status, out, err in ranks:
        if not folder:
            assert status == 0, err
            assert "on 4 validation images" in out, out
            continue
        assert status == 1, err
        line = _the_line(err)
        want = f"--data: rank 1: cannot list the data folder {str(data / folder)!r}: Permission"
        assert want in line and line.endswith("; every rank stops"), line


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("add", "rank 1 lists 'train/cat/02b.JPEG', which rank 0 does not (rank 1: 13 files, "
                "rank 0: 12)"),
        ("remove", "rank 0 lists 'val/cat/01.JPEG', which rank 1 does not (rank 1: 3 files, "
                   "rank 0: 4)"),
        ("no val", "rank 1: --data '{copy}' has no val/ folder"),
        # Rank 0 checks file 8 (train/cat/02): rank 1's copy cut short would go unchecked.
        ("cut", "'train/cat/02.JPEG' has 300 bytes on rank 1, {whole} on rank 0"),
    ],
)  # fmt: skip
def test_ranks_whose_copies_list_other_files_end_naming_one(
    tmp_path: Path, change: str, said: str
) -> None:
    data = two_class_folder(tmp_path / "data")
    copy = tmp_path / "copy"  # another node's copy of the data, for rank 1
    shutil.copytree(data, copy)
    if change == "add":
        shutil.copy(copy / "train" / "cat" / "02.JPEG", copy / "train" / "cat" / "02b.JPEG")
    elif change == "cut":
        cut = copy / "train" / "cat" / "02.JPEG"
        cut.write_bytes(cut.read_bytes()[:300])
    elif change == "remove":
        (copy / "val" / "cat" / "01.JPEG").unlink()
    else:
        shutil.rmtree(copy / "val")
    for status, _, err in _two_ranks(tmp_path, f"data={copy}", _train(data, tmp_path)):
        assert status == 1, err
        line = _the_line(err)
        whole = (data / "train" / "cat" / "02.JPEG").stat().st_size
        assert said.format(copy=copy, whole=whole) in line, line


def test_the_file_lists_are_compared_by_blocks_and_the_difference_named() -> None:
    """Two threads stand for two ranks: lists of 3000 names that differ in their third block
    of checksums (from name 2500 on) are refused on both, naming the first name that differs."""
    from echopipe.data.folder_check import same_files

    names = [f"train/n{i // 1000:02d}/{i:05d}.JPEG" for i in range(3000)]
    other = [*names[:2500], "train/n02/02500b.JPEG", *names[2500:]]
    barrier = threading.Barrier(2)
    slots: list[Any] = [None, None]

    def gather(rank: int, obj: Any) -> list[Any]:
        slots[rank] = obj
        barrier.wait(timeout=30)
        views = list(slots)
        barrier.wait(timeout=30)  # both have read the views before the next exchange
        return views

    errors: list[str] = ["", ""]

    def rank(r: int, mine: list[str]) -> None:
        try:
            same_files(ScanShare(r, 2, lambda obj: gather(r, obj)), mine)
        except ValueError as exc:
            errors[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r, n)) for r, n in ((0, names), (1, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors[0] == errors[1] != "", errors
    assert "rank 1 lists 'train/n02/02500b.JPEG', which rank 0 does not" in errors[0]
    assert "(rank 1: 3001 files, rank 0: 3000)" in errors[0]
