"""What a new user sees in the first hour: the lines ``echopipe train`` prints, its run folders,
its per-step log, and what Ctrl-C or SIGTERM during start-up says."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from echopipe.cli import bench_results_dir, build_parser, main
from echopipe.training.progress import Progress

TINY = ["--image-size", "32", "-b", "8", "--warmup-epochs", "0", "--no-progress"]


@pytest.mark.dali
def test_first_hour_lines_folder_and_step_log(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Without --output a run gets its own dated folder; the start says what it times and how
    long an epoch is; log lines show rates only after the warm-up; the epoch line has train
    and val loss, top-1, top-5, LR, epoch time, rates and ETA; steps.csv has every step."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--data", str(tiny_imagenet), *TINY, "--epochs", "2", "--echo", "1",
            "--log-interval", "2"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    (run,) = (tmp_path / "echopipe-train").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}-resnet_small", run.name), run.name
    assert "stages: timing the model's blocks, then one stage against two," in err
    assert "an epoch is 4 steps of 8 at e = 1; run folder echopipe-train/" in err
    lines = err.splitlines()
    # Rates come after the warm-up (5 steps), and not on a line whose epoch has no loss yet:
    # its steps only refilled the pipeline the epoch end drained (once thousands of img/s).
    for line in (line for line in lines if line.startswith("step ")):
        shown = re.search(r"img/s [0-9.e+]+, fresh/s [0-9.e+]+", line) is not None
        assert shown == (int(line.split(":")[0][5:]) > 5 and "loss" in line), line
    epoch1 = next(line for line in lines if line.startswith("epoch 1/2"))
    assert re.fullmatch(
        r"epoch 1/2: train loss [0-9.]+, val loss [0-9.]+, top-1 [0-9.]+ %, top-5 [0-9.]+ %, "
        r"lr [0-9.e-]+, \d+:\d\d \(\d+ img/s, \d+ fresh\), e=1; ETA \d+:\d\d",
        epoch1,
    ), epoch1
    assert re.search(r"epoch 2/2: .*; done$", err, re.MULTILINE)
    assert f"run folder          echopipe-train/{run.name}" in out
    with open(run / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert set(rows[0]) == {"step", "epoch", "train_loss", "lr", "echo_factor", "wall_s"}
    assert float(rows[-1]["epoch"]) == pytest.approx(2.0)
    doc = json.loads((run / "metrics.json").read_text())
    assert all(0 <= r["val_top1"] <= r["val_top5"] <= 1 for r in doc["epochs"])
    # A step's lr is the rate its update used: step 5's is the rate after epoch 1's 4 updates.
    assert float(rows[4]["lr"]) == pytest.approx(doc["epochs"][0]["lr"], rel=1e-4)
    # Run files get the mode a plain write gives (0666 less the umask), not mkstemp's 0600.
    mask = os.umask(0o022)
    os.umask(mask)
    for f in ("config.json", "metrics.json", "metrics.csv", "steps.csv", "checkpoints/last.pt"):
        assert os.stat(run / f).st_mode & 0o777 == 0o666 & ~mask, f
    config = json.loads((run / "config.json").read_text())
    assert config["options"]["output"] is None and config["restarts"] == []
    # A second run the same way gets a folder of its own: nothing is refused or overwritten.
    assert main([*argv, "--max-steps", "1"]) == 0
    runs = sorted((tmp_path / "echopipe-train").iterdir())
    assert len(runs) == 2
    capsys.readouterr()
    # A bare --resume continues the newest run (the stopped one) with its own options.
    assert main(["train", "--data", str(tiny_imagenet), "--no-progress", "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"resume: the newest run, echopipe-train/{runs[-1].name}" in err
    with open(runs[-1] / "steps.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, 9))


@pytest.mark.dali
def test_fp16_on_the_cpu_is_warned_about_with_the_bf16_alternative(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--data", str(tiny_imagenet), *TINY, "--amp", "fp16", "--stages", "1",
            "--max-steps", "1", "--output", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: --amp fp16 on the CPU is about 60x slower than --amp bf16" in err


def test_rates_leave_out_the_warm_up_steps() -> None:
    """Given timings: 3 warm-up steps that only fill the pipeline (no time), then 0.1 s per
    step of 8 images: the line after them says 80 img/s, not thousands."""
    now = [0.0]
    lines: list[str] = []
    p = Progress(True, False, 5, 1, lines.append, None, warmup_steps=3, clock=lambda: now[0])
    p.start_epoch(0, 10, 0)
    for k in range(1, 11):
        if k > 3:
            now[0] += 0.1
        p.step(k, 1.0, 1.0, delivered=8 * k, fresh=8.0 * k)
    first, second = lines
    assert "img/s 80," in first and "fresh/s 80" in first
    assert "img/s 80," in second


def test_messages_go_above_a_live_bar(capsys: pytest.CaptureFixture[str]) -> None:
    """A message while a tqdm bar is drawn: the bar is cleared, the message gets its own line,
    and the bar is drawn again (not 'epoch 1/2: 40%|...|echo: factor 4')."""
    from tqdm import tqdm

    p = Progress(True, False, 50, 2, lambda m: None, None)
    p.bar = tqdm(total=10, desc="epoch 1/2", file=sys.stderr)
    p.bar.update(4)
    p.write("echo: factor 4", lambda m: print(m, file=sys.stderr))
    p.bar.close()
    err = capsys.readouterr().err
    assert "\recho: factor 4\n" in err
    assert "|echo: factor 4" not in err and err.rindex("epoch 1/2") > err.index("echo: factor 4")


@pytest.mark.dali
def test_each_line_of_steps_csv_has_its_own_steps_loss_also_when_pipelined(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Two stages: a step's loss is known only steps later (at the latest at the drain), and
    its line waits for it. Every line has a loss, and each epoch's lines average to the
    epoch's train loss in metrics.json (the same minibatches)."""
    run = tmp_path / "run"
    argv = ["train", "--data", str(tiny_imagenet), *TINY, "--epochs", "2", "--echo", "2",
            "--stages", "2", "--checkpoint-every", "3", "--output", str(run)]  # fmt: skip
    assert main(argv) == 0
    with open(run / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 17))  # 32 images, e = 2, batch 8
    assert all(r["train_loss"] for r in rows), rows
    epochs = json.loads((run / "metrics.json").read_text())["epochs"]
    assert [e["step"] for e in epochs] == [8, 16]
    for k, epoch in enumerate(epochs):
        mine = [float(r["train_loss"]) for r in rows[8 * k : 8 * (k + 1)]]
        assert sum(mine) / 8 == pytest.approx(epoch["train_loss"], rel=1e-5)


@pytest.mark.dali
def test_sigterm_during_start_up_is_one_line_and_leaves_nothing(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """SIGTERM (as Ctrl-C) sent when the run says it is timing the stages: one line, status
    143, no traceback, and the run folder it had made is gone again."""
    import echopipe

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(echopipe.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "echopipe.cli", "train", "--data", str(tiny_imagenet), *TINY,
           "--output", str(run)]  # fmt: skip
    with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                          text=True) as proc:  # fmt: skip
        try:
            assert proc.stderr is not None
            seen = []
            for line in proc.stderr:
                seen.append(line)
                if line.startswith("stages: timing"):
                    proc.send_signal(signal.SIGTERM)
                    break
            rest = proc.stderr.read()
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 143, "".join(seen) + rest
    assert "Traceback" not in rest
    assert rest.strip().splitlines() == [
        f"echopipe train: interrupted during start-up; nothing to resume: the run folder {run} "
        "was removed again"
    ]
    assert not run.exists()


@pytest.mark.dali
def test_sigterm_while_the_summary_is_written_names_the_step_and_the_resume(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """A real SIGTERM arriving after the last epoch, while the summary is written: the run's
    interrupt line (its step and the --resume command), status 143, not the start-up line."""
    import echopipe

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(echopipe.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    run = tmp_path / "run"
    argv = ["train", "--data", str(tiny_imagenet), *TINY, "--epochs", "1", "--echo", "1",
            "--stages", "1", "--output", str(run)]  # fmt: skip
    program = (
        "import os, signal, sys\n"
        "import echopipe.training.trainer as trainer\n"
        "real = trainer.summarize\n"
        "def summarize(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "trainer.summarize = summarize\n"
        "from echopipe.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 143, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"echopipe train: interrupted at step 4; --resume --output {re.escape(str(run))} "
        r"continues from .*last\.pt \(step 4, end of epoch 1\)",
        last,
    ), last
    assert "Traceback" not in proc.stderr


def test_bench_writes_a_new_folder_unless_told_to_update_the_committed_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from echopipe.cli import bench_dir

    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    fresh = bench_results_dir(parser.parse_args(["bench"]))
    assert fresh.parent == Path("bench-results") and re.fullmatch(r"\d{8}-\d{6}", fresh.name)
    fresh.mkdir(parents=True)
    assert bench_results_dir(parser.parse_args(["bench"])) != fresh  # never an existing one
    # An installed echopipe finds the suites through the checkout it is run in.
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    checkout = bench_dir()
    assert checkout is not None
    updated = bench_results_dir(parser.parse_args(["bench", "--update-results"]))
    assert updated == checkout / "results"
    given = bench_results_dir(parser.parse_args(["bench", "--results-dir", "x"]))
    assert given == Path("x")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--update-results", "--results-dir", "x"])


def test_a_damaged_steps_csv_and_a_fifo_config_do_not_stop_a_run(tmp_path: Path) -> None:
    """Resuming keeps the lines of steps.csv up to its step: lines that are not UTF-8 or do
    not start with a step number are dropped, not a traceback. A FIFO named config.json is
    not an echopipe run's, and reading it does not wait for a writer."""
    from echopipe.training.progress import StepLog
    from echopipe.training.runfolder import read_run_config

    path = tmp_path / "steps.csv"
    header = ",".join(StepLog.FIELDS) + "\n"
    damaged = b"\xff\xfe,garbage\n" + "\u00b2,x\n".encode()
    lines = b"1,0.1,2.3,0.1,2,0.5\n" + damaged + b"2,0.2,2.1,0.1,2,0.9\n3,0.3,2,0.1,2,1.2\n"
    path.write_bytes(header.encode() + lines)
    log = StepLog(path, resumed_step=2)
    log.close()
    assert path.read_text().splitlines()[1:] == ["1,0.1,2.3,0.1,2,0.5", "2,0.2,2.1,0.1,2,0.9"]
    folder = tmp_path / "run"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    assert read_run_config(folder) is None


@pytest.mark.parametrize(("name", "status"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stop_during_interpreter_exit_after_the_run_ends_at_once(
    tiny_imagenet: Path, tmp_path: Path, name: str, status: int
) -> None:
    """A real Ctrl-C or SIGTERM after the command finished, while the interpreter's exit hooks
    run (sent from one): the process ends at once with 130 or 143, without the traceback of an
    interrupted exit hook (status 0) or death by the signal."""
    import echopipe

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(echopipe.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    argv = ["echopipe", "train", "--data", str(tiny_imagenet), *TINY, "--epochs", "1",
            "--echo", "1", "--stages", "1", "--output", str(tmp_path / "run")]  # fmt: skip
    program = (
        "import atexit, os, signal, sys\n"
        f"sys.argv = {argv!r}\n"
        "from echopipe.cli import main\n"
        f"atexit.register(lambda: os.kill(os.getpid(), signal.{name}))\n"
        "sys.exit(main())\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == status, proc.stderr[-2000:]
    assert "echopipe train: summary" in proc.stdout
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_a_planted_steps_csv_is_read_bounded_and_never_written_through(tmp_path: Path) -> None:
    """On a resume steps.csv is read only as far as the lines up to its step can reach, and only
    from a regular file: a sparse 3 GiB file or a FIFO under the name is warned about and
    replaced by a new log (a FIFO is not waited on); a link under the name is replaced, never
    followed, on a resume or a new start."""
    import threading

    from echopipe.training.progress import StepLog

    header = ",".join(StepLog.FIELDS) + "\n"
    path = tmp_path / "steps.csv"

    def open_log(resumed_step: int | None) -> list[str]:
        said: list[str] = []
        opened = threading.Thread(
            target=lambda: StepLog(path, resumed_step, said.append).close(), daemon=True
        )
        opened.start()
        opened.join(timeout=30)
        assert not opened.is_alive(), "StepLog waits on steps.csv"
        return said

    # Lines past what steps 1..2 can take are not read: the "2," after a long damaged run is
    # dropped with it.
    path.write_bytes(
        header.encode() + b"1,0.1,2.3,0.1,2,0.5\n" + b"x" * 5000 + b"\n2,0.2,2,0.1,2,1\n"
    )
    assert open_log(2) == []
    assert path.read_text() == header + "1,0.1,2.3,0.1,2,0.5\n"
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(3 << 30)
    (said,) = open_log(2)
    assert "sparse file" in said and "from step 3" in said and path.read_text() == header
    path.unlink()
    os.mkfifo(path)
    (said,) = open_log(2)
    assert "not a regular file" in said and path.read_text() == header
    path.unlink()
    outside = tmp_path / "outside.csv"
    path.symlink_to(outside)  # dangling: following it would create the file outside
    (said,) = open_log(2)
    assert "symbolic link" in said and not outside.exists() and not path.is_symlink()
    outside.write_text("someone else's file\n")
    path.unlink()
    path.symlink_to(outside)
    assert open_log(None) == []  # a new run's log replaces the link silently
    assert outside.read_text() == "someone else's file\n" and path.read_text() == header


@pytest.mark.dali
def test_a_resumed_run_replaces_a_steps_csv_link_rather_than_fill_its_target(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dangling link named steps.csv in a run folder: `echopipe train --resume` says so and
    writes its log in the run folder, and creates nothing where the link points."""
    run = tmp_path / "run"
    argv = ["train", "--data", str(tiny_imagenet), *TINY, "--epochs", "1", "--echo", "1",
            "--output", str(run)]  # fmt: skip
    assert main(argv) == 0
    outside = tmp_path / "outside.csv"
    (run / "steps.csv").unlink()
    (run / "steps.csv").symlink_to(outside)
    capsys.readouterr()
    argv[argv.index("--epochs") + 1] = "2"
    assert main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "steps.csv' is a symbolic link" in err, err
    assert not outside.exists() and not (run / "steps.csv").is_symlink()
    lines = (run / "steps.csv").read_text().splitlines()
    assert [int(line.split(",")[0]) for line in lines[1:]] == [5, 6, 7, 8]
