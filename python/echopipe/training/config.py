"""Every option of ``echopipe train``, defined once: the Python API and the CLI both read it.

Each :class:`TrainConfig` field carries its command-line spelling, help text, choices, whether
it may change on ``--resume``, and the check its value must pass. :mod:`.arguments` builds the
argparse groups from those fields, :meth:`TrainConfig.validate` checks a whole config (no data,
model or DALI is touched), and the trainer compares a checkpoint's config against the fields
that may not change.
"""

# Every field's default is an opt(...) call, which returns a dataclasses.field (RUF009 cannot
# see that).
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..echo.config import MODES, PLACEMENTS, EchoConfig
from ..models import MODEL_NAMES
from .crosschecks import check_combination
from .options import (
    MAX_IMAGE_SIZE,
    DataError,
    Interrupted,
    TrainError,
    UsageError,
    check_balance,
    check_bool,
    check_devices,
    check_optional,
    check_output,
    check_path,
    check_stages,
    check_stages_or_zero,
    check_value,
    echo_opt,
    finite,
    flag,
    int_at_least,
    opt,
    parse_balance,
    parse_devices,
    parse_echo,
    parse_float,
    parse_int,
    parse_path,
    parse_stages,
)

__all__ = [
    "DEFAULT_OUTPUT_BASE",
    "DataError",
    "Interrupted",
    "TrainConfig",
    "TrainError",
    "UsageError",
    "flag",
    "free_on_resume",
]

DEFAULT_OUTPUT_BASE = "echopipe-train"  # runs without --output get a dated folder in it

# The optimizer's step is a float32 scalar on float32 parameters: a larger --lr or --wd is a
# traceback at the first update ("cannot be converted to type float without overflow").
FLOAT32_MAX = 3.4028234663852886e38
# torch.distributed keeps deadlines in int64 nanoseconds: from about 1e10 s on, a wait times out
# at once, hangs, or Gloo refuses it as negative. A billion seconds (31 years) is still no limit.
MAX_DIST_TIMEOUT_S = 1e9

_D, _E, _P, RUN_FOLDER_GROUP = (
    "data and schedule",
    "data echoing",
    "pipelining and devices",
    "run folder",
)


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
        check=check_path(True),
        parse=parse_path,
        metavar="DIR",
    )
    model: str = opt("resnet_small", "model from echopipe.models", choices=MODEL_NAMES)
    image_size: int = opt(
        64,
        "training crop / validation centre crop side (px)",
        check=int_at_least(16, MAX_IMAGE_SIZE),
        parse=parse_int,
    )
    epochs: int = opt(
        8,
        "passes over the fresh training data",
        check=int_at_least(1, 100_000),
        parse=parse_int,
        on_resume="free",
    )
    max_steps: int | None = opt(
        None,
        "stop after this many training steps in all (the LR schedule still spans --epochs)",
        parse=parse_int,
        check=check_optional(int_at_least(1)),
        on_resume="each",
    )
    stop_at_top1: float | None = opt(
        None,
        "stop once validation top-1 (a fraction, e.g. 0.6) reaches this; the LR schedule still "
        "spans --epochs",
        parse=parse_float,
        check=check_optional(finite(maximum=1.0, positive=True)),
        on_resume="each",
    )
    batch_size: int = opt(
        32,
        "minibatch size per replica",
        check=int_at_least(1, 1 << 16),
        parse=parse_int,
        short="-b",
    )
    lr: float = opt(
        0.1,
        "peak learning rate (SGD, Nesterov)",
        check=finite(positive=True, maximum=FLOAT32_MAX),
        parse=parse_float,
    )
    momentum: float = opt(
        0.9,
        "SGD momentum, Nesterov's (0: plain SGD)",
        check=finite(maximum=0.999),
        parse=parse_float,
    )
    weight_decay: float = opt(
        5e-4,
        "weight decay (not on biases and norm scales)",
        check=finite(maximum=FLOAT32_MAX),
        parse=parse_float,
        alias="--wd",
    )
    warmup_epochs: float = opt(
        0.5, "linear LR warm-up, then cosine decay", check=finite(), parse=parse_float
    )
    workers: int = opt(
        1,
        "DALI CPU threads per pipeline (upstream and downstream each)",
        check=int_at_least(1, 256),
        parse=parse_int,
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
    check: str = opt(
        "header",
        "what is checked of every image before training: its markers and size (header), or "
        "also a full decode (decode: about two Pillow decodes per image; finds a JPEG cut "
        "inside its image data and ended with an end marker, which DALI trains on grey)",
        choices=("header", "decode"),
        on_resume="free",
    )
    seed: int = opt(
        0,
        "seed for model init, DALI and echo draws",
        check=int_at_least(0, 2**32 - 1),  # numpy's seeds are 32-bit
        parse=parse_int,
    )
    deterministic: bool = opt(
        False,
        "repeatable runs: input in lock-step with training, "
        "balance by modelled cost (FLOPs, bytes), e = 1 under --echo auto, deterministic torch "
        "kernels",
        check=check_bool,
    )
    synthetic_classes: int = opt(
        10,
        "classes of the synthetic set (without --data)",
        check=int_at_least(2, 1000),
        parse=parse_int,
    )
    synthetic_per_class: int = opt(
        100,
        "training images per class of the synthetic set",
        check=int_at_least(1, 100000),
        parse=parse_int,
    )
    echo: float | str = echo_opt("factor", parse=parse_echo, metavar="E|auto", group=_E)
    echo_max: float = echo_opt("factor_max", parse=parse_float, group=_E)
    echo_interval: int = opt(
        50,
        "with --echo auto: steps between decisions on e (every step before the first "
        "interval, so the first decision, after a short warm-up, applies at once)",
        check=int_at_least(1),
        parse=parse_int,
        group=_E,
    )
    echo_insert: str = echo_opt("placement", choices=PLACEMENTS, group=_E)
    echo_mode: str = echo_opt("mode", choices=MODES, group=_E)
    shuffle_buffer: int | None = echo_opt("shuffle_buffer", parse=parse_int, group=_E)
    cache_mb: int = echo_opt(
        "cache_bytes", unit=1 << 20, unit_name="MiB", parse=parse_int, group=_E
    )
    read_delay_ms: float = opt(
        0.0,
        "simulated read latency per sample (a network file system), ms",
        check=finite(maximum=10_000.0),
        parse=parse_float,
        group=_E,
        on_resume="free",
    )
    stages: int | str = opt(
        "auto",
        "pipeline stages; 'auto': 2-stage pipelining only where a "
        "measurement shows it faster than one stage",
        check=check_stages,
        parse=parse_stages,
        metavar="N|auto",
        group=_P,
    )
    balance: list[int] | str = opt(
        "auto",
        "model blocks per stage, or 'auto' (split by measured forward times)",
        check=check_balance,
        parse=parse_balance,
        metavar="N,N,...|auto",
        group=_P,
    )
    hybrid_switch: int | str | None = opt(
        None,
        "train pipelined (stale) until this epoch, then synchronously; 'auto': after 25 %% of "
        "the epochs, with the learning rate restarting at the switch (the default hybrid of "
        "bench/staleness_remedies.py, which recovered the stale accuracy drop at K = 4)",
        parse=parse_stages,
        metavar="EPOCH|auto",
        check=check_optional(check_stages_or_zero),
        group=_P,
    )
    devices: list[str] | None = opt(
        None,
        "one device per stage (cpu, cuda:0, ...), or one for all (default: the GPUs, else cpu)",
        check=check_devices,
        parse=parse_devices,
        metavar="DEV,...",
        group=_P,
    )
    amp: str = opt(
        "off",
        "mixed precision per block: bf16 autocast (bare --amp), or fp16 autocast with dynamic loss "
        "scaling",
        choices=("off", "bf16", "fp16"),
        const="bf16",
        group=_P,
    )
    channels_last: bool = opt(
        False, "channels-last memory format for the model and input", check=check_bool, group=_P
    )
    dist_timeout_s: float = opt(
        600.0,
        "under torchrun: longest wait for another rank",
        check=finite(positive=True, maximum=MAX_DIST_TIMEOUT_S),
        parse=parse_float,
        group=_P,
        on_resume="free",
        metavar="SECONDS",
    )
    output: Path | None = opt(
        None,
        "run folder: metrics.json/.csv, steps.csv, config.json, plot, checkpoints/ (default: a "
        f"new folder {DEFAULT_OUTPUT_BASE}/<date>-<time>-<model> per run)",
        check=check_output,
        parse=parse_path,
        metavar="DIR",
        group=RUN_FOLDER_GROUP,
        on_resume="each",
    )
    checkpoint_every: int = opt(
        0,
        "also checkpoint every N steps (0: epoch ends only)",
        check=int_at_least(0),
        parse=parse_int,
        metavar="STEPS",
        group=RUN_FOLDER_GROUP,
        on_resume="free",
    )
    resume: bool | str | Path = opt(
        False,
        "continue the run in --output from its last checkpoint (True), from CKPT (a path), or "
        "'auto': from the last checkpoint when there is one, else start the run",
        group=RUN_FOLDER_GROUP,
        on_resume="each",
        cli=False,
    )
    log_interval: int = opt(
        50,
        "steps between log lines when stderr is not a terminal",
        check=int_at_least(1),
        parse=parse_int,
        metavar="STEPS",
        group=RUN_FOLDER_GROUP,
        on_resume="free",
    )
    progress: bool = opt(
        True,
        "progress bars on a terminal",
        check=check_bool,
        group=RUN_FOLDER_GROUP,
        on_resume="each",
        cli=False,
    )

    def __post_init__(self) -> None:
        if isinstance(self.amp, bool):  # the older on/off spelling means bfloat16
            self.amp = "bf16" if self.amp else "off"

    def validate(self, *, combination: bool = True) -> None:
        """Raise :class:`UsageError` naming the first bad value; touches no data or model.
        ``combination=False`` checks each value alone: on a resume the options not given are
        the checkpoint's, and their defaults refused true combinations (``--resume --model
        lenet5`` of a lenet5 run at ``--image-size 32``, for the default 64); the merged options
        are checked whole (:func:`~.resume.merge_options`)."""
        for f in dataclasses.fields(self):
            check_value(f, getattr(self, f.name))
        if self.resume == "auto" and self.output is None:
            raise UsageError(
                "--resume auto continues the run in --output, so a restarted job finds the same "
                "folder: give --output DIR"
            )
        if isinstance(self.resume, Path) and not self.resume.is_file():
            what = "is not a file" if self.resume.exists() else "does not exist"
            raise UsageError(f"--resume checkpoint {str(self.resume)!r} {what}")
        if combination:
            check_combination(self)

    def echo_config(self) -> EchoConfig:
        """The run's :class:`~echopipe.echo.EchoConfig`, from the options that give its fields
        (each converted from its unit here, e.g. ``--cache-mb`` to bytes)."""
        given: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.metadata["echo"] is not None:
                name, unit = f.metadata["echo"]
                value = getattr(self, f.name)
                given[name] = value if unit == 1 else value * unit
        return EchoConfig(**given)

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
        if f.metadata["on_resume"] != "fixed" and f.metadata["cli"]
    ]
