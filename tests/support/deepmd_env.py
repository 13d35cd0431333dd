"""Where DeePMD-kit 3.2.0 (the reference) can be imported: this interpreter, else
``$MDLOADER_DEEPMD_PYTHON``, else the repository's ``.venv-deepmd`` (``scripts/deepmd-env.sh``,
which the README's test command runs first).

``MDLOADER_TESTS_WITHOUT_DEEPMD=1`` leaves every test that needs DeePMD-kit out of the run (the
version matrix, ``scripts/test-matrix.sh``, runs the rest on other torch releases: the reference
would run on its own environment's torch and tell nothing of theirs)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=1)
def deepmd_python() -> str | None:
    candidates = (sys.executable, os.environ.get("MDLOADER_DEEPMD_PYTHON"),
                  str(REPO / ".venv-deepmd" / "bin" / "python"))
    for cand in candidates:
        if not cand or not os.path.exists(cand):
            continue
        probe = subprocess.run([cand, "-c", "import deepmd.pt.utils.dataloader"],
                               capture_output=True, timeout=180)
        if probe.returncode == 0:
            return cand
    return None


def require_deepmd_python() -> str:
    """The interpreter, or a skip that says how to create it."""
    if os.environ.get("MDLOADER_TESTS_WITHOUT_DEEPMD") == "1":
        pytest.skip("needs DeePMD-kit: left out by MDLOADER_TESTS_WITHOUT_DEEPMD=1")
    python = deepmd_python()
    if python is None:
        pytest.skip("DeePMD-kit 3.2.0 is not installed: run bash scripts/deepmd-env.sh")
    return python
