"""Write an LMDB database that DeePMD-kit 3.2.0 (and dpdata) read as is, streaming and atomic.

The layout is dpdata's ``deepmd/lmdb``: one msgpack record per frame keyed by its zero-padded
index, with ``atom_types`` (global ids into ``type_map``), ``coords``, ``cells`` (absent when
non-periodic), ``energies``, ``forces``, ``virials``, any other field, and ``atom_numbs``; then
``__metadata__`` with ``nframes``, ``frame_idx_fmt``, ``type_map``, ``frame_nlocs`` and
``frame_system_ids``. Unlike ``MultiSystems.to("deepmd/lmdb")`` each source system written is
its own system id, in the order given, so ``sys_probs`` and ``auto_prob`` blocks keep their
meaning.

Memory stays bounded: records are committed every ``commit_bytes``, and only two integers per
frame are kept until the end. The database is built in a hidden sibling folder (a temporary
name of :mod:`mdloader.persist`) whose ``__metadata__`` is written last; it is reopened and
checked, then published (:func:`mdloader.persist.publish_folder`: synced, renamed into place),
so a crash never leaves something that looks complete, and the next writer removes what a dead
one left (:func:`mdloader.persist.remove_leftovers`).
"""

from __future__ import annotations

import array
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mdloader.data.formats.lmdb import codec
from mdloader.data.formats.lmdb.environment import DEFAULT_FRAME_FORMAT, METADATA_KEY, frame_key
from mdloader.errors import ConfigError, DataError, TypeMapError
from mdloader.persist import discard, publish_folder, remove_leftovers, temporary_path

log = logging.getLogger(__name__)


@dataclass
class SourceChunk:
    """Consecutive frames of one source system, in the disk layout.

    ``types`` are ids into ``names`` (``-1``: a virtual atom of a mixed-type system, removed on
    every atom axis); ``fields`` map disk names to arrays ``(frames, *per-frame shape)``;
    ``atom_axes`` give, per field, the per-frame axes that run over atoms.
    """

    names: tuple[str, ...]
    types: np.ndarray
    fields: dict[str, np.ndarray]
    atom_axes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    periodic: bool = True

    @property
    def nframes(self) -> int:
        return int(self.types.shape[0])


class LmdbWriter:
    """Append source systems, then :meth:`finish` (or use it as a context manager).

    Parameters
    ----------
    dest
        The database folder to create (conventionally ``*.lmdb``).
    type_map
        Element names, in the order of the stored ids (every element the sources hold).
    overwrite
        Replace an existing database at ``dest`` (only once the new one is complete).
    commit_bytes
        Encoded bytes per write transaction (bounds memory).
    """

    def __init__(self, dest: str | os.PathLike[str], type_map: Sequence[str], *,
                 overwrite: bool = False, commit_bytes: int = 64 << 20,
                 frame_format: str = DEFAULT_FRAME_FORMAT) -> None:
        import lmdb

        self.dest = os.path.abspath(os.fspath(dest)).rstrip("/")
        if os.path.exists(self.dest) and not overwrite:
            raise ConfigError(f"{self.dest} already exists (pass overwrite to replace it)",
                              path="dest")
        os.makedirs(os.path.dirname(self.dest), exist_ok=True)
        for left in remove_leftovers(self.dest):
            log.warning("removed %s, left by an interrupted writer", left)
        self.partial = temporary_path(self.dest)
        self.type_map = list(type_map)
        self.frame_format, self.commit_bytes = frame_format, commit_bytes
        self.nlocs, self.system_ids = array.array("l"), array.array("l")
        self.shapes: dict[str, list[Any]] = {}
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._next_system = 0
        self._env = lmdb.open(self.partial, map_size=1 << 30, subdir=True, sync=False,
                              metasync=False, readahead=False, meminit=False)

    @property
    def nframes(self) -> int:
        return len(self.nlocs)

    def __enter__(self) -> LmdbWriter:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self.finish()
        else:
            self.abort()

    # -- writing ------------------------------------------------------------------------------
    def new_system(self) -> int:
        """The id of the next source system; call once per source system, before its chunks."""
        sid, self._next_system = self._next_system, self._next_system + 1
        return sid

    def write(self, system_id: int, chunk: SourceChunk) -> None:
        """Append the frames of ``chunk`` as frames of source system ``system_id``."""
        lookup = self._global_ids(chunk.names)
        fields = {k: v for k, v in chunk.fields.items() if k != "cells" or chunk.periodic}
        for name, values in fields.items():
            self._note_shape(name, values.shape[1:], chunk.atom_axes.get(name, ()))
        keep = chunk.types >= 0
        if keep.all():  # every frame keeps every atom: slice each field's bytes per frame
            ids = lookup[chunk.types].astype(np.int32)
            columns = [(name, _Column(values)) for name, values in fields.items()]
            for i in range(chunk.nframes):
                record = {name: column.encoded(i) for name, column in columns}
                self._append(system_id, ids[i], record)
            return
        for i in range(chunk.nframes):  # virtual atoms: drop them on every atom axis
            record = {}
            for name, values in fields.items():
                value = values[i]
                for axis in chunk.atom_axes.get(name, ()):
                    value = np.compress(keep[i], value, axis=axis)
                record[name] = codec.encode_array(value)
            self._append(system_id, lookup[chunk.types[i][keep[i]]].astype(np.int32), record)

    def _append(self, system_id: int, ids: np.ndarray, fields: dict[str, Any]) -> None:
        record: dict[str, Any] = {"atom_types": codec.encode_array(ids), **fields}
        counts = np.bincount(ids, minlength=len(self.type_map))
        record["atom_numbs"] = counts.tolist()
        self._put(codec.pack(record))
        self.nlocs.append(len(ids))
        self.system_ids.append(system_id)

    def _global_ids(self, names: tuple[str, ...]) -> np.ndarray:
        missing = [n for n in names if n not in self.type_map]
        if missing:
            raise TypeMapError(f"Elements {missing} are not in the type_map of the database",
                               file=self.dest, expected=f"elements within {self.type_map}",
                               found=list(names))
        return np.asarray([self.type_map.index(n) for n in names], dtype=np.int64)

    def _note_shape(self, name: str, shape: tuple[int, ...], atom_axes: tuple[int, ...]) -> None:
        # the shape of a frame before virtual atoms are dropped: atom axes are symbolic anyway
        """The dpdata ``dp_data_shapes`` entry for a field it does not know by itself."""
        if name not in self.shapes and name not in ("coords", "cells", "energies", "forces",
                                                    "virials"):
            self.shapes[name] = ["nframes"] + ["natoms" if a in atom_axes else int(n)
                                               for a, n in enumerate(shape)]

    def _put(self, value: bytes) -> None:
        key = frame_key(self.nframes, self.frame_format)  # before this frame's nlocs entry
        self._pending.append((key, value))
        self._pending_bytes += len(value)
        if self._pending_bytes >= self.commit_bytes:
            self._commit()

    def _commit(self, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Write the pending records (growing the map when it is full)."""
        import lmdb

        records = self._pending + list(extra)
        ordered = self.frame_format == DEFAULT_FRAME_FORMAT  # zero-padded keys come in order
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in records:
                        txn.put(key, value, append=ordered and key != METADATA_KEY)
                break
            except lmdb.MapFullError:
                self._env.set_mapsize(2 * int(self._env.info()["map_size"]))
        self._pending, self._pending_bytes = [], 0

    # -- finishing ----------------------------------------------------------------------------
    def finish(self) -> str:
        """Write ``__metadata__``, sync, check, and rename into place; returns the path."""
        if self.nframes == 0:
            self.abort()
            raise DataError("nothing to write: the sources hold no frame", file=self.dest)
        nframes = self.nframes
        self._commit()  # frames first, so that a crash leaves no __metadata__ behind
        meta = {"nframes": nframes, "frame_idx_fmt": self.frame_format,
                "type_map": self.type_map, "frame_nlocs": self.nlocs.tolist(),
                "frame_system_ids": self.system_ids.tolist()}
        if self.shapes:
            meta["dp_data_shapes"] = self.shapes
        self._commit([(METADATA_KEY, codec.pack(meta))])
        self._env.sync(True)
        self._env.close()
        self._verify(nframes)
        publish_folder(self.partial, self.dest)
        log.info("wrote %d frames of %d systems to %s", nframes, self._next_system, self.dest)
        return self.dest

    def _verify(self, nframes: int) -> None:
        import lmdb

        env = lmdb.open(self.partial, readonly=True, lock=False)
        try:
            entries = int(env.stat()["entries"])
            with env.begin() as txn:
                last = txn.get(frame_key(nframes - 1, self.frame_format))
        finally:
            env.close()
        if entries != nframes + 1 or last is None:
            raise DataError("the written database does not hold every frame", file=self.partial,
                            expected=f"{nframes + 1} entries", found=f"{entries} entries")

    def abort(self) -> None:
        """Discard the partial database (after an error or an interruption)."""
        try:
            self._env.close()
        finally:
            discard(self.partial)


class _Column:
    """One field of a chunk as contiguous bytes, cut into per-frame encoded arrays."""

    def __init__(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values)
        self.head = {"type": codec.dtype_name(values.dtype), "shape": list(values.shape[1:])}
        self.size = values[:1].nbytes
        self.data = values.tobytes()

    def encoded(self, i: int) -> dict[str, Any]:
        return {**self.head, "data": self.data[i * self.size:(i + 1) * self.size]}
