"""Fresh examples needed to reach a target validation accuracy, with and without data echoing.

The question (Choi et al. 2019, "Faster Neural Network Training with Data Echoing"): when the
input pipeline is the bottleneck, each fresh example can be reused ``e`` times. Does that cut
the number of *fresh* examples needed to reach a target accuracy, and how do the echo point, the
echo granularity and the amount of shuffling matter? The paper's findings, which this study
sets its numbers against:

1. echoing reduces the fresh examples needed (up to e times fewer in the best case);
2. echoing earlier in the pipeline (before augmentation) is better than after it;
3. more shuffling (a larger buffer between the echo point and the trainer) is better;
   example echoing is at least as good as batch echoing.

Every variant, including ``e = 1``, runs through echopipe's native :class:`EchoCache`: a
reader walks the training set in a fresh random order each epoch and puts upstream batches
into the cache (``capacity_samples`` = the shuffle buffer); the trainer draws random batches
from it (``take_batch``). ``after_decode`` puts the un-augmented example (each copy gets its
own random augmentation downstream); ``after_augment`` augments upstream, so copies are
identical. ``example`` echoes single examples; ``batch`` echoes whole upstream batches. The
producer tops the cache up before every draw in the same thread, so a run is deterministic
given its seed.

"Fresh examples" counts the distinct examples the trainer has received so far (the cache's
sample ids). The cache's read-ahead (the examples sitting in the buffer, never drawn yet) is not
counted, because on these small sets it would be a large constant that grows with the buffer
size; the upstream read count is recorded too (``fresh_read``).

Run: ``python bench/convergence.py [--quick]``. Writes ``bench/results/convergence.json`` and
``bench/results/convergence_<dataset>.png``.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import benchutil as bu
from echopipe.echo import EchoCache
from echopipe.models import build_model


@dataclass(frozen=True)
class RunConfig:
    """One training run of the study."""

    dataset: str
    model: str
    echo: float
    insert: str  # "after_decode" | "after_augment"
    mode: str  # "example" | "batch"
    buffer: int  # shuffle buffer = echo cache capacity in samples
    seed: int
    batch: int
    lr: float
    target: float
    max_fresh: int
    eval_every: int  # fresh examples between validations
    weight_decay: float = 5e-4
    model_width: int | None = None

    @property
    def label(self) -> str:
        if self.echo == 1:
            return f"e=1 buf={self.buffer}"
        ins = "decode" if self.insert == "after_decode" else "augment"
        return f"e={self.echo:g} {self.mode} after-{ins} buf={self.buffer}"


def make_model(cfg: RunConfig, data: bu.Dataset) -> torch.nn.Module:
    """The study's model for ``cfg`` (seeded by ``cfg.seed``)."""
    torch.manual_seed(cfg.seed)
    kw: dict[str, Any] = {"in_channels": data.in_channels}
    if cfg.model_width is not None:
        kw["width"] = cfg.model_width
    return build_model(cfg.model, num_classes=data.num_classes, **kw)


def make_optimizer(cfg: RunConfig, params: Any) -> torch.optim.Optimizer:
    """SGD with momentum 0.9 and a constant learning rate (same for every variant)."""
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay, nesterov=True
    )


class Reader:
    """Hands out upstream batches of (stored input, label): a new random order every epoch."""

    def __init__(self, data: bu.Dataset, batch: int, seed: int) -> None:
        self.data = data
        self.batch = batch
        self.rng = np.random.default_rng(seed)
        self.order = np.empty(0, dtype=np.int64)
        self.pos = 0
        self.epochs = 0
        self.read = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > len(self.order):
            # Epoch boundary: the remainder of the old order goes first, so no example is skipped.
            rest = self.order[self.pos :]
            self.order = np.concatenate([rest, self.rng.permutation(len(self.data.train_y))])
            self.pos = 0
            self.epochs += 1
        idx = torch.from_numpy(self.order[self.pos : self.pos + self.batch])
        self.pos += self.batch
        self.read += self.batch
        return self.data.train_x[idx], self.data.train_y[idx]


def make_cache(cfg: RunConfig, sample_bytes: int) -> EchoCache:
    """The echo cache of one run: ``buffer`` slots, room for all of them in bytes."""
    return EchoCache(
        capacity_bytes=cfg.buffer * (sample_bytes + 256) + (1 << 20),
        capacity_samples=cfg.buffer,
        echo_factor=cfg.echo,
        min_fill=0,  # the producer keeps the buffer topped up; see run_one
        seed=cfg.seed,
        mode=cfg.mode,
        batch_size=cfg.batch if cfg.mode == "batch" else None,
        memory="pageable",
    )


def upstream_batch(
    cfg: RunConfig, data: bu.Dataset, reader: Reader, gen: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Reads one upstream batch and, for ``after_augment``, augments it before the echo point."""
    x, y = reader.next()
    if cfg.insert == "after_augment":
        x = data.augment(x, gen)
    return np.ascontiguousarray(x.numpy()), y.numpy()


def downstream_input(
    cfg: RunConfig, data: bu.Dataset, x: np.ndarray, gen: torch.Generator
) -> torch.Tensor:
    """The model input for a drawn batch: augmentation happens here for ``after_decode``."""
    t = torch.from_numpy(x)
    return data.augment(t, gen) if cfg.insert == "after_decode" else t


def run_one(cfg: RunConfig, data: bu.Dataset) -> dict[str, Any]:
    """Trains until the target validation accuracy or ``max_fresh`` fresh examples.

    Returns the accuracy curve (fresh examples consumed, steps, accuracy) and the fresh
    examples, steps and seconds at the first validation that reached the target (None if
    never reached).
    """
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    model = make_model(cfg, data)
    opt = make_optimizer(cfg, model.parameters())
    reader = Reader(data, cfg.batch, cfg.seed)
    probe_x, _ = upstream_batch(cfg, data, Reader(data, 1, 0), gen)
    cache = make_cache(cfg, probe_x.nbytes)
    seen = np.zeros(cfg.max_fresh + cfg.buffer + 4 * cfg.batch + 1, dtype=bool)
    fresh = steps = 0
    next_eval = cfg.eval_every
    curve: list[tuple[int, int, float]] = []
    reached: dict[str, Any] | None = None
    start = time.perf_counter()
    try:
        while fresh < cfg.max_fresh:
            # Top the buffer up with whole upstream batches (batch mode echoes whole batches).
            while cache.stats().resident + cfg.batch <= cfg.buffer:
                cache.put_batch(upstream_batch(cfg, data, reader, gen), timeout=10)
            # A fractional e can leave fewer tickets than a batch (example mode: a ticket is a
            # sample) while the buffer is not low enough for another put: take what there is.
            n = cfg.batch
            if cfg.mode == "example":
                n = min(n, max(cache.stats().tickets_left, 1))
            got = cache.take_batch(n, timeout=10)
            assert got is not None  # input never ends here
            ids = got.sample_ids
            new = ~seen[ids]
            fresh += int(np.unique(ids[new]).size)
            seen[ids] = True
            x = downstream_input(cfg, data, got.fields[0], gen)
            y = torch.from_numpy(got.fields[1])
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            if fresh >= next_eval or fresh >= cfg.max_fresh:
                next_eval = (fresh // cfg.eval_every + 1) * cfg.eval_every
                acc = bu.evaluate(model, data)
                curve.append((fresh, steps, acc))
                if acc >= cfg.target:
                    reached = {
                        "fresh": fresh,
                        "steps": steps,
                        "seconds": time.perf_counter() - start,
                    }
                    break
        stats = cache.stats()
    finally:
        cache.close()
    return {
        "config": asdict(cfg),
        "label": cfg.label,
        "reached": reached is not None,
        "fresh_to_target": reached["fresh"] if reached else None,
        "steps_to_target": reached["steps"] if reached else None,
        "seconds_to_target": reached["seconds"] if reached else None,
        "final_accuracy": curve[-1][2] if curve else None,
        "fresh_consumed": fresh,
        "fresh_read": reader.read,
        "steps": steps,
        "seconds": time.perf_counter() - start,
        "cache_echo_ratio": stats.echo_ratio,
        "curve": curve,
    }


# ----------------------------------------------------------------------------------------------
# The study
# ----------------------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # Sized for the shared 2-core machine: digits runs the whole grid, the synthetic set (about
    # 10x the CPU time per step) the reduced grid described in study_configs.
    "full": {
        "digits": dict(
            model="lenet5",
            batch=64,
            lr=0.05,
            target=0.97,
            max_fresh=30_000,
            eval_every=256,
            buffers=(64, 1024),
            grid="full",
        ),
        "synthetic": dict(
            model="resnet_cifar",
            model_width=8,
            batch=64,
            lr=0.05,
            target=0.60,
            max_fresh=16_000,
            eval_every=250,
            buffers=(64, 800),
            grid="reduced",
            data=dict(stored_size=28, image_size=24),
        ),
    },
    "quick": {
        "digits": dict(
            model="lenet5",
            batch=64,
            lr=0.05,
            target=0.90,
            max_fresh=8_000,
            eval_every=256,
            buffers=(64, 1024),
            grid="reduced",
        ),
    },
}

_NOT_RUN_KEYS = ("buffers", "grid", "data")


def study_configs(
    dataset: str, preset: dict[str, Any], seeds: Sequence[int], factors: Sequence[float]
) -> list[RunConfig]:
    """The variants of one data set.

    ``grid="full"``: e=1 once per buffer size; every e>1 crossed with insertion point x mode x
    buffer size. ``grid="reduced"``: e=1 per buffer; for e>1 example echoing after decode and
    after augmentation with the large buffer, plus batch echoing after decode (large buffer)
    and example echoing after decode with the small buffer, i.e. each factor is varied once
    against the same reference variant.
    """
    base = {k: v for k, v in preset.items() if k not in _NOT_RUN_KEYS}
    small, big = min(preset["buffers"]), max(preset["buffers"])
    out: list[RunConfig] = []
    for seed in seeds:
        for e in factors:
            if e == 1:
                combos = [("after_decode", "example", b) for b in preset["buffers"]]
            elif preset.get("grid", "full") == "full":
                combos = list(
                    itertools.product(
                        ("after_decode", "after_augment"), ("example", "batch"), preset["buffers"]
                    )
                )
            else:
                combos = [
                    ("after_decode", "example", big),
                    ("after_augment", "example", big),
                    ("after_decode", "batch", big),
                    ("after_decode", "example", small),
                ]
            for insert, mode, buffer in combos:
                out.append(
                    RunConfig(
                        dataset=dataset,
                        echo=float(e),
                        insert=insert,
                        mode=mode,
                        buffer=buffer,
                        seed=seed,
                        **base,
                    )
                )
    return out


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: fresh examples to target (mean ± sd over seeds), ratio vs e=1."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        c = r["config"]
        key = (c["dataset"], c["echo"], c["insert"], c["mode"], c["buffer"])
        groups.setdefault(key, []).append(r)
    rows = []
    baselines: dict[tuple[str, int], float] = {}
    for key in sorted(groups, key=lambda k: (k[0], k[4], k[1], k[2], k[3])):
        rs = groups[key]
        mean, sd, n = bu.mean_std([r["fresh_to_target"] for r in rs])
        steps, _, _ = bu.mean_std([r["steps_to_target"] for r in rs])
        row = {
            "dataset": key[0],
            "echo": key[1],
            "insert": key[2],
            "mode": key[3],
            "buffer": key[4],
            "label": rs[0]["label"],
            "seeds": len(rs),
            "reached": n,
            "fresh_to_target_mean": mean,
            "fresh_to_target_sd": sd,
            "steps_to_target_mean": steps,
            "final_accuracy_mean": bu.mean_std([r["final_accuracy"] for r in rs])[0],
        }
        if key[1] == 1 and n == len(rs):
            baselines[(key[0], key[4])] = mean  # type: ignore[assignment]
        rows.append(row)
    for row in rows:
        base = baselines.get((row["dataset"], row["buffer"]))
        ok = row["fresh_to_target_mean"] is not None and row["reached"] == row["seeds"]
        row["fresh_ratio_vs_e1"] = row["fresh_to_target_mean"] / base if base and ok else None
    return rows


def check_claims(rows: list[dict[str, Any]], factors: Sequence[float]) -> list[dict[str, Any]]:
    """The paper's qualitative findings, each marked met / not met with the numbers.

    Only comparisons whose two variants were both run appear; a variant that did not reach the
    target in every seed makes its comparison "not measurable".
    """
    claims: list[dict[str, Any]] = []
    index = {(r["dataset"], r["echo"], r["insert"], r["mode"], r["buffer"]): r for r in rows}

    def compare(
        ds: str, text: str, better: tuple[Any, ...], worse: tuple[Any, ...], names: tuple[str, str]
    ) -> None:
        rb, rw = index.get((ds, *better)), index.get((ds, *worse))
        if rb is None or rw is None:
            return
        vb = rb["fresh_to_target_mean"] if rb["reached"] == rb["seeds"] else None
        vw = rw["fresh_to_target_mean"] if rw["reached"] == rw["seeds"] else None
        if vb is None or vw is None:
            status, detail = "not measurable", "a variant did not reach the target in every seed"
        else:
            status = "met" if vb < vw else "not met"
            detail = f"{names[0]}: {vb:.0f}, {names[1]}: {vw:.0f} fresh examples (mean)"
        met = None if status == "not measurable" else status == "met"
        aim = f"{names[0]} < {names[1]} (fresh examples to target)"
        measured = None if met is None else {names[0]: round(vb), names[1]: round(vw)}
        claims.append({"dataset": ds, **bu.claim(f"{ds}: {text}", aim, measured, met, detail)})

    for ds in sorted({r["dataset"] for r in rows}):
        buffers = sorted({r["buffer"] for r in rows if r["dataset"] == ds})
        small, big = buffers[0], buffers[-1]
        for e in [float(f) for f in factors if f > 1]:
            compare(
                ds,
                f"e={e:g} (example, after decode, buffer {big}) needs fewer fresh "
                "examples than e=1",
                (e, "after_decode", "example", big),
                (1.0, "after_decode", "example", big),
                (f"e={e:g}", "e=1"),
            )
            for mode in ("example", "batch"):
                compare(
                    ds,
                    f"e={e:g} {mode}, buffer {big}: echoing after decode beats after augmentation",
                    (e, "after_decode", mode, big),
                    (e, "after_augment", mode, big),
                    ("decode", "augment"),
                )
            for ins in ("after_decode", "after_augment"):
                compare(
                    ds,
                    f"e={e:g} {ins}, buffer {big}: example echoing beats batch echoing",
                    (e, ins, "example", big),
                    (e, ins, "batch", big),
                    ("example", "batch"),
                )
                for mode in ("example", "batch"):
                    compare(
                        ds,
                        f"e={e:g} {mode} {ins}: shuffle buffer {big} beats {small}",
                        (e, ins, mode, big),
                        (e, ins, mode, small),
                        (f"buf {big}", f"buf {small}"),
                    )
    return claims


def plot(runs: list[dict[str, Any]], rows: list[dict[str, Any]], out_dir: Path) -> list[str]:
    """Per data set: bar chart of fresh examples to target, and accuracy-vs-fresh curves."""
    paths = []
    for ds in sorted({r["dataset"] for r in rows}):
        sub = [r for r in rows if r["dataset"] == ds]

        def draw(plt: Any, sub: list[dict[str, Any]] = sub, ds: str = ds) -> Any:
            fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 5))
            labels = [r["label"] for r in sub]
            means = [r["fresh_to_target_mean"] or 0 for r in sub]
            sds = [r["fresh_to_target_sd"] or 0 for r in sub]
            colors = [
                "tab:gray"
                if r["echo"] == 1
                else ("tab:blue" if r["insert"] == "after_decode" else "tab:orange")
                for r in sub
            ]
            hatches = ["" if r["mode"] == "example" else "//" for r in sub]
            bars = ax0.barh(range(len(sub)), means, xerr=sds, color=colors)
            for b, h, r in zip(bars, hatches, sub, strict=True):
                b.set_hatch(h)
                if r["reached"] < r["seeds"]:
                    b.set_alpha(0.35)
            ax0.set_yticks(range(len(sub)), labels, fontsize=7)
            ax0.invert_yaxis()
            ax0.set_xlabel(
                "fresh examples to target (mean ± sd over seeds; faded: not all reached)"
            )
            ax0.set_title(f"{ds}: fresh examples to target")
            seed0 = min(r["config"]["seed"] for r in runs if r["config"]["dataset"] == ds)
            for r in runs:
                c = r["config"]
                if c["dataset"] != ds or c["seed"] != seed0 or not r["curve"]:
                    continue
                if c["insert"] != "after_decode" or c["mode"] != "example":
                    continue
                xs = [p[0] for p in r["curve"]]
                ys = [p[2] for p in r["curve"]]
                ax1.plot(
                    xs,
                    ys,
                    label=r["label"],
                    lw=1.2,
                    ls="-" if c["buffer"] == max(x["buffer"] for x in sub) else "--",
                )
            target = runs[0]["config"]["target"] if runs else None
            for r in runs:
                if r["config"]["dataset"] == ds:
                    target = r["config"]["target"]
                    break
            if target is not None:
                ax1.axhline(target, color="k", lw=0.8, ls=":")
            ax1.set_xlabel("fresh examples consumed")
            ax1.set_ylabel("validation accuracy")
            ax1.set_title(f"{ds}: example echoing after decode, seed {seed0}")
            ax1.legend(fontsize=7)
            return fig

        p = bu.save_plot(out_dir / f"convergence_{ds}.png", draw)
        if p:
            paths.append(p)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the study, prints its tables, writes ``convergence.json``; 0 unless it errs."""
    p = bu.bench_parser("convergence", __doc__, "digits only, 1 seed, low target (< 60 s)")
    p.add_argument("--datasets", nargs="+", default=None, choices=("digits", "synthetic"))
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--echo-factors", type=float, nargs="+", default=(1.0, 2.0, 4.0))
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: the machine is shared; 2 threads oversubscribed it)",
    )
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    factors = sorted(set(args.echo_factors))
    if 1.0 not in factors:
        p.error("--echo-factors must include 1 (the baseline)")
    run = bu.BenchRun.start("convergence", args, argv)
    bu.set_threads(args.threads)
    preset_name = "quick" if args.quick else "full"
    presets = PRESETS[preset_name]
    datasets = args.datasets or list(presets)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])

    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    data_info = {}
    for ds in datasets:
        preset = presets.get(ds) or PRESETS["full"][ds]
        data = bu.load_dataset(ds, **preset.get("data", {}))
        data_info[ds] = data.description
        for cfg in study_configs(ds, preset, seeds, factors):
            r = run_one(cfg, data)
            runs.append(r)
            got = f"{r['fresh_to_target']} fresh" if r["reached"] else "not reached"
            print(
                f"[{time.perf_counter() - start:6.1f}s] {ds} seed {cfg.seed} {cfg.label}: "
                f"{got}, {r['steps']} steps, {r['seconds']:.1f}s",
                flush=True,
            )
    rows = summarise(runs)
    claims = check_claims(rows, factors)
    plots = [] if args.no_plots else plot(runs, rows, run.results_dir)

    table = bu.format_table(
        ["data", "variant", "fresh to target", "ratio vs e=1", "steps", "final acc"],
        [
            [
                r["dataset"],
                r["label"],
                bu.fmt_ms(
                    r["fresh_to_target_mean"], r["fresh_to_target_sd"], r["reached"], r["seeds"]
                ),
                r["fresh_ratio_vs_e1"],
                r["steps_to_target_mean"],
                r["final_accuracy_mean"],
            ]
            for r in rows
        ],
    )
    print()
    print(table)
    run.finish(
        figures={"rows": rows},
        ratios={
            f"{r['dataset']} {r['label']}: fresh vs e=1": r["fresh_ratio_vs_e1"]
            for r in rows
            if r["fresh_ratio_vs_e1"] is not None
        },
        claims=claims,
        config={
            "preset": preset_name,
            "presets": {ds: presets.get(ds) or PRESETS["full"][ds] for ds in datasets},
            "seeds": seeds,
            "echo_factors": factors,
        },
        data=data_info,
        metric="distinct training examples received by the trainer at the first validation "
        "with accuracy >= target",
        paper="Choi et al. 2019: echoing cuts fresh examples; earlier insertion and more "
        "shuffling are better; example echoing >= batch echoing",
        plots=plots,
        runs=runs,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
