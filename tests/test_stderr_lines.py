"""A line of ``echopipe train`` reaches stderr in one write: torchrun's ranks share stderr, and a
line written as its text and then its newline let another rank's line land inside it (seen in
CI: ``... e=2; ETA 0:00held after validation``)."""

from __future__ import annotations

import io
import sys

import pytest

from echopipe.training.progress import to_stderr


class _Writes(io.StringIO):
    """stderr that keeps each ``write`` call apart."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_a_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Writes()
    monkeypatch.setattr(sys, "stderr", err)
    to_stderr("epoch 1/2: train loss 1.391; ETA 0:00")
    to_stderr("")
    assert err.calls == ["epoch 1/2: train loss 1.391; ETA 0:00\n", "\n"]


def test_the_interrupted_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during start-up: main() says so in one line, one write."""
    import echopipe.training.arguments as arguments
    from echopipe import cli

    def interrupted(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(arguments, "from_namespace", interrupted)
    monkeypatch.delenv("RANK", raising=False)
    err = _Writes()
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.main(["train", "--epochs", "1"]) == 130
    said = [c for c in err.calls if "interrupted" in c]
    assert said == ["echopipe train: interrupted during start-up; nothing was written\n"], err.calls
