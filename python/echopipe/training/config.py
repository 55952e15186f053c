"""Every option of ``echopipe train``, defined once: the Python API and the CLI both read it.

Each :class:`TrainConfig` field carries its command-line spelling, help text, choices, whether
it may change on ``--resume``, and the check its value must pass. ``add_arguments`` builds the
argparse group from those fields, :meth:`TrainConfig.validate` checks a whole config (no data,
model or DALI is touched), and the trainer compares a checkpoint's config against the fields
that may not change.
"""

# Every field's default is an opt(...) call, which returns a dataclasses.field (RUF009 cannot
# see that).
# ruff: noqa: RUF009

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..models import MODEL_NAMES

__all__ = ["DataError", "TrainConfig", "TrainError", "UsageError", "add_arguments", "flag"]

MAX_ECHO = 100.0
MAX_IMAGE_SIZE = 1024
MAX_SHUFFLE_BUFFER = 1 << 16


class TrainError(Exception):
    """A run that cannot go on, told in one line; ``exit_code`` is the CLI's exit status."""

    exit_code = 1


class UsageError(TrainError, ValueError):
    """A bad option or option combination (exit status 2)."""

    exit_code = 2


class DataError(TrainError):
    """Bad data, or a run that failed on it (exit status 1)."""

    exit_code = 1


def flag(name: str) -> str:
    """The command-line spelling of field ``name``."""
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------------------------
# Value parsers (CLI text to value) and checks (value to None or raise)
# --------------------------------------------------------------------------------------------


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _echo_text(text: str) -> float | str:
    return "auto" if text == "auto" else _number(text)


def _stages_text(text: str) -> int | str:
    return "auto" if text == "auto" else _integer(text)


def _balance_text(text: str) -> list[int] | str:
    if text == "auto":
        return "auto"
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give blocks per stage like 4,4") from None


def _devices_text(text: str) -> list[str]:
    return [d.strip() for d in text.split(",") if d.strip()]


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{flag(name)} must be an integer, got {value!r}")
        if value < minimum:
            raise UsageError(f"{flag(name)} must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise UsageError(f"{flag(name)} must be <= {maximum}, got {value}")

    return check


def _finite(minimum: float = 0.0, positive: bool = False) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"{flag(name)} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise UsageError(f"{flag(name)} must be a finite number, got {value!r}")
        if value < minimum or (positive and value <= 0):
            bound = "> 0" if positive else f">= {minimum:g}"
            raise UsageError(f"{flag(name)} must be {bound}, got {value:g}")

    return check


def _check_echo(name: str, value: Any) -> None:
    if value == "auto":
        return
    _finite(1.0)(name, value)
    if value > MAX_ECHO:
        raise UsageError(
            f"{flag(name)} {value:g} is above {MAX_ECHO:g}: each sample would be "
            "trained on that many times"
        )


def _check_stages(name: str, value: Any) -> None:
    if value != "auto":
        _int_at_least(1)(name, value)


def _check_balance(name: str, value: Any) -> None:
    if value == "auto":
        return
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in value)
    ):
        raise UsageError(f"{flag(name)} {value!r}: give blocks per stage (ints >= 1) or 'auto'")


def _check_devices(name: str, value: Any) -> None:
    if value is None:
        return
    from ..pipeline import parse_devices

    if not isinstance(value, list) or not value:
        raise UsageError(f"{flag(name)} {value!r}: give e.g. cpu or cuda:0,cuda:1")
    try:
        parse_devices(list(value), len(value))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"{flag(name)} {','.join(value)}: {exc}") from None


def _check_path(must_be_dir: bool) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is None:
            return
        path = Path(value)
        if must_be_dir and not path.is_dir():
            what = "is not a folder" if path.exists() else "does not exist"
            raise UsageError(f"{flag(name)} {str(path)!r} {what}")
        if not must_be_dir and path.exists() and not path.is_file():
            raise UsageError(f"{flag(name)} {str(path)!r} is not a file")

    return check


def _check_output(name: str, value: Any) -> None:
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag(name)} {str(path)!r} is a file; give a run folder")


def _check_optional(check: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    def optional(name: str, value: Any) -> None:
        if value is not None:
            check(name, value)

    return optional


def _no_check(name: str, value: Any) -> None:
    return None


def opt(
    default: Any,
    help: str,
    *,
    check: Callable[[str, Any], None] = _no_check,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[Any, ...] | None = None,
    metavar: str | None = None,
    short: str | None = None,
    alias: str | None = None,
    group: str = "data and schedule",
    on_resume: Literal["fixed", "free"] = "fixed",
    cli: bool = True,
) -> Any:
    """A :class:`TrainConfig` field with everything the CLI and the checks need."""
    meta = dict(
        help=help,
        check=check,
        parse=parse,
        choices=choices,
        metavar=metavar,
        short=short,
        alias=alias,
        group=group,
        on_resume=on_resume,
        cli=cli,
    )
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------
# The options
# --------------------------------------------------------------------------------------------

_D, _E, _P, _O = "data and schedule", "data echoing", "pipelining and devices", "run folder"


@dataclass
class TrainConfig:
    """Everything ``echopipe train`` needs; each field is one command-line option.

    ``None`` for ``data`` means the cached synthetic set; ``None`` for ``devices`` means the
    GPUs when there are any, else the CPU.
    """

    data: Path | None = opt(
        None,
        "ImageNet-layout folder with train/<class>/*.JPEG and "
        "val/<class>/*.JPEG (default: the cached synthetic set)",
        check=_check_path(True),
        parse=Path,
        metavar="DIR",
    )
    model: str = opt("resnet_small", "model from echopipe.models", choices=MODEL_NAMES)
    image_size: int = opt(
        64,
        "training crop / validation centre crop side (px)",
        check=_int_at_least(16, MAX_IMAGE_SIZE),
        parse=_integer,
    )
    epochs: int = opt(
        8,
        "passes over the fresh training data",
        check=_int_at_least(1),
        parse=_integer,
        on_resume="free",
    )
    max_steps: int | None = opt(
        None,
        "stop after this many training steps in all (the LR schedule still spans --epochs)",
        parse=_integer,
        check=_check_optional(_int_at_least(1)),
        on_resume="free",
    )
    batch_size: int = opt(
        32,
        "minibatch size per replica",
        check=_int_at_least(1, 1 << 16),
        parse=_integer,
        short="-b",
    )
    lr: float = opt(
        0.1, "peak learning rate (SGD, Nesterov)", check=_finite(positive=True), parse=_number
    )
    momentum: float = opt(0.9, "SGD momentum", check=_finite(), parse=_number)
    weight_decay: float = opt(
        5e-4,
        "weight decay (not on biases and norm scales)",
        check=_finite(),
        parse=_number,
        alias="--wd",
    )
    warmup_epochs: float = opt(
        0.5, "linear LR warm-up, then cosine decay", check=_finite(), parse=_number
    )
    workers: int = opt(
        1,
        "DALI CPU threads per pipeline (upstream and downstream each)",
        check=_int_at_least(1, 256),
        parse=_integer,
        short="-j",
        on_resume="free",
    )
    decode: str = opt(
        "cpu",
        "JPEG decoding on the CPU, or DALI's mixed (nvJPEG on the GPU)",
        choices=("cpu", "mixed"),
    )
    on_corrupt: str = opt(
        "error",
        "a corrupt image stops the run naming it, or is skipped and counted",
        choices=("error", "skip"),
    )
    seed: int = opt(
        0, "seed for model init, DALI and echo draws", check=_int_at_least(0), parse=_integer
    )
    deterministic: bool = opt(
        False,
        "repeatable runs: input in lock-step with training, "
        "balance by parameter count, deterministic torch kernels",
    )
    synthetic_classes: int = opt(
        10,
        "classes of the synthetic set (without --data)",
        check=_int_at_least(2, 1000),
        parse=_integer,
    )
    synthetic_per_class: int = opt(
        100,
        "training images per class of the synthetic set",
        check=_int_at_least(1, 100000),
        parse=_integer,
    )
    echo: float | str = opt(
        "auto",
        "echo factor e >= 1 (1 = no echoing), or 'auto': e follows "
        "R = t_up/t_down and stays 1 while the input keeps up",
        check=_check_echo,
        parse=_echo_text,
        metavar="E|auto",
        group=_E,
    )
    echo_max: float = opt(
        4.0, "upper bound of --echo auto", check=_finite(1.0), parse=_number, group=_E
    )
    echo_interval: int = opt(
        50,
        "with --echo auto: steps between decisions on e",
        check=_int_at_least(1),
        parse=_integer,
        group=_E,
    )
    echo_insert: str = opt(
        "after_decode",
        "where the echo cache sits in the DALI pipeline",
        choices=("after_decode", "after_augment"),
        group=_E,
    )
    echo_mode: str = opt(
        "example", "echo single examples or whole batches", choices=("example", "batch"), group=_E
    )
    shuffle_buffer: int | None = opt(
        None,
        "samples the echo cache holds before the first draw (default: the batch size)",
        parse=_integer,
        group=_E,
        check=_check_optional(_int_at_least(0, MAX_SHUFFLE_BUFFER)),
    )
    cache_mb: int = opt(
        256,
        "echo cache size in MiB (decoded images are stored)",
        check=_int_at_least(1, 1 << 20),
        parse=_integer,
        group=_E,
    )
    read_delay_ms: float = opt(
        0.0,
        "simulated read latency per sample (a network file system), ms",
        check=_finite(),
        parse=_number,
        group=_E,
        on_resume="free",
    )
    stages: int | str = opt(
        "auto",
        "pipeline stages; 'auto': 2-stage pipelining only where a "
        "measurement shows it faster than one stage",
        check=_check_stages,
        parse=_stages_text,
        metavar="N|auto",
        group=_P,
    )
    balance: list[int] | str = opt(
        "auto",
        "model blocks per stage, or 'auto' (by profiling)",
        check=_check_balance,
        parse=_balance_text,
        metavar="N,N,...|auto",
        group=_P,
    )
    hybrid_switch: int | None = opt(
        None,
        "train pipelined (stale) until this epoch, then synchronously",
        parse=_integer,
        metavar="EPOCH",
        check=_check_optional(_int_at_least(0)),
        group=_P,
    )
    devices: list[str] | None = opt(
        None,
        "one device per stage (cpu, cuda:0, ...), or one for all (default: the GPUs, else cpu)",
        check=_check_devices,
        parse=_devices_text,
        metavar="DEV,...",
        group=_P,
    )
    amp: bool = opt(False, "mixed precision: every block under bfloat16 autocast", group=_P)
    channels_last: bool = opt(
        False, "channels-last memory format for the model and input", group=_P
    )
    dist_timeout_s: float = opt(
        600.0,
        "under torchrun: longest wait for another rank",
        check=_finite(positive=True),
        parse=_number,
        group=_P,
        on_resume="free",
        metavar="SECONDS",
    )
    output: Path = opt(
        Path("echopipe-train"),
        "run folder: metrics.json/.csv, config.json, plot, checkpoints/",
        check=_check_output,
        parse=Path,
        metavar="DIR",
        group=_O,
        on_resume="free",
    )
    checkpoint_every: int = opt(
        0,
        "also checkpoint every N steps (0: epoch ends only)",
        check=_int_at_least(0),
        parse=_integer,
        metavar="STEPS",
        group=_O,
        on_resume="free",
    )
    resume: bool | Path = opt(
        False,
        "continue the run in --output from its last checkpoint, or from CKPT",
        group=_O,
        on_resume="free",
        cli=False,
    )
    log_interval: int = opt(
        50,
        "steps between log lines when stderr is not a terminal",
        check=_int_at_least(1),
        parse=_integer,
        metavar="STEPS",
        group=_O,
        on_resume="free",
    )
    progress: bool = opt(True, "progress bars on a terminal", group=_O, on_resume="free", cli=False)

    def validate(self) -> None:
        """Raise :class:`UsageError` naming the first bad value; touches no data or model."""
        for f in dataclasses.fields(self):
            f.metadata["check"](f.name, getattr(self, f.name))
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise UsageError(
                    f"{flag(f.name)} {getattr(self, f.name)!r} is not one of "
                    f"{', '.join(map(str, choices))}"
                )
        if isinstance(self.resume, Path) and not self.resume.is_file():
            what = "is not a file" if self.resume.exists() else "does not exist"
            raise UsageError(f"--resume checkpoint {str(self.resume)!r} {what}")
        if (
            isinstance(self.balance, list)
            and isinstance(self.stages, int)
            and len(self.balance) != self.stages
        ):
            raise UsageError(
                f"--balance {self.balance} has {len(self.balance)} stages but "
                f"--stages is {self.stages}"
            )
        if (
            self.devices is not None
            and isinstance(self.stages, int)
            and len(self.devices) not in (1, self.stages)
        ):
            raise UsageError(
                f"--devices {','.join(self.devices)} gives {len(self.devices)} "
                f"devices for {self.stages} stages; give one, or one per stage"
            )
        self._validate_model_split()
        self._validate_gpu_needs()

    def _validate_model_split(self) -> None:
        # The model's block count, from a build on the meta device (no memory, no init cost).
        import torch

        from ..models import build_model

        with torch.device("meta"):
            blocks = len(build_model(self.model, num_classes=2))
        if isinstance(self.balance, list) and sum(self.balance) != blocks:
            raise UsageError(
                f"--balance {','.join(map(str, self.balance))} covers "
                f"{sum(self.balance)} blocks; {self.model} has {blocks}"
            )
        if isinstance(self.stages, int) and self.stages > blocks:
            raise UsageError(f"--stages {self.stages}: {self.model} has only {blocks} blocks")

    def _validate_gpu_needs(self) -> None:
        import torch

        has_cuda = torch.cuda.is_available()
        wants_gpu = self.devices is not None and any(d.startswith("cuda") for d in self.devices)
        if self.decode == "mixed" and self.devices is not None and not wants_gpu:
            raise UsageError(
                f"--decode mixed decodes on a GPU, but --devices {','.join(self.devices)} has none"
            )
        if self.decode == "mixed" and not has_cuda:
            raise UsageError("--decode mixed decodes on a GPU, but torch sees no CUDA device")

    def fixed_on_resume(self) -> dict[str, Any]:
        """The options a resumed run must share with its checkpoint, as JSON values."""
        return {
            f.name: _json_value(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.metadata["on_resume"] == "fixed"
        }

    def as_json(self) -> dict[str, Any]:
        """Every option as a JSON value."""
        return {f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _json_value(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def free_on_resume() -> list[str]:
    """Flags that may differ between a checkpoint's run and the run resuming it."""
    return [
        flag(f.name)
        for f in dataclasses.fields(TrainConfig)
        if f.metadata["on_resume"] == "free" and f.metadata["cli"]
    ]


# --------------------------------------------------------------------------------------------
# The CLI, generated from the fields
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one argument per :class:`TrainConfig` field (defaults shown once, choices listed)."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        if not meta["cli"]:
            continue
        group = groups.get(meta["group"]) or groups.setdefault(
            meta["group"], parser.add_argument_group(meta["group"])
        )
        names = [n for n in (meta["short"], flag(f.name), meta["alias"]) if n]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        shown = "off" if default is None or default is False else default
        help_text = (
            meta["help"] if "default:" in meta["help"] else f"{meta['help']} (default: {shown})"
        )
        if isinstance(default, bool):
            group.add_argument(*names, dest=f.name, action="store_true", help=help_text)
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if meta["choices"]:
            kw["choices"] = meta["choices"]
        if meta["parse"]:
            kw["type"] = meta["parse"]
        metavar = meta["metavar"] or {_integer: "N", _number: "X"}.get(meta["parse"])
        if metavar:
            kw["metavar"] = metavar
        group.add_argument(*names, **kw)
    g = groups[_O]
    g.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="CKPT",
        help="continue the run in --output from its last checkpoint, or from CKPT "
        f"(these may change on resume: {', '.join(free_on_resume())})",
    )
    g.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bars; log lines every --log-interval steps instead",
    )
    g.add_argument(
        "--evaluate",
        type=Path,
        default=None,
        metavar="CKPT",
        help="only validate the weights of checkpoint CKPT and print top-1",
    )
    g.add_argument("--debug", action="store_true", help="show the traceback of an error")


def from_namespace(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``echopipe train`` arguments."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    if values["resume"] not in (True, False):
        values["resume"] = Path(values["resume"])
    return TrainConfig(**values)
