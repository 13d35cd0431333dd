"""``rglob_patterns``: which paths below a ``systems`` entry its glob patterns select."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import PurePosixPath


def matches(relpath: str, patterns: Sequence[str] | None) -> bool:
    """Whether ``relpath`` (below a root) matches one of ``patterns`` at any depth, like
    ``pathlib.Path.rglob`` (all paths match when there is no pattern)."""
    if not patterns:
        return True
    rel = PurePosixPath(relpath.replace(os.sep, "/"))
    return any(rel.match(p) for p in patterns)
