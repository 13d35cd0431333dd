"""The catalog of a job's systems, and the one road to it: request, load or survey, save.

A catalog is the descriptions of the systems (a :class:`~mdloader.catalog.table.SystemTable`)
with where they came from and what obtaining them took. Rank 0 obtains it with
:func:`catalog_for`:

1. **request**: which systems, for which type map, and which index file
   (:func:`mdloader.catalog.index.index_request`);
2. **load or survey**: the saved index when it is usable (:func:`mdloader.catalog.index.load`),
   checked (:mod:`mdloader.catalog.freshness`) and brought up to date by :func:`resurvey`, which
   lists again only the folders that changed and describes again only the systems that are new
   or changed; else :func:`survey` walks the tree and reads every header;
3. **save**: :meth:`Catalog.save` writes the index when what it holds changed.

Modes (``index_mode=`` or ``$MDLOADER_INDEX``): ``check`` (default), ``refresh`` (describe
everything again), ``trust`` (no check: read-only archives), ``off`` (no index).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from mdloader import logs
from mdloader.catalog import index
from mdloader.catalog.describe import describe_systems
from mdloader.catalog.discover import Discovery, KnownTree, discover
from mdloader.catalog.freshness import check_saved
from mdloader.catalog.index_file import SavedIndex
from mdloader.catalog.table import SystemTable, TableBuilder
from mdloader.data.formats import backend_of, parse_address
from mdloader.data.formats.base import SystemMeta
from mdloader.data.formats.capabilities import walks_folders
from mdloader.fs_calls import Overlap
from mdloader.settings import resolve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Catalog:
    """The descriptions of a job's systems, where they came from, what they took to obtain.

    ``saved`` is the table with what an index needs to check it later; ``save_needed`` says
    whether that differs from the index file of ``request`` (``None``: no index).
    """

    saved: SavedIndex
    source: str = "built"  # or "index", "index (updated)", "index (trusted)"
    request: index.IndexRequest | None = None
    save_needed: bool = False
    discovery_seconds: float = 0.0
    build_seconds: float = 0.0
    check_seconds: float = 0.0  # loading and checking the index
    described: int = 0  # systems whose headers were read
    reused: int = 0  # systems copied from the index

    @cached_property
    def table(self) -> SystemTable:
        """The descriptions, naming the index they come from (``None`` for a fresh build)."""
        origin = self.request.path if self.request and self.source != "built" else None
        return self.saved.table.with_origin(origin)

    @property
    def index_file(self) -> str | None:
        """The index file read or written, if any."""
        return self.request.path if self.request is not None else None

    def save(self) -> None:
        """Write the index if what it holds changed (a failure is one warning)."""
        if self.save_needed and self.request is not None:
            index.save(self.request, self.saved)


def catalog_for(systems: object, type_map: Sequence[str] | None,
                rglob_patterns: Sequence[str] | None, *, workers: int, progress: bool,
                index_file: str | os.PathLike[str] | None = None,
                mode: str | None = None, key: str = "systems") -> Catalog:
    """The catalog of ``systems`` on rank 0: from the index when it is usable, else surveyed.

    Parameters
    ----------
    systems, rglob_patterns
        As :func:`mdloader.catalog.discover.discover_systems`.
    type_map
        The model's type map.
    workers, progress
        Most threads for walking, describing and checking; whether to report the progress of
        describing (:func:`mdloader.logs.progress`: a bar on a terminal, else log lines).
    index_file, mode
        The index file (default: one in ``$MDLOADER_CACHE_DIR``) and the index mode.
    key
        The JSON path of ``systems``, named by the error for an entry that does not exist.
    """
    mode = str(resolve("index_mode", mode, argument="index_mode"))
    if mode == "off":
        return survey(systems, rglob_patterns, type_map, workers, progress, key)
    request = index.index_request(systems, rglob_patterns, type_map, index_file)
    start = time.monotonic()
    saved = None if mode == "refresh" else index.load(request)
    loaded = time.monotonic() - start
    if saved is None:
        surveyed = survey(systems, rglob_patterns, type_map, workers, progress, key)
        return replace(surveyed, request=request, save_needed=True)
    if mode == "trust":
        return Catalog(saved, "index (trusted)", request, check_seconds=loaded,
                       reused=len(saved.table))
    settle = int(float(resolve("index_settle")) * 1e9)
    updated = resurvey(saved, systems, rglob_patterns, type_map, workers, progress, settle, key)
    return replace(updated, request=request, check_seconds=updated.check_seconds + loaded)


def survey(systems: object, rglob_patterns: Sequence[str] | None,
           type_map: Sequence[str] | None, workers: int, progress: bool,
           key: str = "systems") -> Catalog:
    """Walk the tree and describe every system (rank 0's cold build)."""
    since = time.time_ns()
    start = time.monotonic()
    found = discover(systems, rglob_patterns, workers=workers, key=key)  # type: ignore[arg-type]
    found_at = time.monotonic()
    unique = list(dict.fromkeys(found.addresses))  # a repeated entry is described once
    metas = dict(zip(unique, _described(unique, found, type_map, workers, progress)))
    builder = TableBuilder()
    for address in found.addresses:
        builder.add(metas[address])
    return Catalog(_saved(builder, since, found), discovery_seconds=found_at - start,
                   build_seconds=time.monotonic() - found_at, described=len(unique))


def resurvey(saved: SavedIndex, systems: object, rglob_patterns: Sequence[str] | None,
             type_map: Sequence[str] | None, workers: int, progress: bool,
             settle_ns: int, key: str = "systems") -> Catalog:
    """``saved`` if nothing it depends on changed, else brought up to date (see the module)."""
    since = time.time_ns()
    start = time.monotonic()
    check = check_saved(saved, saved.since_ns - settle_ns, Overlap(workers))
    checked = time.monotonic()
    if check.unchanged:
        return Catalog(saved, "index", check_seconds=checked - start, reused=len(saved.table))
    stale, table = check.systems, saved.table
    addresses = table.addresses()
    folders = {a: i for i, a in enumerate(addresses)
               if walks_folders(backend_of(a))}  # found walking
    walked = {**saved.walked, **dict.fromkeys(folders, True)}
    unchanged = {p for p, s in zip(saved.walked, check.folders) if not s}
    unchanged.update(a for a, i in folders.items() if not stale[i])
    by_file: dict[str, list[str]] = {}
    for address in addresses:
        if "#" in address:
            by_file.setdefault(parse_address(address).path, []).append(address)
    known_files = {f: by_file.get(f, []) for f, s in zip(saved.files, check.files) if not s}
    found = discover(systems, rglob_patterns, workers=workers,  # type: ignore[arg-type]
                     known=KnownTree(walked, unchanged), known_files=known_files, key=key)
    found_at = time.monotonic()
    keep = {a: i for i, a in enumerate(addresses) if not stale[i]}
    new = list(dict.fromkeys(a for a in found.addresses if a not in keep))
    described = dict(zip(new, _described(new, found, type_map, workers, progress)))
    builder = TableBuilder()
    for address in found.addresses:
        if address in keep:
            builder.add_row(table, keep[address])
        else:
            builder.add(described[address])
    reused = len(set(found.addresses)) - len(new)
    log.info("index: %d systems unchanged, %d described again or new, %d gone", reused,
             len(new), len(set(addresses) - set(found.addresses)))
    changed = not check.nothing_stored_changed  # LMDB groups are always described again
    return Catalog(_saved(builder, since, found), "index (updated)" if changed else "index",
                   save_needed=changed, discovery_seconds=found_at - checked,
                   build_seconds=time.monotonic() - found_at, check_seconds=checked - start,
                   described=len(new), reused=reused)


def _saved(builder: TableBuilder, since: int, found: Discovery) -> SavedIndex:
    table = builder.table()
    indexed = set(found.addresses)
    walked = {p: s for p, s in found.walked.items() if p not in indexed}
    return SavedIndex(table, since, walked, list(found.files), dict(found.globs))


def _described(addresses: list[str], found: Discovery, type_map: Sequence[str] | None,
               workers: int, progress: bool) -> Iterator[SystemMeta]:
    with logs.progress(len(addresses), "describing systems", enabled=progress) as bar:
        for meta in describe_systems(addresses, type_map, workers, found.listings):
            bar.update()
            yield meta
