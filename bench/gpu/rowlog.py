"""Results written row by row: after every measured row the whole JSON file is replaced
atomically (a temporary file, then a rename), so a step cut short by its timeout leaves every
row it finished in a readable file, marked ``"complete": false``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class RowLog:
    """``payload`` (the benchmark's description) plus ``rows`` named ``key``, kept on disk."""

    def __init__(self, path: Path, payload: dict[str, Any], key: str = "rows") -> None:
        self.path = path
        self.payload = dict(payload)
        self.payload.setdefault(key, [])
        self.payload["complete"] = False
        self.key = key
        self.write()

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The rows so far (the same list that is written)."""
        return self.payload[self.key]

    def add(self, row: dict[str, Any], key: str | None = None) -> None:
        """Appends ``row`` to the list ``key`` (default: the main one) and writes the file."""
        self.payload.setdefault(key or self.key, []).append(row)
        self.write()

    def finish(self, **extra: Any) -> dict[str, Any]:
        """Adds ``extra`` fields, marks the file complete and writes it a last time."""
        self.payload.update(extra)
        self.payload["complete"] = True
        self.write()
        return self.payload

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.payload, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
