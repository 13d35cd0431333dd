"""``merge_lmdb``: DeePMD-kit 3.2's concatenation of LMDB databases, with type maps remapped.

Frames are copied in order with ``frame_nlocs`` and ``frame_system_ids`` (each source's system
ids shifted past the previous sources'). Where DeePMD-kit refuses sources whose ``type_map``
differ (its frames are copied byte for byte), mdloader merges them under the union of the
maps, in first-seen order, and rewrites the ``atom_types`` (and ``atom_names``/``atom_numbs``)
of every frame whose source map differs, by element name: an atom keeps its species, whatever
index it had (the bug DeePMD-kit's refusal guards against is an index read under another
source's map). Sources with and without a ``type_map`` cannot be merged: the species of the
unnamed ids are unknown. The output is built beside the destination and renamed into place
(:func:`mdloader.persist.publish_folder`), so a failed merge leaves an existing destination
as it was.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from mdloader.data.formats.lmdb import codec, environment
from mdloader.data.formats.lmdb.environment import DEFAULT_FRAME_FORMAT, METADATA_KEY, frame_key
from mdloader.data.formats.lmdb.metadata import read_metadata
from mdloader.errors import TypeMapError
from mdloader.persist import discard, publish_folder, remove_leftovers, temporary_path

log = logging.getLogger(__name__)


def merged_type_map(type_maps: Sequence[Sequence[str] | None],
                    paths: Sequence[str]) -> list[str] | None:
    """The union of the sources' type maps in first-seen order (``None``: none has one)."""
    named = [list(m) for m in type_maps if m is not None]
    if not named:
        return None
    if len(named) != len(type_maps):
        listed = ", ".join(f"{p}: {list(m) if m is not None else 'missing'}"
                           for p, m in zip(paths, type_maps))
        raise TypeMapError("Cannot merge LMDB datasets with mixed type_map metadata: the "
                           f"species of the unnamed atom types are unknown ({listed})",
                           file=paths[0])
    union: list[str] = []
    for names in named:
        union.extend(name for name in names if name not in union)
    return union


def type_remap(source: Sequence[str] | None, merged: Sequence[str] | None) -> np.ndarray | None:
    """Stored id -> merged id, by element name (``None``: ids stay as they are)."""
    if source is None or merged is None or list(source) == list(merged):
        return None
    return np.asarray([list(merged).index(name) for name in source], dtype=np.int64)


def remap_record(record: dict[Any, Any], remap: np.ndarray, merged: Sequence[str]
                 ) -> dict[Any, Any]:
    """A frame record with its ``atom_types`` under the merged map (negative ids kept)."""
    out = {(k.decode() if isinstance(k, bytes) else k): v for k, v in record.items()}
    encoded = out.get("atom_types")
    if codec.is_encoded_array(encoded):
        types = codec.decode_array(encoded).copy()
        real = types >= 0
        types[real] = remap[types[real]]
        out["atom_types"] = codec.encode_array(types)
        counts = np.bincount(types[real].reshape(-1), minlength=len(merged))
        if "atom_names" in out:
            out["atom_names"] = list(merged)
        if "atom_numbs" in out:
            out["atom_numbs"] = counts.tolist()
    return out


def _raw_metadata(path: str) -> dict[str, Any]:
    with environment.metadata_view(path) as (txn, _entries):
        meta = codec.unpack(txn.get(METADATA_KEY), "the __metadata__ entry", path, METADATA_KEY)
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in meta.items()}


def merge_lmdb(src_paths: list[str], dst_path: str, *, map_size: int = 1024**4) -> str:
    """Merge LMDB databases into ``dst_path`` (replaced once the merge is complete).

    Parameters
    ----------
    src_paths
        The source databases, in the order their frames are written.
    dst_path
        The merged database.
    map_size
        Largest size of the output (``lmdb.MapFullError`` beyond), as in DeePMD-kit.

    Returns
    -------
    str
        ``dst_path``.
    """
    import lmdb

    sources = [(os.path.abspath(p), read_metadata(os.path.abspath(p))) for p in src_paths]
    merged = merged_type_map([m.type_map for _, m in sources], [p for p, _ in sources])
    dest = os.path.abspath(os.fspath(dst_path)).rstrip("/")
    for left in remove_leftovers(dest):
        log.warning("removed %s, left by an interrupted merge", left)
    partial = temporary_path(dest)
    nlocs: list[int] = []
    sids: list[int] = []
    offset = 0
    env = lmdb.open(partial, map_size=map_size, subdir=True)
    try:
        with env.begin(write=True) as out:
            for path, meta in sources:
                remap = type_remap(meta.type_map, merged)
                with environment.metadata_view(path) as (txn, _entries):
                    for index in range(meta.nframes):
                        raw = bytes(txn.get(frame_key(index, meta.frame_format)))
                        if remap is not None:
                            record = codec.unpack(raw, f"frame {index}", path,
                                                  frame_key(index, meta.frame_format))
                            raw = codec.pack(remap_record(record, remap, merged))
                        out.put(frame_key(len(nlocs), DEFAULT_FRAME_FORMAT), raw)
                        nlocs.append(int(meta.frame_nlocs[index]))
                own = meta.frame_system_ids
                sids.extend((np.zeros(meta.nframes, np.int64) if own is None
                             else np.asarray(own, np.int64)) + offset)
                offset += 1 if own is None else int(np.max(own)) + 1
            info = _raw_metadata(sources[0][0]).get("system_info", {})
            meta_out: dict[str, Any] = {"nframes": len(nlocs),
                                        "frame_idx_fmt": DEFAULT_FRAME_FORMAT,
                                        "system_info": info, "frame_nlocs": nlocs,
                                        "frame_system_ids": [int(s) for s in sids]}
            if merged is not None:
                meta_out["type_map"] = merged
            out.put(METADATA_KEY, codec.pack(meta_out))
        env.sync(True)
        env.close()
        publish_folder(partial, dest)
    except BaseException:
        env.close()
        discard(partial)
        raise
    log.info("Merged %d LMDBs -> %s: %d frames", len(src_paths), dest, len(nlocs))
    return dst_path


__all__ = ["merge_lmdb", "merged_type_map", "type_remap", "remap_record"]
