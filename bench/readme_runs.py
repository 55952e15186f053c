"""The README's two example runs of ``echopipe train``, recorded so that its figures are not typed.

* ``default``: ``echopipe train`` exactly as the README's first command runs it, ``--runs``
  times. Its stage decision (``--stages auto``) and echo decision (``--echo auto``) come from
  timed trials, so the runs record which way each went: the spread of the decisions is part of
  the result.
* ``slow reader``: the README's example of a slow file system, ``--read-delay-ms 20 --epochs 3``,
  once with ``--echo auto`` and once with ``--echo 1``, both with the same seed.

Each run is a separate ``echopipe train`` process in a temporary folder; the study reads its
``metrics.json``. The figures depend on the machine and its load, which the JSON records.

Run: ``python bench/readme_runs.py [--quick]``; writes ``readme_runs.json``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchutil as bu
from wallclock_train import run_train, trainer_command

SLOW_READER = ["--read-delay-ms", "20", "--epochs", "3"]


def _summary(metrics: dict[str, Any]) -> dict[str, Any]:
    s = metrics["summary"]
    keep = (
        "top1", "fresh_images_per_s", "images_per_s", "train_s", "wall_s", "ratio",
        "echo_factor", "echo_factors_used", "balance", "fresh_samples", "echoed_samples",
    )  # fmt: skip
    out = {k: s[k] for k in keep}
    out["top1"] = 100.0 * s["top1"]  # the summary holds a fraction
    out["stages"] = len(s["balance"])
    out["decisions"] = s["decisions"]
    out["command"] = metrics["command"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the README's examples; returns 0 (figures are reported, not judged)."""
    p = bu.bench_parser("readme_runs", __doc__, "one default run and a 1-epoch slow reader")
    p.add_argument("--runs", type=int, default=3, help="default runs (the decisions' spread)")
    args = p.parse_args(argv)
    run = bu.BenchRun.start("readme_runs", args, argv)
    trainer = trainer_command()
    runs = 1 if args.quick else args.runs
    slow = ["--read-delay-ms", "20", "--epochs", "1"] if args.quick else SLOW_READER
    with tempfile.TemporaryDirectory(prefix="readme_runs_") as tmp:
        root = Path(tmp)
        default = []
        for i in range(runs):
            out = root / f"default-{i}"
            default.append(_summary(run_train(trainer, [], out, root / f"d{i}.log", 1800)))
            print(f"default run {i + 1}/{runs}: {default[-1]['top1']:.1f} % top-1", flush=True)
        slow_runs = {}
        for echo in ("auto", "1"):
            out = root / f"slow-{echo}"
            flags = [*slow, "--echo", echo]
            slow_runs[echo] = _summary(run_train(trainer, flags, out, root / f"s{echo}.log", 1800))
            print(f"slow reader, --echo {echo}: {slow_runs[echo]['top1']:.1f} %", flush=True)
    stages = Counter(r["stages"] for r in default)
    echo_used = Counter(r["echo_factor"] for r in default)
    top1 = [r["top1"] for r in default]
    rate = [r["fresh_images_per_s"] for r in default]
    spread = ", ".join(f"{n} stage(s) in {k} of {runs}" for n, k in sorted(stages.items()))
    auto, plain = slow_runs["auto"], slow_runs["1"]
    claims = [
        bu.claim(
            "default `echopipe train`: validation top-1 at the end (median of the runs)",
            "reported",
            round(statistics.median(top1), 1),
            True,
            f"{runs} run(s): {', '.join(f'{t:.1f} %' for t in top1)}; {spread}; final e "
            + ", ".join(f"{e:g} in {k}" for e, k in sorted(echo_used.items())),
        ),
        bu.claim(
            "default `echopipe train`: fresh images/s over the training time (median)",
            "reported",
            round(statistics.median(rate)),
            True,
            f"wall {statistics.median(r['wall_s'] for r in default):.0f} s, training "
            f"{statistics.median(r['train_s'] for r in default):.0f} s (median)",
        ),
        bu.claim(
            f"slow reader ({' '.join(slow)}): top-1 with --echo auto minus --echo 1",
            "reported",
            round(auto["top1"] - plain["top1"], 1),
            True,
            f"auto {auto['top1']:.1f} % (R {auto['ratio']:.2f}, e used "
            f"{', '.join(f'{e:g}' for e in auto['echo_factors_used'])}, {auto['train_s']:.0f} s, "
            f"{auto['stages']} stage(s)); e = 1 {plain['top1']:.1f} % ({plain['train_s']:.0f} s, "
            f"{plain['stages']} stage(s))",
        ),
    ]
    run.finish(
        figures={"default": default, "slow_reader": slow_runs},
        ratios={"slow_reader_auto_top1_gain": auto["top1"] - plain["top1"]},
        claims=claims,
        config={"runs": runs, "slow_reader_flags": slow},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
