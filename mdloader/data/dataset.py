"""``DeepmdDataSetForLoader``: one system as a lazy torch ``Dataset``.

It holds a :class:`~mdloader.data.formats.base.SystemMeta` and the data requirements, nothing
else, so it pickles to a few hundred bytes and travels cheaply to other ranks and DataLoader
workers.
Frames are read on demand by the reader of the system's storage format
(:meth:`mdloader.data.formats.base.Backend.reader`), through handles opened on first read in the
reading process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from mdloader.data.formats.base import FrameReader, SystemMeta
from mdloader.data.formats.registry import backend_of
from mdloader.data.schema import DataRequirementItem, merge_requirements
from mdloader.data.system import build_system_meta


class DeepmdDataSetForLoader(Dataset):
    """The frames of one DeePMD system, read lazily.

    Parameters
    ----------
    system
        A system address (directory or ``file.h5#/group``) or an already built
        :class:`SystemMeta` (what :func:`mdloader.loading.build.build_systems` hands every rank).
    type_map
        The model's type map; system types are remapped to it (DeePMD-kit's rules).
    origin
        Where the description comes from (an index file), named when a read finds that a file
        changed since; ``None``: described at start-up.
    """

    def __init__(self, system: str | SystemMeta, type_map: Sequence[str] | None = None, *,
                 origin: str | None = None) -> None:
        meta = system if isinstance(system, SystemMeta) else build_system_meta(system, type_map)
        self._meta = meta
        self._origin = origin
        self._extra: list[DataRequirementItem] = []
        self._reset()

    def _reset(self) -> None:
        # Shared tuples and a reader made on first read: a dataset costs little until read.
        self._reader: FrameReader | None = None
        self._requirements = backend_of(self._meta.location).requirements(self._meta,
                                                                          self._extra)

    # -- pickling: metadata and requirements only ------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"meta": self._meta, "extra": self._extra, "origin": self._origin}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._meta = state["meta"]
        self._extra = state["extra"]
        self._origin = state.get("origin")
        self._reset()

    # -- DeePMD-kit's attributes -------------------------------------------------------------
    @property
    def meta(self) -> SystemMeta:
        return self._meta

    @property
    def system(self) -> str:
        return self._meta.address

    @property
    def mixed_type(self) -> bool:
        return self._meta.mixed_type

    @property
    def _natoms(self) -> int:
        return self._meta.natoms

    @property
    def _ntypes(self) -> int:
        return self._meta.ntypes

    @property
    def _natoms_vec(self) -> np.ndarray:
        return self._meta.natoms_vec()

    @property
    def requirements(self) -> list[DataRequirementItem]:
        return list(self._requirements)

    def __len__(self) -> int:
        return self._meta.nframes

    def __repr__(self) -> str:
        return (f"DeepmdDataSetForLoader({self.system!r}, natoms={self._natoms}, "
                f"nframes={len(self)})")

    def add_data_requirement(self, data_requirement: Iterable[Any]) -> None:
        """Add what a model or loss needs, and check it against the description right away."""
        merged = merge_requirements(self._extra, data_requirement)
        backend_of(self._meta.location).check_requirements(self._meta, merged)
        self._extra = merged
        self._reset()

    def _frame_reader(self) -> FrameReader:
        """The format's reader, made on first read (100 000 systems cost nothing before)."""
        if self._reader is None:
            self._reader = backend_of(self._meta.location).reader(
                self._meta, self._requirements, self._origin)
        return self._reader

    # -- reading ------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.get_frames([index])[0]

    def get_frames(self, fids: Sequence[int]) -> list[dict[str, Any]]:
        """Frame dicts exactly as DeePMD-kit's ``DeepmdDataSetForLoader[i]`` yields them (for an
        LMDB group: as its ``LmdbDataReader[i]`` does)."""
        return self._frame_reader().frames(fids)

    def get_batch(self, fids: Sequence[int]) -> dict[str, Any]:
        """The collated batch of ``fids`` (the same as ``collate_batch(get_frames(fids))``; for
        an LMDB group, a flag is 1 only when every frame has the label, as DeePMD-kit's)."""
        return self._frame_reader().batch(fids)
