"""A persistent system index: rank 0 describes the systems once and reuses that at every start.

After a build, rank 0 saves the descriptions with what is needed to tell whether they are still
true (:mod:`mdloader.catalog.index_file`); the next start, at any world size, loads them, checks
them (:mod:`mdloader.catalog.freshness`) and describes again only what changed
(:mod:`mdloader.catalog.index`). Other ranks never read an index: they receive the descriptions in
the build's broadcast, as always.

Where: the file named by ``index_file=`` (``index_file`` in a data section of ``input.json``),
else
``$MDLOADER_CACHE_DIR/<name>-<key>.mdlidx``, where the key is a hash of the resolved system
entries, the ``rglob`` patterns, the model ``type_map`` and the index format. Modes
(``index_mode=`` or ``$MDLOADER_INDEX``): ``check`` (default), ``refresh`` (describe everything
again), ``trust`` (no check: read-only archives), ``off``. A missing index is built; an index
that cannot be used (corrupt, truncated, another format or mdloader version, another key,
unreadable) costs one warning and a rebuild; an index that cannot be saved costs one warning.

Discover and describe the systems: from scratch, or starting from a saved index.

:func:`survey` walks the tree and reads every header. :func:`resurvey` starts from what an index
saved: it checks every path the index depends on (:mod:`mdloader.data.freshness`), and when
something changed it lists again only the folders that changed and describes again only the
systems that are new or changed; the others are copied from the index.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mdloader import __version__
from mdloader.catalog.describe import describe_systems
from mdloader.catalog.discover import Discovery, KnownTree, discover, entries_of
from mdloader.catalog.freshness import check_saved
from mdloader.catalog.index_file import (
    FORMAT,
    IndexFileError,
    SavedIndex,
    read_header,
    read_index,
    write_index,
)
from mdloader.catalog.table import TableBuilder
from mdloader.data.formats import backend_of, parse_address
from mdloader.data.formats.capabilities import walks_folders
from mdloader.data.system import SystemMeta
from mdloader.fs_calls import Overlap
from mdloader.settings import resolve

log = logging.getLogger(__name__)

SUFFIX = ".mdlidx"


@dataclass(frozen=True)
class IndexRequest:
    """Which systems, described for which type map, and where their index lives."""

    entries: tuple[str, ...]
    rglob_patterns: tuple[str, ...] | None
    type_map: tuple[str, ...] | None
    key: str
    path: str

    def describe(self) -> dict[str, object]:
        """What the key is made of, as saved in the index header."""
        return {"format": FORMAT, "systems": list(self.entries),
                "rglob_patterns": None if self.rglob_patterns is None else list(
                    self.rglob_patterns),
                "type_map": None if self.type_map is None else list(self.type_map)}


def index_request(systems: object, rglob_patterns: Sequence[str] | None,
                  type_map: Sequence[str] | None,
                  index_file: str | os.PathLike[str] | None = None,
                  cache_dir: str | None = None) -> IndexRequest:
    """The request for ``systems``; its index is ``index_file`` if given, else in the cache."""
    entries = tuple(_resolved(e) for e in entries_of(systems))  # type: ignore[arg-type]
    patterns = tuple(rglob_patterns) if rglob_patterns else None
    tmap = tuple(type_map) if type_map is not None else None
    draft = IndexRequest(entries, patterns, tmap, "", "")
    key = hashlib.sha256(json.dumps(draft.describe(), sort_keys=True).encode()).hexdigest()
    if index_file is not None:
        path = os.path.abspath(os.fspath(index_file))
    else:
        folder = str(resolve("cache_dir", cache_dir, argument="cache_dir"))
        path = os.path.join(os.path.abspath(os.path.expanduser(folder)),
                            f"{_slug(entries)}-{key[:20]}{SUFFIX}")
    return IndexRequest(entries, patterns, tmap, key, path)


def _resolved(entry: str) -> str:
    head, sep, tail = entry.partition("#")
    return os.path.normpath(os.path.abspath(os.path.expanduser(head))) + sep + tail


def _slug(entries: tuple[str, ...]) -> str:
    name = os.path.basename(entries[0].partition("#")[0].rstrip("/")) if entries else "none"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:40] or "root"


@dataclass
class Described:
    """The outcome on rank 0: the survey, where it came from, and how to save it."""

    survey: Survey
    source: str  # "built", "index", "index (updated)", "index (trusted)"
    request: IndexRequest | None
    save_needed: bool = False

    def save(self) -> None:
        """Write the index if it changed; a failure is one warning, never an error."""
        if not self.save_needed or self.request is None:
            return
        try:
            write_index(self.request.path, self.survey.saved,
                        index_header(self.request, self.survey.saved))
        except Exception as exc:  # noqa: BLE001 - the build succeeded; an index is an extra
            log.warning("mdloader: could not save the system index %s (%s); the next start "
                        "will describe the systems again", self.request.path, exc)
            return
        log.info("saved the system index %s", self.request.path)


def describe(systems: object, type_map: Sequence[str] | None,
             rglob_patterns: Sequence[str] | None, *, workers: int, progress: bool,
             index_file: str | os.PathLike[str] | None = None,
             mode: str | None = None, key: str = "systems") -> Described:
    """The systems' descriptions on rank 0: from the index when it is usable, else surveyed."""
    mode = str(resolve("index_mode", mode, argument="index_mode"))
    if mode == "off":
        return Described(survey(systems, rglob_patterns, type_map, workers, progress, key),
                         "built", None)
    request = index_request(systems, rglob_patterns, type_map, index_file)
    start = time.monotonic()
    saved = None if mode == "refresh" else load(request)
    loaded = time.monotonic() - start
    if saved is None:
        done = survey(systems, rglob_patterns, type_map, workers, progress, key)
        return Described(done, "built", request, save_needed=True)
    if mode == "trust":
        return Described(Survey(saved, check_seconds=loaded, reused=len(saved.table)),
                         "index (trusted)", request)
    settle = int(float(resolve("index_settle")) * 1e9)
    done = resurvey(saved, systems, rglob_patterns, type_map, workers, progress, settle, key)
    done.check_seconds += loaded
    if done.saved is saved or not done.save:  # unchanged (LMDB groups are always described)
        return Described(done, "index", request)
    return Described(done, "index (updated)", request, save_needed=True)


def load(request: IndexRequest) -> SavedIndex | None:
    """The saved index of ``request``; ``None`` (after one warning) when it cannot be used."""
    try:
        header, saved = read_index(request.path)
    except (FileNotFoundError, NotADirectoryError):
        log.info("no system index at %s yet: describing the systems", request.path)
        return None
    except (OSError, IndexFileError) as exc:
        return _unusable(str(exc) if isinstance(exc, IndexFileError)
                         else f"the index {request.path} cannot be read ({exc})")
    if header.get("key") != request.key:
        return _unusable(f"the index {request.path} was made for other systems, patterns or "
                         "type map")
    if header.get("mdloader") != __version__:
        return _unusable(f"the index {request.path} was made by mdloader "
                         f"{header.get('mdloader')}, this is {__version__}")
    return saved


def _unusable(reason: str) -> None:
    log.warning("mdloader: %s; describing the systems again", reason)
    return None


def index_header(request: IndexRequest, saved: SavedIndex) -> dict[str, object]:
    """The JSON header of ``saved``'s file: format, mdloader version, key, when and where."""
    return {"format": FORMAT, "mdloader": __version__, "key": request.key,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
            "systems": len(saved.table), "frames": int(saved.table.nframes().sum()),
            "request": request.describe()}


def inspect(path: str) -> dict[str, object]:
    """An index file's header (what it indexes, who made it, when), without checking it."""
    return read_header(path)


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
