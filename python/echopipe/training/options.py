"""How an ``echopipe train`` option is defined: its parser, its check, and the CLI from fields.

An option is a dataclass field made by :func:`opt`, carrying its help text, choices, command-line
spelling, whether it may change on ``--resume``, and the check its value must pass.
:func:`add_field_arguments` turns such a dataclass into argparse arguments, so the Python API and
the command line share one definition.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ..echo.config import EchoConfig, EchoConfigError

__all__ = [
    "CollectiveError",
    "DataError",
    "Interrupted",
    "TrainError",
    "UsageError",
    "add_field_arguments",
    "check_value",
    "echo_opt",
    "flag",
    "opt",
]

MAX_IMAGE_SIZE = 1024


class TrainError(Exception):
    """A run that cannot go on, told in one line; ``exit_code`` is the CLI's exit status."""

    exit_code = 1


class CollectiveError(TrainError):
    """A collective with the other ranks failed: one timed out, stopped or died."""

    exit_code = 1


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run; ``line`` says where and what ``--resume`` would use."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


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


def parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def parse_path(text: str) -> Path:
    # Path("") is ".": an unset shell variable would put a run into the current folder.
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a folder (. for the current one)")
    return Path(text)


def parse_echo(text: str) -> float | str:
    return "auto" if text == "auto" else parse_float(text)


def parse_stages(text: str) -> int | str:
    return "auto" if text == "auto" else parse_int(text)


def parse_balance(text: str) -> list[int] | str:
    if text == "auto":
        return "auto"
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give blocks per stage like 4,4") from None


def parse_devices(text: str) -> list[str]:
    return [d.strip() for d in text.split(",") if d.strip()]


def check_bool(name: str, value: Any) -> None:
    """An on/off option: a bool (a crafted checkpoint's "yes" is not one)."""
    if not isinstance(value, bool):
        raise UsageError(f"{flag(name)} must be on or off (a bool), got {value!r}")


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{flag(name)} must be an integer, got {value!r}")
        if value < minimum:
            raise UsageError(f"{flag(name)} must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise UsageError(f"{flag(name)} must be <= {maximum}, got {value}")

    return check


def finite(
    minimum: float = 0.0, positive: bool = False, maximum: float | None = None
) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"{flag(name)} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise UsageError(f"{flag(name)} must be a finite number, got {value!r}")
        if value < minimum or (positive and value <= 0):
            bound = "> 0" if positive else f">= {minimum:g}"
            raise UsageError(f"{flag(name)} must be {bound}, got {value:g}")
        if maximum is not None and value > maximum:
            raise UsageError(f"{flag(name)} must be <= {maximum:g}, got {value:g}")

    return check


def check_stages(name: str, value: Any) -> None:
    if value != "auto":
        int_at_least(1)(name, value)


def check_stages_or_zero(name: str, value: Any) -> None:
    if value != "auto":
        int_at_least(0)(name, value)


def check_balance(name: str, value: Any) -> None:
    if value == "auto":
        return
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in value)
    ):
        raise UsageError(f"{flag(name)} {value!r}: give blocks per stage (ints >= 1) or 'auto'")


def check_devices(name: str, value: Any) -> None:
    if value is None:
        return
    from ..pipeline import parse_devices as resolve_devices

    if not isinstance(value, list) or not value or not all(isinstance(d, str) for d in value):
        raise UsageError(f"{flag(name)} {value!r}: give e.g. cpu or cuda:0,cuda:1")
    try:
        resolve_devices(list(value), len(value))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"{flag(name)} {','.join(value)}: {exc}") from None


def _path(name: str, value: Any) -> Path:
    if not isinstance(value, str | Path) or value == "":
        raise UsageError(f"{flag(name)} must be a path, got {value!r}")
    return Path(value)


def check_path(must_be_dir: bool) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is None:
            return
        path = _path(name, value)
        if must_be_dir and not path.is_dir():
            what = "is not a folder" if path.exists() else "does not exist"
            raise UsageError(f"{flag(name)} {str(path)!r} {what}")
        if not must_be_dir and path.exists() and not path.is_file():
            raise UsageError(f"{flag(name)} {str(path)!r} is not a file")

    return check


def check_output(name: str, value: Any) -> None:
    if value is None:
        return
    path = _path(name, value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag(name)} {str(path)!r} is a file; give a run folder")


def check_optional(check: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    def optional(name: str, value: Any) -> None:
        if value is not None:
            check(name, value)

    return optional


def _no_check(name: str, value: Any) -> None:
    return None


def check_value(field: dataclasses.Field, value: Any) -> None:
    """Raise :class:`UsageError` unless ``value`` passes the check and choices of ``field``,
    an option made by :func:`opt`."""
    field.metadata["check"](field.name, value)
    choices = field.metadata["choices"]
    if choices and value not in choices:
        raise UsageError(
            f"{flag(field.name)} {value!r} is not one of {', '.join(map(str, choices))}"
        )


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
    on_resume: Literal["fixed", "free", "each"] = "fixed",
    cli: bool = True,
    const: Any = None,
    echo: tuple[str, int] | None = None,
) -> Any:
    """A :class:`TrainConfig` field with everything the CLI and the checks need.

    ``on_resume``: ``"fixed"`` options are the checkpoint's and may not change; ``"free"`` ones
    are the checkpoint's unless given again (a change is named and recorded); ``"each"`` ones
    belong to one invocation (where to write, when to stop early) and are never inherited.
    ``echo``: the :class:`~echopipe.echo.EchoConfig` field this option gives, and its unit
    (set by :func:`echo_opt`).
    """
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
        const=const,
        echo=echo,
    )
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def echo_opt(name: str, *, unit: int = 1, unit_name: str | None = None, **kw: Any) -> Any:
    """A :func:`opt` field that is :class:`~echopipe.echo.EchoConfig` field ``name``, given in
    ``unit``s of it (``unit_name`` says which, e.g. MiB): its default, help text and check are
    that field's, so the bound is written once, in :mod:`echopipe.echo.config`."""
    default = EchoConfig.__dataclass_fields__[name].default
    if unit != 1:
        default //= unit
    help_text = EchoConfig.help(name) + (f", in {unit_name}" if unit_name else "")

    def check(opt_name: str, value: Any) -> None:
        label = flag(opt_name)
        if unit != 1:
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"{label} must be an integer, got {value!r}")
            label, value = f"{label} {value} ({unit_name}), as {name},", value * unit
        try:
            EchoConfig.check_field(name, value, label)
        except EchoConfigError as exc:
            raise UsageError(str(exc)) from None

    return opt(default, help_text, check=check, echo=(name, unit), **kw)


# --------------------------------------------------------------------------------------------


def add_field_arguments(parser: argparse.ArgumentParser, cls: type) -> dict[str, Any]:
    """One argument per field of dataclass ``cls`` made by :func:`opt` (each default shown
    once, choices listed), in argument groups; returns the groups by title."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta["cli"]:
            continue
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"])
        names = [n for n in (meta["short"], flag(f.name), meta["alias"]) if n]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        shown = "off" if default is None or default is False else default
        help_text = (
            meta["help"] if "default:" in meta["help"] else (f"{meta['help']} (default: {shown})")
        )
        if isinstance(default, bool):
            groups[meta["group"]].add_argument(
                *names, dest=f.name, action="store_true", help=help_text
            )
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if meta["choices"]:
            kw["choices"] = meta["choices"]
        if meta["const"] is not None:  # the flag alone means this value
            kw.update(nargs="?", const=meta["const"])
        if meta["parse"]:
            kw["type"] = meta["parse"]
        metavar = meta["metavar"] or {parse_int: "N", parse_float: "X"}.get(meta["parse"])
        if metavar:
            kw["metavar"] = metavar
        groups[meta["group"]].add_argument(*names, **kw)
    return groups
