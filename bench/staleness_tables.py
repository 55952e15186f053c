"""Summary, claims and markdown tables of ``staleness_remedies.json`` (no training here).

``python bench/staleness_remedies.py --render-docs`` calls :func:`render_docs`, which rewrites
the blocks between the ``staleness-remedies`` and ``staleness-resnet-val`` markers of
docs/pipeline.md from the JSON files, so the numbers in the docs are never typed by hand.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import benchutil as bu

DOCS = Path(__file__).resolve().parents[1] / "docs" / "pipeline.md"
GENERATOR = "python bench/staleness_remedies.py --render-docs"
BLOCKS = (
    ("staleness-remedies", "staleness_remedies.json"),
    ("staleness-resnet-val", "staleness_resnet_val/staleness_remedies.json"),
)
NOISE_SE = 2.0  # "beyond seed noise": a paired mean difference above 2 standard errors


def _stats(values: list[float]) -> dict[str, float | int]:
    n = len(values)
    sd = statistics.stdev(values) if n > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "se": sd / math.sqrt(n), "n": n}


def summarise(runs: list[dict[str, Any]], speed: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (data set, variant): accuracy and paired drop over seeds; the study's derived choices."""
    acc = {(r["dataset"], r["label"], r["seed"]): r["final_accuracy"] for r in runs}
    rows = []
    for ds in dict.fromkeys(r["dataset"] for r in runs):
        for label in dict.fromkeys(r["label"] for r in runs if r["dataset"] == ds):
            mine = [r for r in runs if (r["dataset"], r["label"]) == (ds, label)]
            first = mine[0]
            base = "paper non-pipelined" if first["group"] == "paper" else "non-pipelined"
            seeds = [r["seed"] for r in mine if (ds, base, r["seed"]) in acc]
            drops = [100 * (acc[ds, base, s] - acc[ds, label, s]) for s in seeds]
            a = _stats([r["final_accuracy"] for r in mine])
            d = _stats(drops) if label != base else None
            rows.append(
                {
                    "dataset": ds,
                    "model": first["model"],
                    "label": label,
                    "group": first["group"],
                    "stages": first["stages"],
                    "balance": first["balance"],
                    "switch_epoch": first["switch_epoch"],
                    "epochs": first["epochs"],
                    "lr_mode": first["lr_mode"],
                    "seeds": a["n"],
                    "accuracy_mean": a["mean"],
                    "accuracy_sd": a["sd"],
                    "drop_points_mean": d["mean"] if d else None,
                    "drop_points_sd": d["sd"] if d else None,
                    "drop_points_se": d["se"] if d else None,
                    "baseline": base,
                }
            )
    return {
        "rows": rows,
        "throughput": speed,
        "early_vs_balanced": _early_vs_balanced(runs, acc),
        "hybrid_default": _hybrid_default(rows),
    }


def _early_vs_balanced(runs: list[dict[str, Any]], acc: dict) -> list[dict[str, Any]]:
    """Paired per seed: (drop of the balanced split) - (drop of the early split), in points."""
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in runs):
        for k in (2, 4):
            early, bal = f"K={k} early", f"K={k} balanced"
            seeds = sorted(
                {r["seed"] for r in runs if r["dataset"] == ds}
                & {s for (d, lab, s) in acc if d == ds and lab == early}
                & {s for (d, lab, s) in acc if d == ds and lab == bal}
            )
            if not seeds:
                continue
            diff = _stats([100 * (acc[ds, early, s] - acc[ds, bal, s]) for s in seeds])
            out.append(
                {
                    "dataset": ds,
                    "stages": k,
                    "extra_drop_of_balanced_points_mean": diff["mean"],
                    "sd": diff["sd"],
                    "se": diff["se"],
                    "seeds": diff["n"],
                    "beyond_noise": diff["n"] > 1 and diff["mean"] > NOISE_SE * diff["se"],
                }
            )
    return out


def _hybrid_default(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The hybrid (switch, LR mode) whose worst mean drop over the data sets is smallest.

    The worst case, not the average: a default has to hold on every model, and an average
    lets a noisy gain on one model hide a loss on another.
    """
    hybrid = [r for r in rows if r["group"] == "hybrid"]
    if not hybrid:
        return None
    keys = list(dict.fromkeys((r["switch_epoch"] / r["epochs"], r["lr_mode"]) for r in hybrid))
    by_key = {
        key: [r for r in hybrid if (r["switch_epoch"] / r["epochs"], r["lr_mode"]) == key]
        for key in keys
    }
    drops = {k: [r["drop_points_mean"] for r in by_key[k]] for k in keys}
    best = min(keys, key=lambda k: (max(drops[k]), statistics.fmean(drops[k])))
    return {
        "rule": "smallest worst-case (over the data sets) mean drop, ties by the average",
        "switch_fraction": best[0],
        "lr_mode": best[1],
        "worst_drop_points": max(r["drop_points_mean"] for r in by_key[best]),
        "labels": {r["dataset"]: r["label"] for r in by_key[best]},
    }


def claims(summary: dict[str, Any], hybrid_aim: float, paper: dict[str, float]) -> list[dict]:
    """The issue's aims, each met / not met with its reason."""
    rows = {(r["dataset"], r["label"]): r for r in summary["rows"]}
    out = []
    default = summary["hybrid_default"]
    for ds, label in (default or {"labels": {}})["labels"].items():
        r = rows[ds, label]
        thru = rows[ds, "K=4 balanced"]
        n_hybrid = sum(x["dataset"] == ds and x["group"] == "hybrid" for x in summary["rows"])
        best = min(
            (x for x in summary["rows"] if x["dataset"] == ds and x["group"] == "hybrid"),
            key=lambda x: x["drop_points_mean"],
        )
        out.append(
            bu.claim(
                f"{r['model']} K=4 hybrid drop (study default: {label[11:]})",
                f"<= {hybrid_aim} pt",
                round(r["drop_points_mean"], 3),
                r["drop_points_mean"] <= hybrid_aim,
                f"drop {r['drop_points_mean']:+.2f} ± {r['drop_points_sd']:.2f} pt (s.e. "
                f"{r['drop_points_se']:.2f}) over {r['seeds']} seeds; pipelined throughout "
                f"{_pm(thru['drop_points_mean'], thru['drop_points_sd'])} pt; "
                + (
                    "the only hybrid in this run: the default was fixed before it"
                    if n_hybrid == 1
                    else f"best hybrid on {r['model']}: {best['label'][11:]} "
                    f"{best['drop_points_mean']:+.2f} pt (the default is picked on these seeds)"
                ),
            )
        )
    for e in summary["early_vs_balanced"]:
        if e["stages"] != 4:
            continue
        model = rows[e["dataset"], "non-pipelined"]["model"]
        m, se = e["extra_drop_of_balanced_points_mean"], e["se"]
        out.append(
            bu.claim(
                f"{model} K=4: early-layers-only drop smaller than balanced, beyond seed noise",
                f"paired difference > {NOISE_SE:g} standard errors",
                round(m, 3),
                bool(e["beyond_noise"]),
                f"balanced drops {m:+.2f} pt more than early (s.e. {se:.2f} pt, "
                f"{e['seeds']} seeds)",
            )
        )
    for t in summary["throughput"]:
        r = rows.get((t["dataset"], t["label"]))
        out.append(
            bu.claim(
                f"{t['dataset']} {t['label']} {t['balance']}: throughput beside accuracy",
                "reported",
                round(t["samples_per_s"], 1),
                r is not None,
                f"{t['samples_per_s']:.0f} samples/s (x{t['measured_speedup_vs_1_stage']:.2f} "
                f"vs 1 stage, under load), stage-time bound x{t['stage_bound_speedup']:.2f}; "
                + (
                    "no accuracy row" if r is None else f"accuracy {100 * r['accuracy_mean']:.2f} %"
                ),
            )
        )
    p = rows.get(("digits", "paper K=2 [1, 5]"))
    if p is not None:
        out.append(
            bu.claim(
                "lenet5 paper setting ([1, 5], Caffe solver): drop within the paper's",
                f"<= {paper['lenet5']} pt",
                round(p["drop_points_mean"], 3),
                p["drop_points_mean"] <= paper["lenet5"],
                f"drop {p['drop_points_mean']:+.2f} ± {p['drop_points_sd']:.2f} pt",
            )
        )
    return out


def ratios(summary: dict[str, Any]) -> dict[str, float]:
    """Measured and stage-bound speedups of each split against one stage."""
    out: dict[str, float] = {}
    for t in summary["throughput"]:
        key = f"{t['dataset']} {t['label']} {t['balance']}"
        out[f"{key}: samples/s vs 1 stage (under load)"] = t["measured_speedup_vs_1_stage"]
        out[f"{key}: stage-time bound speedup"] = t["stage_bound_speedup"]
    return out


def _pm(mean: float | None, sd: float | None, scale: float = 1.0) -> str:
    return "-" if mean is None else f"{scale * mean:+.2f} ± {scale * (sd or 0):.2f}"


def markdown(summary: dict[str, Any], claim_list: list[dict[str, Any]]) -> str:
    """The study's tables: depth with throughput, hybrid grid, paper setting, aims."""
    rows = summary["rows"]
    speed = {(t["dataset"], t["label"]): t for t in summary["throughput"]}
    depth = []
    for r in rows:
        if r["group"] not in ("baseline", "depth"):
            continue
        t = speed.get((r["dataset"], r["label"]), {})
        depth.append(
            [
                r["model"], r["label"], str(r["balance"]),
                f"{t['stale_share_params']:.2f} / {t['stale_share_layers']:.2f}" if t else "-",
                f"{100 * r['accuracy_mean']:.2f} ± {100 * r['accuracy_sd']:.2f}",
                _pm(r["drop_points_mean"], r["drop_points_sd"]),
                f"x{t['stage_bound_speedup']:.2f}" if t else "-",
                f"{t['samples_per_s']:.0f} (x{t['measured_speedup_vs_1_stage']:.2f})" if t else "-",
            ]
        )  # fmt: skip
    models = list(dict.fromkeys(r["model"] for r in rows))
    k4 = {t["dataset"]: t["stage_bound_speedup"] for t in summary["throughput"]
          if t["label"] == "K=4 balanced"}  # fmt: skip
    bound = {r["model"]: k4[r["dataset"]] for r in rows if r["dataset"] in k4}
    grid = []
    labels = ["K=4 balanced"] + [r["label"] for r in rows if r["group"] == "hybrid"]
    for key in dict.fromkeys(labels):
        cells = ["pipelined throughout" if key == "K=4 balanced" else key[11:]]
        speeds = []
        for m in models:
            r = next((x for x in rows if x["model"] == m and x["label"] == key), None)
            cells.append("-" if r is None else _pm(r["drop_points_mean"], r["drop_points_sd"]))
            f = 1.0 if r is None or r["switch_epoch"] is None else r["switch_epoch"] / r["epochs"]
            # Pipelined epochs run at the stage-time bound, the synchronous ones at 1x.
            speeds.append(f"x{1 / (f / bound[m] + 1 - f):.2f}" if m in bound else "-")
        grid.append(cells + speeds)
    paper = [
        [r["label"], f"{100 * r['accuracy_mean']:.2f} ± {100 * r['accuracy_sd']:.2f}",
         _pm(r["drop_points_mean"], r["drop_points_sd"])]
        for r in rows if r["group"] == "paper"
    ]  # fmt: skip
    parts = [
        "**How deep the pipelining goes** (pipelined for the whole run; stale share = "
        "parameters / layers with parameters in the stale stages; drop = non-pipelined minus "
        "variant, paired per seed, mean ± s.d. in points; samples/s measured under load):",
        "",
        bu.format_table(
            [
                "model",
                "split",
                "balance",
                "stale share",
                "accuracy %",
                "drop (pt)",
                "stage-time bound",
                "samples/s (vs 1 stage)",
            ],
            depth,
        ),
        "",
        "**Hybrid switch and LR across it** (K = 4, balanced split; drop in points, mean ± s.d.; "
        "speed bound: the K = 4 stage-time bound for the pipelined epochs, 1x for the rest):",
        "",
        bu.format_table(
            [
                "switch, LR across it",
                *(f"{m} drop (pt)" for m in models),
                *(f"{m} speed bound" for m in models),
            ],
            grid,
        ),
    ]
    if paper:
        parts += [
            "",
            "**The paper's LeNet-5 setting** (Caffe solver, `[1, 5]`):",
            "",
            bu.format_table(["variant", "accuracy %", "drop (pt)"], paper),
        ]
    if claim_list:
        parts += ["", "**Aims:**", "", bu.claims_table(claim_list)]
    return "\n".join(parts)


def resummarise(path: Path, hybrid_aim: float, paper: dict[str, float]) -> dict[str, Any]:
    """Recomputes figures, claims and ratios of a written JSON from its stored runs.

    No training: the runs and throughput rows are kept as measured; only the derived summary
    follows the current rules. The JSON records that it was re-summarised.
    """
    blob = json.loads(path.read_text())
    summary = summarise(blob["runs"], blob["figures"]["throughput"])
    blob["figures"] = summary
    blob["claims"] = claims(summary, hybrid_aim, paper)
    blob["ratios"] = ratios(summary)
    blob["resummarised"] = "figures, claims and ratios recomputed from runs by --resummarise"
    bu.write_json(path, blob)
    return blob


def _block(blob: dict[str, Any]) -> str:
    m = blob["machine"]
    head = (
        f"Run {m['date_utc'][:16].replace('T', ' ')} UTC, `{blob['command']['reproduce']}`, "
        f"{len(blob['config']['seeds'])} seeds, {blob['wall_s'] / 60:.0f} min; load average "
        f"{m['load_average_1_5_15_start'][0]} at the start on {m['cpu_count']} CPUs "
        f"({blob.get('machine_load', '')})."
    )
    return f"{head}\n\n{markdown(blob['figures'], blob['claims'])}"


def render_docs(results_dir: Path | None) -> int:
    """Rewrites the generated blocks of docs/pipeline.md from the study's JSON files."""
    folder = Path(results_dir or Path(__file__).resolve().parent / "results")
    text = DOCS.read_text()
    for name, path in BLOCKS:
        begin, end = f"<!-- {name}:begin (generated: {GENERATOR}) -->", f"<!-- {name}:end -->"
        if begin not in text or end not in text:
            print(f"error: {DOCS} lacks the markers {begin!r} ... {end!r}")
            return 2
        if not (folder / path).exists():
            print(f"note: {folder / path} does not exist; its block is left as it is")
            continue
        before, rest = text.split(begin, 1)
        _, after = rest.split(end, 1)
        body = _block(json.loads((folder / path).read_text()))
        text = f"{before}{begin}\n{body}\n{end}{after}"
    DOCS.write_text(text)
    print(f"rewrote the generated tables in {DOCS}")
    return 0
