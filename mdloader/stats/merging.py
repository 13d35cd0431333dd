"""Partial statistics folded into one, in order, by their own ``merge``: the one fold that every
kind of statistics (neighbours, environment sums, feature moments, output samples) uses.

A partial result is computed on a share of the frames (a chunk, a system, a rank's share) and
its type says how two of them combine (:meth:`merge`); the order of the parts is kept, because
float sums are added in it and must not depend on how the work was split.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from mdloader.errors import ConfigError

M = TypeVar("M", bound="Mergeable")


class Mergeable(Protocol):
    """A partial result that combines with another of its kind."""

    def merge(self: M, other: M) -> M:
        """The result of both parts, ``self``'s first."""


def merge_all(parts: Iterable[M]) -> M:
    """The parts merged from first to last, each with the type's own ``merge``.

    There must be at least one part: where there may be none (no system in a share), put the
    type's empty value first (``NeighbourStats.empty``, ``EnvMatSums.zeros``, ...), which only
    the caller knows how to make.
    """
    it = iter(parts)
    try:
        total = next(it)
    except StopIteration:
        raise ConfigError("no partial statistics to merge: give at least one part (the empty "
                          "value of its type where there may be none)") from None
    for part in it:
        total = total.merge(part)
    return total
