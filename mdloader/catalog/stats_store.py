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
prune``) is simply computed again. The store holds bytes; what they mean is
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
            log.warning("statistics cache entry %s cannot be read (%s): computing it again",
                        path, exc)
            return None
        return payload

    def put(self, stamp: str, key: str, payload: bytes) -> None:
        """Write an entry atomically, not flushed to disk (an entry lost in a crash is computed
        again); a failure costs one warning (the statistics stand)."""
        if self.folder is None:
            return
        target = self.path(stamp, key)
        try:
            write_atomic(target, payload, durable=False)
        except OSError as exc:
            log.warning("statistics cache entry %s cannot be saved (%s)", target, exc)
