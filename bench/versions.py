"""This checkout against another one: EchoLoader's ceiling, paired in alternating processes.

A change that makes the echo machinery slower shows where nothing else bounds it: the ceiling
regime of ``bench/echo_loader.py`` (pre-collated batches from memory, e = 2, batches of 64, no
step), for 3x32x32 and 3x112x112 uint8 images, and the consumer alone (e = 16, where the
reader thread is nearly idle). Both trees cannot be imported by one process, so each round runs
one child process per tree (``PYTHONPATH=<tree>/python``), back to back, in alternating order
(``benchutil.paired_ratios``); a child reports the best of 5 epochs. ``vs_baseline`` is the
median of the per-round ratios (this tree / the baseline; above 1 = this tree is faster), with
their interquartile range and the load average before each pair.

The baseline is a second checkout whose native parts are built into its ``python/echopipe/``
(e.g. ``git worktree add ../base <rev>`` and the README's developer build there). Writes
``<results-dir>/versions.json``; ``--quick`` runs 3 rounds of shorter epochs.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import benchutil as bu
from echo_loader import BATCH, timed_epoch

CASES = (
    {"name": "ceiling 3x32x32, e=2", "side": 32, "e": 2.0},
    {"name": "ceiling 3x112x112, e=2", "side": 112, "e": 2.0},
    {"name": "consumer 3x32x32, e=16", "side": 32, "e": 16.0},
)


def child(side: int, e: float, batches: int) -> float:
    """Best images/s of 5 epochs of EchoLoader over ``batches`` in-memory batches (the ceiling
    regime of ``echo_loader.py``, timed as it times it)."""
    import torch

    from echopipe.torch import EchoLoader

    torch.set_num_threads(1)
    pool = torch.randint(0, 256, (BATCH, 3, side, side), dtype=torch.uint8)
    data = [(pool, torch.arange(BATCH))] * batches
    return max(timed_epoch(EchoLoader(data, e, seed=1), None)[0] for _ in range(5))


def run_child(tree: Path, side: int, e: float, batches: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree / "python"))
    cmd = [sys.executable, __file__, "--child", str(side), str(e), str(batches)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
    return float(out.stdout.split()[-1])


def revision(tree: Path) -> str:
    def git(*args: str) -> str:
        cmd = ["git", "-C", str(tree), *args]
        return subprocess.run(cmd, capture_output=True, text=True).stdout

    # The code measured is the package and its native parts (not results, docs or the README).
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "python", "csrc").strip()
    return git("rev-parse", "HEAD").strip() + (" (with uncommitted changes)" if dirty else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the paired rounds, prints the table, writes ``versions.json``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        print(child(int(argv[1]), float(argv[2]), int(argv[3])))
        return 0
    p = bu.bench_parser("versions", __doc__, "3 rounds of shorter epochs")
    p.add_argument("--baseline", type=Path, required=True, help="the other checkout (built)")
    p.add_argument("--rounds", type=int, default=None, help="paired rounds per case")
    args = p.parse_args(argv)
    if not (args.baseline / "python" / "echopipe").is_dir():
        p.error(f"--baseline {args.baseline}: no python/echopipe there (not a checkout)")
    run = bu.BenchRun.start("versions", args, argv)
    rounds = args.rounds or (3 if args.quick else 10)
    batches = 40 if args.quick else 150
    here = bu.REPO
    rows = []
    for case in CASES:
        n = batches if case["e"] <= 2 else max(batches // 4, 10)
        pairs = bu.paired_ratios(
            rounds,
            lambda c=case, n=n: run_child(args.baseline, c["side"], c["e"], n),
            lambda c=case, n=n: run_child(here, c["side"], c["e"], n),
        )
        rows.append({"case": case["name"], **case, "batches_per_epoch": n,
                     "this_images_per_s": statistics.median(pairs["round_measured_rates"]),
                     "baseline_images_per_s": statistics.median(pairs["round_baseline_rates"]),
                     "vs_baseline": pairs["median_ratio"], "pairs": pairs})  # fmt: skip
        print(f"{case['name']}: this tree / baseline {pairs['median_ratio']:.3f} "
              f"(IQR {pairs['q1_ratio']:.3f}..{pairs['q3_ratio']:.3f})", flush=True)  # fmt: skip
    worst = min(row["vs_baseline"] for row in rows)
    print()
    print(bu.format_table(
        ["case", "this tree img/s", "baseline img/s", "this / baseline", "IQR"],
        [[r["case"], r["this_images_per_s"], r["baseline_images_per_s"], r["vs_baseline"],
          r["pairs"]["iqr_ratio"]] for r in rows],
    ))  # fmt: skip
    claim = bu.claim(
        "EchoLoader where the echo machinery bounds it, this tree against the baseline "
        "(median of paired rounds)",
        ">= 0.95x (no slowdown beyond noise)",
        round(worst, 3),
        worst >= 0.95,
        "worst of "
        + ", ".join(f"{r['case']} {r['vs_baseline']:.3f}" for r in rows)
        + f"; baseline {revision(args.baseline)[:12]}",
    )
    config = {"batch": BATCH, "rounds": rounds, "epochs_per_child": 5,
              "this_tree": revision(here), "baseline_tree": revision(args.baseline)}  # fmt: skip
    run.finish(
        figures={"rows": rows},
        ratios={f"{r['case']} vs baseline": r["vs_baseline"] for r in rows},
        claims=[claim],
        config=config,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
