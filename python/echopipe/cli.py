"""The ``echopipe`` command: ``echopipe train``, ``echopipe export`` and ``echopipe bench``.

``echopipe train`` runs DALI input with data echoing into a stale-weight pipelined model (see
:mod:`echopipe.training` and ``docs/train.md``). ``echopipe bench`` runs the benchmark suites and
prints their tables. A bad argument prints one line, ``echopipe <command>: error: ...``, naming
the value, and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from . import stops
from .cli_parser import CommandParser, OneLineParser

__all__ = [
    "BENCH_DEFAULT", "BENCH_STUDIES", "BENCH_SUITES", "bench_dir", "bench_results_dir",
    "build_parser", "main",
]  # fmt: skip

BENCH_DEFAULT: tuple[str, ...] = ("echo_cache", "echo_loader", "dali_echo", "pipeline")
"""The microbenchmarks ``echopipe bench`` runs by default, in this order."""

BENCH_STUDIES: tuple[str, ...] = (
    "convergence", "wallclock", "wallclock_train", "staleness", "staleness_remedies", "readme_runs",
)  # fmt: skip
"""Training studies (minutes each): run only with ``--only NAME`` or ``--all``."""

BENCH_SUITES: tuple[str, ...] = BENCH_DEFAULT + BENCH_STUDIES
"""Every suite ``echopipe bench`` knows, in the order it runs them."""


def _add_train(sub: Any) -> argparse.ArgumentParser:
    from .training.arguments import add_arguments

    p = sub.add_parser(
        "train",
        help="train a ResNet with DALI + data echoing + stale-weight pipelining",
        description=(
            "Train an image classifier end to end: DALI reads and decodes JPEGs, the echo cache "
            "reuses each fresh sample e times when the input is the bottleneck, and the model is "
            "split into pipeline stages trained with stale weights (PPL-SGD) when that measures "
            "faster. With no arguments it builds a small synthetic ImageNet-style set once "
            "(cached), trains resnet_small, validates every epoch and prints a summary; the run "
            "folder (--output) holds metrics, config, plot and checkpoints. Under torchrun, each "
            "process is a data-parallel replica reading its own shard. Exit status: 2 for a bad "
            "argument, 1 for bad data or a failed run."
        ),
    )
    add_arguments(p)
    return p


def _add_export(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export",
        help="write a training checkpoint's model weights as a plain state_dict",
        description=(
            "Read an echopipe train checkpoint (checked, weights only) and write the model's "
            "state_dict under the model's own parameter names, loadable with "
            "build_model(name, num_classes).load_state_dict(torch.load(OUT))."
        ),
    )
    p.add_argument("checkpoint", type=Path, metavar="CKPT", help="e.g. RUN/checkpoints/best.pt")
    p.add_argument("out", type=Path, metavar="OUT.pt", help="where to write the state_dict")
    return p


def _add_bench(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="run the benchmark suites and print their tables",
        description=(
            f"Run echopipe's benchmark suites in sequence ({', '.join(BENCH_DEFAULT)}; the "
            f"studies {', '.join(BENCH_STUDIES)} only with --only or --all) and print their "
            "tables; each writes <results-dir>/<suite>.json, by default into a new folder "
            "bench-results/<date>-<time> (--update-results: the checkout's committed "
            "bench/results). A suite that cannot run here "
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
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the suites write <suite>.json (default: a new folder "
        "bench-results/<date>-<time>)",
    )
    where.add_argument(
        "--update-results",
        action="store_true",
        help="write into the source checkout's bench/results, replacing the committed figures",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``echopipe`` argument parser (sub-commands ``train`` and ``bench``)."""
    parser = OneLineParser(
        prog="echopipe",
        description="echopipe: data echoing in DALI + stale-weight pipelined training.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"echopipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    sub.required = True
    for add in (_add_train, _add_export, _add_bench):
        command = add(sub)
        command.set_defaults(command_parser=command)  # for its one-line errors after parsing
    return parser


# --------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------


def _fail(prog: str, exc: BaseException, debug: bool) -> int:
    """One line naming the problem (the traceback with ``--debug``); the exit status."""
    from .training.config import TrainError

    if debug:
        traceback.print_exception(exc)
    elif not getattr(exc, "quiet", False):  # (a rank that leaves the saying to rank 0)
        sys.stderr.write(f"{prog}: error: {exc}\n")  # one write: torchrun's ranks share stderr
        sys.stderr.flush()
    # A malformed file (a checkpoint, an image) is bad input, not a bad argument: status 1.
    return exc.exit_code if isinstance(exc, TrainError) else 1


def _run_train(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    from .data import CorruptImageError
    from .training.allocator import tune_host_allocator
    from .training.arguments import from_namespace, given_options
    from .training.checkpoints import CheckpointError
    from .training.config import TrainError, UsageError
    from .training.input import evaluate_checkpoint
    from .training.report import format_summary
    from .training.trainer import train

    # Before the first large allocation, so activations are reused rather than page-faulted in.
    tune_host_allocator(single_arena=not torch.cuda.is_available())
    cfg = from_namespace(args)
    if args.evaluate is not None:  # the model and its image size are the checkpoint's
        default = type(cfg)()
        cfg = dataclasses.replace(cfg, model=default.model, image_size=default.image_size)
    try:
        cfg.validate(combination=not cfg.resume)  # a resume's: once merged with its checkpoint
    except UsageError as exc:
        if args.debug:
            raise
        parser.error(str(exc))
    if args.evaluate is not None and not args.evaluate.is_file():
        what = "is not a file" if args.evaluate.exists() else "does not exist"
        parser.error(f"--evaluate {str(args.evaluate)!r} {what}")
    expected = (TrainError, CheckpointError, CorruptImageError, FileNotFoundError, OSError)
    try:
        if args.evaluate is not None:
            top1, loss, n = evaluate_checkpoint(cfg, args.evaluate)
            print(
                f"echopipe train --evaluate: top-1 {100 * top1:.2f} %, loss {loss:.4f} on {n} "
                "validation images (at the checkpoint's image size)",
                flush=True,
            )
            return 0
        summary = train(cfg, given=given_options(argv[argv.index("train") + 1 :]))
    except expected as exc:
        return _fail(parser.prog, exc, args.debug)
    if int(os.environ.get("RANK", "0")) == 0 and not summary.resumed_finished:
        print(format_summary(summary), flush=True)
    return 0


def _not_a_folder(path: Path) -> Path | None:
    """The nearest existing path at or above ``path`` when it is not a folder (nothing can be
    made under it); None when it is one."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return None if path.is_dir() else path


def _run_export(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .pipeline.checkpoint import atomic_save
    from .training.checkpoints import CheckpointError, check_export, export_state_dict

    if not args.checkpoint.exists():
        parser.error(f"CKPT {str(args.checkpoint)!r} does not exist")
    out = args.out  # the write replaces it: a device or FIFO (even /dev/null) would be lost
    if out.exists() and (not out.is_file() or out.samefile(args.checkpoint)):
        what = "a folder" if out.is_dir() else "not a regular file"  # a device, a FIFO
        what = "CKPT itself" if out.is_file() else what
        parser.error(f"OUT {str(out)!r} is {what}; give the file to write")
    if blocker := _not_a_folder(out.parent):
        parser.error(f"cannot write OUT {str(out)!r}: {str(blocker)!r} is not a folder")
    try:
        weights, saved = export_state_dict(args.checkpoint)
    except (CheckpointError, OSError) as exc:  # a malformed or unreadable file: status 1
        return _fail(parser.prog, exc, debug=False)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(weights, args.out)
    except OSError as exc:
        parser.error(f"cannot write OUT {str(args.out)!r}: {exc.strerror or exc}")
    model = saved["model"]
    try:
        check_export(args.out, model)  # what was written loads into the model it names
    except CheckpointError as exc:
        args.out.unlink(missing_ok=True)
        return _fail(parser.prog, exc, debug=False)
    tensors = f"{len(weights)} tensors of {model['name']} ({model['num_classes']} classes)"
    print(f"echopipe export: {tensors} -> {args.out}", flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------


def bench_dir() -> Path | None:
    """The ``bench/`` folder of the source checkout that is the current directory or that this
    package runs from; None outside a checkout (the suites are not in the wheel)."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "bench" / "benchutil.py").is_file() and (root / "pyproject.toml").is_file():
            return root / "bench"
    return None


def _load_suite(name: str) -> tuple[ModuleType | None, str]:
    """The suite module, or None and the reason it cannot run here.

    The suite is imported from the checkout's ``bench/``, which goes onto ``sys.path`` as it
    does for ``python bench/<name>.py``; processes the suite spawns inherit that path.
    """
    folder = bench_dir()
    if folder is None:
        return None, (
            "the suites live in a source checkout's bench/ folder, not in the installed package: "
            "run `echopipe bench` inside a clone of echopipe"
        )
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        return None, f"needs {exc.name}, which is not installed"
    if Path(getattr(module, "__file__", "")).parent != folder:
        return None, f"another module named {name!r} shadows bench/{name}.py"
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


def bench_results_dir(args: argparse.Namespace) -> Path:
    """Where this ``echopipe bench`` writes: ``--results-dir``, the checkout's ``bench/results``
    with ``--update-results``, else a new dated folder under ``./bench-results``."""
    if args.results_dir is not None:
        if blocker := _not_a_folder(Path(args.results_dir)):  # now, not after the suites ran
            args.command_parser.error(
                f"--results-dir {str(args.results_dir)!r}: {str(blocker)!r} is not a folder"
            )
        return Path(args.results_dir)
    if args.update_results:
        folder = bench_dir()
        if folder is None:
            args.command_parser.error(
                "--update-results writes into a source checkout's bench/results; run it inside a "
                "clone of echopipe"
            )
        return folder / "results"
    base = Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    out, n = base, 1
    while out.exists():
        out, n = Path(f"{base}-{n}"), n + 1
    return out


def _run_bench(args: argparse.Namespace) -> int:
    results = bench_results_dir(args)
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
        argv += ["--results-dir", str(results)]
        print(f"\n=== echopipe bench: {name} {' '.join(argv)} ===", flush=True)
        rc = _run_suite(module, argv)
        seconds = time.perf_counter() - t0
        outcomes.append((name, "ok" if rc == 0 else f"failed (exit {rc})", seconds))
    print("\n=== echopipe bench: suites ===")
    width = max(len(result) for _, result, _ in outcomes)
    name_width = max(len("suite"), *(len(name) for name, _, _ in outcomes))
    print(f"{'suite':<{name_width}} {'result':<{width}} {'seconds':>8}")
    for name, result, seconds in outcomes:
        print(f"{name:<{name_width}} {result:<{width}} {seconds:8.1f}")
    print(f"results: {results}")
    return 1 if any(result.startswith("failed") for _, result, _ in outcomes) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``echopipe`` console script; returns the exit status.

    Ctrl-C and SIGTERM end it with one line (status 130 and 143): where a run stopped and the
    checkpoint ``--resume`` would continue from, or that there is none.
    """
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    from_command_line = argv is None
    before = signal.signal(signal.SIGTERM, stops.on_sigterm) if main_thread else None
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "bench":
            return _run_bench(args)
        sub = args.command_parser
        if args.command == "train":
            return _run_train(sub, args, argv)
        return _run_export(sub, args)
    except KeyboardInterrupt as exc:
        if debug:
            raise
        line = getattr(exc, "line", None) or "interrupted during start-up; nothing was written"
        if int(os.environ.get("RANK", "0")) == 0:
            command = argv[0] if argv and not argv[0].startswith("-") else ""
            sys.stderr.write(f"echopipe {command}: {line}\n".replace("  ", " "))  # one write
            sys.stderr.flush()
        return 143 if stops.terminated(exc) else 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)
            if from_command_line:
                stops.quiet_teardown()


if __name__ == "__main__":
    sys.exit(main())
