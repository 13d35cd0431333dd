"""The system index: a catalog saved to a file, so that the next start reads it instead of the tree.

After a build, rank 0 saves the catalog with what is needed to tell whether it is still true
(:mod:`mdloader.catalog.index_file` holds the file format); the next start, at any world size,
loads it and :mod:`mdloader.catalog.catalog` checks it. Other ranks never read an index: they
receive the catalog's table in the build's broadcast.

Where: the file named by ``index_file=`` (``index_file`` in a data section of ``input.json``),
else ``$MDLOADER_CACHE_DIR/index/<name>-<key>.mdlidx``, where the key is a hash of the resolved
system entries, the ``rglob`` patterns, the model ``type_map`` and the index format. An index that
cannot be used (corrupt, truncated, another format or mdloader version, another key,
unreadable) costs one warning and a rebuild; an index that cannot be saved costs one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mdloader import __version__
from mdloader.catalog.discover import entries_of
from mdloader.catalog.index_file import (
    FORMAT,
    IndexFileError,
    SavedIndex,
    read_header,
    read_index,
    write_index,
)
from mdloader.persist import mark_used
from mdloader.settings import cache_folder

log = logging.getLogger(__name__)

SUFFIX = ".mdlidx"


@dataclass(frozen=True)
class IndexRequest:
    """Which systems, described for which type map, and the file their index lives in."""

    entries: tuple[str, ...]
    rglob_patterns: tuple[str, ...] | None
    type_map: tuple[str, ...] | None
    key: str
    path: str

    def key_parts(self) -> dict[str, object]:
        """What the key is a hash of, as saved in the index header."""
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
    key = hashlib.sha256(json.dumps(draft.key_parts(), sort_keys=True).encode()).hexdigest()
    if index_file is not None:
        path = os.path.abspath(os.fspath(index_file))
    else:
        path = os.path.join(cache_folder("index", cache_dir),
                            f"{_slug(entries)}-{key[:20]}{SUFFIX}")
    return IndexRequest(entries, patterns, tmap, key, path)


def _resolved(entry: str) -> str:
    head, sep, tail = entry.partition("#")
    return os.path.normpath(os.path.abspath(os.path.expanduser(head))) + sep + tail


def _slug(entries: tuple[str, ...]) -> str:
    name = os.path.basename(entries[0].partition("#")[0].rstrip("/")) if entries else "none"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:40] or "root"


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
    mark_used(request.path)  # a start used it (``mdloader cache prune --older-than``)
    return saved


def _unusable(reason: str) -> None:
    log.warning("mdloader: %s; describing the systems again", reason)
    return None


def save(request: IndexRequest, saved: SavedIndex) -> None:
    """Write ``saved`` as the index of ``request``; a failure is one warning, never an error."""
    try:
        write_index(request.path, saved, index_header(request, saved))
    except Exception as exc:  # noqa: BLE001 - the build succeeded; an index is an extra
        log.warning("mdloader: could not save the system index %s (%s); the next start "
                    "will describe the systems again", request.path, exc)
        return
    log.info("saved the system index %s", request.path)


def index_header(request: IndexRequest, saved: SavedIndex) -> dict[str, object]:
    """The JSON header of ``saved``'s file: format, mdloader version, key, when and where."""
    return {"format": FORMAT, "mdloader": __version__, "key": request.key,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
            "systems": len(saved.table), "frames": int(saved.table.nframes().sum()),
            "request": request.key_parts()}


def inspect(path: str) -> dict[str, object]:
    """An index file's header (what it indexes, who made it, when), without checking it."""
    return read_header(path)
