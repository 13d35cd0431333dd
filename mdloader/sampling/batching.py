"""Batch-size rules: ``int | list[int] | "auto" | "auto:N" | "max:N" | "filter:N"``.

Pure functions of the per-system atom counts, so that the numbers DeePMD-kit documents (in
DeePMD-kit's ``dataloader.py:121-163`` and ``test_dploaderset.py``) are checked without touching
a file. A string rule is dispatched through :data:`RULES` (name -> function); every rule returns
one batch size per *kept* system plus the indices of the kept systems, because ``filter:N``
drops systems and the probability inputs written against the original list must then be remapped
(see :func:`mdloader.sampling.probability.remap_blocks`).

Differences from DeePMD-kit, all on invalid input only: a wrong-length list, a non-positive size
or rule value and a malformed rule raise :class:`~mdloader.errors.ConfigError` (a ``ValueError``)
naming the config key, instead of an empty ``AssertionError`` or a batch size of 0.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from mdloader.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_AUTO_RULE = 32
"""``"auto"`` means ``"auto:32"``, as in DeePMD-kit."""


class BatchPlan(NamedTuple):
    """The outcome of a batch-size rule.

    Attributes
    ----------
    batch_sizes
        One batch size per kept system (int64), in the order of ``kept``.
    kept
        Indices into the original system list of the systems that stay (all of them unless
        ``filter:N`` removed some), sorted ascending.
    """

    batch_sizes: np.ndarray
    kept: np.ndarray


def rule_auto(natoms: np.ndarray, rule: int) -> BatchPlan:
    """B = ceil(rule / natoms): the smallest B with B * natoms >= rule."""
    return BatchPlan(-(-rule // natoms), np.arange(len(natoms)))


def rule_max(natoms: np.ndarray, rule: int) -> BatchPlan:
    """B = max(1, floor(rule / natoms)): B * natoms <= rule unless one frame is already larger."""
    return BatchPlan(np.maximum(rule // natoms, 1), np.arange(len(natoms)))


def rule_filter(natoms: np.ndarray, rule: int) -> BatchPlan:
    """Drop the systems with more than ``rule`` atoms, then apply :func:`rule_max`.

    Logs ``WARNING "Remove k systems with more than N atoms"`` (DeePMD-kit's message) when some
    are dropped; :func:`resolve_batch_sizes` refuses a plan that keeps none.
    """
    kept = np.flatnonzero(natoms <= rule)
    removed = len(natoms) - len(kept)
    if removed:
        log.warning("Remove %d systems with more than %d atoms", removed, rule)
    return BatchPlan(rule_max(natoms[kept], rule).batch_sizes, kept)


RULES: dict[str, Callable[[np.ndarray, int], BatchPlan]] = {
    "auto": rule_auto,
    "max": rule_max,
    "filter": rule_filter,
}
"""String rule name -> function of (natoms array, N)."""

#: Rules DeePMD-kit knows that mdloader does not implement, and what to write instead: each is
#: refused by :func:`parse_rule` in one line (under ``mdloader dp`` before any set-up).
NOT_IMPLEMENTED = {
    "mix": "DeePMD-kit 3.2's LMDB rule for batches of mixed atom counts; DpLoaderSet does "
           "not implement mix:N (its batches come from one system): train it with mdloader "
           "train or mdloader dp on an LMDB database, read it with mdloader.LmdbDataset, or "
           "use a fixed batch size or 'auto:N' (or 'max:N'), whose batches keep one atom count",
}


def parse_rule(rule: str, key: str = "batch_size") -> tuple[str, int]:
    """Split ``"name:N"`` (or bare ``"auto"``) into the rule name and a positive N."""
    name, sep, value = rule.strip().partition(":")
    name = name.strip()
    if name in NOT_IMPLEMENTED:
        raise ConfigError(f"Unsupported batch size rule: {rule} ({NOT_IMPLEMENTED[name]})",
                          path=key)
    if name not in RULES:
        raise ConfigError(f"Unsupported batch size rule: {rule}", path=key)
    if not sep:
        if name != "auto":
            raise ConfigError(f"Unsupported batch size rule: {rule} ('{name}' needs ':N', "
                              f"e.g. '{name}:256')", path=key)
        return name, DEFAULT_AUTO_RULE
    try:
        n = int(value.strip())
    except ValueError:
        raise ConfigError(f"Unsupported batch size rule: {rule} (N must be an integer)",
                          path=key) from None
    if n < 1:
        raise ConfigError(f"Unsupported batch size rule: {rule} (N must be >= 1, got {n})",
                          path=key)
    return name, n


def _check_size(value: object, where: str, key: str) -> int:
    """A batch size must be a positive integer (``bool`` is rejected: it is a typo)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"batch size {where} must be a positive integer, got {value!r}",
                          path=key)
    return int(value)


def resolve_batch_sizes(
    batch_size: int | Sequence[int] | str,
    natoms: Sequence[int] | np.ndarray,
    key: str = "batch_size",
) -> BatchPlan:
    """Turn a DeePMD ``batch_size`` value into one batch size per system.

    Parameters
    ----------
    batch_size
        An int (same size everywhere), a list (one per system), or a string rule
        ``"auto"``, ``"auto:N"``, ``"max:N"``, ``"filter:N"``.
    natoms
        Atoms per frame of each system, in system order.
    key
        Config path used in error messages (e.g. ``training.training_data.batch_size``).

    Returns
    -------
    BatchPlan
        Batch sizes for the kept systems and the kept indices.

    Raises
    ------
    ConfigError
        Unknown or malformed rule (``"Unsupported batch size rule: <s>"``), a list of the wrong
        length, a non-positive size, or no system left after ``filter:N``.
    """
    atoms = np.asarray(natoms, dtype=np.int64).reshape(-1)
    if len(atoms) == 0:
        raise ConfigError("no systems to compute batch sizes for", path=key)
    if isinstance(batch_size, str):
        name, n = parse_rule(batch_size, key)
        plan = RULES[name](atoms, n)
        if len(plan.kept) == 0:
            raise ConfigError(f"No system left after removing systems with more than {n} atoms",
                              path=key)
        return BatchPlan(plan.batch_sizes.astype(np.int64), plan.kept.astype(np.int64))
    if isinstance(batch_size, (list, tuple, np.ndarray)):
        sizes = list(batch_size)
        if len(sizes) != len(atoms):
            raise ConfigError(f"batch size list has {len(sizes)} entries but there are "
                              f"{len(atoms)} systems (expected one per system)", path=key)
        checked = [_check_size(v, f"entry {i}", key) for i, v in enumerate(sizes)]
        return BatchPlan(np.asarray(checked, dtype=np.int64), np.arange(len(atoms)))
    size = _check_size(batch_size, "", key)
    return BatchPlan(np.full(len(atoms), size, dtype=np.int64), np.arange(len(atoms)))


def batches_per_rank(nframes: np.ndarray | Sequence[int], batch_sizes: np.ndarray | Sequence[int],
                     world_size: int = 1) -> np.ndarray:
    """nb_i = ceil(ceil(F_i / W) / B_i): batches of system i on each rank (DeePMD's ``index``).

    Every rank has the same count because the shard is padded to ceil(F/W) frames
    (:func:`mdloader.sampling.order.shard_frames`).
    """
    f = np.asarray(nframes, dtype=np.int64)
    b = np.asarray(batch_sizes, dtype=np.int64)
    per_rank = -(-f // int(world_size))
    return -(-per_rank // b)


def describe_rule(batch_size: int | Sequence[int] | str) -> str:
    """A short human-readable form of the rule, for summaries and logs."""
    if isinstance(batch_size, str):
        return batch_size
    if isinstance(batch_size, (list, tuple, np.ndarray)):
        return f"list[{len(batch_size)}]"
    return str(batch_size)


__all__ = [
    "BatchPlan", "RULES", "NOT_IMPLEMENTED", "DEFAULT_AUTO_RULE", "resolve_batch_sizes",
    "parse_rule", "rule_auto", "rule_max", "rule_filter", "batches_per_rank", "describe_rule",
]
