"""Finding systems: the only place that walks a directory tree.

Each entry of ``systems`` expands in place (:func:`expand_entry`), in the order given: a list
the user wrote keeps its order and its duplicates, because positional ``sys_probs`` and
``auto_prob`` blocks refer to those positions, and repeating a system is how people up-weight
it (DeePMD-kit does the same). What one entry finds -- a directory walk, a glob, the groups of
an HDF5 file -- is sorted and de-duplicated, so it is the same on every run, file system and
``PYTHONHASHSEED`` (DeePMD-kit's walk order is not, which silently reassigns ``sys_probs``).

A root is walked once with ``os.walk`` (``scandir`` under the hood: no ``stat`` per entry),
not descending into the ``set.*`` folders of a system (a directory holding ``type.raw``): they
hold frames. The one difference this makes: a ``type.raw`` *inside* a system's ``set.*`` folder
is no longer taken for a system (DeePMD-kit's ``rglob`` would take it; such a tree mixes a set
and a system). Systems nested in a system's other subfolders are found.

An LMDB database (a path ending in ``.lmdb`` or a folder holding ``data.mdb``, given as an
entry) expands into one address per group of frames, in the order of its system ids
(:mod:`mdloader.data.lmdb_index`); ``rglob_patterns`` do not apply to it.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath

from mdloader.data.formats import address_sort_key, parse_address
from mdloader.data.lmdb_index import group_addresses
from mdloader.errors import NoSystemsFoundError

log = logging.getLogger(__name__)

_GLOB_CHARS = set("*?[")


def discover_systems(
    systems: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    rglob_patterns: Sequence[str] | None = None,
) -> list[str]:
    """Addresses of every system of ``systems``: entries in the order given, each expanded.

    Parameters
    ----------
    systems
        A path or a list of paths: system directories, roots to search recursively, glob
        patterns, HDF5 files (every group holding ``type.raw``), ``file.h5#/group`` addresses,
        LMDB databases (one address per group) or ``db.lmdb#system=S,natoms=N`` addresses.
        Each entry is replaced by what it finds (:func:`expand_entry`); entries keep their
        order and repeated entries their repetitions.
    rglob_patterns
        Keep only systems whose path below a root matches one of these patterns (at any depth,
        like ``pathlib.Path.rglob``), e.g. ``["data_*"]``.
    """
    entries = [os.fspath(systems)] if isinstance(systems, (str, os.PathLike)) else [
        os.fspath(s) for s in systems]
    found = [address for entry in entries for address in expand_entry(entry, rglob_patterns)]
    if not found:
        where = ", ".join(entries) or "(no path given)"
        extra = f" matching {list(rglob_patterns)}" if rglob_patterns else ""
        raise NoSystemsFoundError(
            f"no DeePMD system (a directory or HDF5 group holding type.raw){extra} found under: "
            f"{where}")
    return found


def expand_entry(entry: str, rglob_patterns: Sequence[str] | None = None) -> list[str]:
    """The systems one entry stands for, sorted and unique (empty when it finds none); the groups
    of an LMDB database in the order of their system ids and atom counts."""
    found: set[str] = set()
    for path in _expand_globs([entry]):
        found.update(_systems_under(path, rglob_patterns))
    return sorted(found, key=address_sort_key)


def _expand_globs(entries: Iterable[str]) -> list[str]:
    out = []
    for entry in entries:
        path_part = entry.split("#", 1)[0]
        if _GLOB_CHARS & set(path_part):
            matches = sorted(glob.glob(path_part))
            if not matches:
                log.warning("the pattern %s matched nothing", entry)
            suffix = entry[len(path_part):]
            out.extend(m + suffix for m in matches)
        else:
            out.append(entry)
    return out


def _systems_under(entry: str, patterns: Sequence[str] | None) -> list[str]:
    loc = parse_address(entry)
    if loc.backend == "lmdb":  # a path ending in .lmdb, or one group's address
        return [os.path.abspath(loc.path) + "#" + loc.group] if loc.group else \
            group_addresses(entry)
    if "#" in entry or (loc.backend == "hdf5" and os.path.isfile(loc.path)):
        return _hdf5_systems(loc.path, loc.group, patterns)
    if os.path.isfile(entry):
        return _hdf5_systems(entry, "/", patterns)  # DeePMD-kit: any existing file is HDF5
    root = os.path.abspath(entry)
    if not os.path.isdir(root):
        log.warning("%s does not exist or is not a directory", entry)
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == root and "data.mdb" in filenames:  # an LMDB database named otherwise
            return group_addresses(root)
        if "type.raw" not in filenames:
            continue
        # A system's set.* folders hold frames, not systems, and are most of the tree: skip
        # them. Other subfolders of a system are still searched for nested systems.
        dirnames[:] = [d for d in dirnames if not d.startswith("set.")]
        if not patterns or _matches(os.path.relpath(dirpath, root), patterns):
            out.append(os.path.normpath(dirpath))
    return out


def _matches(relpath: str, patterns: Sequence[str] | None) -> bool:
    if not patterns:
        return True
    rel = PurePosixPath(relpath.replace(os.sep, "/"))
    return any(rel.match(p) for p in patterns)


def _hdf5_systems(path: str, group: str, patterns: Sequence[str] | None) -> list[str]:
    from mdloader.data.formats.hdf5 import open_file

    path = os.path.abspath(path)
    handle = open_file(path, f"{path}#{group}")
    top = handle[group] if group != "/" else handle
    out = []
    if "type.raw" in top and _matches(".", patterns):
        out.append(f"{path}#{group}")
    prefix = group.rstrip("/")

    def visit(name: str, obj: object) -> None:
        if name.endswith("/type.raw") or name == "type.raw":
            grp = name[: -len("type.raw")].rstrip("/")
            if grp and _matches(grp, patterns):
                out.append(f"{path}#{prefix}/{grp}")

    top.visititems(visit)
    return out
