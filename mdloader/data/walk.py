"""Walking directory trees for systems, level by level, overlapping the listings when they wait.

A folder holding ``type.raw`` is a system; the walk does not descend into its ``set.*`` folders
(they hold frames) nor into symbolic links to folders (as ``os.walk``). Each folder is listed
once, even when it lies below several roots; a system's listing is kept, so that describing it
does not list it again. All folders of a level are listed together, in threads when the first
listings waited on the file system (:mod:`mdloader.data.overlap`).

Given the folders of an earlier walk that have not changed since (:class:`KnownTree`), the walk
lists only the others: an unchanged folder has the same entries, hence the same subfolders.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from mdloader.data.formats import Listing
from mdloader.data.formats.npy import list_dir
from mdloader.data.overlap import Overlap

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
    while level:
        todo = list(dict.fromkeys(f for f, _ in level if f not in known.unchanged
                                  and f not in listed))
        listed.update(zip(todo, overlap.map(_listing_or_none, todo)))
        below = []
        for folder, i in level:
            is_system, children = _entries(folder, listed, known)
            if is_system is None:
                continue
            walked[folder] = is_system
            if is_system and matches(os.path.relpath(folder, roots[i]), patterns):
                found[i].add(folder)
            for child in children:
                if (child, i) not in seen:
                    seen.add((child, i))
                    below.append((child, i))
        level = below
    listings = {f: lst for f, lst in listed.items() if lst is not None and walked.get(f)}
    return Walk([sorted(systems) for systems in found], listings, walked)


def _entries(folder: str, listed: dict[str, Listing | None],
             known: KnownTree) -> tuple[bool | None, list[str]]:
    """(is it a system? -- ``None`` when it cannot be listed, subfolders to walk)."""
    if folder not in listed:  # unchanged since the known walk: same entries
        return known.walked[folder], known.children(folder)
    listing = listed[folder]
    if listing is None:
        return None, []
    files, dirs, links = listing
    is_system = "type.raw" in files
    return is_system, [os.path.join(folder, d) for d in dirs
                       if d not in links and not (is_system and d.startswith("set."))]


def _listing_or_none(folder: str) -> Listing | None:
    """The folder's listing; ``None`` when it cannot be listed (skipped, as ``os.walk`` does)."""
    try:
        return list_dir(folder)
    except OSError as exc:
        log.debug("cannot list %s: %s", folder, exc)
        return None


def matches(relpath: str, patterns: Sequence[str] | None) -> bool:
    """Whether ``relpath`` (below a root) matches one of ``patterns`` at any depth."""
    if not patterns:
        return True
    rel = PurePosixPath(relpath.replace(os.sep, "/"))
    return any(rel.match(p) for p in patterns)
