"""Discover and describe the systems: from scratch, or starting from a saved index.

:func:`survey` walks the tree and reads every header. :func:`resurvey` starts from what an index
saved: it checks every path the index depends on (:mod:`mdloader.data.freshness`), and when
something changed it lists again only the folders that changed and describes again only the
systems that are new or changed; the others are copied from the index.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mdloader.data.describe import describe_systems
from mdloader.data.discovery import Discovery, discover
from mdloader.data.formats import parse_address
from mdloader.data.freshness import check_saved
from mdloader.data.index_file import SavedIndex
from mdloader.data.overlap import Overlap
from mdloader.data.system import SystemMeta
from mdloader.data.table import TableBuilder
from mdloader.data.walk import KnownTree

log = logging.getLogger(__name__)


@dataclass
class Survey:
    """A surveyed set of systems: what to save, and what it took."""

    saved: SavedIndex
    discovery_seconds: float = 0.0
    build_seconds: float = 0.0
    check_seconds: float = 0.0
    described: int = 0  # systems whose headers were read
    reused: int = 0  # systems copied from the index
    save: bool = True  # whether what an index file holds changed


def survey(systems: object, rglob_patterns: Sequence[str] | None,
           type_map: Sequence[str] | None, workers: int, progress: bool,
           key: str = "systems") -> Survey:
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
    saved = _saved(builder, since, found)
    return Survey(saved, found_at - start, time.monotonic() - found_at, described=len(unique))


def resurvey(saved: SavedIndex, systems: object, rglob_patterns: Sequence[str] | None,
             type_map: Sequence[str] | None, workers: int, progress: bool,
             settle_ns: int, key: str = "systems") -> Survey:
    """``saved`` if nothing it depends on changed, else an updated survey (see the module)."""
    since = time.time_ns()
    start = time.monotonic()
    check = check_saved(saved, saved.since_ns - settle_ns, Overlap(workers))
    checked = time.monotonic()
    if check.unchanged:
        return Survey(saved, check_seconds=checked - start, reused=len(saved.table))
    stale, table = check.systems, saved.table
    addresses = table.addresses()
    npy = {a: i for i, a in enumerate(addresses) if parse_address(a).backend == "npy"}
    walked = {**saved.walked, **dict.fromkeys(npy, True)}
    unchanged = {p for p, s in zip(saved.walked, check.folders) if not s}
    unchanged.update(a for a, i in npy.items() if not stale[i])
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
    return Survey(_saved(builder, since, found), found_at - checked,
                  time.monotonic() - found_at, checked - start, described=len(new),
                  reused=reused, save=not check.nothing_stored_changed)


def _saved(builder: TableBuilder, since: int, found: Discovery) -> SavedIndex:
    table = builder.table()
    indexed = set(found.addresses)
    walked = {p: s for p, s in found.walked.items() if p not in indexed}
    return SavedIndex(table, since, walked, list(found.files),
                      dict(found.globs))


def _described(addresses: list[str], found: Discovery, type_map: Sequence[str] | None,
               workers: int, progress: bool) -> Iterator[SystemMeta]:
    items = describe_systems(addresses, type_map, workers, found.listings)
    if not progress:
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=len(addresses), desc="mdloader: building systems", unit="sys",
                    file=sys.stderr, dynamic_ncols=True)
