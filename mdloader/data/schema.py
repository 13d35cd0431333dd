"""DeePMD data keys declared once: requirements, precision, and widths known from the format.

Reading (``dataset.py``) and build-time checking (``system.py``) both use these declarations, so
the npy and HDF5 backends cannot drift apart. Nothing here touches a file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from mdloader.errors import ConfigError

_SOURCE_POLICIES = ("tracked", "default", "derived")


class DataRequirementItem:
    """What a model or loss needs from the data, with DeePMD-kit's fields and meaning.

    Parameters
    ----------
    key
        Array stem: ``set.*/<key>.npy``. ``atomic_X`` is renamed ``atom_X``; a lookup for
        ``atom_X`` also tries ``atomic_X.npy``.
    ndof
        Values per frame (global) or per atom (``atomic``).
    atomic
        Per-atom quantity (``F x N*ndof`` on disk).
    must
        The file must exist; otherwise missing data is ``default``-filled and ``find_<key>`` is 0.
    high_prec
        Use the "energy" precision (float64 in both precision modes).
    type_sel
        Atom types the per-atom label is given for: stored for the selected atoms only
        (``F x nsel*ndof``) or for all atoms; both layouts are accepted.
    repeat
        Repeat each value ``repeat`` times (DeePMD-kit's per-frame path forgets this; we apply it).
    default
        Fill value when the file is absent and ``must`` is false.
    dtype
        Explicit output dtype, overriding ``high_prec``.
    output_natoms_for_type_sel
        With ``type_sel``, output all N atoms (zeros for unselected) instead of nsel.
    special_shape
        ``"hessian"`` (also implied by the key ``hessian``): one ``3N x 3N`` matrix per frame.
    source_policy
        DeePMD-kit >= 3.2's ``"tracked"``, ``"default"`` or ``"derived"`` (only ``"tracked"``
        with ``must``). The npy and HDF5 readers keep it and hand it on without interpreting it
        (as DeePMD-kit's do); LMDB frames use it as DeePMD-kit's LMDB reader does: a
        ``"default"`` label filled with ``default`` counts as found (``find_<key>`` = 1).
    """

    def __init__(
        self,
        key: str,
        ndof: int,
        atomic: bool = False,
        must: bool = False,
        high_prec: bool = False,
        type_sel: list[int] | None = None,
        repeat: int = 1,
        default: float = 0.0,
        dtype: Any = None,
        output_natoms_for_type_sel: bool = False,
        special_shape: str | None = None,
        source_policy: str = "tracked",
    ) -> None:
        if int(ndof) < 1:
            raise ConfigError(f"data requirement {key!r}: ndof must be >= 1, got {ndof}")
        if int(repeat) < 1:
            raise ConfigError(f"data requirement {key!r}: repeat must be >= 1, got {repeat}")
        if special_shape not in (None, "hessian"):
            raise ConfigError(
                f"data requirement {key!r}: special_shape must be None or 'hessian', "
                f"got {special_shape!r}"
            )
        if source_policy not in _SOURCE_POLICIES:
            raise ConfigError(
                f"data requirement {key!r}: source_policy must be one of {_SOURCE_POLICIES}, "
                f"got {source_policy!r}"
            )
        if must and source_policy != "tracked":
            raise ConfigError(f"data requirement {key!r}: a mandatory requirement (must=True) "
                              f"cannot use source_policy={source_policy!r}, only 'tracked'")
        self.key = key
        self.ndof = int(ndof)
        self.atomic = bool(atomic)
        self.must = bool(must)
        self.high_prec = bool(high_prec)
        self.type_sel = None if type_sel is None else [int(t) for t in type_sel]
        self.repeat = int(repeat)
        self.default = default
        self.dtype = dtype
        self.output_natoms_for_type_sel = bool(output_natoms_for_type_sel)
        self.special_shape = special_shape
        self.source_policy = source_policy
        self.dict = self.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "ndof": self.ndof, "atomic": self.atomic, "must": self.must,
            "high_prec": self.high_prec, "type_sel": self.type_sel, "repeat": self.repeat,
            "default": self.default, "dtype": self.dtype,
            "output_natoms_for_type_sel": self.output_natoms_for_type_sel,
            "special_shape": self.special_shape, "source_policy": self.source_policy,
        }

    def __getitem__(self, key: str) -> Any:
        return self.dict[key]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DataRequirementItem) and self.dict == other.dict

    def __hash__(self) -> int:
        return hash(self.key)

    def __reduce__(self) -> tuple[Any, ...]:
        # positional arguments only: keeps pickled datasets small
        d = self.dict
        return (DataRequirementItem, (d["key"], d["ndof"], d["atomic"], d["must"], d["high_prec"],
                                      d["type_sel"], d["repeat"], d["default"], d["dtype"],
                                      d["output_natoms_for_type_sel"], d["special_shape"],
                                      d["source_policy"]))

    def __repr__(self) -> str:
        return f"DataRequirementItem({self.dict})"

    @property
    def is_hessian(self) -> bool:
        return self.special_shape == "hessian" or self.key == "hessian"


# -- key spelling: DeePMD-kit writes per-atom keys "atom_X" and accepts files "atomic_X.npy" ----


def canonical_key(key: str) -> str:
    """``atomic_X`` -> ``atom_X``: the name a requirement is known by (DeePMD-kit's ``add``)."""
    return "atom_" + key[len("atomic_"):] if key.startswith("atomic_") else key


def output_key(key: str) -> str:
    """The key a frame dict uses: every ``atomic`` spelled ``atom``, as DeePMD-kit outputs it."""
    return canonical_key(key).replace("atomic", "atom")


def stem_in(keys: tuple[str, ...], key: str) -> str | None:
    """The array stem holding ``key`` among ``keys`` (a set's files): ``atom_X``, else
    ``atomic_X``; ``None`` when neither is there."""
    key = canonical_key(key)
    if key in keys:
        return key
    if key.startswith("atom_") and "atomic_" + key[5:] in keys:
        return "atomic_" + key[5:]
    return None


def as_requirement(item: Any) -> DataRequirementItem:
    """Accept our items, DeePMD-kit's items (mapping-style access) and plain dicts."""
    if isinstance(item, DataRequirementItem):
        return item
    if isinstance(item, Mapping) or hasattr(item, "__getitem__"):
        def get(name: str, default: Any) -> Any:
            try:
                return item[name]
            except (KeyError, IndexError):
                return default
        return DataRequirementItem(
            get("key", None), get("ndof", 1), atomic=get("atomic", False),
            must=get("must", False), high_prec=get("high_prec", False),
            type_sel=get("type_sel", None), repeat=get("repeat", 1),
            default=get("default", 0.0), dtype=get("dtype", None),
            output_natoms_for_type_sel=get("output_natoms_for_type_sel", False),
            special_shape=get("special_shape", None),
            source_policy=get("source_policy", None) or "tracked",
        )
    raise ConfigError(f"not a data requirement: {item!r}")


_DEFAULTS: dict[bool, tuple[DataRequirementItem, ...]] = {}


def default_requirements(pbc: bool) -> tuple[DataRequirementItem, ...]:
    """What every DeePMD system provides: box (required when periodic), coord, numb_copy.

    One interned tuple per periodicity: 100 000 datasets must not each carry their own copies.
    """
    if pbc not in _DEFAULTS:
        _DEFAULTS[pbc] = (
            DataRequirementItem("box", 9, must=pbc),
            DataRequirementItem("coord", 3, atomic=True, must=True),
            DataRequirementItem("numb_copy", 1, must=False, default=1, dtype=int),
        )
    return _DEFAULTS[pbc]


def merge_requirements(
    current: Iterable[DataRequirementItem], added: Iterable[Any]
) -> list[DataRequirementItem]:
    """Later items replace earlier ones with the same canonical key (DeePMD-kit's dict update)."""
    merged: dict[str, DataRequirementItem] = {}
    for item in list(current) + [as_requirement(a) for a in added]:
        merged[canonical_key(item.key)] = item
    return list(merged.values())


def float_precisions() -> tuple[np.dtype, np.dtype]:
    """(normal, high) output precision from ``DP_INTERFACE_PREC`` as DeePMD-kit reads it."""
    prec = os.environ.get("DP_INTERFACE_PREC", "high").lower()
    if prec == "high":
        return np.dtype(np.float64), np.dtype(np.float64)
    if prec == "low":
        return np.dtype(np.float32), np.dtype(np.float64)
    raise ConfigError(
        f"DP_INTERFACE_PREC must be 'high' or 'low', got {prec!r}", path="$DP_INTERFACE_PREC"
    )


def output_dtype(req: DataRequirementItem) -> np.dtype:
    """The dtype a requirement is delivered in: its own, else DeePMD-kit's precision rule."""
    if req.dtype is not None:
        return np.dtype(req.dtype)
    normal, high = float_precisions()
    return high if req.high_prec else normal


#: Per-frame widths the format fixes, as a multiple of natoms ("atoms", k) or absolute ("abs", k).
#: Used at build time to catch files whose width disagrees with ``type.raw`` before training.
KNOWN_WIDTHS: dict[str, tuple[str, int]] = {
    "coord": ("atoms", 3),
    "force": ("atoms", 3),
    "box": ("abs", 9),
    "virial": ("abs", 9),
    "energy": ("abs", 1),
    "spin": ("atoms", 3),
    "force_mag": ("atoms", 3),
    "atom_ener": ("atoms", 1),
    "real_atom_types": ("atoms", 1),
}
