"""The command line's argument parsers: one line per error, no abbreviations, and an unknown
option named by its command with the option it was probably meant to be."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["CommandParser", "OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """``parser.error`` prints one line (no usage block) and exits with status 2. No option is
    abbreviated: a prefix read ``--check`` as ``--checkpoint-every``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class CommandParser(OneLineParser):
    """A sub-command's parser (``echopipe train``): arguments it does not know are refused by
    it, naming the command and the closest option (argparse hands them to the top-level
    parser, whose line named ``echopipe --help`` and no option)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._closest(extras)}")
        return parsed, extras

    def _closest(self, extras: list[str]) -> str:
        """`` (did you mean --epochs?)`` for the unknown options that are near a known one."""
        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        hints = []
        for given in (x.split("=", 1)[0] for x in extras if x.startswith("--")):
            # A prefix of one option (what argparse's abbreviations took it for), else a near
            # spelling; a loose match named options with no link to the one given.
            near = [k for k in known if k.startswith(given)]
            if len(near) != 1:
                near = difflib.get_close_matches(given, known, n=1, cutoff=0.8)
            if near:
                hints.append((given, near[0]))
        if len(hints) == 1:
            return f" (did you mean {hints[0][1]}?)"
        said = "; ".join(f"{given}: did you mean {near}?" for given, near in hints)
        return f" ({said})" if said else ""
