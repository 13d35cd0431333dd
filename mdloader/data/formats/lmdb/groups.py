"""Rank 0's view of an LMDB database: its metadata, checked, and its frames grouped into systems.

A database mixes frames of many source systems and atom counts; a batch needs one atom count.
So its frames are grouped by (``frame_system_ids``, ``frame_nlocs``) -- by atom count alone when
the database records no system ids, as DeePMD-kit does -- and every group becomes one system
with the address ``<db>#system=S,natoms=N``, in the order of (S, N). Each group is described by
a :class:`~mdloader.data.formats.base.SystemMeta` whose one set-like entry, :class:`LmdbGroup`,
lists its frames as runs of consecutive indices, so the description stays small at 10⁶ frames.

Only the ``__metadata__`` entry is read, except when it lacks ``frame_nlocs``: then every frame is
read once, here (on rank 0), for its atom count. The groups of each database are kept per process
(a few, keyed by the file's size and modification time), because discovery and the description
of every group both need it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mdloader.data.formats.base import Location, SystemMeta, interned
from mdloader.data.formats.lmdb import environment
from mdloader.data.formats.lmdb.address import group_address, lmdb_group_of
from mdloader.data.formats.lmdb.environment import METADATA_KEY, entry_of
from mdloader.data.formats.lmdb.frame_runs import FrameRuns, encode_groups
from mdloader.data.formats.lmdb.metadata import Metadata, read_metadata
from mdloader.errors import DataError, MissingDataError, TypeMapError

_CACHE: OrderedDict[str, tuple[tuple[int, ...], LmdbGroups]] = OrderedDict()
_CACHE_LIMIT = 8
_LOCK = threading.Lock()
_PLACEHOLDERS: dict[int, np.ndarray] = {}


@dataclass(frozen=True)
class LmdbGroup:
    """The set-like entry of an LMDB group: its frames, their key format, and the type remap
    from the database's ``type_map`` to the model's (``None``: ids are used as stored)."""

    name: str
    nframes: int
    runs: FrameRuns
    frame_format: str
    remap: tuple[int, ...] | None
    stamp: tuple[int, ...] | None = None  # data.mdb when described; every read checks it

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_group, (self.runs.nframes, self.runs.blob, self.frame_format,
                                 self.remap, self.stamp))


def _restore_group(nframes: int, blob: bytes, frame_format: str,
                   remap: tuple[int, ...] | None,
                   stamp: tuple[int, ...] | None = None) -> LmdbGroup:
    return LmdbGroup("frames", nframes, FrameRuns(nframes, blob), interned(frame_format),
                     interned(remap), interned(stamp))  # one stamp per database in a broadcast


@dataclass(frozen=True)
class LmdbGroups:
    """A database's checked metadata and its groups, in (system id, atoms) order."""

    path: str
    metadata: Metadata
    groups: dict[tuple[int, int], FrameRuns]
    stamp: tuple[int, ...] | None = None  # data.mdb before its metadata was read

    def addresses(self) -> list[str]:
        return [group_address(self.path, sid, natoms) for sid, natoms in self.groups]


def group_addresses(entry: str) -> list[str]:
    """One address per group of the database at ``entry`` (discovery's expansion)."""
    return read_groups(os.path.abspath(os.fspath(entry).rstrip("/"))).addresses()


def read_groups(path: str) -> LmdbGroups:
    """The groups of the database at ``path``, from this process's cache when still current."""
    stamp = _stamp(path)
    with _LOCK:
        hit = _CACHE.get(path)
        if hit is not None and hit[0] == stamp:
            _CACHE.move_to_end(path)
            return hit[1]
        if hit is not None:  # replaced: this process's environment still maps the old file
            environment.forget(path)
        groups = _read_groups(path, stamp)
        _CACHE[path] = (stamp, groups)
        while len(_CACHE) > _CACHE_LIMIT:
            _CACHE.popitem(last=False)
        return groups


def cached_groups(path: str) -> LmdbGroups:
    """The groups discovery just read (no ``stat``: 10⁵ groups are described in a row), else
    :func:`read_groups`."""
    hit = _CACHE.get(path)
    return hit[1] if hit is not None else read_groups(path)


def _stamp(path: str) -> tuple[int, ...]:
    """``data.mdb``'s stamp as a plain tuple: it travels in every broadcast description, where
    a named tuple would pickle its class's name too."""
    stamp = environment.data_stamp(path)
    return tuple(stamp) if stamp is not None else (-1, -1, -1, -1)  # gone: _read_groups says


def _read_groups(path: str, stamp: tuple[int, ...]) -> LmdbGroups:
    meta = read_metadata(path)
    return LmdbGroups(path, meta, group_frames(meta.frame_nlocs, meta.frame_system_ids), stamp)


def group_frames(nlocs: np.ndarray, sids: np.ndarray | None) -> dict[tuple[int, int],
                                                                      FrameRuns]:
    """Frames grouped by (system id, atom count), each group's indices as runs.

    One stable sort of all frames, then the runs of the whole sorted order are cut at group
    boundaries: no Python loop over frames, one short step per group.
    """
    nl = np.asarray(nlocs, dtype=np.int64)
    sid = np.full(len(nl), -1, dtype=np.int64) if sids is None else np.asarray(sids, np.int64)
    key = (sid + 1) * (int(nl.max(initial=0)) + 1) + nl
    order = np.argsort(key, kind="stable")
    skey = key[order]
    new_group = np.concatenate(([True], skey[1:] != skey[:-1]))
    new_run = new_group | np.concatenate(([True], np.diff(order) != 1))
    heads = np.flatnonzero(new_run)
    lengths = np.diff(np.concatenate((heads, [len(order)])))
    group_heads = np.flatnonzero(new_group)
    first_run = np.searchsorted(heads, group_heads)
    bounds = np.concatenate((first_run, [len(heads)]))
    blobs = encode_groups(order[heads], lengths, bounds)
    counts = np.diff(np.concatenate((group_heads, [len(order)]))).tolist()
    first = order[group_heads]
    return {(int(s), int(n)): FrameRuns(c, blob) for s, n, c, blob in
            zip(sid[first].tolist(), nl[first].tolist(), counts, blobs)}


def describe_group(loc: Location, type_map: Sequence[str] | None) -> SystemMeta:
    """The :class:`SystemMeta` of one group (rank 0; reads nothing once the groups are cached)."""
    if not loc.group:
        raise DataError("an LMDB database holds many systems: pass it to discover_systems "
                        "(or as `systems` in input.json), or name one group as "
                        f"'{loc.path}#system=0,natoms=6'", system=loc.path, file=loc.path)
    found = cached_groups(os.path.abspath(loc.path))
    sid, natoms = lmdb_group_of(loc)
    runs = found.groups.get((sid, natoms))
    if runs is None:
        raise MissingDataError("the database has no such group of frames", system=loc.address,
                               file=entry_of(loc.path, METADATA_KEY),
                               expected=f"one of {_some_groups(found)}")
    final_map, remap = _type_maps(found, type_map, loc.address)
    group = _restore_group(runs.nframes, runs.blob, found.metadata.frame_format, remap,
                           found.stamp)
    return SystemMeta(address=loc.address, backend=loc.backend,
                      atom_types=_placeholder(natoms), type_map=interned(final_map), pbc=True,
                      mixed_type=True, sets=(group,))


def _some_groups(found: LmdbGroups) -> str:
    names = [a.rpartition("#")[2] for a in found.addresses()]
    return ", ".join(names[:5]) + (f" ... ({len(names)} groups)" if len(names) > 5 else "")


def _placeholder(natoms: int) -> np.ndarray:
    """Atom types vary per frame in a database: the description holds zeros, like the
    ``type.raw`` of a mixed-type system (one shared read-only array per atom count)."""
    found = _PLACEHOLDERS.get(natoms)
    if found is None:
        found = np.zeros(natoms, dtype=np.int32)
        found.flags.writeable = False
        _PLACEHOLDERS[natoms] = found
    return found


def _type_maps(found: LmdbGroups, model_map: Sequence[str] | None, address: str
               ) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """(type map of the frames, remap from stored ids to it): DeePMD-kit's name-based rule."""
    stored = found.metadata.type_map
    if model_map is None:
        if stored is None:
            raise DataError("the database has no type_map: give the model's type_map",
                            system=address, file=entry_of(found.path, METADATA_KEY))
        return stored, None
    model = tuple(model_map)
    if stored is None or stored == model:
        return model, None
    missing = [name for name in stored if name not in model]
    if missing:
        raise TypeMapError(f"Elements {missing} of the database's type_map are not in the "
                           "model type_map", system=address,
                           file=entry_of(found.path, METADATA_KEY),
                           expected=f"elements within {list(model)}", found=list(stored))
    return model, tuple(model.index(name) for name in stored)
