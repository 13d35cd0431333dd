"""System probabilities as a rule of the batch counts, so another world size can recompute them.

``nb_i`` (batches of system ``i`` on each rank) depends on the number of ranks, so
``prob_sys_size`` gives other numbers on ``W'`` ranks than on ``W``. An elastic resume replays the
streams of earlier generations with *their* probabilities and continues with the new ones; the
sampler therefore keeps the rule, not only its numbers. A rule's :attr:`digest` does not depend on
the world size: it is what a resumed job compares to refuse another ``auto_prob``/``sys_probs``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from mdloader.sampling.order import sizes_digest
from mdloader.sampling.probability import system_probabilities


@runtime_checkable
class ProbabilityRule(Protocol):
    """``rule(nbatch)`` gives one probability per system; ``digest`` identifies the rule."""

    digest: int

    def __call__(self, nbatch: np.ndarray) -> np.ndarray: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class StyleRule:
    """DeePMD-kit's ``auto_prob`` style or ``sys_probs`` list, remapped after ``filter:N``.

    The arguments are those of :func:`mdloader.sampling.probability.system_probabilities`.
    """

    style: str | tuple[float, ...]
    sys_prob: bool = False
    kept: tuple[int, ...] | None = None
    nsys_original: int | None = None
    key: str | None = None
    digest: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        words = repr((self.style, self.sys_prob, self.nsys_original)).encode()
        kept = sizes_digest(self.kept) if self.kept is not None else 0
        object.__setattr__(self, "digest", zlib.crc32(words, kept))

    @classmethod
    def of(cls, style: str | Sequence[float], sys_prob: bool = False, *,
           kept: np.ndarray | None = None, nsys_original: int | None = None,
           key: str | None = None) -> StyleRule:
        """A rule from the values a data section gives (lists become tuples)."""
        value = style if isinstance(style, str) else tuple(float(p) for p in style)
        kept_t = None if kept is None else tuple(int(i) for i in kept)
        return cls(value, bool(sys_prob), kept_t, nsys_original, key)

    def describe(self) -> str:
        """What the user wrote, shortened: for error messages."""
        text = f"sys_probs {list(self.style)}" if self.sys_prob else f"auto_prob {self.style!r}"
        return text if len(text) <= 80 else text[:77] + "..."

    def __call__(self, nbatch: np.ndarray) -> np.ndarray:
        kept = None if self.kept is None else np.asarray(self.kept, dtype=np.int64)
        style = self.style if isinstance(self.style, str) else list(self.style)
        return system_probabilities(nbatch, style, self.sys_prob, kept=kept,
                                    nsys_original=self.nsys_original, key=self.key)


@dataclass(frozen=True, eq=False)
class FixedProbabilities:
    """Probabilities given as numbers: the same on every number of ranks."""

    probs: np.ndarray
    digest: int = field(init=False)

    def __post_init__(self) -> None:
        probs = np.asarray(self.probs, dtype=np.float64).reshape(-1)
        object.__setattr__(self, "probs", probs)
        object.__setattr__(self, "digest", sizes_digest(probs))

    def __call__(self, nbatch: np.ndarray) -> np.ndarray:
        return self.probs

    def describe(self) -> str:
        return f"probabilities given as {len(self.probs)} numbers"


def as_rule(probs: Sequence[float] | np.ndarray | ProbabilityRule) -> ProbabilityRule:
    """A rule as it is, numbers as :class:`FixedProbabilities`."""
    if isinstance(probs, ProbabilityRule):
        return probs
    return FixedProbabilities(np.asarray(probs, dtype=np.float64))


__all__ = ["ProbabilityRule", "StyleRule", "FixedProbabilities", "as_rule"]
