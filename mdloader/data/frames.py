"""Turning rows read from disk into DeePMD-kit's per-frame arrays.

Pure numpy: atom sorting by type, ``type_sel`` layouts, Hessian permutation, ``repeat``, dtype
casts and default filling. Shapes per frame follow DeePMD-kit's PyTorch path: atomic keys
``[natoms(or nsel), ndof*repeat]``, global keys ``[ndof*repeat]``, the Hessian ``[9 N^2]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mdloader.data.schema import DataRequirementItem, output_dtype
from mdloader.errors import ShapeError


@dataclass(frozen=True)
class AtomOrder:
    """Precomputed permutations of one system (DeePMD-kit's ``idx_map``)."""

    atom_types: np.ndarray  # model ids, type.raw order
    idx_map: np.ndarray  # stable sort of atoms by type

    @classmethod
    def of(cls, atom_types: np.ndarray) -> AtomOrder:
        return cls(atom_types, np.argsort(atom_types, kind="stable"))

    def selection(self, type_sel: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(mask of selected atoms in file order, stable type order of the selected atoms)."""
        mask = np.isin(self.atom_types, type_sel)
        return mask, np.argsort(self.atom_types[mask], kind="stable")

    def hessian_index(self) -> np.ndarray:
        return (3 * self.idx_map[:, None] + np.arange(3)[None, :]).reshape(-1)


def frame_shape(req: DataRequirementItem, natoms: int, nsel: int) -> tuple[int, ...]:
    """The per-frame output shape of a requirement."""
    if req.is_hessian:
        return (9 * natoms * natoms,)
    if req.atomic:
        rows = nsel if req.type_sel is not None and not req.output_natoms_for_type_sel else natoms
        return (rows, req.ndof * req.repeat)
    return (req.ndof * req.repeat,)


def default_block(req: DataRequirementItem, nframes: int, natoms: int, nsel: int) -> np.ndarray:
    """What a missing optional key becomes: ``default`` everywhere (``find_<key>`` is 0)."""
    return np.full((nframes,) + frame_shape(req, natoms, nsel), req.default,
                   dtype=output_dtype(req))


def transform(req: DataRequirementItem, rows: np.ndarray, order: AtomOrder,
              where: tuple[str, str]) -> np.ndarray:
    """Rows ``(k, width)`` as stored -> ``(k, *frame_shape)`` in model order and dtype.

    ``where`` is (system, file) for error messages.
    """
    k, width = rows.shape
    natoms = order.atom_types.shape[0]
    dtype = output_dtype(req)
    if req.is_hessian:
        _expect(width, 9 * natoms * natoms, req, where)
        idx = order.hessian_index()
        cube = rows.reshape(k, 3 * natoms, 3 * natoms)[:, idx][:, :, idx]
        return cube.reshape(k, -1).astype(dtype)
    if not req.atomic:
        _expect(width, req.ndof, req, where)
        return _repeat(rows.astype(dtype), req.repeat)
    if req.type_sel is None:
        _expect(width, natoms * req.ndof, req, where)
        data = rows.reshape(k, natoms, req.ndof)[:, order.idx_map]
        return _repeat(data.astype(dtype), req.repeat)
    return _repeat(_type_sel(req, rows, order, where).astype(dtype), req.repeat)


def _type_sel(req: DataRequirementItem, rows: np.ndarray, order: AtomOrder,
              where: tuple[str, str]) -> np.ndarray:
    k, width = rows.shape
    natoms = order.atom_types.shape[0]
    mask, sel_order = order.selection(req.type_sel or [])
    nsel = int(mask.sum())
    if width == nsel * req.ndof:
        data = rows.reshape(k, nsel, req.ndof)
        if not req.output_natoms_for_type_sel:
            return data[:, sel_order]
        full = np.zeros((k, natoms, req.ndof), dtype=rows.dtype)
        full[:, mask] = data
        return full[:, order.idx_map]
    if width == natoms * req.ndof:
        data = rows.reshape(k, natoms, req.ndof)
        if req.output_natoms_for_type_sel:
            return data[:, order.idx_map]
        return data[:, mask][:, sel_order]
    raise ShapeError(
        f"per-frame width of {req.key} fits neither the selected atoms nor all atoms",
        system=where[0], file=where[1],
        expected=f"{nsel * req.ndof} ({nsel} selected atoms x {req.ndof}) or "
                 f"{natoms * req.ndof} ({natoms} atoms x {req.ndof})",
        found=width)


def expected_widths(req: DataRequirementItem, atom_types: np.ndarray) -> tuple[int, ...]:
    """Widths on disk a requirement accepts (checked against headers before any read)."""
    natoms = atom_types.shape[0]
    if req.is_hessian:
        return (9 * natoms * natoms,)
    if not req.atomic:
        return (req.ndof,)
    if req.type_sel is None:
        return (natoms * req.ndof,)
    nsel = int(np.isin(atom_types, req.type_sel).sum())
    return (nsel * req.ndof, natoms * req.ndof)


def _expect(width: int, expected: int, req: DataRequirementItem, where: tuple[str, str]) -> None:
    if width != expected:
        raise ShapeError(f"per-frame width of {req.key} does not match the requirement",
                         system=where[0], file=where[1], expected=expected, found=width)


def _repeat(data: np.ndarray, repeat: int) -> np.ndarray:
    if repeat == 1:
        return data
    return np.repeat(data, repeat, axis=-1)
