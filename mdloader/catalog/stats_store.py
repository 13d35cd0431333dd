"""Per-system statistics kept between jobs: a content stamp per system and a folder of entries.

A system's *stamp* digests the size, modification and status-change times of every file its
frames come from (an npy system: its folder, ``type.raw``, ``type_map.raw`` and every file of
each ``set.*``; an HDF5 system: its file; an LMDB database: the files of its folder). Nobody can
set a status-change time, so a file rewritten in place, or replaced by an older copy, changes
the stamp. The caller folds the stamp into each entry's key with everything else the
statistics depend on (:func:`mdloader.stats.cache.cache_key`), so a stale entry is never found:
it is simply another key, and the statistics are computed again.

Entries are files ``<folder>/<key[:2]>/<key>.mdlstat`` (``$MDLOADER_CACHE_DIR/stats`` by
default) written atomically (temporary file, then rename), so ranks writing their own shares on a
shared file system never see a partial entry. The store holds bytes; what they mean is
:mod:`mdloader.stats.cache`'s.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile

from mdloader.data.formats import backend_of, parse_address
from mdloader.data.formats.capabilities import freshness_paths

log = logging.getLogger(__name__)

SUFFIX = ".mdlstat"


def _stat_line(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}\0missing"
    return f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"


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
    """Entries of per-system statistics in ``folder``; ``None`` as folder keeps nothing."""

    def __init__(self, folder: str | None) -> None:
        self.folder = folder

    def path(self, key: str) -> str:
        return os.path.join(str(self.folder), key[:2], key + SUFFIX)

    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or ``None`` when there is none (or it cannot be read)."""
        if self.folder is None:
            return None
        try:
            with open(self.path(key), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("statistics cache entry %s cannot be read (%s): computing it again",
                        self.path(key), exc)
            return None

    def put(self, key: str, payload: bytes) -> None:
        """Write an entry atomically; a failure costs one warning (the statistics stand)."""
        if self.folder is None:
            return
        target = self.path(key)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(payload)
                os.replace(tmp, target)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("statistics cache entry %s cannot be saved (%s)", target, exc)
