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


def _bad(argv: list[str], capsys: pytest.CaptureFixture[str], status: int = 2) -> str:
    """The one line of a bad argument (exit status 2), from the parser or the run; a malformed
    file is status 1."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    assert code == status
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(("echopipe train: error: ", "echopipe export: error: "))
    return lines[0]


def _jpeg(path: Path, size: tuple[int, int] = (40, 30), seed: int = 0) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _dataset(root: Path, classes: tuple[str, ...] = ("ant", "cat"), per_class: int = 4) -> Path:
    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(per_class if split == "train" else 2):
                _jpeg(root / split / c / f"{i}.JPEG", seed=i)
    return root


def _only_non_images(root: Path) -> None:
    _dataset(root)
    for f in (root / "train").rglob("*.JPEG"):
        f.unlink()
        f.with_suffix(".txt").write_text("not an image")


def _empty_jpeg(root: Path) -> None:
    _dataset(root)
    (root / "train" / "ant" / "empty.JPEG").write_bytes(b"")


def _truncated_jpeg(root: Path) -> None:
    _dataset(root)
    whole = (root / "train" / "ant" / "0.JPEG").read_bytes()
    (root / "train" / "ant" / "cut.JPEG").write_bytes(whole[: len(whole) // 2])


def _truncated_val_jpeg(root: Path) -> None:
    _dataset(root)
    whole = (root / "val" / "cat" / "0.JPEG").read_bytes()
    (root / "val" / "cat" / "cut.JPEG").write_bytes(whole[: len(whole) // 2])


def _claiming(jpeg: bytes, width: int, height: int) -> bytes:
    """``jpeg`` with a frame header (SOF0) that claims ``width`` x ``height``: a few KB that
    a decoder would expand to width x height x 3 bytes."""
    data = bytearray(jpeg)
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def _val_bomb(root: Path) -> None:
    _dataset(root)
    whole = (root / "val" / "cat" / "0.JPEG").read_bytes()
    (root / "val" / "cat" / "bomb.JPEG").write_bytes(_claiming(whole, 14000, 14000))


def _frameless_jpeg(root: Path) -> None:
    _dataset(root)
    (root / "train" / "ant" / "frameless.JPEG").write_bytes(b"\xff\xd8\xff\xd9")


def _non_utf8_name(root: Path) -> None:
    _dataset(root)
    name = os.fsencode(root / "train" / "cat") + b"/\xff\xfe.JPEG"
    Path(os.fsdecode(name)).write_bytes((root / "train" / "cat" / "0.JPEG").read_bytes())


def _non_utf8_class(root: Path) -> None:
    _dataset(root)
    for split in ("train", "val"):
        folder = os.fsdecode(os.fsencode(root / split) + b"/c\xff")
        _jpeg(Path(folder) / "0.JPEG")


def _no_classes(root: Path) -> None:
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()


def _one_class(root: Path) -> None:
    _dataset(root, classes=("ant",))


def _too_big_for_the_cache(root: Path) -> None:
    _dataset(root, per_class=8)
    _jpeg(root / "train" / "ant" / "huge.JPEG", size=(1000, 1000))


def _fewer_than_a_draw_fit_the_cache(root: Path) -> None:
    _dataset(root, per_class=0)
    for i in range(16):
        _jpeg(root / "train" / ("ant", "cat")[i % 2] / f"big{i}.JPEG", size=(300, 300), seed=i)


BAD_DATA = {
    "only non-images": (_only_non_images, [], 1, "has no images"),
    "empty JPEG": (_empty_jpeg, [], 1, "empty.JPEG"),
    "truncated JPEG": (_truncated_jpeg, [], 1, "cut.JPEG"),
    "truncated val JPEG": (_truncated_val_jpeg, [], 1, "val/cat/cut.JPEG"),
    "no classes": (_no_classes, [], 1, "no class sub-folders"),
    "val JPEG claiming 14000 x 14000": (_val_bomb, [], 1, "bomb.JPEG': its header claims 14000"),
    "JPEG without a frame": (_frameless_jpeg, [], 1, "frameless.JPEG': JPEG ends (EOI) before"),
    "non-UTF-8 file name": (_non_utf8_name, [], 1, "\\udcff\\udcfe.JPEG': its name is not UTF-8"),
    "non-UTF-8 class folder": (_non_utf8_class, [], 1, "train/c\\udcff' has a name that is not"),
    "one class": (_one_class, [], 1, "1 class folder"),
    "image larger than the cache": (
        _too_big_for_the_cache,
        ["--cache-mb", "1", "--echo", "2"],
        1,
        # The file is named (found from the image headers), and the flag that fixes it.
        "huge.JPEG, 1000x1000) needs 2.9 MiB, more than the echo cache holds (--cache-mb 1)",
    ),
    "deterministic draw larger than the cache": (
        _fewer_than_a_draw_fit_the_cache,
        ["--cache-mb", "1", "--echo", "2", "--deterministic"],
        1,
        "--deterministic: the echo cache (--cache-mb 1) holds only 3 decoded training images, "
        "but the first draw waits for 16",
    ),
    "echo cache larger than the machine": (
        _dataset,
        ["--cache-mb", str(1 << 42), "--echo", "2"],  # 4 EiB: more than any address space
        1,
        f"the echo cache does not fit in memory (--cache-mb {1 << 42}): give a smaller --cache-mb",
    ),
    # Refused before the data folder is scanned (or the synthetic set built: minutes on a first
    # run), so the cut JPEG, which the scan would name, is never reached.
    "echo cache larger than the machine, before the data": (
        _truncated_jpeg,
        ["--cache-mb", str(1 << 42), "--echo", "2"],
        1,
        f"the echo cache does not fit in memory (--cache-mb {1 << 42}): give a smaller --cache-mb",
    ),
}

BAD_ARGUMENTS = [
    (["--data", "/no/such/folder"], "/no/such/folder"),
    (["--echo", "0.5"], "--echo must be a finite number in [1, 65535] or 'auto', got 0.5"),
    (["--echo", "often"], "'often'"),
    (["--echo", "1e9"], "--echo must be a finite number in [1, 65535] or 'auto'"),
    (["--echo", "65536"], "got 65536.0"),
    (["--echo-max", "0.5"], "--echo-max must be a finite number in [1, 65535], got 0.5"),
    (["--cache-mb", "0"], "--cache-mb 0 (MiB), as cache_bytes, must be an integer in [64, "),
    (["--cache-mb", "1e3"], "'1e3' is not an integer"),
    (["--image-size", "100000"], "--image-size must be <= 1024"),
    (["--shuffle-buffer", "1e8"], "'1e8' is not an integer"),
    (["--shuffle-buffer", "-1"], "--shuffle-buffer must be an integer in [0, 2147483647], got -1"),
    (["--shuffle-buffer", "4294967296"], "--shuffle-buffer must be an integer in [0, 2147483647]"),
    # Within its own bound, but the default cache has twice the slots it needs: the line says
    # the largest buffer that fits, not a bound the value is already under.
    (["--shuffle-buffer", "1073741792"], "give a shuffle_buffer of at most 1073741791"),
    (["--echo-mode", "epoch"], "'epoch'"),
    (["--devices", "tpu:0"], "tpu:0"),
    (["--devices", "cuda:7"], "cuda:7"),
    (["--balance", "3,x"], "3,x"),
    (["--balance", "2,2"], "covers 4 blocks; resnet_small has 8"),
    (["--balance", "4,4", "--stages", "3"], "[4, 4]"),
    (["--stages", "20"], "--stages 20: resnet_small has only 8 blocks"),
    (["--epochs", "0"], "--epochs"),
    (["--batch-size", "-2"], "-2"),
    (["--lr", "0"], "--lr"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--echo-insert", "before_read"], "before_read"),
    (["--model", "vgg"], "'vgg'"),
    (["--read-delay-ms", "-1"], "--read-delay-ms"),
    (["--dist-timeout-s", "0"], "--dist-timeout-s must be > 0, got 0"),
    (["--decode", "mixed", "--devices", "cpu"], "--devices cpu has none"),
    (["--decode", "gpu"], "'gpu'"),
    (["--on-corrupt", "ignore"], "'ignore'"),
    (["--output", "/etc/hostname"], "--output '/etc/hostname' is a file"),
    (["--resume", "/no/such.pt"], "/no/such.pt"),
    (["--output", "/proc/echopipe-run"], "--output '/proc/echopipe-run': cannot create"),
    (["--output", "/etc/hostname/run"], "--output '/etc/hostname/run': cannot create"),
    (["--read-delay-ms", "1e9"], "--read-delay-ms must be <= 10000, got 1e+09"),
    (["--momentum", "2"], "--momentum must be <= 0.999, got 2"),
    (["--seed", "4294967296"], "--seed must be <= 4294967295, got 4294967296"),
    (["--seed", "99999999999999999999999"], "--seed must be <= 4294967295"),
    (["--model", "lenet5"], "--image-size 64 does not fit --model lenet5, which takes 32 to 35"),
    (["--epochs", "100000000000"], "--epochs must be <= 100000"),
    (["--warmup-epochs", "1e9"], "--warmup-epochs 1e+09 is longer than the run (--epochs 8)"),
    (["--hybrid-switch", "100"], "--hybrid-switch 100 is after the last epoch (--epochs 8)"),
    (["--evaluate", "/no/such.pt"], "--evaluate '/no/such.pt' does not exist"),
    (["--evaluate", "/tmp"], "--evaluate '/tmp' is not a file"),
    (["--hybrid-switch", "-1"], "--hybrid-switch"),
    (["--hybrid-switch", "soon"], "'soon'"),
]


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit status and the one error line; the error is the last line and no traceback."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("echopipe train: error: "), err
    assert not any(line.startswith("echopipe train: error") for line in lines[:-1]), err
    return int(code), lines[-1]


@pytest.mark.parametrize(("argv", "needle"), BAD_ARGUMENTS)
def test_bad_train_arguments_give_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _bad(["train", *argv], capsys)
    assert needle in line


def test_an_echo_max_over_the_cores_bound_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--echo-max 1e9`` is refused by EchoConfig's bound (the native core's largest factor)
    in one line with status 2: no data is read or made, no run folder is created."""
    from echopipe.echo.config import MAX_ECHO_FACTOR

    data = tmp_path / "data"
    (data / "train" / "ant").mkdir(parents=True)  # no val/: reading it would fail (status 1)
    run = tmp_path / "run"
    argv = ["train", "--data", str(data), "--output", str(run), "--echo-max", "1e9"]
    line = _bad(argv, capsys)
    assert f"--echo-max must be a finite number in [1, {MAX_ECHO_FACTOR:g}], got 1000000000.0" in (
        line
    )
    assert not run.exists()
    # The largest factor the core takes is taken: the same command then fails on the data.
    argv[-1] = f"{MAX_ECHO_FACTOR:g}"
    code, line = _fails(argv, capsys)
    assert code == 1 and f"--data {str(data)!r} has no val/ folder" in line, line


@pytest.mark.parametrize("option", ["--epoch", "--checkpoint", "--warmup"])
def test_an_option_is_never_taken_for_a_longer_one(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A prefix of --epochs, --checkpoint-every, --warmup-epochs: read as that option, a typo or an
    # option of another version would change the run without a word.
    try:
        code = main(["train", option, "1"])
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unrecognized arguments" in line and option in line


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["train", "--epoch", "1"], " (did you mean --epochs?)"),
        (["train", "--warmup=1"], " (did you mean --warmup-epochs?)"),
        (["train", "--modle", "lenet5"], " (did you mean --model?)"),
        (["train", "--modle", "x", "--no-progres"],
         " (--modle: did you mean --model?; --no-progres: did you mean --no-progress?)"),
        (["train", "--echo-factor", "2"], ""),  # nothing near enough to name
        (["bench", "--quik"], " (did you mean --quick?)"),
    ],
)  # fmt: skip
def test_an_unknown_option_is_named_by_its_command_with_the_closest_option(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped option was refused by the top-level parser: ``echopipe: error:
    unrecognized arguments: --epoch 1 (see echopipe --help)``, a help without the command's
    options and no word of the option meant. The command refuses it, naming the closest."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    given = " ".join(argv[1:])
    assert capsys.readouterr().err.strip().splitlines() == [
        f"echopipe {argv[0]}: error: unrecognized arguments: {given}{hint} (see echopipe "
        f"{argv[0]} --help)"
    ]


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_gives_one_line_and_exit_1(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, extra, status, needle = BAD_DATA[case]
    make(tmp_path / "data")
    argv = [
        "train",
        "--data",
        str(tmp_path / "data"),
        "--output",
        str(tmp_path / "run"),
        "-b",
        "4",
        "--image-size",
        "32",
        "--epochs",
        "1",
        "--stages",
        "1",
        *extra,
    ]
    code, line = _fails(argv, capsys)
    assert code == status and needle in line, line
    # These two are found by the first batch, once the input and model are built.
    if case not in ("image larger than the cache", "deterministic draw larger than the cache"):
        # A refused start leaves nothing behind: not even the run folder it made (a corrupt
        # val/ image is found with the same header check as train/, before any training).
        assert not (tmp_path / "run").exists()


def test_debug_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _one_class(tmp_path / "data")
    argv = ["train", "--data", str(tmp_path / "data"), "--output", str(tmp_path / "run"), "--debug"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "1 class folder" in err


def test_on_corrupt_skip_and_empty_class_folders_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    _empty_jpeg(data)
    (data / "train" / "bee").mkdir()
    (data / "val" / "bee").mkdir()
    argv = [
        "train",
        "--data",
        str(data),
        "--output",
        str(tmp_path / "run"),
        "-b",
        "4",
        "--image-size",
        "32",
        "--epochs",
        "1",
        "--stages",
        "1",
        "--on-corrupt",
        "skip",
        "--no-progress",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: class folder train/bee has no images" in err
    assert "1 corrupt image(s) left out of train/" in err and "empty.JPEG" in err
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["resolved"]["classes"] == ["ant", "bee", "cat"]


def test_on_corrupt_skip_leaves_out_bombs_frameless_jpegs_and_names_dali_cannot_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the header check finds, --on-corrupt skip leaves out, in train/ and val/: a JPEG
    whose header claims 14000 x 14000 pixels (never decoded), one with no frame before its end
    (which DALI's decoder would fail on), and a file whose name is not UTF-8."""
    data = tmp_path / "data"
    _non_utf8_name(data)
    whole = (data / "val" / "cat" / "0.JPEG").read_bytes()
    for split in ("train", "val"):
        (data / split / "ant" / "bomb.JPEG").write_bytes(_claiming(whole, 14000, 14000))
        (data / split / "cat" / "frameless.JPEG").write_bytes(b"\xff\xd8\xff\xd9")
    argv = ["train", "--data", str(data), "--output", str(tmp_path / "run"), "-b", "4",
            "--image-size", "32", "--epochs", "1", "--stages", "1", "--on-corrupt", "skip",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "3 corrupt image(s) left out of train/" in err, err
    assert "2 corrupt image(s) left out of val/" in err, err
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"]
    assert rows[0]["val_images"] == 4


def test_data_folder_without_train_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = _fails(["train", "--data", str(tmp_path), "--output", str(tmp_path / "r")], capsys)
    assert code == 1 and str(tmp_path) in line and "train/" in line


def test_output_folder_of_an_earlier_run_is_refused_and_kept(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "run" / "checkpoints"
    ck.mkdir(parents=True)
    earlier = ck / "last.pt"
    earlier.write_bytes(b"an earlier run's checkpoint")
    line = _bad(["train", "--data", str(tiny_imagenet), "--output", str(tmp_path / "run")], capsys)
    assert "earlier run" in line and "--resume" in line and str(tmp_path / "run") in line
    assert earlier.read_bytes() == b"an earlier run's checkpoint"


def test_output_folder_with_files_from_elsewhere_is_refused_and_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder holding a config.json (or metrics, plot) that no echopipe run wrote is not
    overwritten; other files in it are no obstacle."""
    data = _dataset(tmp_path / "data")
    out = tmp_path / "project"
    out.mkdir()
    (out / "config.json").write_text('{"lr": 0.1}')
    argv = ["train", "--data", str(data), "--output", str(out), "--image-size", "32"]
    line = _bad(argv, capsys)
    assert "project" in line and "'config.json'" in line
    assert (out / "config.json").read_text() == '{"lr": 0.1}'
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    # A start refused on its data in a folder that existed: the lock file it made goes too.
    empty = tmp_path / "empty"
    empty.mkdir()
    (data / "train" / "ant" / "bad.JPEG").write_bytes(b"")
    assert main(["train", "--data", str(data), "--output", str(empty)]) == 1
    assert list(empty.iterdir()) == []


def test_output_folder_in_use_by_a_live_run_is_refused(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from filelock import FileLock

    run = tmp_path / "run"
    run.mkdir()
    with FileLock(str(run / ".echopipe-train.lock")):  # what a live run holds
        line = _bad(["train", "--data", str(tiny_imagenet), "--output", str(run)], capsys)
    assert "in use by another echopipe train" in line


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def test_resume_refuses_planted_foreign_and_damaged_files_without_running_them(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    base = ["train", "--data", str(tiny_imagenet), "--output", str(run)]
    # An old-style name is not this run folder's checkpoint: bare --resume ignores it.
    torch.save(
        {"kind": "echopipe-train", "x": _RunsCode(marker)},
        run / "checkpoints" / "ckpt-000000099.pt",
    )
    (run / "checkpoints" / "ckpt-000000099.pt").rename(tmp_path / "evil.pt")
    assert "no checkpoint" in _bad([*base, "--resume"], capsys)
    # Planted under the run folder's own name, or given by path: refused before unpickling.
    (run / "checkpoints" / "last.pt").write_bytes((tmp_path / "evil.pt").read_bytes())
    assert "not an echopipe checkpoint" in _bad([*base, "--resume"], capsys, 1)
    assert "evil.pt" in _bad([*base, "--resume", str(tmp_path / "evil.pt")], capsys, 1)
    (run / "checkpoints" / "last.pt").unlink()
    from echopipe.training import write_checkpoint

    good = write_checkpoint({"kind": "echopipe-train"}, tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(good[:-100])
    assert "truncated" in _bad([*base, "--resume", str(tmp_path / "cut.pt")], capsys, 1)
    assert not marker.exists()


def test_export_refuses_a_foreign_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    line = _bad(["export", str(tmp_path / "other.pt"), str(tmp_path / "out.pt")], capsys, 1)
    assert "other.pt" in line and "not an echopipe checkpoint" in line
    assert "gone.pt" in _bad(["export", str(tmp_path / "gone.pt"), str(tmp_path / "o.pt")], capsys)
    assert not (tmp_path / "out.pt").exists()


def test_export_refuses_a_folder_or_an_unwritable_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OUT a folder, or under a file, gives one line (it once gave an IsADirectoryError
    traceback after writing a temp file beside it)."""
    from echopipe.training.checkpoints import write_checkpoint

    ckpt = tmp_path / "c.pt"
    model = {"name": "lenet5", "num_classes": 2}
    pipeline = {"balance": [], "stages": []}
    write_checkpoint({"kind": "echopipe-train", "model": model, "pipeline": pipeline}, ckpt)
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("x")
    line = _bad(["export", str(ckpt), str(tmp_path / "folder")], capsys)
    assert "folder" in line and "is a folder" in line
    line = _bad(["export", str(ckpt), str(tmp_path / "afile" / "w.pt")], capsys)
    assert "afile" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "c.pt", "folder"]
    assert list((tmp_path / "folder").iterdir()) == []


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--data",
        "--epochs",
        "--batch-size",
        "--lr",
        "--workers",
        "--seed",
        "--echo",
        "--echo-insert",
        "--echo-mode",
        "--read-delay-ms",
        "--stages",
        "--balance",
        "--hybrid-switch",
        "--devices",
        "--amp",
        "--resume",
        "--checkpoint-every",
        "--output",
        "--max-steps",
        "--evaluate",
        "--deterministic",
        "--on-corrupt",
        "--cache-mb",
        "--channels-last",
        "--log-interval",
        "--debug",
    ):
        assert flag in out
    # Each default once, and the choices of --model listed.
    flat = " ".join(out.split())
    assert flat.count("(default: 0.1)") == 1 and "(default: (default" not in flat
    assert "{lenet5,resnet110,resnet18,resnet20,resnet50,resnet56,resnet_cifar,resnet_small}" in out
    assert "--epochs, --max-steps" in flat  # what may change on resume
    parser = build_parser()
    assert parser.parse_args(["train"]).echo == "auto"
    assert parser.parse_args(["train"]).stages == "auto"
    assert parser.parse_args(["train", "--echo", "auto"]).echo == "auto"
    assert parser.parse_args(["train", "--balance", "3,5"]).balance == [3, 5]
    assert parser.parse_args(["train", "--hybrid-switch", "auto"]).hybrid_switch == "auto"
    # The shuffle buffer's default as the code has it (DEFAULT_SHUFFLE_BATCHES batches).
    from echopipe.dali.config import DEFAULT_SHUFFLE_BATCHES

    assert f"(default: {DEFAULT_SHUFFLE_BATCHES} batches' worth" in flat
    assert "25 % of the epochs" in flat


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
        [
            sys.executable,
            "-m",
            "echopipe.cli",
            "train",
            "--data",
            str(tiny_imagenet),
            "--batch-size",
            "8",
            "--image-size",
            "32",
            "--epochs",
            "2",
            "--amp",
            "--hybrid-switch",
            "1",
            "--devices",
            "cpu,cpu",
            "--balance",
            "4,4",
            "--channels-last",
            "--echo",
            "2",
            "--echo-insert",
            "after_augment",
            "--echo-mode",
            "batch",
            "--log-interval",
            "3",
            "--output",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "echopipe train: summary" in done.stdout
    assert "staleness per stage [2, 0]" in done.stdout
    # Not a terminal: plain log lines every 3 steps and one per epoch, no progress bars.
    assert "step 3: " in done.stderr
    # The epoch line: train and val loss, top-1 and top-5, LR, epoch time, its rates, ETA.
    epoch_line = (
        r"epoch 1/2: train loss [0-9.]+, val loss [0-9.]+, top-1 [0-9.]+ %, top-5 [0-9.]+ %, "
        r"lr [0-9.e-]+, \d+:\d\d \(\d+ img/s, \d+ fresh\), e=2; ETA \d+:\d\d"
    )
    assert re.search(epoch_line, done.stderr), done.stderr
    assert "\r" not in done.stderr
    run = tmp_path  # an --output naming metrics.json runs in its folder
    doc = json.loads((run / "metrics.json").read_text())
    assert [r["pipelined"] for r in doc["epochs"]] == [True, False]
    assert doc["summary"]["balance"] == [4, 4]
    config = json.loads((run / "config.json").read_text())
    assert config["options"]["amp"] == "bf16" and config["options"]["channels_last"] is True
    assert (run / "training.png").is_file()


def test_docs_table_lists_every_option_with_its_default() -> None:
    """docs/train.md's option table and the one definition of the options agree."""
    import dataclasses

    from echopipe.training.config import TrainConfig, flag

    docs = (Path(__file__).resolve().parents[1] / "docs" / "train.md").read_text()
    cells = [re.split(r"(?<!\\)\|", line) for line in docs.splitlines()]
    table = {c[1].strip(): c[2].strip() for c in cells if len(c) > 3 and c[1].strip()[:2] == "`-"}
    for f in dataclasses.fields(TrainConfig):
        if not f.metadata["cli"]:
            continue
        row = next(
            (
                k
                for k in table
                if f"`{flag(f.name)}" in k
                or f", {flag(f.name)}" in k
                or f"`{f.metadata['alias']}" in k
            ),
            None,
        )
        assert row is not None, flag(f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if default not in (None, False) and "default:" not in f.metadata["help"]:
            assert str(default) in table[row], (flag(f.name), table[row])


def test_bench_unknown_suite_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--only", "nosuch"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nosuch" in err[0]
    assert err[0].startswith("echopipe bench: error: ")


def test_bench_suite_sets() -> None:
    assert BENCH_DEFAULT == ("echo_cache", "echo_loader", "dali_echo", "pipeline")
    assert BENCH_SUITES == BENCH_DEFAULT + BENCH_STUDIES
    assert set(BENCH_STUDIES) == {
        "convergence",
        "wallclock",
        "wallclock_train",
        "staleness",
        "staleness_remedies",
        "readme_runs",
    }
    parser = build_parser()
    assert parser.parse_args(["bench", "--only", "staleness_remedies"]).only == [
        "staleness_remedies"
    ]
    assert parser.parse_args(["bench"]).only is None
    args = parser.parse_args(["bench", "--only", "staleness", "pipeline"])
    assert args.only == ["staleness", "pipeline"]


def test_every_bench_suite_loads() -> None:
    """Each registered suite is a bench/ module with a ``main`` (a name typo would only show
    when someone ran it)."""
    from echopipe.cli import _load_suite

    for name in BENCH_SUITES:
        module, reason = _load_suite(name)
        assert module is not None or "needs" in reason or "nvidia" in reason.lower(), (name, reason)
        if module is not None:
            assert callable(module.main), name


def test_bench_all_and_only_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--all", "--only", "pipeline"])
    assert info.value.code == 2
    assert "--all" in capsys.readouterr().err


def test_a_results_dir_that_cannot_be_a_folder_is_refused_before_any_suite_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line naming the file in the way, before the suites run (it was a NotADirectoryError
    traceback once the suite had run and wrote its table)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for given in (afile, afile / "results"):
        with pytest.raises(SystemExit) as info:
            main(["bench", "--quick", "--only", "echo_cache", "--results-dir", str(given)])
        assert info.value.code == 2
        out, err = capsys.readouterr()
        assert "=== echopipe bench" not in out  # no suite ran
        assert err.strip().splitlines() == [
            f"echopipe bench: error: --results-dir {str(given)!r}: {str(afile)!r} is not a "
            "folder (see echopipe bench --help)"
        ]
    assert afile.read_text() == "x"


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
        [
            sys.executable,
            "-m",
            "echopipe.cli",
            "bench",
            "--quick",
            "--only",
            "pipeline",
            "--results-dir",
            str(results),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
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
