"""The ``echopipe`` command: ``echopipe train`` and ``echopipe bench``.

``echopipe train`` runs DALI input with data echoing into a stale-weight pipelined model (see
:mod:`echopipe.train` and ``docs/train.md``). ``echopipe bench`` runs the benchmark suites and
prints their tables. A bad argument prints one line, ``echopipe <command>: error: ...``, naming
the value, and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

__all__ = ["BENCH_DEFAULT", "BENCH_STUDIES", "BENCH_SUITES", "build_parser", "main"]

BENCH_DEFAULT: tuple[str, ...] = ("echo_cache", "dali_echo", "pipeline")
"""The microbenchmarks ``echopipe bench`` runs by default, in this order."""

BENCH_STUDIES: tuple[str, ...] = ("convergence", "wallclock", "staleness")
"""Training studies (minutes each): run only with ``--only NAME`` or ``--all``."""

BENCH_SUITES: tuple[str, ...] = BENCH_DEFAULT + BENCH_STUDIES
"""Every suite ``echopipe bench`` knows, in the order it runs them."""


class _OneLineParser(argparse.ArgumentParser):
    """``parser.error`` prints one line (no usage block) and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _echo_value(text: str) -> float | str:
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid echo factor {text!r}: give a number >= 1 or 'auto'"
        ) from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(
            f"invalid echo factor {text!r}: e must be >= 1 (e < 1 would drop data)"
        )
    return value


def _balance_value(text: str) -> list[int] | str:
    if text == "auto":
        return "auto"
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid balance {text!r}: give blocks per stage like 4,4 or 'auto'"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"invalid balance {text!r}: every stage needs >= 1 block")
    return values


def _devices_value(text: str) -> list[str]:
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise argparse.ArgumentTypeError(
            f"invalid devices {text!r}: give e.g. cpu or cuda:0,cuda:1"
        )
    return devices


def _existing_dir(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"folder {text!r} {what}")
    return path


def _add_train(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train a ResNet with DALI + data echoing + stale-weight pipelining",
        description=(
            "Train an image classifier end to end: DALI reads and decodes JPEGs, the echo cache "
            "reuses each fresh sample e times, and the model is split into pipeline stages "
            "trained with stale weights (PPL-SGD). With no arguments it builds a small synthetic "
            "ImageNet-style set once (cached), trains resnet_small on 2 CPU stages (or the GPUs), "
            "validates every epoch and prints a summary. Under torchrun, each process is a "
            "data-parallel replica reading its own shard."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("data and schedule")
    g.add_argument("--data", type=_existing_dir, default=None,
                   help="ImageNet-layout folder with train/<class>/*.JPEG and val/<class>/*.JPEG "
                   "(default: the cached synthetic set)")  # fmt: skip
    g.add_argument(
        "--model",
        default="resnet_small",
        help="model name from echopipe.models (resnet_small, resnet18, resnet50, ...)",
    )
    g.add_argument("--image-size", type=int, default=64, help="training/validation crop side (px)")
    g.add_argument("--epochs", type=int, default=8, help="passes over the fresh training data")
    g.add_argument("-b", "--batch-size", type=int, default=32, help="minibatch size per replica")
    g.add_argument("--lr", type=float, default=0.1, help="peak learning rate (SGD, Nesterov)")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument(
        "--wd",
        "--weight-decay",
        dest="weight_decay",
        type=float,
        default=5e-4,
        help="weight decay (not applied to biases and norm scales)",
    )
    g.add_argument(
        "--warmup-epochs",
        type=float,
        default=0.5,
        help="linear LR warm-up, then cosine decay (per step)",
    )
    g.add_argument(
        "-j",
        "--workers",
        type=int,
        default=1,
        help="DALI CPU threads per pipeline (upstream and downstream each)",
    )
    g.add_argument(
        "--decode",
        choices=("cpu", "mixed"),
        default="cpu",
        help="JPEG decoding on the CPU, or DALI's mixed (nvJPEG on the GPU; then the augmentations "
        "run on the GPU too)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for model init, DALI and echo draws")
    g.add_argument(
        "--synthetic-classes",
        type=int,
        default=10,
        help="classes of the synthetic set (without --data)",
    )
    g.add_argument(
        "--synthetic-per-class",
        type=int,
        default=100,
        help="training images per class of the synthetic set (without --data)",
    )
    g = p.add_argument_group("data echoing")
    g.add_argument(
        "--echo",
        type=_echo_value,
        default=2.0,
        metavar="FACTOR|auto",
        help="echo factor e >= 1 (1 = no echoing), or 'auto' to follow R = t_up/t_down",
    )
    g.add_argument("--echo-max", type=float, default=4.0, help="upper bound for --echo auto")
    g.add_argument(
        "--echo-interval",
        type=int,
        default=50,
        metavar="STEPS",
        help="with --echo auto: steps between decisions on e (also at every epoch end)",
    )
    g.add_argument(
        "--echo-insert",
        choices=("after_decode", "after_augment"),
        default="after_decode",
        help="where the echo cache sits in the DALI pipeline",
    )
    g.add_argument(
        "--echo-mode",
        choices=("example", "batch"),
        default="example",
        help="echo single examples or whole batches",
    )
    g.add_argument(
        "--shuffle-buffer",
        type=int,
        default=None,
        help="samples the echo cache holds before the first draw (default: batch size)",
    )
    g.add_argument(
        "--read-delay-ms",
        type=float,
        default=0.0,
        help="simulated read latency per sample (a network file system), ms",
    )
    g = p.add_argument_group("pipelining and devices")
    g.add_argument(
        "--stages",
        type=int,
        default=None,
        help="pipeline stages (default: one per GPU, or 2 on one GPU / on CPU)",
    )
    g.add_argument(
        "--balance",
        type=_balance_value,
        default=None,
        metavar="N,N,...|auto",
        help="model blocks per stage (default: auto, by profiling)",
    )
    g.add_argument(
        "--hybrid-switch",
        type=int,
        default=None,
        metavar="EPOCH",
        help="train pipelined (stale) until this epoch, then synchronously",
    )
    g.add_argument(
        "--devices",
        type=_devices_value,
        default=None,
        metavar="DEV,DEV,...",
        help="one device per stage (cpu, cuda:0, ...), or one for all stages",
    )
    g.add_argument(
        "--amp", action="store_true", help="mixed precision: run each block under bfloat16 autocast"
    )
    g.add_argument(
        "--dist-timeout-s",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="under torchrun: longest wait for another rank in a collective before the job "
        "fails instead of hanging (default 600)",
    )
    g = p.add_argument_group("checkpoints and output")
    g.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="write checkpoints here, per rank under torchrun (default: a "
        "checkpoints/ folder next to --output)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="STEPS",
        help="also checkpoint every N steps (0: only at epoch ends)",
    )
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept")
    g.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="CKPT",
        help="continue from a checkpoint file, or from the newest in --checkpoint-dir",
    )
    g.add_argument(
        "--output",
        type=Path,
        default=Path("echopipe-train/metrics.json"),
        help="metrics JSON (one row per epoch); the PNG plots go next to it",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars; print one line per epoch instead",
    )
    return p


def _add_bench(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="run the benchmark suites and print their tables",
        description=(
            f"Run echopipe's benchmark suites in sequence ({', '.join(BENCH_DEFAULT)}; the "
            f"studies {', '.join(BENCH_STUDIES)} only with --only or --all) and print their "
            "tables; each writes <results-dir>/<suite>.json. A suite that cannot run here "
            "(e.g. DALI missing) is reported as skipped with the reason; a failing suite makes "
            "the exit status 1. Aims not met are results, not failures."
        ),
    )
    p.add_argument("--quick", action="store_true", help="each suite's short preset")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--only",
        nargs="+",
        choices=BENCH_SUITES,
        default=None,
        metavar="NAME",
        help=f"run only these suites, in the order given ({', '.join(BENCH_SUITES)})",
    )
    which.add_argument("--all", action="store_true", help="also run the studies")
    p.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the suites write <suite>.json (default: bench/results in a source "
        "checkout, else ./bench-results)",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``echopipe`` argument parser (sub-commands ``train`` and ``bench``)."""
    parser = _OneLineParser(
        prog="echopipe",
        description="echopipe: data echoing in DALI + stale-weight pipelined training.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"echopipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_OneLineParser)
    sub.required = True
    _add_train(sub)
    _add_bench(sub)
    return parser


# --------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------


def _train_config(args: argparse.Namespace) -> Any:
    from .train import TrainConfig

    resume: bool | Path = args.resume if args.resume is True or args.resume is False else Path(
        args.resume
    )  # fmt: skip
    return TrainConfig(
        data=args.data,
        model=args.model,
        image_size=args.image_size,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        warmup_epochs=args.warmup_epochs,
        workers=args.workers,
        decode=args.decode,
        seed=args.seed,
        synthetic_classes=args.synthetic_classes,
        synthetic_per_class=args.synthetic_per_class,
        echo=args.echo,
        echo_max=args.echo_max,
        echo_interval=args.echo_interval,
        echo_insert=args.echo_insert,
        echo_mode=args.echo_mode,
        shuffle_buffer=args.shuffle_buffer,
        read_delay_ms=args.read_delay_ms,
        stages=args.stages,
        balance=args.balance,
        devices=args.devices,
        hybrid_switch=args.hybrid_switch,
        amp=args.amp,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        dist_timeout_s=args.dist_timeout_s,
        keep_checkpoints=args.keep_checkpoints,
        resume=resume,
        output=args.output,
        progress=not args.no_progress,
    )


def _run_train(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch

    from ._allocator import tune_host_allocator
    from .train import format_summary, train

    # Before the first large allocation, so activations are reused rather than page-faulted in.
    tune_host_allocator(single_arena=not torch.cuda.is_available())
    cfg = _train_config(args)
    try:
        cfg.validate()
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    from .train_io import CheckpointError

    try:
        summary = train(cfg)
    except (FileExistsError, FileNotFoundError, CheckpointError) as exc:
        parser.error(str(exc))
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(summary), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------


def _bench_package() -> str | None:
    """Makes ``echopipe._bench`` importable; the reason why not, or None.

    Installs ship ``bench/*.py`` as ``echopipe._bench``; a source tree that was never installed
    gets its ``bench/`` folder mapped to that name, so the suites' relative imports still work.
    """
    try:
        importlib.import_module("echopipe._bench")
        return None
    except ModuleNotFoundError as exc:
        if exc.name != "echopipe._bench":
            raise
    source = Path(__file__).resolve().parents[2] / "bench"
    if not (source / "benchutil.py").is_file():
        return "echopipe._bench is not installed and there is no bench/ folder next to it"
    package = ModuleType("echopipe._bench")
    package.__path__ = [str(source)]
    package.__package__ = "echopipe._bench"
    sys.modules["echopipe._bench"] = package
    return None


def _load_suite(name: str) -> tuple[ModuleType | None, str]:
    """The suite module, or None and the reason it cannot run here."""
    problem = _bench_package()
    if problem is not None:
        return None, problem
    try:
        module = importlib.import_module(f"echopipe._bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"echopipe._bench.{name}":
            return None, f"echopipe._bench.{name} is not installed (re-install echopipe)"
        return None, f"needs {exc.name}, which is not installed"
    unavailable = getattr(module, "unavailable", None)
    reason = unavailable() if callable(unavailable) else None
    return (None, reason) if reason else (module, "")


def _run_suite(module: ModuleType, argv: list[str]) -> int:
    """``module.main(argv)`` as an exit status; exceptions are printed and count as 1."""
    try:
        result = module.main(argv)
    except SystemExit as exc:  # e.g. the suite's own argument parser
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:
        traceback.print_exc()
        return 1
    return result if isinstance(result, int) else 0


def _run_bench(args: argparse.Namespace) -> int:
    if args.only:
        suites = list(dict.fromkeys(args.only))
    else:
        suites = list(BENCH_SUITES if args.all else BENCH_DEFAULT)
    outcomes: list[tuple[str, str, float]] = []
    for name in suites:
        t0 = time.perf_counter()
        module, reason = _load_suite(name)
        if module is None:
            outcomes.append((name, f"skipped: {reason}", 0.0))
            print(f"\n=== echopipe bench: {name}: skipped: {reason} ===", flush=True)
            continue
        argv: list[str] = ["--quick"] if args.quick else []
        if args.results_dir is not None:
            argv += ["--results-dir", str(args.results_dir)]
        print(f"\n=== echopipe bench: {name} {' '.join(argv)} ===", flush=True)
        rc = _run_suite(module, argv)
        seconds = time.perf_counter() - t0
        outcomes.append((name, "ok" if rc == 0 else f"failed (exit {rc})", seconds))
    print("\n=== echopipe bench: suites ===")
    width = max(len(result) for _, result, _ in outcomes)
    print(f"{'suite':<12} {'result':<{width}} {'seconds':>8}")
    for name, result, seconds in outcomes:
        print(f"{name:<12} {result:<{width}} {seconds:8.1f}")
    return 1 if any(result.startswith("failed") for _, result, _ in outcomes) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``echopipe`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        train_parser = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
        return _run_train(train_parser, args)
    return _run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
