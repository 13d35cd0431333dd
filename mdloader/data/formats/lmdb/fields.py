"""The fields of DeePMD-kit 3.2.0's LMDB records and the rules both read paths share: their
names in memory, shapes, flags, and how one data requirement is resolved over stacked frames
(:func:`resolve_requirement`, the one place that rule is written)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from mdloader.data.schema import DataRequirementItem, output_dtype
from mdloader.errors import ConfigError

#: Disk names of the core fields -> DeePMD-kit's keys.
DISK_KEYS = {"coords": "coord", "cells": "box", "energies": "energy", "forces": "force",
             "atom_types": "atype", "virials": "virial"}
#: Per-frame shape of the core fields (``-1``: the atom count), in DeePMD-kit's keys.
CORE_SHAPES = {"coord": (-1, 3), "box": (9,), "force": (-1, 3), "virial": (9,), "energy": (1,)}
DROPPED = frozenset({"atom_numbs", "atom_names", "orig"})
STRUCTURAL = frozenset({"coord", "box", "atype", "natoms", "real_natoms_vec", "fid"})
ALWAYS_FLAGGED = ("fparam", "aparam", "spin", "charge_spin")
ONE, ZERO = np.float32(1.0), np.float32(0.0)
NUMERIC = (np.ndarray, np.generic, int, float, bool)  # what a batch stacks (text is left out)


def canonical(key: Any) -> str:
    """A record key in DeePMD-kit's in-memory spelling (``atomic_X`` -> ``atom_X``)."""
    key = key.decode() if isinstance(key, bytes) else str(key)
    key = DISK_KEYS.get(key, key)
    if key.startswith("find_atomic_"):
        return "find_atom_" + key[len("find_atomic_"):]
    if key.startswith("atomic_"):
        return "atom_" + key[len("atomic_"):]
    return key


def check_requirements(requirements: Sequence[DataRequirementItem]) -> None:
    """What an LMDB group cannot serve, refused when the requirement is added."""
    for req in requirements:
        if req.source_policy == "derived":
            raise ConfigError(f"data requirement {req.key!r}: derived labels are not "
                              "computed by mdloader", path="data_requirement")


@functools.lru_cache(maxsize=64)
def core_dtypes(requirements: tuple[DataRequirementItem, ...],
                 precisions: tuple[np.dtype, np.dtype]) -> tuple[dict[str, np.dtype], tuple]:
    """Output dtypes of the cast fields (a requirement's dtype, else DeePMD-kit's defaults),
    and a hashable key of them; shared by every group read under the same requirements."""
    normal, high = precisions
    core = {"coord": normal, "box": normal, "force": normal, "virial": normal, "energy": high}
    given = {req.key: req for req in requirements}
    dtypes = {k: output_dtype(given[k]) if k in given else v for k, v in core.items()}
    return dtypes, tuple(sorted((k, v.str) for k, v in dtypes.items()))


def resolve_requirement(req: DataRequirementItem, stored: np.ndarray | None, natoms: int,
                        frames: int) -> tuple[np.float32, np.ndarray]:
    """The ``find_`` flag and the ``(frames, ...)`` values of ``req`` for ``frames`` stacked
    frames whose stored values are ``stored`` (``None``: absent, and ``req`` is optional):
    DeePMD-kit's rule, an absent label ``default``-filled with ``find`` = 0 (1 for the
    ``"default"`` source policy), a present one repeated ``repeat`` times."""
    if stored is None:
        flag = ONE if req.source_policy == "default" else ZERO
        shape = (natoms, req.ndof) if req.atomic else (req.ndof,)
        block = np.full((frames,) + shape, req.default, dtype=output_dtype(req))
        if req.repeat != 1:
            block = np.repeat(block.reshape(frames, -1), req.repeat, axis=1)
        return flag, block
    if req.repeat != 1:
        stored = np.repeat(stored.reshape(frames, -1), req.repeat,
                           axis=1).astype(output_dtype(req), copy=False)
    return ONE, stored
