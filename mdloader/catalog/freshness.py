"""Is a saved description still true? One ``stat`` per folder, small text file and set.

The rule: a path is unchanged when it still exists and its :class:`~mdloader.persist.FileStamp`
did not change since the start of the build that described it
(:meth:`~mdloader.persist.FileStamp.changed_since`, less a settling margin, because file times
are coarse and clocks differ between machines). The status change time is part of the stamp, so
copying old files over new ones (``cp -p``, ``rsync -a``, ``tar``) is caught too.

Per npy system that is: its folder (a set, ``nopbc``, ``type_map.raw`` or a nested system added
or removed changes it), ``type.raw`` and ``type_map.raw`` (rewritten in place, they would change
nothing else), each ``set.*`` folder (an array added or removed) and its ``coord.npy`` (a set
rewritten in place with other frames rewrites it). Another array rewritten in place is checked
when it is read: its frames, width and size must still match
(:func:`mdloader.data.formats.npy.read_rows`), and a read that finds it changed removes the
index, so that the next start describes the systems again. An HDF5 system is its file. Each
format says which paths it depends on
(:func:`mdloader.data.formats.capabilities.freshness_paths`); systems of a format that names
none are always described again.
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mdloader.catalog.index_file import SavedIndex
from mdloader.catalog.table import SystemTable
from mdloader.data.formats import get_backend
from mdloader.data.formats.capabilities import Freshness, has
from mdloader.fs_calls import Overlap
from mdloader.persist import changed_paths


def changed(paths: Sequence[str], since_ns: int, overlap: Overlap) -> np.ndarray:
    """For each path, whether it is gone or changed at or after ``since_ns`` (ns since epoch)."""
    return np.fromiter(overlap.map_batches(lambda part: changed_paths(part, since_ns), paths),
                       dtype=bool, count=len(paths))


def system_paths(table: SystemTable, addresses: list[str] | None = None
                 ) -> tuple[list[str], np.ndarray, list[int]]:
    """The paths checked for the systems of ``table`` (each format's ``freshness_paths``,
    :mod:`mdloader.data.formats.capabilities`), the row of each path, and the rows of systems
    that cannot be checked (described again at every start).

    Each row's format comes from the table (no address is parsed again); ``addresses``: the
    table's, when decoded already."""
    addresses = table.addresses() if addresses is None else addresses
    layouts = table.layouts()
    paths: list[str] = []
    rows: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    uncheckable: list[int] = []
    for name, of_backend in table.rows_by_backend().items():
        backend = get_backend(name)
        if not has(backend, Freshness):  # never saved as fresh: described at every start
            uncheckable.extend(of_backend.tolist())
            continue
        by_layout: dict[tuple[bool, tuple[str, ...]], list[int]] = {}
        for row in of_backend.tolist():
            by_layout.setdefault(layouts[row], []).append(row)
        for layout, group in by_layout.items():
            found = backend.freshness_paths(  # type: ignore[attr-defined]
                [addresses[r] for r in group], layout)
            if found is None:
                uncheckable.extend(group)
                continue
            paths.extend(found)
            rows.append(np.repeat(np.asarray(group, dtype=np.int64), len(found) // len(group)))
    return paths, np.concatenate(rows), uncheckable


def stale_systems(table: SystemTable, since_ns: int, overlap: Overlap) -> np.ndarray:
    """Whether each system of ``table`` changed since ``since_ns`` (see the module docstring)."""
    addresses = table.addresses()
    paths, rows, uncheckable = system_paths(table, addresses)
    distinct = _distinct(addresses, paths)
    flags = changed(distinct, since_ns, overlap)
    if distinct is not paths:  # back from the distinct paths to every path
        found = dict(zip(distinct, flags.tolist()))
        flags = np.fromiter((found[p] for p in paths), dtype=bool, count=len(paths))
    stale = np.zeros(len(table), dtype=bool)
    stale[rows[flags]] = True
    stale[uncheckable] = True
    return stale


def _distinct(addresses: list[str], paths: list[str]) -> list[str]:
    """``paths`` without repeats (an HDF5 file holds many systems: one stat). Only systems with
    a fragment (``file#group``) share a container, so when no address has one, the paths are
    not hashed (a system listed twice is checked twice)."""
    if not any("#" in a for a in addresses):
        return paths
    return list(dict.fromkeys(paths))


@dataclass
class Check:
    """What changed since an index was saved: systems (by row), other folders walked (in the
    order of ``SavedIndex.walked``), HDF5 files, and entries (a
    pattern matches other paths). ``partial``: the file left systems out (LMDB groups), which
    must be found and described again even when nothing changed."""

    systems: np.ndarray
    folders: np.ndarray
    files: np.ndarray
    entries: bool
    partial: bool = False

    @property
    def nothing_stored_changed(self) -> bool:
        return not (self.systems.any() or self.folders.any() or self.files.any()
                    or self.entries)

    @property
    def unchanged(self) -> bool:
        return self.nothing_stored_changed and not self.partial


def check_saved(saved: SavedIndex, before_ns: int, overlap: Overlap) -> Check:
    """Check everything ``saved`` depends on against ``before_ns`` (see the module docstring)."""
    return Check(stale_systems(saved.table, before_ns, overlap),
                 changed(list(saved.walked), before_ns, overlap),
                 changed(saved.files, before_ns, overlap),
                 _globs_moved(saved.globs),
                 saved.partial)


def _globs_moved(globs: dict[str, list[str]]) -> bool:
    """Whether a pattern entry now matches other paths than it did."""
    for entry, matched in globs.items():
        path_part = entry.split("#", 1)[0]
        suffix = entry[len(path_part):]
        if [m + suffix for m in sorted(glob.glob(path_part))] != matched:
            return True
    return False
