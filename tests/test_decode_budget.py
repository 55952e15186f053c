"""The decode check's memory budget: the checks of one process hold at most
``DECODE_BUDGET_BYTES`` at once (one larger decode alone), whatever the number of threads.

Real JPEGs through ``scan_image_folder(check="decode")`` on a pool of threads; the budget's own
accounting (``peak``, ``holds``) is what is compared, no clock.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from echopipe.data import CorruptImageError, decode_check, image_folder, scan_image_folder
from echopipe.data.decode_check import DECODE_BUDGET, MemoryBudget, decode_bytes

HANG_S = 60.0  # a failing test's bound, never reached by a passing one


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def _holder(budget: MemoryBudget, nbytes: int, entered: threading.Event, leave: threading.Event):
    def run() -> None:
        with budget.hold(nbytes):
            entered.set()
            leave.wait(HANG_S)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_request_waits_until_it_fits_and_a_larger_one_runs_alone() -> None:
    budget = MemoryBudget(10)
    a_in, a_out, b_in, b_out, c_in, c_out = (threading.Event() for _ in range(6))
    a = _holder(budget, 6, a_in, a_out)
    assert a_in.wait(HANG_S)
    b = _holder(budget, 6, b_in, b_out)  # 6 + 6 > 10: waits for a
    _until(lambda: budget.waiting == 1, "b never asked")
    assert not b_in.is_set() and budget.used == 6
    a_out.set()
    assert b_in.wait(HANG_S)
    c = _holder(budget, 1000, c_in, c_out)  # more than the budget: waits for all of it
    _until(lambda: budget.waiting == 1, "c never asked")
    assert not c_in.is_set()
    b_out.set()
    assert c_in.wait(HANG_S)
    assert budget.used == 10  # the whole budget, not 1000
    c_out.set()
    for t in (a, b, c):
        t.join(HANG_S)
    assert (budget.used, budget.peak, budget.holds, budget.waiting) == (0, 10, 3, 0)


def _jpeg(path: Path, side: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    pixels = np.repeat(rng.integers(0, 255, (side // 64, side // 64, 3), np.uint8), 64, 0)
    Image.fromarray(np.repeat(pixels, 64, 1)).save(path, "JPEG", quality=80)
    return path


def _folder(root: Path, files: int, side: int) -> Path:
    for i in range(files):
        folder = root / "train" / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        _jpeg(folder / f"img{i}.jpg", side, i)
    return root / "train"


def test_threads_of_a_decode_scan_share_the_budget(tmp_path, monkeypatch) -> None:
    """8 JPEGs of 256 x 256 on 4 threads with room for one decode at a time: every decode held
    its share, never more than the budget together, and the scan's result is whole (a bad file
    found among them, every good one kept)."""
    root = _folder(tmp_path, 8, 256)
    bad = root / "class0" / "img0.jpg"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2] + b"\xff\xd9")  # cut inside its image data
    one = decode_bytes(max(p.stat().st_size for p in root.rglob("*.jpg")), 256 * 256)
    budget = MemoryBudget(one + one // 2)
    monkeypatch.setattr(image_folder, "DECODE_BUDGET", budget)
    index = scan_image_folder(root, check="decode", on_corrupt="skip", workers=4)
    assert len(index) == 7 and [Path(p) for p, _ in index.skipped] == [bad]
    assert budget.holds == 8 and budget.used == 0
    assert one <= budget.peak <= budget.total
    with pytest.raises(CorruptImageError, match=r"img0\.jpg"):
        scan_image_folder(root, check="decode", on_corrupt="error", workers=4)
    assert budget.used == 0  # also after the error


def test_two_images_near_the_size_limit_are_decoded_one_at_a_time(tmp_path) -> None:
    """The real budget: two 6016 x 6016 JPEGs (36 megapixels; a decode may hold 580 MB, two
    more than DECODE_BUDGET_BYTES) on 2 threads are checked one after the other."""
    root = _folder(tmp_path, 2, 6016)
    assert 2 * decode_bytes(0, 6016 * 6016) > decode_check.DECODE_BUDGET_BYTES
    holds = DECODE_BUDGET.holds
    index = scan_image_folder(root, check="decode", workers=2)
    assert len(index) == 2
    assert DECODE_BUDGET.holds == holds + 2
    assert DECODE_BUDGET.peak <= DECODE_BUDGET.total == decode_check.DECODE_BUDGET_BYTES
