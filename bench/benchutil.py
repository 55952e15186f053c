"""Shared plumbing of every benchmark suite in ``bench/``, and the convention they follow.

The convention (every suite: echo_cache, dali_echo, pipeline, convergence, wallclock, staleness)
-----------------------------------------------------------------------------------------------
* ``main(argv: list[str] | None = None) -> int``: 0 when the suite ran; non-zero only on errors.
  An aim that is not met is a *result*, reported as ``met: false`` with the reason, never an
  error. ``if __name__ == "__main__": sys.exit(main())``.
* Flags from :func:`bench_parser`: ``--quick`` (a short preset) and ``--results-dir DIR``
  (default :func:`default_results_dir`: ``bench/results`` of the source checkout the suite is
  in or that is the current directory, else ``./bench-results``; ``--quick`` runs go to its
  ``quick/`` subfolder so they never overwrite recorded full results); the suite writes
  ``DIR/<name>.json`` (plots may go next to it).
* The suite runs as ``python bench/<name>.py``; ``echopipe bench`` runs the same file from the
  checkout, with ``bench/`` on ``sys.path`` (the suites are not in the wheel). Import this
  module as ``import benchutil as bu``.
* A suite that cannot run on this machine (a missing optional dependency, e.g. DALI) defines
  ``unavailable() -> str | None`` returning the reason (see :func:`missing_module`);
  ``echopipe bench`` then reports it as skipped with that reason, and ``main`` returns 1 with
  the reason on stderr when run directly. A ``ModuleNotFoundError`` while importing the suite
  is reported as skipped too.
* Plumbing: ``run = bu.BenchRun.start("<name>", args, argv)`` right after parsing (records the
  machine and the load average at the start), then ``run.finish(figures=..., ratios=...,
  claims=..., config=..., **extra)`` writes the JSON (load average at the end too) and prints
  the claims table; :func:`claim` builds one claim.
* The JSON: ``benchmark`` (name), ``quick``, ``machine`` (platform, cpu count, load averages at
  start and end, python/torch/numpy/DALI/echopipe versions and echopipe build info, GPUs if any),
  ``command`` (``argv``: the suite's exact arguments; ``process``: the process's own argv;
  ``reproduce``: ``python bench/<name>.py ...``), ``figures`` (what was measured), ``ratios``
  (against peers and the physical limit, measured in the same run), ``claims`` (a list of
  ``{claim, aim, measured, met, reason}``; ``met`` is true, false, or null when it could not be
  measured), ``config``, ``wall_s``, plus suite-specific keys. The start load average shows
  other work on the machine; the end one includes the suite's own.

The study helpers below the convention (data sets, augmentation, evaluation, plots) are shared
by the convergence, wall-clock and staleness studies: scikit-learn's digits with random affine
augmentation, and the synthetic ImageNet-style JPEG set decoded once to uint8 tensors with
random-resized-crop and flip done in torch. Augmentations are batched (one ``affine_grid`` +
``grid_sample`` per batch, per-sample random parameters), so the studies spend their CPU time
on training, not on Python.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent


def _is_checkout(root: Path) -> bool:
    """Whether ``root`` is an echopipe source checkout (pyproject naming echopipe, bench/)."""
    try:
        project = (root / "pyproject.toml").read_text()
    except OSError:
        return False
    return (root / "bench").is_dir() and 'name = "echopipe"' in project


def default_results_dir() -> Path:
    """Where results go without ``--results-dir``.

    ``bench/results`` of the checkout this file lives in, or of the checkout that is the
    current directory; else ``./bench-results``.
    """
    if BENCH_DIR.name == "bench" and _is_checkout(REPO):
        return BENCH_DIR / "results"
    if _is_checkout(Path.cwd()):
        return Path.cwd() / "bench" / "results"
    return Path.cwd() / "bench-results"


def missing_module(name: str) -> str | None:
    """``"needs <name>, which is not installed"`` if ``name`` cannot be imported, else None."""
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    return None if found else f"needs {name}, which is not installed"


def bench_parser(name: str, doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """An argument parser with the convention's ``--quick`` and ``--results-dir``."""
    first = (doc or name).strip().splitlines()[0]
    p = argparse.ArgumentParser(prog=f"bench/{name}.py", description=first)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where {name}.json goes (default: bench/results of a checkout, else ./bench-results)",
    )
    return p


def cpu_model() -> dict[str, Any]:
    """The CPU's model, family and cache sizes (Linux; empty elsewhere).

    The same ``cpu_count`` can hide another host: the copy-bound ratios differ by 2x between
    CPU generations, so a result is only comparable with one from the same model.
    """
    out: dict[str, Any] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return out
    for key, name in (("model name", "cpu_model"), ("cpu family", "cpu_family"),
                      ("model", "cpu_model_number"), ("cache size", "cpu_cache")):  # fmt: skip
        m = re.search(rf"^{key}\s*:\s*(.*)$", text, re.M)
        if m:
            out[name] = m.group(1).strip()
    caches = {}
    for index in range(4):  # L1d, L1i, L2, L3 on the CPUs this runs on
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}/"
        try:
            with open(base + "level") as f:
                level = f"L{f.read().strip()}"
            if level in ("L2", "L3"):
                with open(base + "size") as f:
                    caches[level] = f.read().strip()
        except OSError:
            continue
    if caches:
        out["cpu_caches"] = caches
    return out


def machine_info() -> dict[str, Any]:
    """Platform, cores, load and library versions (the load average shows shared-machine noise)."""
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        **cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "load_average_1_5_15_start": [round(v, 2) for v in os.getloadavg()],
    }
    try:
        from nvidia import dali

        info["dali"] = dali.__version__
    except ImportError:
        info["dali"] = None
    try:
        import echopipe

        info["echopipe"] = echopipe.__version__
        try:
            info["echopipe_build"] = echopipe.build_info()
        except Exception as exc:  # the figures are still worth having without the build info
            info["echopipe_build"] = {"error": repr(exc)}
    except ImportError:  # pragma: no cover - the benchmarks measure echopipe
        info["echopipe"] = None
    if info["cuda_devices"]:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(info["cuda_devices"])]
    return info


def claim(text: str, aim: str, measured: Any, met: bool | None, reason: str = "") -> dict[str, Any]:
    """One claim check: ``met`` is True, False, or None when it could not be measured."""
    return {"claim": text, "aim": aim, "measured": measured, "met": met, "reason": reason}


def verdict(met: bool | None) -> str:
    """``met`` / ``not met`` / ``not measurable``."""
    return {True: "met", False: "not met", None: "not measurable"}[met]


def claims_table(claims: Sequence[dict[str, Any]]) -> str:
    """The claims as a table: claim, aim, measured, verdict, reason."""
    return format_table(
        ["claim", "aim", "measured", "result", "reason"],
        [[c["claim"], c["aim"], c["measured"], verdict(c["met"]), c["reason"]] for c in claims],
    )


@dataclass
class BenchRun:
    """One run of a suite: its name, arguments, output folder, machine and start time."""

    name: str
    argv: list[str]
    quick: bool
    results_dir: Path
    machine: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, name: str, args: argparse.Namespace, argv: Sequence[str] | None) -> BenchRun:
        """Records the machine (load average at the start) right after argument parsing."""
        # A --quick run must never overwrite the recorded full results.
        results_dir = args.results_dir or (
            default_results_dir() / "quick" if args.quick else default_results_dir()
        )
        args.results_dir = results_dir
        return cls(
            name=name,
            argv=list(sys.argv[1:] if argv is None else argv),
            quick=bool(args.quick),
            results_dir=Path(results_dir),
            machine=machine_info(),
        )

    @property
    def json_path(self) -> Path:
        """``<results-dir>/<name>.json``."""
        return self.results_dir / f"{self.name}.json"

    def elapsed(self) -> float:
        """Seconds since :meth:`start`."""
        return time.perf_counter() - self.started

    def finish(
        self,
        *,
        figures: dict[str, Any],
        ratios: dict[str, Any],
        claims: Sequence[dict[str, Any]],
        config: dict[str, Any] | None = None,
        **extra: Any,
    ) -> Path:
        """Prints the claims table and writes ``<results-dir>/<name>.json``; returns its path."""
        for c in claims:
            missing = {"claim", "aim", "measured", "met", "reason"} - set(c)
            if missing:
                raise ValueError(f"claim {c!r} lacks {sorted(missing)}")
        machine = dict(self.machine)
        machine["load_average_1_5_15_end"] = [round(v, 2) for v in os.getloadavg()]
        # Suites may limit torch's threads after start(); record what the measurements used.
        machine["torch_threads"] = torch.get_num_threads()
        payload = {
            "benchmark": self.name,
            "quick": self.quick,
            "machine": machine,
            "command": {
                "argv": self.argv,
                "process": list(sys.argv),
                "reproduce": shlex.join(["python", f"bench/{self.name}.py", *self.argv]),
            },
            "figures": figures,
            "ratios": ratios,
            "claims": list(claims),
            "config": config or {},
            **extra,
            "wall_s": round(self.elapsed(), 2),
        }
        if claims:
            print()
            print(claims_table(claims))
        start_load = machine["load_average_1_5_15_start"][0]
        end_load = machine["load_average_1_5_15_end"][0]
        cores = os.cpu_count() or 1
        # The end figure includes this suite's own work; the start one shows the others.
        if start_load > cores / 2:
            print(
                f"note: 1-min load average {start_load:.1f} on {cores} CPUs at the start "
                f"({end_load:.1f} at the end, this suite included): other processes were using "
                "the CPUs, the figures are noisy"
            )
        write_json(self.json_path, payload)
        print(f"wrote {self.json_path} ({payload['wall_s']:.0f} s)")
        return self.json_path


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Writes ``payload`` atomically (temp file + rename), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable as plain text)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """Mean and sample standard deviation of the values that are not None, and their count."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return None, None, 0
    sd = statistics.stdev(got) if len(got) > 1 else 0.0
    return statistics.fmean(got), sd, len(got)


def fmt_ms(mean: float | None, sd: float | None, n: int, total: int, scale: float = 1.0) -> str:
    """``mean ± sd`` (scaled), with ``(k/n reached)`` when some runs did not reach the target."""
    if mean is None:
        return f"not reached (0/{total})"
    text = (
        f"{mean * scale:.0f} ± {sd * scale:.0f}"
        if scale != 1.0 or mean >= 100
        else (f"{mean:.3g} ± {sd:.2g}")
    )
    if n < total:
        text += f" ({n}/{total} reached)"
    return text


def set_threads(threads: int | None) -> None:
    """Caps torch's intra-op threads (this machine is shared by several jobs)."""
    if threads:
        torch.set_num_threads(int(threads))


# ----------------------------------------------------------------------------------------------
# Data sets
# ----------------------------------------------------------------------------------------------


@dataclass
class Dataset:
    """A small image classification set held in memory.

    ``train_x`` is what the reader hands out (float32 normalised for digits; uint8 NCHW of side
    ``stored_size`` for the synthetic set); :meth:`augment` maps a batch of it to the model's
    float32 input; :meth:`prepare` does the deterministic part only (for validation).
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    num_classes: int
    in_channels: int
    image_size: int
    kind: str  # "digits" | "synthetic"
    mean: torch.Tensor | None = None
    std: torch.Tensor | None = None
    description: str = ""

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Deterministic input transform (validation, and the non-augmented part of training)."""
        if self.kind == "digits":
            return x.float()
        x = x.float().div_(255.0)
        if x.shape[-1] != self.image_size:
            x = F.interpolate(
                x,
                size=(self.image_size, self.image_size),
                mode="bilinear",
                align_corners=False,
                antialias=True,
            )
        assert self.mean is not None and self.std is not None
        return (x - self.mean) / self.std

    def augment(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Random augmentation of one batch (new randomness on every call)."""
        if self.kind == "digits":
            return random_affine(x.float(), generator)
        x = x.float().div_(255.0)
        x = random_resized_crop_flip(x, self.image_size, generator)
        assert self.mean is not None and self.std is not None
        return (x - self.mean) / self.std


def random_affine(
    x: torch.Tensor,
    generator: torch.Generator,
    max_shift: float = 0.125,
    max_rotate_deg: float = 12.0,
    scale: tuple[float, float] = (0.9, 1.1),
) -> torch.Tensor:
    """Random shift (fraction of the side), rotation and zoom per sample; one grid_sample call.

    Pixels moved in from outside take the border value (the normalised background of digits).
    """
    n = x.shape[0]
    u = torch.rand(n, 4, generator=generator)
    angle = (u[:, 0] * 2 - 1) * math.radians(max_rotate_deg)
    s = scale[0] + (scale[1] - scale[0]) * u[:, 1]
    tx = (u[:, 2] * 2 - 1) * max_shift * 2  # affine_grid coordinates span [-1, 1]
    ty = (u[:, 3] * 2 - 1) * max_shift * 2
    cos, sin = torch.cos(angle) / s, torch.sin(angle) / s
    theta = torch.stack(
        [torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1
    )  # (n, 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def random_resized_crop_flip(
    x: torch.Tensor,
    size: int,
    generator: torch.Generator,
    area: tuple[float, float] = (0.25, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> torch.Tensor:
    """Random-resized-crop (area fraction and log-uniform aspect ratio, as torchvision's) to
    ``size`` plus a horizontal flip with probability 1/2, per sample, as one grid_sample call.

    Crop sides are clamped to the image, so extreme aspect draws shrink instead of being redrawn.
    """
    n = x.shape[0]
    u = torch.rand(n, 5, generator=generator)
    a = area[0] + (area[1] - area[0]) * u[:, 0]
    log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[:, 1]
    r = torch.exp(log_r)
    w = torch.sqrt(a * r).clamp(max=1.0)  # crop width / image width
    h = torch.sqrt(a / r).clamp(max=1.0)
    cx = (u[:, 2] * 2 - 1) * (1 - w)  # crop centre in [-1, 1] coordinates, crop stays inside
    cy = (u[:, 3] * 2 - 1) * (1 - h)
    flip = torch.where(u[:, 4] < 0.5, -1.0, 1.0)
    zeros = torch.zeros(n)
    theta = torch.stack([torch.stack([w * flip, zeros, cx], 1), torch.stack([zeros, h, cy], 1)], 1)
    grid = F.affine_grid(theta, [n, x.shape[1], size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def load_digits_set(seed: int = 0) -> Dataset:
    """scikit-learn digits at 32x32 (1347 train / 450 validation), normalised."""
    from echopipe.data import load_digits

    xtr, ytr, xte, yte = load_digits(image_size=32, test_fraction=0.25, seed=seed)
    return Dataset(
        "digits",
        xtr,
        ytr,
        xte,
        yte,
        num_classes=10,
        in_channels=1,
        image_size=32,
        kind="digits",
        description="sklearn digits 8x8 -> 32x32 bilinear, 1347 train / 450 val (stratified)",
    )


def load_synthetic_set(
    classes: int = 10,
    per_class: int = 100,
    val_per_class: int = 20,
    stored_size: int = 40,
    image_size: int = 32,
    data_root: Path | None = None,
) -> Dataset:
    """The embedded synthetic JPEG set, generated once (cached) and decoded once with Pillow.

    Each JPEG is decoded and resized (bilinear) to ``stored_size`` square uint8 pixels, so the
    studies pay for JPEG decoding once instead of on every fresh read; the reader then hands out
    these tensors and training applies random-resized-crop + flip to ``image_size``.
    """
    from PIL import Image

    from echopipe.data import ensure_synthetic_imagenet

    root = ensure_synthetic_imagenet(
        data_root, classes=classes, per_class=per_class, val_per_class=val_per_class
    )
    cache = root / f"decoded_{stored_size}.pt"
    if cache.exists():
        blob = torch.load(cache, weights_only=True)
    else:
        blob = {}
        for split in ("train", "val"):
            names = sorted(p.name for p in (root / split).iterdir() if p.is_dir())
            xs, ys = [], []
            for label, name in enumerate(names):
                for f in sorted((root / split / name).iterdir()):
                    with Image.open(f) as im:
                        im = im.convert("RGB").resize((stored_size, stored_size), Image.BILINEAR)
                        xs.append(np.asarray(im, dtype=np.uint8))
                    ys.append(label)
            blob[f"{split}_x"] = torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).contiguous()
            blob[f"{split}_y"] = torch.tensor(ys, dtype=torch.int64)
        tmp = cache.with_suffix(".tmp")
        torch.save(blob, tmp)
        os.replace(tmp, cache)
    xtr = blob["train_x"]
    scaled = F.interpolate(
        xtr.float() / 255.0,
        size=(image_size, image_size),
        mode="bilinear",
        align_corners=False,
        antialias=True,
    )
    mean = scaled.mean(dim=(0, 2, 3)).view(1, 3, 1, 1)
    std = scaled.std(dim=(0, 2, 3)).view(1, 3, 1, 1)
    return Dataset(
        "synthetic",
        xtr,
        blob["train_y"],
        blob["val_x"],
        blob["val_y"],
        num_classes=classes,
        in_channels=3,
        image_size=image_size,
        kind="synthetic",
        mean=mean,
        std=std,
        description=(
            f"echopipe synthetic ImageNet-style JPEGs: {classes} classes x {per_class} train / "
            f"{val_per_class} val, decoded once with Pillow to {stored_size}x{stored_size} uint8; "
            f"random-resized-crop (area 0.25-1) + flip to {image_size}x{image_size} in torch"
        ),
    )


def load_dataset(name: str, **kw: Any) -> Dataset:
    """``"digits"`` or ``"synthetic"``."""
    if name == "digits":
        return load_digits_set()
    if name == "synthetic":
        return load_synthetic_set(**kw)
    raise ValueError(f"unknown data set {name!r}; choose 'digits' or 'synthetic'")


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, batch: int = 512) -> float:
    """Top-1 accuracy on the validation split (model put back in training mode)."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(data.val_y), batch):
        x = data.prepare(data.val_x[i : i + batch])
        correct += int((model(x).argmax(1) == data.val_y[i : i + batch]).sum())
    model.train(was_training)
    return correct / len(data.val_y)


def train_stale_epochs(
    pipe: Any, data: Dataset, batch: int, epochs: int, gen: torch.Generator
) -> list[float]:
    """Trains a StalePipeline ``epochs`` times over a fresh seeded shuffle of the training set
    (augmented per batch, last partial batch dropped), draining after each epoch so that the
    validation sees every update; returns the validation accuracy after each epoch."""
    n = len(data.train_y)
    accs = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        batches = []
        for i in range(n // batch):
            idx = order[i * batch : (i + 1) * batch]
            batches.append((data.augment(data.train_x[idx], gen), data.train_y[idx]))
        pipe.run_epoch(batches)
        pipe.drain()
        accs.append(float(pipe.accuracy(data.prepare(data.val_x), data.val_y, batch_size=512)))
    return accs


def save_plot(path: Path, draw: Any) -> str | None:
    """Calls ``draw(plt)`` on a fresh Agg figure and saves it; returns the path or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def paired_ratios(
    rounds: int, baseline: Callable[[], float], measured: Callable[[], float]
) -> dict[str, Any]:
    """``measured / baseline`` rates, paired round by round, with their median and spread.

    Each round runs both callables (each returns a rate of the same unit, higher is better)
    back to back, in alternating order (baseline first in even rounds, measured first in odd
    ones) so that a machine speeding up or slowing down within a pair favours neither side.
    The median of the per-round ratios is robust to a noisy round; the interquartile range says
    how noisy the rounds were, and the load average before each pair how loaded the machine was.
    """
    ratios, base_rates, rates, loads = [], [], [], []
    for i in range(rounds):
        loads.append(round(os.getloadavg()[0], 2))
        if i % 2 == 0:
            b = baseline()
            m = measured()
        else:
            m = measured()
            b = baseline()
        base_rates.append(b)
        rates.append(m)
        ratios.append(m / b)
    q = statistics.quantiles(ratios, n=4, method="inclusive") if rounds > 1 else ratios * 3
    return {
        "median_ratio": statistics.median(ratios),
        "q1_ratio": q[0],
        "q3_ratio": q[2],
        "iqr_ratio": q[2] - q[0],
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "rounds": rounds,
        "round_ratios": [round(r, 4) for r in ratios],
        "round_baseline_rates": base_rates,
        "round_measured_rates": rates,
        "load_average_1min_per_round": loads,
    }
