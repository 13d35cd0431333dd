"""stderr as a terminal or as a batch job's log file, for the tests of progress reports."""

from __future__ import annotations

import io
import sys

import pytest


class Stderr(io.StringIO):
    """A captured stderr that says whether it is a terminal."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def stderr(monkeypatch: pytest.MonkeyPatch, *, tty: bool) -> Stderr:
    """Replace ``sys.stderr`` for the rest of the test; what was written is its value."""
    fake = Stderr(tty)
    monkeypatch.setattr(sys, "stderr", fake)
    return fake


def drawn_bar(text: str) -> bool:
    """Whether tqdm drew a bar in ``text`` (a carriage return and a bar's edge)."""
    return "\r" in text and "|" in text
