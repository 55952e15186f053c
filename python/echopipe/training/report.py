"""What a run tells: progress, the run folder's metrics, config and plot, and the summary.

On a terminal, tqdm bars; otherwise (a log file, a pipe) one plain line every
``--log-interval`` steps and one per epoch. The run folder gets ``metrics.json`` (rewritten
atomically each epoch), ``metrics.csv`` (one row per epoch), ``config.json`` (the resolved
config, versions, the command line and the decisions taken), ``training.png`` and, when
``tensorboard`` is installed, TensorBoard event files in ``tb/``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..pipeline.checkpoint import atomic_write
from .state import RunState

__all__ = [
    "Progress",
    "TrainSummary",
    "echo_verdict",
    "format_summary",
    "summarize",
    "write_config",
    "write_csv",
    "write_json",
    "write_plot",
    "write_run_files",
]


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _write(path: str | os.PathLike[str], data: bytes) -> Path:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: f.write(data))


def write_json(path: str | os.PathLike[str], document: dict[str, Any]) -> Path:
    """Write ``document`` as JSON atomically (non-finite floats become ``null``)."""
    return _write(path, (json.dumps(_json_safe(document), indent=2) + "\n").encode())


def write_csv(path: str | os.PathLike[str], rows: Sequence[dict[str, Any]]) -> Path:
    """Write the metric rows as CSV atomically (columns from the first row)."""
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(_json_safe(list(rows)))
    return _write(path, buf.getvalue().encode())


def write_plot(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """One figure: top-1 against fresh examples and against training time, and the losses."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    acc = [100.0 * float(r["val_top1"]) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13.0, 3.8), dpi=100)
    for ax, key, label in (
        (axes[0], "fresh_samples", "fresh training examples read"),
        (axes[1], "train_s", "training time (s)"),
    ):
        ax.plot([float(r[key]) for r in rows], acc, marker="o")
        ax.set_xlabel(label)
        ax.set_ylabel("validation top-1 (%)")
        ax.grid(True, alpha=0.3)
    epochs = [r["epoch"] for r in rows]
    for key, label in (("train_loss", "training loss"), ("val_loss", "validation loss")):
        points = [(e, r[key]) for e, r in zip(epochs, rows, strict=True) if r[key] is not None]
        axes[2].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    axes[2].set_xlabel("epoch")
    axes[2].set_ylabel("cross-entropy")
    axes[2].legend()
    axes[2].grid(True, alpha=0.3)
    fig.suptitle("echopipe train")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return _write(path, buf.getvalue())


def write_run_files(
    out: Path,
    rows: Sequence[dict[str, Any]],
    echo_history: list[Any],
    summary: TrainSummary | None = None,
) -> None:
    """``metrics.json`` (with the summary once there is one), ``metrics.csv``, the plot."""
    document: dict[str, Any] = {"epochs": list(rows), "echo_history": echo_history}
    if summary is not None:
        document["summary"] = summary.as_dict()
    write_json(out / "metrics.json", document)
    write_csv(out / "metrics.csv", rows)
    if rows:
        write_plot(rows, out / "training.png")


def write_config(
    out: Path, options: dict[str, Any], resolved: dict[str, Any], decisions: list[str]
) -> Path:
    """``config.json``: the options, the command line, the versions, what was resolved and
    the decisions with their reasons."""
    import torch

    from .. import __version__

    versions = {
        "echopipe": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    try:
        import nvidia.dali as dali

        versions["dali"] = dali.__version__
    except ImportError:  # DALI is an extra
        pass
    return write_json(
        out / "config.json",
        {
            "options": options,
            "command": list(sys.argv),
            "resolved": resolved,
            "decisions": decisions,
            "versions": versions,
        },
    )


def echo_verdict(rows: Sequence[dict[str, Any]], factor: float) -> list[str]:
    """Whether echoing helped, from the last measured ``R = t_up / t_down``."""
    if not rows or rows[-1]["R"] is None:
        return []
    r = rows[-1]["R"]
    if factor <= 1.0:
        why = "the input kept up" if r < 1 else "echoing was off"
        return [f"echo: e = 1 (R = t_up/t_down = {r:.2f}; {why}): no sample was repeated"]
    if r > 1:
        return [
            f"echo: e = {factor:g} at R = {r:.2f}; echo helps: the trainer would otherwise "
            "wait for input"
        ]
    return [
        f"echo: e = {factor:g} at R = {r:.2f}; echo does not help here: the input was not "
        "the bottleneck, so each repeat only adds a training step"
    ]


class Progress:
    """Progress of rank 0: tqdm bars on a terminal, else a plain line every ``interval`` steps."""

    def __init__(
        self,
        enabled: bool,
        bars: bool,
        interval: int,
        epochs: int,
        say: Callable[[str], None],
        tb_dir: Path | None,
    ) -> None:
        self.enabled = enabled
        self.bars = enabled and bars and sys.stderr.isatty()
        self.interval = interval
        self.epochs = epochs
        self.say = say
        self.bar: Any = None
        self.tb: Any = None
        # The rates of a line are over the steps since the previous line, across epoch ends:
        # counts are kept since the run began (the trainer's are per epoch), and the time from
        # an epoch's last step to the next epoch's start (validation, checkpoint) is left out.
        # Restarting the window at each epoch start showed the stale pipeline filling up
        # (steps that only enqueue work) as thousands of images per second.
        self._window: tuple[float, float, float] = (time.perf_counter(), 0.0, 0.0)
        self._base = (0.0, 0.0)  # samples delivered and fresh before this epoch
        self._last = (0.0, 0.0)  # this epoch's counts at its latest step
        self._last_step_at: float | None = None
        if enabled and tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(str(tb_dir))

    def start_epoch(self, epoch: int, steps: int, done: int) -> None:
        now = time.perf_counter()
        t0, d0, f0 = self._window
        if self._last_step_at is not None:
            t0 += now - self._last_step_at
        self._window = (t0, d0, f0)
        self._base = (self._base[0] + self._last[0], self._base[1] + self._last[1])
        self._last = (0.0, 0.0)
        if self.bars:
            from tqdm import tqdm

            self.bar = tqdm(
                total=steps,
                initial=done,
                desc=f"epoch {epoch + 1}/{self.epochs}",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def step(self, step: int, loss: float | None, e: float, *, delivered: int,
             fresh: float) -> None:  # fmt: skip
        """One step done; ``delivered`` and ``fresh`` count samples since the epoch began.

        The rates shown are over the steps since the previous line (or bar refresh), also
        across an epoch end, with the time between epochs left out.
        """
        if not self.enabled:
            return
        now = time.perf_counter()
        self._last, self._last_step_at = (delivered, fresh), now
        total, total_fresh = self._base[0] + delivered, self._base[1] + fresh
        t0, d0, f0 = self._window
        seconds = max(now - t0, 1e-9)
        fields = {"loss": loss, "e": e, "img/s": (total - d0) / seconds,
                  "fresh/s": (total_fresh - f0) / seconds}  # fmt: skip
        shown = {k: v for k, v in fields.items() if v is not None}
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self.bar.update(1)
            if step % self.interval == 0:
                self._window = (now, total, total_fresh)
        elif step % self.interval == 0:
            self.say(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))
            self._window = (now, total, total_fresh)
        if self.tb is not None and loss is not None:
            self.tb.add_scalar("train/loss", loss, step)

    def set_total(self, steps: int) -> None:
        if self.bar is not None:
            self.bar.total = steps
            self.bar.refresh()

    def end_epoch(self, row: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.enabled:
            return
        loss = "n/a" if row["train_loss"] is None else f"{row['train_loss']:.3f}"
        self.say(
            f"epoch {row['epoch']}/{self.epochs}: val top-1 {100 * row['val_top1']:.1f} %, "
            f"loss {loss}, {row['fresh_per_s']:.0f} fresh img/s, "
            f"{row['delivered_per_s']:.0f} delivered img/s, e={row['echo_factor']:g}"
        )
        if self.tb is not None:
            for key in ("val_top1", "val_loss", "train_loss", "echo_factor", "lr"):
                if row.get(key) is not None:
                    self.tb.add_scalar(f"epoch/{key}", row[key], row["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


@dataclass
class TrainSummary:
    """What a finished run reports (also the ``summary`` block of ``metrics.json``).

    ``images_per_s`` counts delivered samples (fresh and echoed copies) and
    ``fresh_images_per_s`` fresh ones, both over ``train_s``, the time the training steps took
    (start-up and validation excluded). ``decisions`` says what ``auto`` options chose and why.
    """

    top1: float
    best_top1: float
    epochs: int
    steps: int
    images_per_s: float
    fresh_images_per_s: float
    train_s: float
    fresh_samples: int
    echoed_samples: int
    t_up_ms: float
    t_down_ms: float
    ratio: float
    echo_factor: float
    echo_factors_used: list[float]
    staleness: list[int]
    balance: list[int]
    devices: list[str]
    world_size: int
    checkpoints_written: int
    wall_s: float
    output: str | None
    metrics_path: str | None
    plots: list[str]
    decisions: list[str]
    stopped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-able values."""
        return dataclasses.asdict(self)


def format_summary(s: TrainSummary) -> str:
    """The human-readable summary block printed at the end of ``echopipe train``."""
    total = s.fresh_samples + s.echoed_samples
    used = ", ".join(f"{e:g}" for e in s.echo_factors_used)
    realised = total / s.fresh_samples if s.fresh_samples else float("nan")
    lines = [
        "echopipe train: summary",
        f"  top-1 (val)         {100 * s.top1:.1f} %  (best {100 * s.best_top1:.1f} %)",
        f"  images/s            {s.fresh_images_per_s:.0f} fresh, {s.images_per_s:.0f} delivered "
        f"over {s.train_s:.1f} s of training ({s.steps} steps, {s.epochs} epochs, "
        f"{s.wall_s:.1f} s wall, {s.world_size} replica(s))",
        f"  samples             {total} = {s.fresh_samples} fresh + {s.echoed_samples} echoed "
        f"(realised echo {realised:.2f}x)",
        (
            f"  t_up / t_down       {s.t_up_ms:.1f} ms / {s.t_down_ms:.1f} ms per step  "
            f"(R = {s.ratio:.2f})"
            if math.isfinite(s.ratio)
            else "  t_up / t_down       not measured (too few steps timed)"
        ),
        f"  echo factor         {s.echo_factor:g}  (used: {used})",
        f"  stages              balance {s.balance} on {', '.join(s.devices)}; staleness per "
        f"stage {s.staleness}",
    ]
    lines += [f"  decision            {d}" for d in s.decisions]
    if s.stopped:
        lines.append(f"  stopped             {s.stopped}")
    lines.append(f"  checkpoints written {s.checkpoints_written}")
    if s.output:
        lines.append(f"  run folder          {s.output}")
    return "\n".join(lines)


def summarize(st: RunState, *, echo_factor: float, staleness: list[int], balance: list[int],
              devices: list[str], wall_s: float, output: Path | None, decisions: list[str],
              stopped: str | None) -> TrainSummary:  # fmt: skip
    """The run's summary: counters from the run state, rates and samples from its last row."""
    last: dict[str, Any] = st.rows[-1] if st.rows else {}
    return TrainSummary(
        top1=last.get("val_top1", math.nan),
        best_top1=max((r["val_top1"] for r in st.rows), default=math.nan),
        epochs=st.epoch,
        steps=st.global_step,
        images_per_s=last.get("delivered_per_s", 0.0),
        fresh_images_per_s=last.get("fresh_per_s", 0.0),
        train_s=st.train_s,
        fresh_samples=last.get("fresh_samples", 0),
        echoed_samples=last.get("echoed_samples", 0),
        t_up_ms=last.get("t_up_ms", math.nan),
        t_down_ms=1000 * st.t_down_s,
        ratio=last.get("R") or math.nan,
        echo_factor=echo_factor,
        echo_factors_used=list(st.factors_used),
        staleness=staleness,
        balance=balance,
        devices=devices,
        world_size=st.world_size,
        checkpoints_written=st.checkpoints_written,
        wall_s=wall_s,
        output=str(output) if output is not None else None,
        metrics_path=str(output / "metrics.json") if output is not None else None,
        plots=[str(output / "training.png")] if output is not None and st.rows else [],
        decisions=decisions,
        stopped=stopped,
    )
