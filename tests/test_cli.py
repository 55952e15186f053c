"""The ``echopipe`` command line: help, bad arguments (one line, exit 2), a run, ``bench``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from echopipe.cli import BENCH_DEFAULT, BENCH_STUDIES, BENCH_SUITES, build_parser, main


def _bad(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("echopipe train: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--data", "/no/such/folder"], "/no/such/folder"),
        (["--echo", "0.5"], "'0.5'"),
        (["--echo", "often"], "'often'"),
        (["--devices", "tpu:0"], "tpu:0"),
        (["--devices", "cuda:7"], "cuda:7"),
        (["--balance", "3,x"], "3,x"),
        (["--balance", "4,4", "--stages", "3"], "[4, 4]"),
        (["--epochs", "0"], "--epochs"),
        (["--batch-size", "-2"], "-2"),
        (["--lr", "0"], "--lr"),
        (["--echo-insert", "before_read"], "before_read"),
        (["--model", "vgg"], "'vgg'"),
        (["--read-delay-ms", "-1"], "--read-delay-ms"),
        (["--dist-timeout-s", "0"], "--dist-timeout-s must be > 0, got 0"),
        (["--decode", "mixed", "--devices", "cpu"], "--devices cpu has none"),
        (["--decode", "gpu"], "'gpu'"),
    ],
)
def test_bad_train_arguments_give_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _bad(["train", *argv], capsys)
    assert needle in line


def test_data_folder_without_train_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _bad(["train", "--data", str(tmp_path)], capsys)
    assert str(tmp_path) in line and "train/" in line


def test_resume_file_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _bad(["train", "--resume", str(tmp_path / "gone.pt")], capsys)
    assert "gone.pt" in line


def test_output_folder_of_an_earlier_run_is_refused_and_kept(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "run" / "checkpoints"
    ck.mkdir(parents=True)
    earlier = ck / "ckpt-000000008.pt"
    earlier.write_bytes(b"an earlier run's checkpoint")
    line = _bad(["train", "--data", str(tiny_imagenet), "--output",
                 str(tmp_path / "run" / "metrics.json")], capsys)  # fmt: skip
    assert "earlier run" in line and "--resume" in line and str(tmp_path / "run") in line
    assert earlier.read_bytes() == b"an earlier run's checkpoint"


def test_bare_resume_refuses_a_planted_pickle_without_running_it(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self) -> tuple[object, tuple[str, str]]:
            return (open, (str(marker), "w"))

    ck = tmp_path / "run" / "checkpoints"
    ck.mkdir(parents=True)
    torch.save({"kind": "echopipe-train", "x": RunsCode()}, ck / "ckpt-000000099.pt")
    line = _bad(["train", "--data", str(tiny_imagenet), "--resume", "--output",
                 str(tmp_path / "run" / "metrics.json")], capsys)  # fmt: skip
    assert "ckpt-000000099.pt" in line and "not an echopipe checkpoint" in line
    assert not marker.exists()


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--data", "--epochs", "--batch-size", "--lr", "--workers", "--seed", "--echo",
                 "--echo-insert", "--echo-mode", "--read-delay-ms", "--stages", "--balance",
                 "--hybrid-switch", "--devices", "--amp", "--checkpoint-dir", "--resume",
                 "--checkpoint-every", "--output"):  # fmt: skip
        assert flag in out
    parser = build_parser()
    assert parser.parse_args(["train"]).echo == 2.0
    assert parser.parse_args(["train", "--echo", "auto"]).echo == "auto"
    assert parser.parse_args(["train", "--balance", "3,5"]).balance == [3, 5]


def test_cli_train_runs_with_amp_and_hybrid(tiny_imagenet: Path, tmp_path: Path) -> None:
    """The console entry point as a user runs it, with bfloat16 autocast, a hybrid switch,
    explicit devices and balance, batch echoing after augmentation."""
    out = tmp_path / "metrics.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    import echopipe

    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(echopipe.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, "-m", "echopipe.cli", "train", "--data", str(tiny_imagenet),
         "--batch-size", "8", "--image-size", "32", "--epochs", "2", "--amp",
         "--hybrid-switch", "1", "--devices", "cpu,cpu", "--balance", "4,4",
         "--echo-insert", "after_augment", "--echo-mode", "batch", "--output", str(out)],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "echopipe train: summary" in done.stdout
    assert "staleness per stage [2, 0]" in done.stdout
    assert "epochs" in done.stderr  # tqdm bars go to stderr
    doc = json.loads(out.read_text())
    assert [r["pipelined"] for r in doc["epochs"]] == [True, False]
    assert doc["summary"]["balance"] == [4, 4]
    assert doc["config"]["amp"] is True
    assert (tmp_path / "metrics_acc_vs_fresh.png").is_file()
    assert (tmp_path / "metrics_acc_vs_time.png").is_file()


def test_bench_unknown_suite_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--only", "nosuch"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nosuch" in err[0]
    assert err[0].startswith("echopipe bench: error: ")


def test_bench_suite_sets() -> None:
    assert BENCH_DEFAULT == ("echo_cache", "dali_echo", "pipeline")
    assert BENCH_SUITES == BENCH_DEFAULT + BENCH_STUDIES
    assert set(BENCH_STUDIES) == {"convergence", "wallclock", "staleness"}
    parser = build_parser()
    assert parser.parse_args(["bench"]).only is None
    args = parser.parse_args(["bench", "--only", "staleness", "pipeline"])
    assert args.only == ["staleness", "pipeline"]


def test_bench_all_and_only_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--all", "--only", "pipeline"])
    assert info.value.code == 2
    assert "--all" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_quick_pipeline_writes_the_convention(tmp_path: Path) -> None:
    """``echopipe bench --quick --only pipeline`` as a user runs it: the suite's table, the
    summary, and a JSON with every field of the convention (bench/benchutil.py)."""
    results = tmp_path / "results"
    env = dict(os.environ)
    import echopipe

    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(echopipe.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, "-m", "echopipe.cli", "bench", "--quick", "--only", "pipeline",
         "--results-dir", str(results)],
        env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| stale pipeline K=2 (threads)" in done.stdout
    summary = done.stdout[done.stdout.index("=== echopipe bench: suites ===") :]
    assert re.search(r"^pipeline\s+ok\s+[0-9.]+$", summary, re.MULTILINE), summary
    doc = json.loads((results / "pipeline.json").read_text())
    assert doc["benchmark"] == "pipeline" and doc["quick"] is True
    machine = doc["machine"]
    for key in ("platform", "cpu_count", "torch", "dali", "echopipe", "python"):
        assert machine[key], key
    for key in ("load_average_1_5_15_start", "load_average_1_5_15_end"):
        assert len(machine[key]) == 3 and all(v >= 0 for v in machine[key])
    assert doc["command"]["argv"] == ["--quick", "--results-dir", str(results)]
    assert doc["command"]["reproduce"].startswith("python bench/pipeline.py --quick")
    rows = {r["name"]: r for r in doc["figures"]["rows"]}
    peers = ("GPipe", "1F1B")
    for name in ["sequential, 1 thread", "stale pipeline K=2 (threads)"] + [
        f"torch pipelining {peer} K=2 (4 mb)" for peer in peers
    ]:
        assert rows[name]["samples_per_s"] > 0, rows[name]
    assert rows["sequential, 1 thread"]["x_1thread"] == 1.0
    assert doc["ratios"]["K2_over_1thread"] == pytest.approx(
        rows["stale pipeline K=2 (threads)"]["samples_per_s"]
        / rows["sequential, 1 thread"]["samples_per_s"],
        abs=2e-3,
    )
    assert (
        0
        < doc["ratios"]["K2_fraction_of_ideal_2x"]
        == pytest.approx(doc["ratios"]["K2_over_1thread"] / 2, abs=2e-3)
    )
    assert len(doc["claims"]) == 3
    for c in doc["claims"]:
        assert set(c) == {"claim", "aim", "measured", "met", "reason"}
        assert isinstance(c["met"], bool) and c["reason"]
    assert doc["wall_s"] > 0
