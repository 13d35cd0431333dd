"""The habits the code keeps: ruff's checks (configured in pyproject.toml).

Modules are sized by concept, not by a line count: one concept per module
(``docs/architecture.md``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                          str(REPO)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
