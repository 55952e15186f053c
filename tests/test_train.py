"""``echopipe train`` end to end on a tiny real JPEG set: DALI + echo cache + stale pipeline.

Every run here is real: Pillow-written JPEGs, DALI CPU pipelines with the echopipe plugin, the
thread-per-stage engine, torchrun with Gloo, and a SIGKILL in the middle of training.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from echopipe.training.checkpoints import (
    CHECKPOINT_MAGIC,
    CheckpointError,
    RunCheckpoints,
    read_checkpoint,
    read_state_file,
    write_checkpoint,
)
from echopipe.training.report import write_csv, write_json, write_plot

pytestmark = pytest.mark.dali

TINY = ["--batch-size", "8", "--image-size", "32", "--no-progress", "--warmup-epochs", "0"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The child imports the same echopipe as this test process, and keeps to one thread per
    # stage so that two CPU cores are enough.
    import echopipe

    pkg_parent = str(Path(echopipe.__file__).resolve().parent.parent)
    if Path(echopipe.__file__).parent.is_symlink() or "site-packages" not in pkg_parent:
        pkg_parent = str(Path(echopipe.__file__).parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([pkg_parent, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cli(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "echopipe.cli", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
        **kw,  # type: ignore[arg-type]
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------------
# Checkpoint files
# --------------------------------------------------------------------------------------------


def test_run_checkpoints_keep_last_and_best_and_ignore_partial_writes(tmp_path: Path) -> None:
    ck = RunCheckpoints(tmp_path / "ck")
    assert ck.existing() == []
    ck.save({"kind": "echopipe-train", "step": 3, "w": torch.arange(3)}, best=True)
    ck.save({"kind": "echopipe-train", "step": 7}, best=False)
    assert ck.written == 2
    assert [p.name for p in ck.existing()] == ["best.pt", "last.pt", "prev.pt"]
    assert read_state_file(ck.last)["step"] == 7
    assert read_state_file(ck.prev)["step"] == 3  # the file last.pt was before
    assert torch.equal(read_state_file(ck.best)["w"], torch.arange(3))
    # A write killed mid-way leaves only a temporary file under another name.
    (tmp_path / "ck" / ".last.pt.abc.tmp").write_bytes(b"\x80half a pickle")
    assert read_state_file(ck.last)["step"] == 7


def test_a_write_that_fails_after_last_pt_leaves_the_new_state_resumable(tmp_path: Path) -> None:
    """last.pt is written before best.pt: a process stopped between the two (here best.pt
    cannot be replaced) leaves last.pt with the new state, which --resume reads; best.pt
    written first left a folder whose newest checkpoint had no last.pt."""
    ck = RunCheckpoints(tmp_path / "ck")
    ck.save({"kind": "echopipe-train", "step": 3}, best=False)
    (ck.best / "in-the-way").mkdir(parents=True)
    with pytest.raises(OSError):
        ck.save({"kind": "echopipe-train", "step": 7}, best=True)
    assert read_state_file(ck.last)["step"] == 7


def test_checkpoint_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.pt"):
        read_checkpoint(tmp_path / "nope.pt")
    other = tmp_path / "other.pt"
    torch.save({"weights": 1}, other)
    with pytest.raises(CheckpointError, match=r"other\.pt.*not an echopipe checkpoint"):
        read_checkpoint(other)
    plain = write_checkpoint({"weights": 1}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match=r"plain\.pt.*not an echopipe train checkpoint"):
        read_checkpoint(plain)


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def _with_valid_header(payload: bytes) -> bytes:
    import hashlib

    digest = hashlib.sha256(payload).hexdigest()
    return CHECKPOINT_MAGIC + f"sha256 {digest} {len(payload)}\n".encode() + payload


def test_crafted_pickle_checkpoint_never_runs_code(tmp_path: Path) -> None:
    """A checkpoint whose unpickling would create a file: as a bare torch.save (no header) and
    with a correct header and digest around it. Both are refused and the file never appears."""
    import io

    marker = tmp_path / "pwned"
    evil = {"kind": "echopipe-train", "global_step": 1, "x": _RunsCode(marker)}
    bare = tmp_path / "bare.pt"
    torch.save(evil, bare)
    buf = io.BytesIO()
    torch.save(evil, buf)
    wrapped = tmp_path / "wrapped.pt"
    wrapped.write_bytes(_with_valid_header(buf.getvalue()))
    with pytest.raises(CheckpointError, match=r"bare\.pt.*not an echopipe checkpoint"):
        read_checkpoint(bare)
    with pytest.raises(CheckpointError, match=r"wrapped\.pt.*cannot be read"):
        read_checkpoint(wrapped)
    assert not marker.exists()
    # The payload really would have run code without weights_only: the test can fail.
    torch.load(bare, weights_only=False)["x"].close()
    assert marker.exists()


def test_checkpoint_round_trip_and_integrity(tmp_path: Path) -> None:
    import random

    import numpy as np

    state = {
        "kind": "echopipe-train",
        "rng": {
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
        },
        "blob": b"\x00\x01dali",
        "empty": b"",
        "arr": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "pair": (1, (2.5, None)),
        "n": np.float64(1.5),
    }
    path = write_checkpoint(state, tmp_path / "c.pt")
    assert path.read_bytes().startswith(CHECKPOINT_MAGIC)
    back = read_state_file(path)
    assert back["blob"] == b"\x00\x01dali" and back["empty"] == b""
    assert back["arr"].dtype == np.uint32 and back["arr"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert back["pair"] == (1, (2.5, None)) and back["n"] == 1.5
    np.random.set_state(back["rng"]["numpy"])
    random.setstate(back["rng"]["python"])
    torch.set_rng_state(back["rng"]["torch"])
    raw = path.read_bytes()
    flipped = bytearray(raw)
    flipped[-10] ^= 0x01
    (tmp_path / "flipped.pt").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"flipped\.pt.*SHA-256"):
        read_checkpoint(tmp_path / "flipped.pt")
    (tmp_path / "short.pt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match=r"short\.pt.*truncated"):
        read_checkpoint(tmp_path / "short.pt")
    (tmp_path / "head.pt").write_bytes(raw[:10])
    with pytest.raises(CheckpointError, match=r"head\.pt"):
        read_checkpoint(tmp_path / "head.pt")


def test_plots_never_write_through_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    # The name the earlier writer used for its temporary file, and the final name.
    for name in (".training.png.tmp.png", "training.png"):
        (run / name).symlink_to(victim)
    rows = [
        {
            "epoch": 1,
            "val_top1": 0.5,
            "fresh_samples": 10,
            "train_s": 1.0,
            "train_loss": 1.2,
            "val_loss": 1.3,
        }
    ]
    png = write_plot(rows, run / "training.png")
    assert not png.is_symlink() and png.read_bytes()[:4] == b"\x89PNG"
    assert victim.read_text() == "keep me"


def test_metrics_json_and_csv_are_written_atomically(tmp_path: Path) -> None:
    path = write_json(tmp_path / "a" / "m.json", {"epochs": [{"R": float("nan"), "x": 1.5}]})
    assert json.loads(path.read_text()) == {"epochs": [{"R": None, "x": 1.5}]}
    rows = [{"epoch": 1, "R": float("nan")}, {"epoch": 2, "R": 0.5}]
    assert write_csv(tmp_path / "m.csv", rows).read_text() == "epoch,R\n1,\n2,0.5\n"
    # Rows of a run resumed from an older checkpoint lack the newer columns.
    rows.append({"epoch": 3, "R": 0.25, "val_top5": 1.0})
    text = write_csv(tmp_path / "m.csv", rows).read_text()
    assert text == "epoch,R,val_top5\n1,,\n2,0.5,\n3,0.25,1.0\n"
    assert [p.name for p in tmp_path.rglob(".*")] == []


# --------------------------------------------------------------------------------------------
# End to end, in process
# --------------------------------------------------------------------------------------------


def test_train_end_to_end_writes_the_run_folder(tiny_imagenet: Path, tmp_path: Path) -> None:
    from echopipe.models import build_model
    from echopipe.training import (
        TrainConfig,
        UsageError,
        evaluate_checkpoint,
        export_state_dict,
        format_summary,
        train,
    )

    out = tmp_path / "run"
    cfg = TrainConfig(
        data=tiny_imagenet,
        image_size=32,
        batch_size=8,
        epochs=3,
        echo=2.0,
        lr=0.05,
        warmup_epochs=0,
        stages=2,
        checkpoint_every=1,
        output=out,
        progress=False,
    )
    s = train(cfg, log=lambda m: None)
    # 32 training images, e = 2, batch 8: 8 steps per epoch.
    assert s.steps == 3 * 8 and s.epochs == 3
    assert s.fresh_samples + s.echoed_samples == s.steps * 8
    # Each fresh sample is emitted floor(e) = ceil(e) = 2 times, so there is at most one repeat
    # per first copy (copies still in the cache when the run ends were never drawn).
    assert 0 < s.echoed_samples <= s.fresh_samples
    assert s.echo_factor == 2.0 and s.echo_factors_used == [2.0]
    assert s.staleness == [2, 0] and len(s.balance) == 2 and sum(s.balance) == 8
    assert s.devices == ["cpu", "cpu"]
    assert 0.0 <= s.top1 <= 1.0 and s.t_up_ms > 0 and s.t_down_ms > 0
    # Delivered images/s counts echoed copies, fresh only fresh ones, both over training time.
    assert s.images_per_s == pytest.approx(s.steps * 8 / s.train_s, rel=1e-6)
    assert s.fresh_images_per_s == pytest.approx(s.fresh_samples / s.train_s, rel=1e-6)
    assert 0 < s.train_s < s.wall_s
    assert s.checkpoints_written == 24  # every step (the last of each epoch: at its end)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["best.pt", "last.pt", "prev.pt"]  # prev.pt: the one before last.pt
    assert read_checkpoint(out / "checkpoints" / "prev.pt")["run"]["global_step"] == 23
    doc = json.loads((out / "metrics.json").read_text())
    assert [r["epoch"] for r in doc["epochs"]] == [1, 2, 3]
    assert [r["step"] for r in doc["epochs"]] == [8, 16, 24]
    # With a checkpoint every step the drain's losses are kept: every epoch has a loss.
    assert all(r["train_loss"] is not None for r in doc["epochs"])
    fresh = [r["fresh_samples"] for r in doc["epochs"]]
    assert fresh == sorted(fresh) and fresh[-1] == s.fresh_samples
    assert all(r["val_images"] == 8 for r in doc["epochs"])
    assert doc["summary"]["steps"] == 24 and doc["summary"]["checkpoints_written"] == 24
    csv_lines = (out / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("epoch,step,") and len(csv_lines) == 4
    config = json.loads((out / "config.json").read_text())
    assert config["options"]["echo"] == 2.0 and config["options"]["stages"] == 2
    assert config["resolved"]["balance"] == s.balance
    assert config["resolved"]["devices"] == ["cpu", "cpu"]
    assert {"echopipe", "torch", "dali", "python"} <= set(config["versions"])
    assert config["command"]
    assert s.plots == [str(out / "training.png")]
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = format_summary(s)
    for needle in (
        "top-1",
        "fresh,",
        "delivered",
        "echoed",
        "R =",
        "echo factor",
        "staleness",
        "decision",
    ):
        assert needle in text, needle
    # The verdict follows the R the run measured (the last epoch's), whichever way it went on
    # this machine's load: no read delay usually makes it < 1.
    last_r = json.loads((out / "metrics.json").read_text())["epochs"][-1]["R"]
    verdict = "echo helps" if last_r > 1 else "echo does not help here"
    assert verdict in text, (verdict, last_r)

    # The exported weights load into the plain model under its own names and give the
    # checkpoint's validation result.
    weights, _ = export_state_dict(out / "checkpoints" / "last.pt")
    model = build_model("resnet_small", num_classes=4)
    model.load_state_dict(weights, strict=True)
    top1, loss, n = evaluate_checkpoint(cfg, out / "checkpoints" / "last.pt")
    assert n == 8 and top1 == pytest.approx(doc["epochs"][-1]["val_top1"])
    assert loss == pytest.approx(doc["epochs"][-1]["val_loss"], rel=1e-4)

    # A resume that changes an option the run depends on is refused, naming it and the
    # options that may change; nothing is overwritten.
    before = (out / "checkpoints" / "last.pt").read_bytes()
    for change, needle in (
        ({"echo": 3.0}, "--echo was 2.0, now 3.0"),
        ({"batch_size": 4}, "--batch-size was 8, now 4"),
        ({"balance": [4, 4]}, "--balance was 'auto', now [4, 4]"),
    ):
        bad = dataclasses.replace(cfg, resume=True, **change)
        with pytest.raises(UsageError, match=re.escape(needle) + ".*may change: .*--epochs"):
            train(bad, log=lambda m: None)
    assert (out / "checkpoints" / "last.pt").read_bytes() == before
    # Without --resume the folder is refused; nothing of the earlier run is deleted.
    with pytest.raises(UsageError, match=r"holds checkpoints of an earlier run.*--resume"):
        train(cfg, log=lambda m: None)
    assert (out / "checkpoints" / "last.pt").read_bytes() == before


def test_fp16_run_exports_a_state_dict_under_the_model_names(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from echopipe.cli import main
    from echopipe.models import build_model
    from echopipe.training import TrainConfig, train

    out = tmp_path / "run"
    cfg = TrainConfig(
        data=tiny_imagenet,
        image_size=32,
        batch_size=8,
        epochs=1,
        amp="fp16",
        stages=2,
        balance=[3, 5],
        output=out,
        progress=False,
    )
    s = train(cfg, log=lambda m: None)
    assert any(d.startswith("amp: fp16, loss scale ") for d in s.decisions)
    assert read_checkpoint(out / "checkpoints" / "last.pt")["amp_scaler"]["scale"] > 0
    assert main(["export", str(out / "checkpoints" / "best.pt"), str(tmp_path / "w.pt")]) == 0
    argv = [
        "train",
        "--data",
        str(tiny_imagenet),
        "--image-size",
        "32",
        "--evaluate",
        str(out / "checkpoints" / "last.pt"),
    ]
    assert main(argv) == 0
    assert "echopipe train --evaluate: top-1 " in capsys.readouterr().out
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert not any(".block." in k for k in weights)
    build_model("resnet_small", num_classes=4).load_state_dict(weights, strict=True)


def test_lenet5_trains_on_the_colour_input_and_its_export_loads_by_name(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lenet5 by name takes the RGB images echopipe train feeds; --evaluate rebuilds it from
    the checkpoint, and the exported weights load into build_model(name, num_classes)."""
    from echopipe.cli import main
    from echopipe.models import build_model

    out = tmp_path / "run"
    data = ["--data", str(tiny_imagenet), *TINY]
    argv = ["train", *data, "--model", "lenet5", "--epochs", "1", "--stages", "1"]
    assert main([*argv, "--output", str(out)]) == 0
    last = out / "checkpoints" / "last.pt"
    assert main(["train", *data, "--evaluate", str(last)]) == 0
    assert "echopipe train --evaluate: top-1 " in capsys.readouterr().out
    # Without --image-size (the default 64, which lenet5 cannot take): the checkpoint's 32.
    plain = ["train", "--data", str(tiny_imagenet), "--no-progress", "--evaluate", str(last)]
    assert main(plain) == 0
    assert "at the checkpoint's image size" in capsys.readouterr().out
    assert main([*plain, "--model", "lenet5"]) == 0  # (the size is not checked against 64)
    assert main(["export", str(last), str(tmp_path / "w.pt")]) == 0
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    build_model("lenet5", num_classes=4).load_state_dict(weights, strict=True)


def test_momentum_0_trains_with_plain_sgd(tiny_imagenet: Path, tmp_path: Path) -> None:
    """Nesterov needs momentum, so --momentum 0 is plain SGD rather than torch's refusal."""
    from echopipe.cli import main

    out = tmp_path / "run"
    argv = ["train", "--data", str(tiny_imagenet), *TINY, "--epochs", "1", "--stages", "1"]
    assert main([*argv, "--momentum", "0", "--output", str(out)]) == 0
    state = read_checkpoint(out / "checkpoints" / "last.pt")
    group = state["pipeline"]["optimizers"][0]["param_groups"][0]
    assert (group["momentum"], group["nesterov"]) == (0.0, False)


@pytest.mark.slow
def test_default_run_learns_well_above_chance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --data: the synthetic set (10 classes) is generated into the cache folder and the
    default model, with the default decisions, learns it well above the 10 % of chance
    (shortened: 30 images per class, 2 epochs)."""
    from echopipe.training import TrainConfig, train

    monkeypatch.setenv("ECHOPIPE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = TrainConfig(epochs=2, synthetic_per_class=30, output=tmp_path / "run", progress=False)
    s = train(cfg, log=lambda m: None)
    assert len(list((tmp_path / "cache").glob("synthetic-imagenet-c10-n30-*"))) == 1
    assert s.top1 > 0.3
    assert any(d.startswith("stages: ") for d in s.decisions)
    assert any(d.startswith("echo: ") for d in s.decisions)


def test_fp16_loss_scaling_skips_overflowing_updates_and_backs_off() -> None:
    """A real two-stage pipeline under float16 autocast with a loss scale far too large: the
    first updates overflow and are skipped (the weights stay), the scale halves until the
    gradients fit, then updates apply; the reported loss is the unscaled one."""
    from torch import nn

    from echopipe.pipeline import StalePipeline
    from echopipe.training.amp import Autocast, LossScaler

    torch.manual_seed(0)
    blocks = [nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)]
    model = nn.Sequential(*[Autocast(b, torch.float16) for b in blocks])
    start = [p.detach().clone() for p in model.parameters()]
    scaler = LossScaler(2, init_scale=2.0**40)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    losses = []
    with StalePipeline(model, balance=[2, 1], devices=["cpu", "cpu"],
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                       loss_fn=scaler.wrap_loss(nn.functional.cross_entropy),
                       grad_hook=scaler.grad_hook) as pipe:  # fmt: skip
        result = pipe.train_step(x, y)
        losses += result.losses
        losses += [r.value for r in pipe.drain()]
        # The first update of each stage overflowed: skipped, weights unchanged.
        assert scaler.skipped == 2 and scaler.scale == 2.0**39
        assert all(torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))
        for _ in range(40):
            losses += pipe.train_step(x, y).losses
        losses += [r.value for r in pipe.drain()]
    assert 2.0**8 <= scaler.scale < 2.0**39
    assert not all(torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))
    assert all(math.isfinite(v) and 0 < v < 10 for v in losses)  # unscaled cross-entropy
    assert losses[-1] < losses[0]
    state = scaler.state_dict()
    again = LossScaler(2)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_deterministic_runs_are_identical(tiny_imagenet: Path, tmp_path: Path) -> None:
    from echopipe.training import TrainConfig, train

    docs = []
    for name in ("a", "b"):
        cfg = TrainConfig(
            data=tiny_imagenet,
            image_size=32,
            batch_size=8,
            epochs=2,
            echo=2.0,
            stages=2,
            seed=1,
            deterministic=True,
            output=tmp_path / name,
            progress=False,
        )
        s = train(cfg, log=lambda m: None)
        assert s.balance == [3, 5]  # by modelled cost (FLOPs, bytes), not by timing
        docs.append(json.loads((tmp_path / name / "metrics.json").read_text())["epochs"])
    keys = ("step", "train_loss", "val_top1", "val_loss", "fresh_samples", "echoed_samples")
    assert [[r[k] for k in keys] for r in docs[0]] == [[r[k] for k in keys] for r in docs[1]]


def test_max_steps_and_a_diverging_loss(tiny_imagenet: Path, tmp_path: Path) -> None:
    from echopipe.training import DataError, TrainConfig, train

    base = dict(
        data=tiny_imagenet,
        image_size=32,
        batch_size=8,
        epochs=3,
        echo=1.0,
        stages=1,
        warmup_epochs=0,
        progress=False,
    )
    s = train(TrainConfig(**base, max_steps=6, output=tmp_path / "short"), log=lambda m: None)
    assert s.steps == 6 and s.stopped == "--max-steps 6 reached" and s.epochs == 1
    doc = json.loads((tmp_path / "short" / "metrics.json").read_text())
    assert [r["step"] for r in doc["epochs"]] == [4, 6]
    assert [r["epoch"] for r in doc["epochs"]] == [1, 1.5]  # the stopped epoch's share
    # Early stop: the first validation (any top-1 >= 0.001 on 4 classes) ends the run.
    s = train(
        TrainConfig(**base, stop_at_top1=0.001, output=tmp_path / "early"), log=lambda m: None
    )
    doc = json.loads((tmp_path / "early" / "metrics.json").read_text())
    assert s.epochs == 1 and len(doc["epochs"]) == 1
    assert s.stopped is not None and s.stopped.startswith("--stop-at-top1 0.001 reached")
    # Two steps: nothing timed, which the summary says instead of printing nan.
    from echopipe.training.report import format_summary

    s = train(TrainConfig(**base, max_steps=2, output=tmp_path / "two"), log=lambda m: None)
    assert "nan" not in format_summary(s)
    with pytest.raises(
        DataError, match=r"training loss became (nan|inf).*lower --lr \(now 1e\+30\)"
    ):
        train(TrainConfig(**base, lr=1e30, output=tmp_path / "nan"), log=lambda m: None)
    # A weight decay that alone makes the loss diverge: the line names it too.
    with pytest.raises(DataError, match=r"or --weight-decay \(now 3e\+38\)"):
        train(TrainConfig(**base, weight_decay=3e38, output=tmp_path / "wd"), log=lambda m: None)


def inject_timings(
    monkeypatch: pytest.MonkeyPatch, t_up: float, t_down: float, pause_room: int | None = 0
) -> None:
    """The trainer reads ``t_up`` and ``t_down`` as ``t_up`` and ``t_down`` seconds, whatever
    the machine's load: the fill's and the live pipeline's upstream timers, the step timing
    before the first step and the stages' busy time. Data, model and pipelines stay real (the
    fill is still waited for); only the timings the echo controller decides from are fixed.
    ``pause_room``: the samples the cache takes in while the steps pause (0: the pauses between
    epochs, whose length is the machine's, read nothing into it; None: the cache's own)."""
    from echopipe.pipeline import StalePipeline
    from echopipe.training import echo_start
    from echopipe.training.input import TrainInput

    real_fill = echo_start.fill_seconds_per_batch

    def fill(pipe: Any, timeout_s: float, report: Any = None, on_estimate: Any = None) -> Any:
        told = None if on_estimate is None else lambda _t: on_estimate(t_up)
        return None if real_fill(pipe, timeout_s, report, told) is None else t_up

    monkeypatch.setattr(echo_start, "fill_seconds_per_batch", fill)
    monkeypatch.setattr(echo_start, "measure_step_seconds", lambda *a, **k: t_down)
    monkeypatch.setattr(TrainInput, "upstream_step_seconds", lambda self: t_up)
    if pause_room is not None:
        monkeypatch.setattr(TrainInput, "pause_room", lambda self: pause_room)
    real_busy = StalePipeline.step_seconds
    monkeypatch.setattr(
        StalePipeline, "step_seconds", lambda self: None if real_busy(self) is None else t_down
    )


def test_echo_auto_raises_the_factor_when_reading_is_slow(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading at 120 ms per batch of 8 against 20 ms training steps: R = 6 from before the
    first step, so the controller echoes at e_max = 3 from step 0 and keeps it."""
    from echopipe.training import TrainConfig, train

    inject_timings(monkeypatch, t_up=0.12, t_down=0.02)
    out = tmp_path / "run"
    cfg = TrainConfig(
        data=tiny_imagenet,
        image_size=32,
        batch_size=8,
        epochs=3,
        echo="auto",
        echo_max=3.0,
        warmup_epochs=0,
        stages=2,
        output=out,
        progress=False,
    )
    s = train(cfg, log=lambda m: None)
    # The step-0 decision (the fill's t_up, the step timing's t_down) already echoes.
    (primed,) = [d for d in s.decisions if "from step 0" in d]
    e0 = s.echo_factors_used[0]
    assert e0 == 3.0 and primed.startswith("echo: e = 3 from step 0 (R = 6.00: t_up 120.0 ms")
    assert primed.endswith("in the stage trial)")  # no headroom: the target is R itself
    assert s.echo_factors_used == [3.0] and s.echo_factor == 3.0
    doc = json.loads((out / "metrics.json").read_text())
    assert doc["epochs"][0]["echo_factor"] == e0
    assert doc["epochs"][-1]["echo_factor"] == s.echo_factor
    assert doc["echo_history"][0]["step"] == 0 and doc["echo_history"][0]["factor"] == e0
    # An epoch at factor e draws about one shard of fresh samples: 32 * e / 8 steps.
    steps = [0] + [r["step"] for r in doc["epochs"]]
    per_epoch = [b - a for a, b in itertools.pairwise(steps)]
    assert per_epoch[-1] == -(-32 * doc["epochs"][-1]["echo_factor"] // 8)
    # Repeats: every sample has e = 3 tickets, those the fill put while it was timed too
    # (tests/test_dali.py checks their tickets); first copies come first in a shuffled stream.
    assert doc["epochs"][1]["echoed_samples"] > doc["epochs"][0]["echoed_samples"] > 0
    # The factor changed in the running cache: the input pipeline was built once, never rebuilt.
    assert [r["input_builds"] for r in doc["epochs"]] == [1] * len(doc["epochs"])
    # The cosine LR follows epochs done, not steps (their number per epoch grew with e): after
    # 2 of 3 epochs it is at cos-schedule(2/3), not already at its floor.
    expected = cfg.lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * 2 / 3)))
    assert doc["epochs"][1]["lr"] == pytest.approx(expected, rel=1e-6)
    assert doc["epochs"][-1]["lr"] == pytest.approx(cfg.lr * 0.02, rel=1e-6)


def test_echo_auto_counts_what_the_reader_reads_while_validation_runs(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader goes on between two epochs' steps (validation, the checkpoint) until the
    cache is full; those reads are fresh samples no step waits for. Reading at 120 ms a batch
    of 8 against 20 ms steps: R = 6, so e = 6 from step 0. During validation the upstream is
    made to read as having waited 1000 s for room (an injected reading: nothing sleeps), so
    what a drained cache could take bounds its reads: 20 samples of the epoch's 32, so
    t_pause = 120 ms * 20 / 32 = 75 ms, and (120 - 75) / 20 = 2.25 from the first retune step
    of epoch 2 on, where a lowering from step readings would need 10 in a row and could not
    leave the band around 6 by this much at once. The cache's own room is what the run
    measured: 256 slots, less the shuffle buffer (32) and an upstream batch (8)."""
    from echopipe.dali.pipeline import EchoPipeline
    from echopipe.training import TrainConfig, train
    from echopipe.training import epoch as epoch_module
    from echopipe.training.input import TrainInput

    inject_timings(monkeypatch, t_up=0.12, t_down=0.02, pause_room=None)
    rooms: list[int] = []
    real_room, real_supply = TrainInput.pause_room, EchoPipeline.upstream_supply

    def room(self: TrainInput) -> int:
        rooms.append(real_room(self))
        return 20

    waited = [0.0]
    real_evaluate = epoch_module.evaluate

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        waited[0] += 1000.0
        return real_evaluate(*args, **kwargs)

    def supply(self: EchoPipeline) -> tuple[int, float]:
        fresh, wait = real_supply(self)
        return fresh, wait + waited[0]

    monkeypatch.setattr(TrainInput, "pause_room", room)
    monkeypatch.setattr(EchoPipeline, "upstream_supply", supply)
    monkeypatch.setattr(epoch_module, "evaluate", evaluate)
    out = tmp_path / "run"
    cfg = TrainConfig(data=tiny_imagenet, image_size=32, batch_size=8, epochs=3, echo="auto",
                      echo_max=8.0, echo_interval=1, warmup_epochs=0, stages=1, output=out,
                      progress=False)  # fmt: skip
    messages: list[str] = []
    s = train(cfg, log=messages.append)
    doc = json.loads((out / "metrics.json").read_text())
    first_epoch_steps = doc["epochs"][0]["step"]
    assert first_epoch_steps == 32 * 6 // 8  # all of epoch 1 at the step-0 factor
    history = [(h["step"], h["factor"]) for h in doc["echo_history"]]
    assert history == [(0, 6.0), (first_epoch_steps, 2.25)], history
    assert doc["echo_history"][1]["ratio"] == pytest.approx(2.25)
    assert s.echo_factors_used == [6.0, 2.25] and s.echo_factor == 2.25
    (said,) = [m for m in messages if m.startswith("echo: factor 2.25")]
    assert f"from step {first_epoch_steps + 1} (epoch 2" in said, said
    assert said.endswith("R = 2.25, t_pause 75 ms: read between epochs)"), said
    # Epoch 3 repeats epoch 2's pause: no change. The room measured: 256 - 32 - 8 slots.
    assert doc["epochs"][-1]["echo_factor"] == 2.25
    assert rooms == [216, 216], rooms
    saved = read_checkpoint(out / "checkpoints" / "last.pt")["controller"]
    assert saved["pauses"] == [pytest.approx(0.075)] * 2


def test_echo_auto_changes_the_factor_within_an_epoch(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a step-0 estimate (no time given to time the fill, so the run starts at e = 1),
    decisions every 2 steps (every step before the first 2): e rises inside the first
    epoch (16 steps of 2; the stages' busy times exist from step 3, then comes 1 warm-up
    observation), whose remaining steps are re-planned for the fresh samples it still owes;
    the second epoch is a whole one at the new e; the LR ends at its floor on the last step.
    Reading (60 ms a batch of 2) is far slower than training here (5 ms steps), so R = 12 is
    well above e_max = 2 and the one change goes straight to 2."""
    from echopipe.training import TrainConfig, echo_start, train
    from echopipe.training.schedule import EpochClock

    inject_timings(monkeypatch, t_up=0.06, t_down=0.005)
    monkeypatch.setattr(echo_start, "FILL_TIMEOUT_S", 0.0)
    out = tmp_path / "run"
    messages: list[str] = []
    cfg = TrainConfig(
        data=tiny_imagenet,
        image_size=32,
        batch_size=2,
        epochs=2,
        echo="auto",
        echo_max=2.0,
        echo_interval=2,
        warmup_epochs=0,
        stages=2,
        output=out,
        progress=False,
    )
    s = train(cfg, log=messages.append)
    assert any(d.startswith("echo: starts at e = 1: no estimate of t_up") for d in s.decisions)
    assert s.echo_factors_used == [1.0, 2.0]
    (change,) = [m for m in messages if m.startswith("echo: factor")]
    assert "epoch 1" in change and "steps left in it" in change
    changed_at = int(change.split("from step ")[1].split()[0])
    doc = json.loads((out / "metrics.json").read_text())
    first, second = doc["epochs"][0]["step"], doc["epochs"][1]["step"] - doc["epochs"][0]["step"]
    # 32 fresh samples: `changed_at` steps of 2 at e = 1, the rest at e = 2 in steps of 2.
    assert first == changed_at + math.ceil((32 - 2 * changed_at) * 2 / 2)
    assert second == 32 * 2 // 2  # a whole epoch at e = 2, not the re-planned length again
    assert s.echoed_samples > 0
    assert doc["epochs"][-1]["lr"] == pytest.approx(cfg.lr * 0.02, rel=1e-6)
    # The checkpoint carries the re-planned clock, so a resumed run keeps the same schedule.
    clock = EpochClock(read_checkpoint(out / "checkpoints" / "last.pt")["run"]["epoch_clock"])
    assert len(clock.segments) >= 3 and clock.epochs_at(s.steps) == pytest.approx(2.0)


def test_stage_and_balance_decisions_are_measured_and_said() -> None:
    """--stages auto times one stage against the 2-stage pipeline on a copy of the model and
    says which won by how much; --deterministic takes no timing-based choice."""
    from echopipe.models import build_model
    from echopipe.training import TrainConfig
    from echopipe.training.decide import balance_by_weights, choose_split

    assert balance_by_weights([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [1, 5]
    assert balance_by_weights([1, 1, 1, 1], 4) == [1, 1, 1, 1]
    assert balance_by_weights([9, 1, 1], 3) == [1, 1, 1]
    model = build_model("resnet_small", num_classes=4)
    before = [p.detach().clone() for p in model.parameters()]
    sample = torch.randn(8, 3, 32, 32)
    decisions: list[str] = []
    balance = choose_split(TrainConfig(), model, sample, 2, ["cpu", "cpu"], decisions)
    assert sum(balance) == len(model) and len(balance) in (1, 2)
    (stages,) = [d for d in decisions if d.startswith("stages:")]
    assert re.search(r"measured (only )?[0-9.]+x the speed of one stage .*ms/step", stages)
    assert stages.startswith(f"stages: {len(balance)}")
    # The trial trained a copy: the model's own weights are untouched.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    decisions = []
    cfg = TrainConfig(deterministic=True)
    assert choose_split(cfg, model, sample, 2, ["cpu", "cpu"], decisions) == [len(model)]
    assert decisions == ["stages: 1 (--deterministic: no timing-based choice)"]
    decisions = []
    cfg = TrainConfig(deterministic=True, stages=2)
    split = choose_split(cfg, model, sample, 2, ["cpu", "cpu"], decisions)
    from echopipe.pipeline.cost_model import estimate_layer_seconds

    assert split == balance_by_weights(estimate_layer_seconds(model, sample), 2)
    assert "by modelled cost" in decisions[0]
    assert choose_split(cfg, model, sample, 2, ["cpu", "cpu"], []) == split  # repeatable


def test_lr_schedule_follows_epochs_done_through_replanned_epochs() -> None:
    from echopipe.training.schedule import EpochClock, lr_factor

    clock = EpochClock()
    clock.plan(0, 0.0, 10, 1.0)  # epoch 1: 10 steps at e = 1
    clock.plan(4, 0.4, 30, 1.0)  # e = 5 from step 4: the 6 steps left become 30
    clock.plan(34, 1.0, 50, 2.0)  # epoch 2 at e = 5
    assert clock.epochs_at(0) == 0.0 and clock.epochs_at(2) == pytest.approx(0.2)
    assert clock.epochs_at(4) == pytest.approx(0.4) and clock.epochs_at(19) == pytest.approx(0.7)
    assert clock.epochs_at(34) == pytest.approx(1.0) and clock.epochs_at(84) == pytest.approx(2.0)
    steps = [clock.epochs_at(n) for n in range(85)]
    assert steps == sorted(steps)
    assert lr_factor(0.25, 0.0, 0.5, 2) == pytest.approx(0.5)  # warm-up
    assert lr_factor(1.25, 1.25, 0.5, 2) == pytest.approx(0.02 + 0.98 * 0.5)  # half-way down
    assert lr_factor(2.0, 2.0, 0.5, 2) == pytest.approx(0.02)
    assert lr_factor(3.0, 3.0, 0.5, 2) == pytest.approx(0.02)  # stays at the floor


def test_hybrid_switch_auto_is_the_study_default_with_a_restart() -> None:
    """``--hybrid-switch auto``: synchronous after DEFAULT_SWITCH_FRACTION of the epochs, and
    the learning rate restarts there (the study's hybrid); an explicit epoch keeps one cosine."""
    from echopipe.pipeline.schedule import DEFAULT_SWITCH_FRACTION
    from echopipe.training import TrainConfig
    from echopipe.training.schedule import hybrid_switch_epoch, lr_factor

    assert DEFAULT_SWITCH_FRACTION == 0.25
    assert hybrid_switch_epoch(TrainConfig(epochs=8, hybrid_switch="auto")) == (2, True)
    assert hybrid_switch_epoch(TrainConfig(epochs=8, hybrid_switch=3)) == (3, False)
    assert hybrid_switch_epoch(TrainConfig(epochs=8)) == (None, False)
    TrainConfig(hybrid_switch="auto").validate()
    # Two cosines: at the floor just before the switch, back at the full rate on it.
    assert lr_factor(2.0, 1.999, 0.5, 8, restart_at=2) == pytest.approx(0.02, abs=1e-4)
    assert lr_factor(2.01, 2.0, 0.5, 8, restart_at=2) == pytest.approx(1.0)
    assert lr_factor(5.0, 5.0, 0.5, 8, restart_at=2) == pytest.approx(0.02 + 0.98 * 0.5)
    assert lr_factor(0.25, 0.0, 0.5, 8, restart_at=2) == pytest.approx(0.5)  # warm-up kept
    assert lr_factor(2.01, 2.0, 0.5, 8) < 0.95  # no restart without restart_at


def test_deterministic_takes_no_timing_based_echo_choice(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """With ``--echo auto`` (the default) and a slow reader, the controller would raise e at a
    step that depends on timing; --deterministic keeps e = 1 and says so."""
    from echopipe.training import TrainConfig, train

    cfg = TrainConfig(
        data=tiny_imagenet,
        image_size=32,
        batch_size=8,
        epochs=1,
        echo_interval=1,
        read_delay_ms=20.0,
        deterministic=True,
        output=tmp_path / "run",
        progress=False,
    )
    s = train(cfg, log=lambda m: None)
    assert "echo: e = 1 (--deterministic: no timing-based choice)" in s.decisions
    assert "stages: 1 (--deterministic: no timing-based choice)" in s.decisions
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["echo_history"]
    assert [h["factor"] for h in history] in ([], [1.0])
    assert s.echoed_samples == 0


def test_log_line_rates_span_epoch_ends_without_the_pause() -> None:
    """A line's img/s covers the steps since the previous line, across an epoch end, with the
    time between epochs left out. (Restarting at each epoch start once reported the stale
    pipeline's fill-up, steps that only enqueue work, as 4508 img/s.)"""
    from echopipe.training.progress import Progress

    lines: list[str] = []
    now = [0.0]  # an injected clock: the test says how long each step and the pause took
    p = Progress(True, False, 4, 2, lines.append, None, warmup_steps=0, clock=lambda: now[0])
    p.start_epoch(0, 3, 0)
    for k in range(1, 4):  # 0.1 s per step of 8 images
        now[0] += 0.1
        p.step(k, 1.0, 1.0, delivered=8 * k, fresh=8.0 * k)
    now[0] += 0.5  # validation: not training time
    p.start_epoch(1, 3, 0)
    p.step(4, 1.0, 1.0, delivered=8, fresh=8.0)  # at once: a step that only enqueued work
    (line,) = lines
    rate = float(re.search(r"img/s ([0-9.e+]+)", line).group(1))
    # 32 images over the 0.3 s of steps; the 0.5 s pause would have made it 40 img/s.
    assert rate == pytest.approx(32 / 0.3, rel=0.01), line


# --------------------------------------------------------------------------------------------
# Subprocesses: kill + resume, torchrun
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_after_sigkill_continues_and_steps_add_up(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    last = out / "checkpoints" / "last.pt"
    args = [
        "train",
        "--data",
        str(tiny_imagenet),
        *TINY,
        "--epochs",
        "3",
        "--stages",
        "2",
        "--echo",
        "2",
        "--checkpoint-every",
        "3",
        "--output",
        str(out),
        "--read-delay-ms",
        "2",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "echopipe.cli", *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not last.exists():
            assert proc.poll() is None, f"run ended before its first checkpoint: {proc.stderr}"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert "summary" not in err
    killed_at = read_checkpoint(last)["run"]["global_step"]
    assert 0 < killed_at < 24

    # The same command again is refused (the folder holds the killed run's checkpoints)...
    again = _cli(args)
    assert again.returncode == 2 and "--resume" in again.stderr
    # ... and with --resume (and more epochs, which may change) it continues.
    done = _cli([*args, "--resume"])
    assert done.returncode == 0, done.stderr
    assert f"resume: {last}" in done.stderr
    doc = json.loads((out / "metrics.json").read_text())
    assert doc["summary"]["steps"] == 24 and doc["summary"]["epochs"] == 3
    assert [r["step"] for r in doc["epochs"]] == [8, 16, 24]
    assert doc["summary"]["fresh_samples"] + doc["summary"]["echoed_samples"] >= 24 * 8
    # The checkpoints of both runs are counted.
    written = doc["summary"]["checkpoints_written"]
    assert written >= 1 + 3
    assert read_checkpoint(last)["run"]["checkpoints_written"] == written
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "best.pt",
        "last.pt",
        "prev.pt",
    ]


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_two_gloo_replicas(tiny_imagenet: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "-m",
        "echopipe.cli",
        "train",
        "--data",
        str(tiny_imagenet),
        *TINY,
        "--epochs",
        "2",
        "--stages",
        "2",
        "--echo",
        "2",
        "--output",
        str(out),
    ]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("echopipe train: summary") == 1  # rank 0 only
    doc = json.loads((out / "metrics.json").read_text())
    s = doc["summary"]
    assert s["world_size"] == 2
    # Each replica reads its own half (16 images), echoes it twice: 4 steps of 8 per epoch.
    assert s["steps"] == 2 * 4
    assert s["fresh_samples"] + s["echoed_samples"] == 2 * 2 * 4 * 8
    assert all(r["val_images"] == 8 for r in doc["epochs"])
    # Replicas average gradients and BN statistics, so their weights agree.
    w = [read_checkpoint(out / "checkpoints" / f"rank{r}" / "last.pt") for r in (0, 1)]
    for a, b in zip(w[0]["pipeline"]["stages"], w[1]["pipeline"]["stages"], strict=True):
        for key in a:
            assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5), key


def test_checkpoint_drains_count_as_training_time(tiny_imagenet: Path, tmp_path: Path) -> None:
    """A checkpoint's drain finishes the compute of the steps in flight: it is training time,
    so the run's training time holds the stage's busy time (a drain counted as the pause made
    train_s a third of it, and images/s three times too high, with a checkpoint every step)."""
    out = tmp_path / "run"
    done = _cli(["train", "--data", str(tiny_imagenet), *TINY, "--epochs", "2", "--stages",
                 "1", "--echo", "1", "--checkpoint-every", "1", "--output", str(out)])  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    busy = summary["t_down_ms"] / 1000 * (summary["steps"] - 2)  # (the first steps are untimed)
    assert summary["train_s"] >= 0.95 * busy, summary


def test_a_run_never_pipelined_says_so_from_its_start(tiny_imagenet: Path, tmp_path: Path) -> None:
    """--hybrid-switch 0 with 2 stages: the start line, the epochs and the summary all say
    staleness 0 (the start said [2, 0], then 'hybrid: synchronous from epoch 1'); a 1-stage
    run with a switch is never told it became synchronous."""
    from echopipe.training import TrainConfig, train

    for stages, switch in ((2, 0), (1, 1)):
        said: list[str] = []
        cfg = TrainConfig(data=tiny_imagenet, image_size=32, batch_size=8, epochs=2, echo=1.0,
                          stages=stages, hybrid_switch=switch, warmup_epochs=0,
                          output=tmp_path / f"run{stages}", progress=False)  # fmt: skip
        s = train(cfg, log=said.append)
        start = next(m for m in said if m.startswith("train: "))
        assert f"staleness {[0] * stages}" in start, start
        assert not any(m.startswith("hybrid: ") for m in said), said
        assert s.staleness == [0] * stages
        rows = json.loads((tmp_path / f"run{stages}" / "metrics.json").read_text())["epochs"]
        assert [r["pipelined"] for r in rows] == [False, False]


def test_the_wait_for_the_first_steps_input_is_training_time(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fill before step 1 (and ``--echo auto``'s timings) is a wait for input, counted in
    the first epoch's training time as later waits are. Uncounted, ``auto``'s longer fill was
    upstream work that its time to a target left out (bench/wallclock_train.py). The fill is
    made to read as 1000 s on the trainer's clock (an injected timing: nothing sleeps)."""
    import types

    from echopipe.training import TrainConfig, train
    from echopipe.training import trainer as trainer_module

    offset = [0.0]
    real_fill = trainer_module.wait_for_fill

    def fill(*args: Any, **kwargs: Any) -> None:
        real_fill(*args, **kwargs)
        offset[0] = 1000.0

    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0])
    monkeypatch.setattr(trainer_module, "wait_for_fill", fill)
    monkeypatch.setattr(trainer_module, "time", clock)
    out = tmp_path / "run"
    cfg = TrainConfig(data=tiny_imagenet, image_size=32, batch_size=8, epochs=2, echo=2.0,
                      warmup_epochs=0, stages=1, output=out, progress=False)  # fmt: skip
    s = train(cfg, log=lambda m: None)
    first, second = json.loads((out / "metrics.json").read_text())["epochs"]
    assert 1000.0 <= first["train_s"] < s.wall_s, first  # (the wall clock read 1000 s on too)
    assert first["epoch_img_per_s"] < 1.0, first  # the first epoch's rates are over it as well
    assert 0 < second["train_s"] - first["train_s"] < 1000.0 and s.train_s == second["train_s"]
