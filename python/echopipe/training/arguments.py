"""The ``echopipe train`` command line, made from :class:`~.config.TrainConfig`'s fields.

The options are defined once, on the config's fields; this module turns them into argparse
arguments (with the CLI-only actions ``--resume``, ``--no-progress``, ``--evaluate`` and
``--debug``) and parsed arguments back into a config.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .config import RUN_FOLDER_GROUP, TrainConfig, free_on_resume
from .options import add_field_arguments

__all__ = ["add_arguments", "from_namespace"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``echopipe train`` arguments: one per :class:`TrainConfig` field, and the actions."""
    groups = add_field_arguments(parser, TrainConfig)
    g = groups[RUN_FOLDER_GROUP]
    g.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="CKPT",
        help="continue the run in --output from its last checkpoint, or from CKPT, or with "
        "'auto' from the last checkpoint when there is one and from the start otherwise (for "
        "torchrun --max-restarts). The run keeps its options; these may be given anew: "
        f"{', '.join(free_on_resume())}",
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
    if values["resume"] not in (True, False, "auto"):
        values["resume"] = Path(values["resume"])
    return TrainConfig(**values)


def given_options(train_argv: list[str]) -> set[str]:
    """Names of the :class:`TrainConfig` fields that ``train_argv`` (the arguments after
    ``train``) sets, also to their default value: a resumed run takes the others from its
    checkpoint."""
    unset = object()
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # as the CLI parses
    add_arguments(parser)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    parser.set_defaults(**dict.fromkeys(names, unset))
    args, _ = parser.parse_known_args(train_argv)
    return {name for name in names if getattr(args, name, unset) is not unset}
