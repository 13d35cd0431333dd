"""Finding systems: the only module that walks a directory tree, level by level.

Each entry of ``systems`` expands in place (:func:`expand_entry`), in the order given: a list
the user wrote keeps its order and its duplicates, because positional ``sys_probs`` and
``auto_prob`` blocks refer to those positions, and repeating a system is how people up-weight
it (DeePMD-kit does the same). What one entry finds -- a directory walk, a glob, the groups of
an HDF5 file -- is sorted and de-duplicated, so it is the same on every run, file system and
``PYTHONHASHSEED`` (DeePMD-kit's walk order is not, which silently reassigns ``sys_probs``).

The walk. A folder holding ``type.raw`` is a system. The roots of all entries are walked
together, one listing per folder and no ``stat`` per entry: each folder is listed once, even
when it lies below several roots, and a system's listing is kept, so that describing it does
not list it again. All folders of a level are listed together, in threads when the first
listings waited on the file system (:mod:`mdloader.fs_calls`). A symbolic link to a folder is
followed as DeePMD-kit's ``Path.rglob`` follows it: the linked folder is a system when it holds
``type.raw``, and the walk does not descend below it (so a link loop ends there; a link that
cannot be resolved is ignored with a warning). The walk does not descend into the ``set.*``
folders of a system: they hold frames. The one difference this makes: a ``type.raw``
*inside* a system's ``set.*`` folder is no longer taken for a system (DeePMD-kit's ``rglob``
would take it; such a tree mixes a set and a system). Systems nested in a system's other
subfolders are found. Given the folders of an earlier walk that have not changed since
(:class:`KnownTree`), the walk lists only the others: an unchanged folder has the same entries,
hence the same subfolders.

An entry that a storage format holds as a file or a database (an HDF5 file, an LMDB database:
a path ending in ``.lmdb`` or a folder holding ``data.mdb``) is expanded by its format
(:func:`mdloader.data.formats.capabilities.systems_of_entry`): an HDF5 file into its groups holding
``type.raw``, a database into one address per group of frames, in the order of its system ids
(``rglob_patterns`` do not apply to it).
"""

from __future__ import annotations

import glob
import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from mdloader.data.formats import Listing, address_sort_key, backend_of, locate_entry, parse_address
from mdloader.data.formats.capabilities import entry_container, systems_of_entry, walks_folders
from mdloader.data.formats.patterns import matches
from mdloader.data.formats.registry import folder_walk
from mdloader.errors import ConfigError, NoSystemsFoundError
from mdloader.fs_calls import Overlap
from mdloader.settings import resolve

_GLOB_CHARS = set("*?[")

Systems = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass
class Discovery:
    """What discovery found, and what it looked at (for a later freshness check).

    ``addresses`` are the systems, entries in the order given; ``listings`` the listing of each
    system folder this walk listed, so that the build does not list it again; ``walked`` every
    folder listed (``True`` for systems); ``files`` the HDF5 files listed; ``globs`` each
    pattern entry's matches.
    """

    addresses: list[str] = field(default_factory=list)
    listings: dict[str, Listing] = field(default_factory=dict)
    walked: dict[str, bool] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    globs: dict[str, list[str]] = field(default_factory=dict)


def discover_systems(systems: Systems, rglob_patterns: Sequence[str] | None = None, *,
                     key: str = "systems") -> list[str]:
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
    key
        The JSON path of ``systems`` (``training.training_data.systems``): an entry that does
        not exist, or a pattern that matches nothing, is a :class:`ConfigError` naming it
        (``...systems[1]`` for the second entry of a list).
    """
    return discover(systems, rglob_patterns, key=key).addresses


def expand_entry(entry: str, rglob_patterns: Sequence[str] | None = None, *,
                 where: str = "systems") -> list[str]:
    """The systems one entry stands for, sorted and unique (empty when it finds none); the groups
    of an LMDB database in the order of their system ids and atom counts. An entry that does
    not exist is a :class:`ConfigError` naming ``where``, its JSON path."""
    try:
        return discover([entry], rglob_patterns, key=where).addresses
    except NoSystemsFoundError:
        return []


def entries_of(systems: Systems) -> list[str]:
    """The ``systems`` argument as a list of strings."""
    if isinstance(systems, (str, os.PathLike)):
        return [os.fspath(systems)]
    return [os.fspath(s) for s in systems]


def discover(systems: Systems, rglob_patterns: Sequence[str] | None = None, *,
             workers: int | None = None, known: KnownTree | None = None,
             known_files: dict[str, list[str]] | None = None, key: str = "systems"
             ) -> Discovery:
    """:func:`discover_systems` with what it looked at; folders are listed in up to
    ``workers`` threads when the file system makes them wait (``$MDLOADER_BUILD_WORKERS``).

    ``known``/``known_files``: an earlier discovery's folders and HDF5 files that have not
    changed since; they are not listed again.
    """
    entries = entries_of(systems)
    threads = int(resolve("build_workers", workers, argument="num_workers"))
    out = Discovery()
    roots: dict[str, int] = {}
    wheres = [key] if len(entries) == 1 else [f"{key}[{i}]" for i in range(len(entries))]
    expanded = [[_part(path, rglob_patterns, out, roots, known_files or {}, where)
             for path in _expand_globs(entry, out.globs, where)]
            for entry, where in zip(entries, wheres)]
    tree = walk(list(roots), rglob_patterns, Overlap(threads), known)
    extra = f" matching {list(rglob_patterns)}" if rglob_patterns else ""
    for parts, entry, where in zip(expanded, entries, wheres):
        found: set[str] = set()
        for part in parts:
            found.update(tree.under[part] if isinstance(part, int) else part)
        if not found and len(entries) > 1:  # one entry of several: never dropped silently
            raise NoSystemsFoundError(
                f"{where}: no DeePMD system (a directory or HDF5 group holding type.raw)"
                f"{extra} found under: {entry}")
        out.addresses.extend(sorted(found, key=address_sort_key))
    if not out.addresses:
        where = ", ".join(entries) or "(no path given)"
        raise NoSystemsFoundError(
            f"no DeePMD system (a directory or HDF5 group holding type.raw){extra} found under: "
            f"{where}")
    out.walked, out.listings = tree.walked, tree.listings
    out.files = list(dict.fromkeys(out.files))
    return out


def _expand_globs(entry: str, globs: dict[str, list[str]], where: str) -> list[str]:
    path_part = entry.split("#", 1)[0]
    if not _GLOB_CHARS & set(path_part):
        return [entry]
    found = sorted(glob.glob(path_part))
    if not found:
        raise ConfigError(f"the pattern {entry} matches nothing", path=where)
    suffix = entry[len(path_part):]
    globs[entry] = [m + suffix for m in found]
    return globs[entry]


def _part(path: str, patterns: Sequence[str] | None, out: Discovery, roots: dict[str, int],
          known_files: dict[str, list[str]], where: str) -> int | list[str]:
    """The systems a file or database holds, expanded by its format now, or a folder's index
    among the roots of the walk; an entry that does not exist is a :class:`ConfigError` naming
    ``where``."""
    if not os.path.exists(parse_address(path).path):
        raise ConfigError(f"{path} does not exist", path=where)
    loc = locate_entry(path)
    backend = backend_of(loc)
    if walks_folders(backend):
        return roots.setdefault(os.path.normpath(os.path.abspath(path)), len(roots))
    file = entry_container(backend, loc)
    if file is not None:
        out.files.append(file)
    return systems_of_entry(backend, loc, patterns,
                        known_files.get(file) if file is not None else None)


log = logging.getLogger(__name__)


@dataclass
class KnownTree:
    """The folders an earlier walk listed (``True`` for systems) and those unchanged since."""

    walked: dict[str, bool]
    unchanged: set[str]
    _children: dict[str, list[str]] | None = field(default=None, repr=False)

    def children(self, folder: str) -> list[str]:
        if self._children is None:
            self._children = defaultdict(list)
            for path in self.walked:
                self._children[os.path.dirname(path)].append(path)
        return self._children.get(folder, [])


@dataclass
class Walk:
    """What a walk found: per root, its systems (sorted, unique); the listing of every system
    folder listed; every folder listed or known unchanged (``True`` for systems)."""

    under: list[list[str]]
    listings: dict[str, Listing] = field(default_factory=dict)
    walked: dict[str, bool] = field(default_factory=dict)


def walk(roots: Sequence[str], patterns: Sequence[str] | None, overlap: Overlap,
         known: KnownTree | None = None) -> Walk:
    """The systems under each of ``roots`` (absolute, normalised folders) whose path below that
    root matches ``patterns`` (all of them when ``patterns`` is empty)."""
    known = known or KnownTree({}, set())
    listed: dict[str, Listing | None] = {}
    found: list[set[str]] = [set() for _ in roots]
    level = list(dict.fromkeys((root, i) for i, root in enumerate(roots)))
    seen = set(level)
    walked: dict[str, bool] = {}
    links: set[str] = set()  # looked at, not descended into
    while level:
        todo = list(dict.fromkeys(f for f, _ in level if f not in known.unchanged
                                  and f not in listed))
        listed.update(zip(todo, overlap.map(_listing_or_none, todo)))
        below = []
        for folder, i in level:
            is_system, children, linked = _entries(folder, listed, known)
            if is_system is None:
                continue
            walked[folder] = is_system
            if is_system and matches(os.path.relpath(folder, roots[i]), patterns):
                found[i].add(folder)
            if folder in links:
                continue
            links.update(linked)
            for child in children + linked:
                if (child, i) not in seen:
                    seen.add((child, i))
                    below.append((child, i))
        level = below
    listings = {f: lst for f, lst in listed.items() if lst is not None and walked.get(f)}
    return Walk([sorted(systems) for systems in found], listings, walked)


def _entries(folder: str, listed: dict[str, Listing | None], known: KnownTree
             ) -> tuple[bool | None, list[str], list[str]]:
    """(is it a system? -- ``None`` when it cannot be listed, subfolders to walk, links to
    folders to look at without walking below them)."""
    if folder not in listed:  # unchanged since the known walk: same entries
        return known.walked[folder], known.children(folder), []
    listing = listed[folder]
    if listing is None:
        return None, [], []
    is_system, subfolders, linked = folder_walk().walk_step(listing)
    return (is_system, [os.path.join(folder, d) for d in subfolders],
            [os.path.join(folder, d) for d in linked])


def _listing_or_none(folder: str) -> Listing | None:
    """The folder's listing; ``None`` when it cannot be listed (skipped, as ``os.walk`` and
    DeePMD-kit's ``rglob`` do, with a warning naming it: systems below it are not used)."""
    try:
        return folder_walk().list_folder(folder)
    except OSError as exc:
        log.warning("cannot list the folder %s (%s): systems below it, if any, are not used",
                    folder, exc.strerror or exc)
        return None
