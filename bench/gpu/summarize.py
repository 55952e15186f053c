"""Collects one ``bench/gpu/run.sh`` run into ``<out>/gpu_results.json`` and prints the last table.

Reads ``<out>/steps.tsv`` (one line per step: name, exit status, seconds, log file), the JSON
files the steps wrote, and ``nvidia-smi`` (GPU name, driver, memory), and records the date, so
the results can be copied to ``bench/results/`` with everything needed to judge them.
Usage: ``python bench/gpu/summarize.py OUT_DIR``.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def nvidia_smi() -> list[dict[str, str]]:
    fields = "name,driver_version,memory.total,pci.bus_id,compute_cap"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [{"error": str(exc)}]
    keys = fields.split(",")
    return [
        dict(zip(keys, (v.strip() for v in line.split(",")), strict=False))
        for line in out.strip().splitlines()
    ]


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_results(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Per pytest step, each test's outcome and seconds from its progress file (written as each
    test ends, so a step cut short still lists the tests it finished; a test that started and
    never ended is listed as "did not finish")."""
    steps: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("*.progress.tsv")):
        rows: dict[str, dict[str, Any]] = {}
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if parts[0] == "start" and len(parts) >= 2:
                rows.setdefault(parts[1], {"test": parts[1], "outcome": "did not finish"})
            elif len(parts) >= 4:
                when, outcome, nodeid, secs = parts[:4]
                row = rows.setdefault(nodeid, {"test": nodeid})
                if when == "call" or outcome != "passed":
                    row["outcome"] = outcome if when == "call" else f"{outcome} in {when}"
                    row["seconds"] = float(secs)
        steps[path.name.removesuffix(".progress.tsv")] = list(rows.values())
    return steps


def collect(out: Path) -> dict[str, Any]:
    """Everything a run left in ``out`` as one record (gpu_results.json)."""
    steps = []
    steps_file = out / "steps.tsv"
    if steps_file.exists():
        for line in steps_file.read_text().splitlines():
            name, rc, secs, log = [*line.split("\t"), "", "", ""][:4]
            steps.append({"step": name, "rc": int(rc), "seconds": float(secs), "log": log})
    results = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "gpus": nvidia_smi(),
        "source": load(out / "source.json"),
        "build_info": load(out / "build_info.json"),
        "steps": steps,
        "tests": test_results(out),
        "gather_bw": load(out / "gather_bw.json"),
        "stream_overlap": load(out / "stream_overlap.json"),
        "pipeline": load(out / "pipeline.json"),
        "dali_gpu": load(out / "dali_gpu.json"),
        "train": {
            name: (load(out / name / "metrics.json") or {}).get("summary")
            for name in ("train_mixed", "train_mixed_amp")
        },
    }
    try:
        import torch

        results["torch"] = torch.__version__
        results["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    return results


def _gbps(value: float | None) -> str:
    """A GB/s cell; '-' where the run has no figure (older runs, or the host paced the device)."""
    return f"{value:8.1f}" if value else f"{'-':>8}"


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The run's table as printed at its end; the README's GPU section is the same text."""
    lines: list[str] = []
    gpu = results["gpus"][0] if results["gpus"] else {}
    if "error" in gpu:
        lines.append(f"nvidia-smi failed: {gpu['error']}")
    lines.append(
        f"GPU: {gpu.get('name', '?')}  driver {gpu.get('driver_version', '?')}  "
        f"({len(results['gpus'])} device(s))  {results['date_utc']}"
    )
    src = results["source"] or {}
    lines.append(
        f"commit {src.get('commit', 'unknown')}  uncommitted changes: {src.get('dirty')}  "
        f"sources {src.get('sources_sha256', '?')}  steps: {src.get('steps', '?')}"
    )
    lines.append(f"{'step':<24}{'status':>8}{'seconds':>9}")
    for s in results["steps"]:
        status = "ok" if s["rc"] == 0 else ("skipped" if s["rc"] == 77 else f"FAIL {s['rc']}")
        lines.append(f"{s['step']:<24}{status:>8}{s['seconds']:>9.1f}")
    for name, tests in results["tests"].items():
        counts: dict[str, int] = {}
        for t in tests:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        lines.append(f"{name}: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))
    bw = results["gather_bw"]
    if bw:
        head = f"{'gather':>8}{'+norm':>8}{'memcpy':>8}{'ratio':>7}{'device':>8}"
        lines.append(f"\n{'H2D gather (GB/s)':<24}{head}")
        for r in bw["rows"]:
            lines.append(
                f"{r['image']:<24}{r['gather_GBps']:8.1f}{r['gather_normalize_GBps']:8.1f}"
                f"{r['memcpy_pinned_GBps']:8.1f}{r['gather_vs_memcpy']:7.2f}"
                f"{_gbps(r.get('gather_device_GBps'))}"
            )
        paths = bw.get("copy_paths", [])
        if paths:
            head = f"{'scatter':>8}{'each':>8}{'peer':>8}{'ratio':>7}{'aim':>8}{'device':>8}"
            lines.append(f"\n{'source copy (GB/s)':<32}{head}")
        for r in paths:
            label = f"{r['arena']} {r.get('destinations', 'aligned')} {r['image']}"
            lines.append(
                f"{label:<32}{r['scatter_GBps']:8.1f}"
                f"{r['memcpy_each_GBps']:8.1f}{r['peer_GBps']:8.1f}{r['scatter_vs_peer']:7.2f}"
                f"{'     met' if r['scatter_vs_peer'] >= r['aim'] else ' not met'}"
                f"{_gbps(r.get('scatter_device_GBps'))}"
            )
    ov = results["stream_overlap"]
    if ov:
        lines.append(
            f"\nstage streams overlap: {ov['overlap_us']:.0f} us of {ov['busy_us']:.0f} us busy "
            f"({100 * ov['overlap_fraction_of_busy']:.0f}%)"
        )
    pl = results["pipeline"]
    if pl and isinstance(pl.get("figures"), dict):
        pl = pl["figures"]
    if pl and isinstance(pl.get("rows"), list):
        lines.append("\npipeline (samples/s):")
        for r in pl["rows"]:
            if isinstance(r, dict):
                name = r.get("name") or r.get("row") or r.get("config")
                val = r.get("samples_per_s") or r.get("rate")
                lines.append(f"  {name!s:<40} {val}")
    dg = results["dali_gpu"]
    if dg:
        lines.append("\nDALI mixed decode -> echo -> GPU augment (images/s):")
        for r in dg["rows"]:
            if r.get("error"):
                lines.append(f"  {r['row']:<20}  FAILED: {r['error'][:60]}")
                continue
            vs = r.get("vs_plain")
            vs_text = f"x{vs:.2f} vs plain" if vs else "no plain rate"
            if r.get("vs_ideal"):
                vs_text += f", x{r['vs_ideal']:.2f} the ideal {r['ideal']:.0f}"
            lines.append(f"  {r['row']:<20}{r['images_per_s']:10.0f}  ({vs_text})")
        if not dg.get("complete", True):
            lines.append("  (cut short: the rows above are all that were measured)")
    runs = {k: v for k, v in results["train"].items() if v}
    if runs:
        lines.append("\nechopipe train, 1 epoch on the synthetic set:")
        for name, summary in runs.items():
            lines.append(
                f"  {name:<20}{summary.get('images_per_s', float('nan')):10.0f} img/s  "
                f"top-1 {100 * summary.get('top1', float('nan')):.1f} %"
            )
    lines.append(f"\nfailed steps: {', '.join(failed_steps(results)) or 'none'}")
    return "\n".join(lines).split("\n")  # entries may hold line breaks


def failed_steps(results: dict[str, Any]) -> list[str]:
    return [s["step"] for s in results["steps"] if s["rc"] not in (0, 77)]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: summarize.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    results = collect(out)
    (out / "gpu_results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(["", "==== echopipe GPU run summary ====", *summary_lines(results)]))
    return 1 if failed_steps(results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
