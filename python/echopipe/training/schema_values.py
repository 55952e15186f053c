"""The checks a checkpoint's entries are made of: each names the entry it refuses.

:mod:`.checkpoint_schema` checks a train checkpoint entry by entry with these; a failed check
is a :class:`SchemaError` whose message starts with the entry's place (``where``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "BIG",
    "SchemaError",
    "check_dict",
    "check_int",
    "check_list",
    "check_num",
    "need",
    "show",
]

BIG = 1 << 62
"""The largest count a checkpoint may hold."""


class SchemaError(ValueError):
    """A checkpoint entry of the wrong type, range, shape or dtype; the message names it."""


def show(value: Any) -> str:
    """``value`` for a message: a short literal as itself, anything else by its type."""
    if isinstance(value, bool | int | float | type(None)) and len(repr(value)) < 40:
        return repr(value)
    if isinstance(value, str) and len(value) < 40:
        return repr(value)
    return f"a {type(value).__name__}"


def need(ok: bool, where: str, what: str) -> None:
    """Raises :class:`SchemaError` ``"<where> <what>"`` unless ``ok``."""
    if not ok:
        raise SchemaError(f"{where} {what}")


def check_int(value: Any, where: str, low: int = 0, high: int = BIG) -> int:
    """``value``, an ``int`` (not a bool) in ``[low, high]``."""
    need(type(value) is int and low <= value <= high, where,
          f"is {show(value)}, not an integer in [{low}, {high}]")  # fmt: skip
    return value


def check_num(value: Any, where: str, low: float = -math.inf, high: float = math.inf) -> float:
    """``value`` as a float: an int or float, finite, in ``[low, high]``."""
    ok = type(value) in (int, float) and math.isfinite(value) and low <= value <= high
    need(ok, where, f"is {show(value)}, not a finite number in [{low:g}, {high:g}]")
    return float(value)


def check_dict(
    value: Any, where: str, required: set[str], optional: set[str] | None = None
) -> dict:
    """``value``, a dict holding every ``required`` key and, when ``optional`` is given, no
    key outside the two."""
    need(isinstance(value, dict), where, f"is {show(value)}, not a dict")
    missing = sorted(required - set(value))
    need(not missing, where, f"lacks the entry {missing[0]!r}" if missing else "")
    if optional is not None:
        unknown = sorted(set(value) - required - optional, key=str)
        need(
            not unknown, where, f"has an unknown entry {str(unknown[0])[:40]!r}" if unknown else ""
        )
    return value


def check_list(value: Any, where: str, length: int | None = None) -> list:
    """``value``, a list (of ``length`` entries when given)."""
    need(isinstance(value, list), where, f"is {show(value)}, not a list")
    need(length is None or len(value) == length, where, f"has {len(value)} entries, not {length}")
    return value
