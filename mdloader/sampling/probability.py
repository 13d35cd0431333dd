"""System probabilities: ``prob_uniform``, ``prob_sys_size``, its blocks, and ``sys_probs``.

Pure functions of ``nb`` (batches of each system on this rank,
:func:`mdloader.sampling.batching.batches_per_rank`). On valid input they give DeePMD-kit's
numbers; invalid input raises :class:`~mdloader.errors.ConfigError` naming the config key at
construction time, instead of DeePMD-kit's late ``IndexError`` or ``invalid multinomial``:

- an unknown style or a typo (``"prob_sys_sze"``), a block style without blocks;
- a malformed, empty (``a >= b`` or entirely past the last system) or overlapping block, a
  negative or non-finite weight, block weights summing to 0;
- a ``sys_probs`` list whose length differs from the number of systems, fixed entries summing
  to more than 1, or to less than 1 with no negative ("auto") entry to take the rest;
- zero systems.

A block end past the last system is clipped, as DeePMD-kit does (``0:1000:1`` means "all").

Probabilities are written against the system list the user sees. When ``filter:N`` drops systems
(``kept`` = surviving original indices), blocks and ``sys_probs`` are *remapped* onto the kept
systems, not shifted: a block keeps its weight over the kept systems it covers (a block left with
no system is dropped and the block weights are renormalised); fixed ``sys_probs`` entries of kept
systems keep their value, negative entries share the rest, and when nothing is negative the kept
entries are renormalised to sum to 1. A WARNING says how much probability mass was moved.

Probabilities are kept as a rule of the batch counts (:class:`ProbabilityRule`), so that another
world size can recompute them: ``nb_i`` (batches of system ``i`` on each rank) depends on the number
of ranks, so ``prob_sys_size`` gives other numbers on ``W'`` ranks than on ``W``. An elastic resume
replays the streams of earlier generations with *their* probabilities and continues with the new
ones; the sampler therefore keeps the rule, not only its numbers. A rule's :attr:`digest` does not
depend on the world size: it is what a resumed job compares to refuse another
``auto_prob``/``sys_probs``.
"""

from __future__ import annotations

import logging
import math
import numbers
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from mdloader.errors import ConfigError
from mdloader.sampling.order import sizes_digest

log = logging.getLogger(__name__)

BLOCK_HEAD = "prob_sys_size"
SUM_TOL = 1e-8
"""DeePMD-kit's tolerance on the sum of fixed ``sys_probs`` entries (deepmd-kit #1917)."""


class Block(NamedTuple):
    """Systems ``[start, end)`` share ``weight`` in proportion to their batch counts."""

    start: int
    end: int
    weight: float


def _nb(nbatch: Sequence[int] | np.ndarray, key: str) -> np.ndarray:
    nb = np.asarray(nbatch, dtype=np.float64).reshape(-1)
    if len(nb) == 0:
        raise ConfigError("no systems: cannot compute system probabilities", path=key)
    if not np.all(nb >= 1):
        raise ConfigError(f"every system needs at least one batch, got {nb.min():g}", path=key)
    return nb


def prob_uniform(nbatch: Sequence[int] | np.ndarray) -> np.ndarray:
    """p_i = 1 / nsys."""
    n = len(_nb(nbatch, "auto_prob"))
    return np.full(n, 1.0 / n)


def prob_sys_size(nbatch: Sequence[int] | np.ndarray) -> np.ndarray:
    """p_i proportional to nb_i (DeePMD-kit's ``prob_sys_size;0:nsys:1.0``)."""
    nb = _nb(nbatch, "auto_prob")
    return nb / nb.sum()


STYLES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "prob_uniform": prob_uniform,
    "prob_sys_size": prob_sys_size,
}
"""Plain style name -> function of ``nb``. ``prob_sys_size;...`` goes to :func:`parse_blocks`."""


def _parse_block(token: str, style: str, key: str) -> Block:
    parts = [p.strip() for p in token.split(":")]
    try:
        if len(parts) != 3:
            raise ValueError
        start, end, weight = int(parts[0]), int(parts[1]), float(parts[2])
    except ValueError:
        raise ConfigError(f"malformed block '{token.strip()}' in '{style}': expected "
                          "'start:end:weight', e.g. 'prob_sys_size;0:2:0.3;2:5:0.7'",
                          path=key) from None
    if not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"block '{token.strip()}' in '{style}': the weight must be a finite "
                          f"number >= 0, got {weight}", path=key)
    return Block(start, end, weight)


def check_style(style: str, key: str = "auto_prob") -> list[Block]:
    """The blocks of a style string, checked without knowing the systems (``[]`` for a plain
    style); raises for an unknown style, a malformed or empty block, or a negative weight."""
    if not isinstance(style, str):
        raise ConfigError(f"the probability style must be a string, got {style!r}", path=key)
    if style.strip() in STYLES:
        return []
    head, *tokens = style.split(";")
    if head.strip() != BLOCK_HEAD:
        raise ConfigError(f"unknown probability style '{style}': expected 'prob_uniform', "
                          f"'prob_sys_size' or 'prob_sys_size;start:end:weight;...'", path=key)
    blocks = [_parse_block(t, style, key) for t in tokens if t.strip()]
    if not blocks:
        raise ConfigError(f"probability style '{style}' has no 'start:end:weight' block",
                          path=key)
    for b in blocks:
        if b.start < 0 or b.start >= b.end:
            raise ConfigError(f"block {b.start}:{b.end}:{b.weight:g} in '{style}' selects no "
                              f"system (start must be >= 0 and below end)", path=key)
    return blocks


def parse_blocks(style: str, nsys: int, key: str = "auto_prob") -> list[Block]:
    """Parse and check ``"prob_sys_size;a:b:w;..."`` against ``nsys`` (original) systems.

    Ends past ``nsys`` are clipped; blocks that are empty after clipping or that overlap raise.
    """
    clipped = []
    for b in check_style(style, key):
        end = min(b.end, nsys)
        if b.start >= end:
            raise ConfigError(f"block {b.start}:{b.end}:{b.weight:g} in '{style}' selects no "
                              f"system (systems are 0..{nsys - 1})", path=key)
        clipped.append(Block(b.start, end, b.weight))
    ordered = sorted(clipped)
    for prev, nxt in zip(ordered, ordered[1:]):
        if nxt.start < prev.end:
            raise ConfigError(f"blocks {prev.start}:{prev.end} and {nxt.start}:{nxt.end} in "
                              f"'{style}' overlap; each system may be in one block only",
                              path=key)
    if sum(b.weight for b in clipped) <= 0:
        raise ConfigError(f"the block weights in '{style}' sum to 0", path=key)
    return clipped


def remap_blocks(blocks: Sequence[Block], kept: np.ndarray) -> list[tuple[np.ndarray, float]]:
    """Map blocks over original indices to arrays of positions in the kept list.

    Blocks that lose all their systems are dropped with a WARNING.
    """
    out = []
    for b in blocks:
        pos = np.flatnonzero((kept >= b.start) & (kept < b.end))
        if len(pos) == 0:
            log.warning("block %d:%d:%g lost all its systems to the batch-size filter; its "
                        "weight is shared by the other blocks", b.start, b.end, b.weight)
            continue
        out.append((pos, b.weight))
    return out


def prob_blocks(style: str, nbatch: Sequence[int] | np.ndarray, *, kept: np.ndarray | None = None,
                nsys_original: int | None = None, key: str = "auto_prob") -> np.ndarray:
    """DeePMD-kit's ``prob_sys_size_ext``: block weights normalised, p ~ nb inside a block."""
    nb = _nb(nbatch, key)
    kept_ = np.arange(len(nb)) if kept is None else np.asarray(kept, dtype=np.int64)
    n_orig = len(nb) if nsys_original is None else int(nsys_original)
    mapped = remap_blocks(parse_blocks(style, n_orig, key), kept_)
    total = sum(w for _, w in mapped)
    if not mapped or total <= 0:
        raise ConfigError(f"no probability left in '{style}' after removing filtered systems",
                          path=key)
    probs = np.zeros(len(nb))
    for pos, w in mapped:
        probs[pos] = nb[pos] / nb[pos].sum() * (w / total)
    return probs


def _as_float_list(sys_probs: Sequence[float], key: str) -> np.ndarray:
    if isinstance(sys_probs, (str, bytes)) or not isinstance(sys_probs, (Sequence, np.ndarray)):
        raise ConfigError(f"sys_probs must be a list of numbers, got {sys_probs!r}", path=key)
    vals = list(sys_probs)
    bad = [v for v in vals if isinstance(v, bool) or not isinstance(v, numbers.Real)
           or not math.isfinite(v)]
    if bad:
        raise ConfigError(f"sys_probs entries must be finite numbers, got {bad[0]!r}", path=key)
    return np.asarray(vals, dtype=np.float64)


def check_sys_probs(sys_probs: Sequence[float], nsys: int, key: str = "sys_probs") -> np.ndarray:
    """Check ``sys_probs`` against the ``nsys`` systems it was written for (DeePMD's rules and
    the length)."""
    p = _as_float_list(sys_probs, key)
    if len(p) != nsys:
        raise ConfigError(f"sys_probs has {len(p)} entries but there are {nsys} systems "
                          "(expected one per system, in system order)", path=key)
    fixed = np.sum(np.where(p >= 0, p, 0.0))
    if fixed > 1.0 + SUM_TOL:
        raise ConfigError(f"the non-negative sys_probs entries sum to {fixed:.10g} > 1", path=key)
    auto = p < 0
    if np.isclose(1.0 - fixed, 0.0) and auto.any():
        raise ConfigError("the non-negative sys_probs entries already sum to 1, so the "
                          f"{int(auto.sum())} negative ('auto') entries would get 0", path=key)
    if not np.isclose(1.0 - fixed, 0.0) and not auto.any():
        raise ConfigError(f"sys_probs sum to {fixed:.10g}, not 1 (use a negative entry to give "
                          "a system a share of the rest)", path=key)
    return p


def process_sys_probs(sys_probs: Sequence[float], nbatch: Sequence[int] | np.ndarray, *,
                      kept: np.ndarray | None = None, nsys_original: int | None = None,
                      key: str = "sys_probs") -> np.ndarray:
    """Fixed entries stay, negative entries share ``1 - sum(fixed)`` in proportion to nb.

    ``sys_probs`` is written against the original list of ``nsys_original`` systems (default:
    ``len(nbatch)``); ``kept`` are the original indices of the systems ``nbatch`` describes.
    """
    nb = _nb(nbatch, key)
    n_orig = len(nb) if nsys_original is None else int(nsys_original)
    full = check_sys_probs(sys_probs, n_orig, key)
    kept_ = np.arange(len(nb)) if kept is None else np.asarray(kept, dtype=np.int64)
    p = full[kept_]
    auto = p < 0
    fixed = np.where(auto, 0.0, p)
    rest = 1.0 - np.sum(fixed)
    if auto.any() and not np.isclose(rest, 0.0):
        rest_nb = np.where(auto, nb, 0.0)
        return rest * rest_nb / np.sum(rest_nb) + fixed
    if len(p) == n_orig or np.isclose(np.sum(fixed), 1.0):
        return p
    if np.sum(fixed) <= 0:
        raise ConfigError("sys_probs give probability 0 to every system left after the "
                          "batch-size filter", path=key)
    log.warning("sys_probs: %.4g of the probability belonged to systems removed by the "
                "batch-size filter; the rest is renormalised", rest)
    return fixed / np.sum(fixed)


def system_probabilities(nbatch: Sequence[int] | np.ndarray, prob_style: str | Sequence[float],
                         sys_prob: bool = False, *, kept: np.ndarray | None = None,
                         nsys_original: int | None = None, key: str | None = None) -> np.ndarray:
    """Dispatch like DeePMD-kit's ``get_weighted_sampler``: a style string, or ``sys_probs``.

    Parameters
    ----------
    nbatch
        nb_i for each kept system.
    prob_style
        A style (``sys_prob=False``) or the ``sys_probs`` list (``sys_prob=True``).
    kept, nsys_original
        Original indices of the kept systems and the original count, when ``filter:N`` dropped
        systems; probabilities written against the original list are remapped.
    key
        Config key named in errors (default ``auto_prob`` or ``sys_probs``).
    """
    if sys_prob:
        return process_sys_probs(prob_style, nbatch, kept=kept, nsys_original=nsys_original,
                                 key=key or "sys_probs")
    key = key or "auto_prob"
    check_style(prob_style, key)  # type: ignore[arg-type]
    style = prob_style.strip()  # type: ignore[union-attr]
    if style in STYLES:
        return STYLES[style](_nb(nbatch, key))
    return prob_blocks(style, nbatch, kept=kept, nsys_original=nsys_original, key=key)


def select_prob_source(params: Mapping[str, Any]) -> tuple[Any, bool, str]:
    """DeePMD-kit's precedence (deepmd-kit #4353): ``sys_probs`` if present and not None, else
    ``auto_prob``, else ``"prob_sys_size"``. Returns (value, is_sys_probs, key)."""
    if params.get("sys_probs") is not None:
        return params["sys_probs"], True, "sys_probs"
    if "auto_prob" in params:
        return params["auto_prob"], False, "auto_prob"
    return "prob_sys_size", False, "auto_prob"


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


__all__ = ["Block", "STYLES", "prob_uniform", "prob_sys_size", "check_style", "parse_blocks",
           "remap_blocks", "prob_blocks", "check_sys_probs", "process_sys_probs",
           "system_probabilities", "select_prob_source", "ProbabilityRule", "StyleRule",
           "FixedProbabilities", "as_rule"]
