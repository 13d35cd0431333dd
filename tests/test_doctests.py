"""The examples in the docstrings of the public names run, and say what they print."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

#: The modules whose public names carry an example: each must hold at least one.
MODULES = ("mdloader.loading.loader", "mdloader.loading.stateful_loader",
           "mdloader.loading.feed")


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the examples write their data under the working folder
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
