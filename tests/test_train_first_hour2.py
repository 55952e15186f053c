"""More of a new user's first hour with ``echopipe train``: a data folder with a link back to
its split, option values at the edge of what torch can take, and the log lines' rates around
the epoch ends."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from PIL import Image

from echopipe.cli import main
from echopipe.data import scan_image_folder
from echopipe.training.fill import FillReport
from echopipe.training.progress import Progress


def _jpeg(path: Path, shade: int) -> None:
    Image.new("RGB", (20, 16), (shade, 255 - shade, 90)).save(path, "JPEG")


def test_a_link_to_the_split_folder_inside_a_class_is_a_loop_not_more_images(
    tmp_path: Path,
) -> None:
    """``train/cat/all -> ..`` (or an absolute link to train/): followed, it filed every
    class's images under ``cat`` as well, with the wrong label, and repeated cat's own; only
    the link one level further down was reported. It is a loop and left out, at once."""
    root = tmp_path / "train"
    for c, name in enumerate(("ant", "cat")):
        (root / name).mkdir(parents=True)
        for i in range(3):
            _jpeg(root / name / f"{name}{i}.JPEG", 40 * c + i)
    (root / "cat" / "all").symlink_to("..")
    (root / "cat" / "again").symlink_to(root)
    index = scan_image_folder(root)
    assert index.counts_per_class() == [3, 3]
    names = sorted(str(Path(f).relative_to(root)) for f in index.files)
    assert names == [f"{n}/{n}{i}.JPEG" for n in ("ant", "cat") for i in range(3)]
    skipped = {str(Path(p).relative_to(root)): why for p, why in index.links_skipped}
    assert set(skipped) == {"cat/all", "cat/again"}
    assert all("loops" in why for why in skipped.values())


@pytest.mark.parametrize(
    ("args", "names"),
    [
        # A float32 step size: larger was a traceback from the first update's optimizer step.
        (["--lr", "1e300"], "--lr"),
        (["--wd", "1e300"], "--weight-decay"),
        # torch.distributed's int64-nanosecond deadlines: 1e10 failed, 1e11 hung the job.
        (["--dist-timeout-s", "1e11"], "--dist-timeout-s"),
        # Within its bound, but the cache's slots for it and the batch are not: a traceback
        # from the DALI pipeline's config after the run folder was made.
        (["--shuffle-buffer", "2147483647"], "--shuffle-buffer"),
        # Path("") is the current folder: a run would write its files there.
        (["--output", ""], "--output"),
        (["--data", ""], "--data"),
    ],
)
def test_values_torch_or_the_cache_cannot_take_are_one_line_and_exit_2(
    tmp_path: Path, args: list[str], names: str
) -> None:
    """Refused with one line naming the option, status 2, before anything is made; the data
    folder is real but has no train/, so a value let through ends as bad data (status 1)."""
    data = tmp_path / "data"
    data.mkdir()
    out, err = io.StringIO(), io.StringIO()
    argv = ["train", "--data", str(data), "--output", str(tmp_path / "run"), "--no-progress"]
    with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main([*argv, *args])
    lines = err.getvalue().strip().splitlines()
    assert exit_.value.code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("echopipe train: error: "), lines
    assert names in lines[0], lines
    assert not (tmp_path / "run").exists() and not (Path.cwd() / "config.json").exists()


def test_lines_on_the_refill_after_an_epoch_end_show_no_rate_and_the_drain_counts() -> None:
    """A pipeline two minibatches deep, 0.1 s of compute per step of 8 images (80 img/s). At the
    epoch end the drain waits for the last two computes (0.2 s, training); validation takes
    0.5 s (not training). The next epoch's first two steps only enqueue (no loss yet) and
    return at once. Every rate a line shows is 80 img/s: the refill lines once said 8e9 img/s,
    and with the drain left out the line after them said 240."""
    now = [0.0]
    lines: list[str] = []
    p = Progress(True, False, 1, 2, lines.append, None, warmup_steps=0, clock=lambda: now[0])
    p.start_epoch(0, 3, 0)
    for k in range(1, 4):
        now[0] += 0.1
        p.step(k, 1.0, 1.0, delivered=8 * k, fresh=8.0 * k)
    now[0] += 0.2  # the drain
    p.drained()
    now[0] += 0.5  # validation and the checkpoint
    p.start_epoch(1, 3, 0)
    for k in range(1, 4):
        now[0] += 0.1 if k == 3 else 0.0  # steps 4 and 5 enqueue; 6 waits for 4's compute
        p.step(3 + k, 1.0 if k == 3 else None, 1.0, delivered=8 * k, fresh=8.0 * k)
    rates = {
        int(m.group(1)): float(m.group(2))
        for m in (re.match(r"step (\d+): .*img/s ([0-9.e+]+)", line) for line in lines)
        if m
    }
    assert sorted(rates) == [1, 2, 3, 6], lines
    assert all(r == pytest.approx(80.0, rel=0.01) for r in rates.values()), lines


def test_a_slow_fill_before_step_1_is_said_after_a_quiet_spell_then_every_so_often() -> None:
    """With a slow reader the first step waited up to 30 s for the echo cache's fill with
    nothing said. A wait says what it waits for once it has lasted ``quiet_s`` (2 s), then
    about every ``every_s`` (10 s), with the pace and the time left; a fill done sooner, or
    reached, says nothing."""
    now = [100.0]
    lines: list[str] = []
    report = FillReport(lines.append, quiet_s=2.0, every_s=10.0, clock=lambda: now[0])
    what = "filling the echo cache (--shuffle-buffer 32)"
    for t, read in ((0.0, 0), (1.9, 0), (2.0, 0), (6.0, 8), (11.9, 8), (12.0, 16), (16.0, 32)):
        now[0] = 100.0 + t
        report(read, 32, what)
    assert lines == [
        "input: before step 1, filling the echo cache (--shuffle-buffer 32): 0 of 32 samples "
        "read so far",
        "input: before step 1, filling the echo cache (--shuffle-buffer 32): 16 of 32 samples "
        "read so far (1.3/s, about 0:12 left)",
    ]
    quick: list[str] = []
    done = FillReport(quick.append, clock=lambda: now[0])
    now[0] += 5.0
    done(32, 32, what)
    assert quick == []


@pytest.mark.dali
def test_the_wait_for_the_echo_cache_before_step_1_says_so_and_ends_filled(
    tiny_imagenet: Path,
) -> None:
    """A reader slowed to 50 ms a sample (``--read-delay-ms``): the wait before the first step
    says what it waits for, through the run's ``say``, and ends once the cache holds the shuffle
    buffer (the first draw's own condition), so the first batch is drawn at once."""
    from echopipe.dali import ReaderSpec, imagenet_train_pipeline
    from echopipe.training.fill import wait_for_fill

    pipe = imagenet_train_pipeline(
        tiny_imagenet, batch_size=4, reader=ReaderSpec(read_delay_ms=50.0, num_threads=1)
    )
    lines: list[str] = []
    try:
        # Said at its first look (quiet_s=0), once (every_s): a fill of 16 samples at 50 ms each
        # takes at least 0.8 s, so it is not done when the wait starts.
        wait_for_fill(pipe, FillReport(lines.append, quiet_s=0.0, every_s=1e9))
        stats = pipe.cache.stats()
        assert stats.resident_with_tickets >= 16, stats
        assert len(lines) == 1, lines
        assert re.fullmatch(
            r"input: before step 1, filling the echo cache \(--shuffle-buffer 16\): \d+ of 16 "
            r"samples read so far( \(.*/s, about \d+:\d\d left\))?",
            lines[0],
        ), lines
        outputs, _ = pipe.next_batch()
        assert len(outputs[0]) == 4
    finally:
        pipe.close()


@pytest.mark.dali
def test_a_run_with_a_slow_reader_says_what_step_1_waits_for(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """``--read-delay-ms 200`` with the shuffle buffer of 32 samples: step 1 waits at least
    6.4 s for the fill, and the run said nothing between its start line and the first step.
    A line says what it waits for (the first after 2 s, inside the fill)."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["train", "--data", str(tiny_imagenet), "--output", str(tmp_path / "run"),
            "--model", "lenet5", "--image-size", "32", "-b", "8", "--stages", "1", "--echo",
            "1", "--epochs", "1", "--max-steps", "1", "--read-delay-ms", "200"]  # fmt: skip
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0
    lines = err.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("train: lenet5"))
    said = [line for line in lines[start + 1 :] if line.startswith("input: before step 1")]
    assert said and said[0].startswith(
        "input: before step 1, filling the echo cache (--shuffle-buffer 32): "
    ), lines
    assert all(re.search(r": \d+ of 32 samples read so far", line) for line in said), said
