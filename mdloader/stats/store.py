"""Per-system statistics kept between jobs: a content stamp per system and a folder of entries.

A system's *stamp* digests the :class:`~mdloader.persist.FileStamp` of every file its frames
come from (an npy system: its folder, ``type.raw``, ``type_map.raw`` and every file of each
``set.*``; an HDF5 system: its file; an LMDB database: the files of its folder), so a file
rewritten in place, or replaced by an older copy, changes the stamp. The caller folds the stamp
into each entry's key with everything else the statistics depend on
(:func:`mdloader.stats.cache.cache_key`), so a stale entry is never found: it is simply another
key, and the statistics are computed again.

Entries are files ``<folder>/<stamp[:2]>/<stamp>/<key>.mdlstat``
(``$MDLOADER_CACHE_DIR/statistics`` by default) written atomically
(:func:`mdloader.persist.write_atomic`), so ranks writing their own shares on a shared file
system never see a partial entry; reading one marks it used (:func:`mdloader.persist.mark_used`),
for ``mdloader cache prune --older-than``. An entry removed meanwhile (by ``mdloader cache
prune``) is simply computed again. An entry that cannot be read or saved (the folder is a file,
read-only, full) costs nothing but time; the failures are counted by cause and reported once a
pass, one line per cause with the count (:meth:`StatsStore.report_failures`), never one line per
entry. The store holds bytes; what they mean is
:mod:`mdloader.stats.cache`'s.
"""

from __future__ import annotations

import hashlib
import logging
import os

from mdloader.data.formats import backend_of, parse_address
from mdloader.data.formats.capabilities import freshness_paths
from mdloader.persist import file_stamp, mark_used, write_atomic

log = logging.getLogger(__name__)

SUFFIX = ".mdlstat"

#: (folder, action, cause) already reported by this process: later passes do not repeat them.
_REPORTED: set[tuple[str, str, str]] = set()

_CONSEQUENCE = {"read": "they are computed again",
                "saved": "the statistics stand, and are computed again at the next start"}


def _stat_line(path: str) -> str:
    stamp = file_stamp(path)
    return f"{path}\0missing" if stamp is None else f"{path}\0" + "\0".join(map(str, stamp))


def system_stamp(address: str, layout: tuple[bool, tuple[str, ...]] | None = None) -> str:
    """A digest that changes whenever a file the system's frames come from changes.

    ``layout`` is the catalog's (own type map, set names), used to name the npy paths without a
    listing; without it (or for formats that name no paths) the system's path is used.
    """
    location = parse_address(address)
    paths = None if layout is None else freshness_paths(backend_of(address), address, layout)
    if paths is None:
        paths = [location.path]
    lines = [address]
    for path in paths:
        lines.append(_stat_line(path))
        if os.path.isdir(path):
            try:
                names = sorted(os.listdir(path))
            except OSError:
                names = []
            lines.extend(_stat_line(os.path.join(path, n)) for n in names
                         if os.path.isfile(os.path.join(path, n)))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


class StatsStore:
    """Entries of per-system statistics in ``folder``; ``None`` as folder keeps nothing.

    An entry is ``<folder>/<stamp[:2]>/<stamp>/<key>.mdlstat``: the entries of one system, as
    its files were, share a folder, so ``mdloader cache prune --unmatched`` tells the entries of
    systems that changed or went away from the stamps of the systems still used.
    """

    def __init__(self, folder: str | None) -> None:
        self.folder = folder
        self.failures: dict[tuple[str, str], list[str]] = {}

    def _failed(self, action: str, path: str, exc: OSError) -> None:
        cause = os.strerror(exc.errno) if exc.errno else type(exc).__name__
        self.failures.setdefault((action, cause), []).append(path)

    def report_failures(self) -> None:
        """One warning per cause of the entries that could not be read or saved since the last
        report, with their count and one of them; a cause this process reported before is not
        repeated (it is logged at debug level)."""
        for (action, cause), paths in self.failures.items():
            reported = (str(self.folder), action, cause)
            level = logging.DEBUG if reported in _REPORTED else logging.WARNING
            _REPORTED.add(reported)
            entries = "1 entry" if len(paths) == 1 else f"{len(paths)} entries"
            log.log(level, "statistics cache %s: %s cannot be %s (%s; e.g. %s): %s", self.folder,
                    entries, action, cause, paths[0], _CONSEQUENCE[action])
        self.failures.clear()

    def path(self, stamp: str, key: str) -> str:
        """Where the entry ``key`` of the system stamped ``stamp`` is kept."""
        return os.path.join(str(self.folder), stamp[:2], stamp, key + SUFFIX)

    def get(self, stamp: str, key: str) -> bytes | None:
        """The entry's bytes, or ``None`` when there is none (or it cannot be read)."""
        if self.folder is None:
            return None
        path = self.path(stamp, key)
        try:
            with open(path, "rb") as fh:
                payload = fh.read()
                mark_used(path, fh)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._failed("read", path, exc)
            return None
        return payload

    def put(self, stamp: str, key: str, payload: bytes) -> None:
        """Write an entry atomically, not flushed to disk (an entry lost in a crash is computed
        again); a failure is counted for :meth:`report_failures` (the statistics stand)."""
        if self.folder is None:
            return
        target = self.path(stamp, key)
        try:
            write_atomic(target, payload, durable=False)
        except OSError as exc:
            self._failed("saved", target, exc)
