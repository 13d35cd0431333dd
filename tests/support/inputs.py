"""The one writer of a test's ``input.json``: a config dict as JSON in a file of a folder."""

from __future__ import annotations

import json
from pathlib import Path


def write_input(folder: Path, config: dict, name: str = "input.json") -> Path:
    """Write ``config`` as JSON to ``folder / name`` (the folder must exist) and return that
    path."""
    path = Path(folder) / name
    path.write_text(json.dumps(config))
    return path
