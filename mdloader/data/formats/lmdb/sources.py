"""The frames of an npy or HDF5 system, or of a dpdata system, as chunks for the LMDB writer.

A system is read set by set, a bounded number of frames at a time, with the raw rows of each
array (atoms in file order, stored dtype: what dpdata's writer stores). Each npy key becomes a
field in dpdata's disk layout:

==============================  ===============  ==================================
npy key                         LMDB field       per-frame shape
==============================  ===============  ==================================
``coord``, ``force``            ``coords``,      ``(natoms, 3)``
                                ``forces``
``box``, ``virial``             ``cells``,       ``(3, 3)`` (``cells`` absent when
                                ``virials``      non-periodic)
``energy``                      ``energies``     ``()``
``real_atom_types``             (the atom types of each frame: mixed-type systems)
``hessian``                     ``hessian``      ``(natoms, 3, natoms, 3)``
per-atom keys (below)           same name        ``(natoms, width / natoms)``
anything else                   same name        ``(width,)``
==============================  ===============  ==================================

Per-atom keys are ``aparam``, ``spin``, ``force_mag``, ``atom_pref``, ``charge`` and every
``atom_*``/``atomic_*`` key whose width is a multiple of the atom count.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from mdloader.data.formats import backend_of
from mdloader.data.formats.base import SystemMeta
from mdloader.data.formats.lmdb.writer import SourceChunk
from mdloader.data.formats.sets import SetBackend
from mdloader.errors import DataError, UnknownFormatError

#: npy key -> (LMDB field, per-frame shape with -1 for the atom count).
CORE = {"coord": ("coords", (-1, 3)), "force": ("forces", (-1, 3)), "box": ("cells", (3, 3)),
        "virial": ("virials", (3, 3)), "energy": ("energies", ())}
PER_ATOM = frozenset({"aparam", "spin", "force_mag", "atom_pref", "charge"})


def field_layout(stem: str, width: int, natoms: int
                 ) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """(LMDB field, per-frame shape, atom axes) of an npy key; ``None``: not stored as a field."""
    if stem == "real_atom_types":
        return None
    if stem in CORE:
        name, shape = CORE[stem]
        atom_axes = (0,) if -1 in shape else ()
        return name, tuple(natoms if s == -1 else s for s in shape), atom_axes
    if stem == "hessian" and width == 9 * natoms * natoms:
        return stem, (natoms, 3, natoms, 3), (0, 2)
    per_atom = stem in PER_ATOM or stem.startswith(("atom_", "atomic_"))
    if per_atom and width % natoms == 0:
        return stem, (natoms, width // natoms), (0,)
    return stem, (width,), ()


def element_names(meta: SystemMeta, type_map: Sequence[str] | None) -> tuple[str, ...]:
    """The element of each type id of ``meta`` (its ``type_map.raw``, else ``type_map``)."""
    if meta.type_map is not None:
        return tuple(meta.type_map)
    if type_map is None:
        raise DataError("the system has no type_map.raw: give the element names (--type-map)",
                        system=meta.address)
    ntypes = int(meta.atom_types.max()) + 1
    if ntypes > len(type_map):
        raise DataError("type.raw holds more types than the given type_map names",
                        system=meta.address, expected=f"ids < {len(type_map)}",
                        found=f"id {ntypes - 1}")
    return tuple(type_map)


def frame_bytes(meta: SystemMeta) -> int:
    """Bytes of one frame as read (8 per value), to size the chunks."""
    return 8 * max(sum(s.widths) for s in meta.sets)


def system_chunks(meta: SystemMeta, names: tuple[str, ...], *,
                  chunk_bytes: int = 32 << 20) -> Iterator[SourceChunk]:
    """The frames of an npy or HDF5 system (described with ``type_map=None``), in order."""
    loc = meta.location
    backend = backend_of(loc)
    if not isinstance(backend, SetBackend):
        raise UnknownFormatError("only systems in the set layout (npy, HDF5) are packed by "
                                 "system", system=meta.address, file=loc.path,
                                 expected="an npy or HDF5 system", found=backend.name)
    storage = backend.storage
    step = max(1, min(4096, chunk_bytes // max(1, frame_bytes(meta))))
    for s in meta.sets:
        layouts = {k: field_layout(k, w, meta.natoms) for k, w in zip(s.keys, s.widths)}
        for lo in range(0, s.nframes, step):
            rows = np.arange(lo, min(s.nframes, lo + step))
            fields, axes = {}, {}
            for stem, layout in layouts.items():
                if layout is None:
                    continue
                name, shape, atom_axes = layout
                block = storage.read_rows(loc, s.name, stem, rows, s.nframes)
                fields[name] = block.reshape((len(rows),) + shape)
                axes[name] = atom_axes
            if meta.mixed_type:
                types = storage.read_rows(loc, s.name, "real_atom_types", rows, s.nframes)
            else:
                types = np.broadcast_to(meta.atom_types, (len(rows), meta.natoms))
            yield SourceChunk(names, np.asarray(types, dtype=np.int64), fields, axes, meta.pbc)


def array_chunks(names: Sequence[str], types: np.ndarray, arrays: Mapping[str, np.ndarray],
                 atom_axes: Mapping[str, tuple[int, ...]], periodic: bool, *,
                 chunk_frames: int = 1024) -> Iterator[SourceChunk]:
    """Chunks of a system already in memory (a dpdata system's ``data``, disk field names)."""
    nframes = len(next(iter(arrays.values())))
    per_frame = np.asarray(types).ndim == 2
    for lo in range(0, nframes, chunk_frames):
        hi = min(nframes, lo + chunk_frames)
        chunk_types = types[lo:hi] if per_frame else np.broadcast_to(types, (hi - lo,
                                                                             len(types)))
        fields: dict[str, Any] = {k: v[lo:hi] for k, v in arrays.items()}
        yield SourceChunk(tuple(names), np.asarray(chunk_types, dtype=np.int64), fields,
                          dict(atom_axes), periodic)
