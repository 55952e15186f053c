"""What a run tells: the run folder's metrics, config and plot, and the summary.

(:mod:`.progress` has the live lines.) The run folder gets ``metrics.json`` (rewritten
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..pipeline.checkpoint import atomic_write
from .state import RunState

__all__ = [
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
    """Write the metric rows as CSV atomically (the columns of all rows, in order of first
    appearance; a row without one leaves it empty)."""
    buf = io.StringIO()
    if rows:
        # Every column of any row (a run resumed from an older checkpoint has rows with fewer).
        columns = list(dict.fromkeys(key for row in rows for key in row))
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
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
    out: Path,
    options: dict[str, Any],
    resolved: dict[str, Any],
    decisions: list[str],
    extra: dict[str, Any] | None = None,
) -> Path:
    """``config.json``: the options, the command line, the versions, what was resolved and
    the decisions with their reasons (and ``extra``: the run id, the restarts)."""
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
            **(extra or {}),
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


@dataclass
class TrainSummary:
    """What a finished run reports (also the ``summary`` block of ``metrics.json``).

    ``images_per_s`` counts delivered samples (fresh and echoed copies) and
    ``fresh_images_per_s`` fresh ones, both over ``train_s``, the time the training steps and
    their waits for input took (the fill before step 1 included; start-up and validation
    excluded). ``decisions`` says what ``auto`` options chose and why.
    ``left_out`` counts the files the data scans left out (``--on-corrupt skip``, links), each
    kind once per split, so that none is lost unsaid in a long log.
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
    resumed_finished: bool = False
    left_out: list[str] = dataclasses.field(default_factory=list)

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
    if s.left_out:
        lines.append(f"  left out            {', '.join(s.left_out)} (named at the start)")
    if s.stopped:
        lines.append(f"  stopped             {s.stopped}")
    lines.append(f"  checkpoints written {s.checkpoints_written}")
    if s.output:
        lines.append(f"  run folder          {s.output}")
    return "\n".join(lines)


def summarize(st: RunState, *, echo_factor: float, staleness: list[int], balance: list[int],
              devices: list[str], wall_s: float, output: Path | None, decisions: list[str],
              stopped: str | None, left_out: Sequence[str] = ()) -> TrainSummary:  # fmt: skip
    """The run's summary: counters from the run state, rates and samples from its last row."""
    last: dict[str, Any] = st.rows[-1] if st.rows else {}
    # best.pt's top-1, also of a --max-steps stop's partial row that the epoch's own replaced
    seen = [r["val_top1"] for r in st.rows] + ([st.best_top1] if st.best_top1 >= 0 else [])
    return TrainSummary(
        top1=last.get("val_top1", math.nan),
        best_top1=max(seen, default=math.nan),
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
        left_out=list(left_out),
    )
