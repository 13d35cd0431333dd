"""Tunable settings: an argument, else an environment variable, else a default.

One reader for every ``MDLOADER_*`` variable, so that each is parsed and validated the same way
and a bad value is a :class:`~mdloader.errors.ConfigError` naming the argument or the variable.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

from .errors import ConfigError

T = TypeVar("T", int, float)


def setting(value: T | str | None, *, argument: str, env: str, default: T,
            parse: Callable[[str], T], minimum: T, expected: str, floor: str) -> T:
    """``value`` if given, else ``$env`` if set and not empty, else ``default``.

    ``parse`` converts (``int`` or ``float``) and the result must be at least ``minimum``;
    ``expected`` and ``floor`` word the two errors ("a whole number of threads",
    "at least 1 thread").
    """
    where, raw = (argument, value) if value is not None else (env, os.environ.get(env))
    if raw is None or raw == "":
        return default
    try:
        parsed = parse(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"expected {expected}, found {raw!r}", path=where) from None
    if not parsed >= minimum:
        raise ConfigError(f"expected {floor}, found {raw!r}", path=where)
    return parsed
