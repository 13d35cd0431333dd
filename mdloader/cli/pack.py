"""``mdloader pack``: many systems into one LMDB database that DeePMD-kit 3.2.0 reads as is.

Sources are what mdloader reads (npy directories, roots, globs, HDF5 files, listed in
:func:`~mdloader.catalog.discover.discover_systems`'s order, the order ``sys_probs`` refers to) or,
with ``fmt``, a file dpdata reads (as ``mdloader convert``). Every source system becomes one
system id, in that order, so the database keeps the user's systems apart where dpdata's
``MultiSystems`` writer would merge those of equal formula. Every source is described (headers
only) before the first frame is written, so a broken system fails the command at once; frames
then stream through :class:`~mdloader.data.formats.lmdb.writer.LmdbWriter` in bounded chunks, with
their progress reported (:func:`mdloader.logs.progress`), and the database appears at ``dest``
only when complete.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mdloader import logs
from mdloader.catalog.describe import SystemFailed, describe_systems
from mdloader.catalog.discover import discover_systems
from mdloader.cli.arguments import add_list_option
from mdloader.data.formats import parse_address
from mdloader.data.formats.lmdb.sources import array_chunks, element_names, system_chunks
from mdloader.data.formats.lmdb.writer import LmdbWriter, SourceChunk
from mdloader.errors import ConfigError

_CORE_DPDATA = {"coords", "cells", "energies", "forces", "virials"}


@dataclass(frozen=True)
class PackReport:
    """What was written: the database, its element order, and one row per source system."""

    dest: str
    type_map: tuple[str, ...]
    systems: tuple[str, ...]
    nframes: tuple[int, ...]

    @property
    def total_frames(self) -> int:
        return sum(self.nframes)


def pack(sources: str | Sequence[str], dest: str, *, fmt: str | None = None,
         type_map: Sequence[str] | None = None, overwrite: bool = False,
         progress: bool = True, workers: int = 8) -> PackReport:
    """Write the systems of ``sources`` into the LMDB database ``dest``.

    Parameters
    ----------
    sources
        Paths mdloader discovers systems in, or (with ``fmt``) one file or folder for dpdata.
    dest
        The database folder to create (``*.lmdb`` by convention).
    fmt
        A dpdata input format (``vasp/outcar``, ``extxyz``, ...); ``None``: npy/HDF5 systems.
    type_map
        Element order of the stored type ids; default: elements in order of first appearance.
    overwrite
        Replace an existing ``dest`` once the new database is complete.
    progress
        Report the progress of describing and of writing (:func:`mdloader.logs.progress`: a
        bar on a terminal, else log lines).
    """
    entries = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    if not dest.rstrip("/"):
        raise ConfigError("the destination is empty", path="dest")
    if os.path.abspath(dest) in {os.path.abspath(os.fspath(e)) for e in entries}:
        raise ConfigError(f"{dest} is also a source: give the database a path of its own",
                          path="dest")
    systems = (_dpdata_sources(entries, fmt, type_map) if fmt
               else _mdloader_sources(entries, type_map, workers, progress))
    elements = list(type_map) if type_map else _union(names for _, _, names, _ in systems)
    rows: list[int] = []
    with LmdbWriter(dest, elements, overwrite=overwrite) as writer, \
            logs.progress(sum(n for _, n, _, _ in systems), "packing", unit="frame",
                          enabled=progress) as bar:
        for _, _, _, chunks in systems:
            sid, written = writer.new_system(), 0
            for chunk in chunks():
                writer.write(sid, chunk)
                written += chunk.nframes
                bar.update(chunk.nframes)
            rows.append(written)
    return PackReport(writer.dest, tuple(writer.type_map), tuple(p[0] for p in systems),
                      tuple(rows))


def _union(name_lists: Iterator[Sequence[str]]) -> list[str]:
    """Every element, in order of first appearance (dpdata's default type_map)."""
    found: dict[str, None] = {}
    for names in name_lists:
        found.update(dict.fromkeys(names))
    return list(found)


def _mdloader_sources(entries: list[str], type_map: Sequence[str] | None, workers: int,
                      progress: bool) -> list[tuple[str, int, tuple[str, ...], Any]]:
    """(address, frames, element names, chunks) per discovered system, described up front."""
    addresses = discover_systems(entries)
    lmdb = [a for a in addresses if parse_address(a).backend == "lmdb"]
    if lmdb:
        raise ConfigError(f"{lmdb[0].partition('#')[0]} is already an LMDB database; pack "
                          "reads npy and HDF5 systems (or a dpdata format with --from)",
                          path="sources")
    metas = []
    try:
        with logs.progress(len(addresses), "describing systems", enabled=progress) as bar:
            for meta in describe_systems(addresses, None, workers):
                metas.append(meta)
                bar.update()
    except SystemFailed as failed:
        raise failed.original() from None
    systems = []
    for meta in metas:
        names = element_names(meta, type_map)

        def chunks(meta: Any = meta, names: tuple[str, ...] = names) -> Iterator[SourceChunk]:
            return system_chunks(meta, names)

        systems.append((meta.address, meta.nframes, names, chunks))
    return systems


def _dpdata_sources(entries: list[str], fmt: str, type_map: Sequence[str] | None
                 ) -> list[tuple[str, int, tuple[str, ...], Any]]:
    """One row per system dpdata reads from the single source (``MultiSystems``: each
    composition)."""
    from mdloader.cli.convert import read_systems

    if len(entries) != 1:
        raise ConfigError(f"--from reads one input, got {len(entries)}", path="sources")
    src = os.fspath(entries[0])
    systems = []
    for i, system in enumerate(read_systems(src, fmt, list(type_map) if type_map else None)):
        def chunks(system: Any = system) -> Iterator[SourceChunk]:
            return _dpdata_chunks(system)

        data = system.data
        names = tuple(data.get("real_atom_names", data["atom_names"]))
        systems.append((f"{src}[{i}:{system.formula}]", system.get_nframes(), names, chunks))
    return systems


def _dpdata_chunks(system: Any) -> Iterator[SourceChunk]:
    """A dpdata system's frames: its registered per-frame arrays, dpdata's disk names."""
    from dpdata.data_type import Axis

    data = system.data
    arrays, axes = {}, {}
    for dt in system.DTYPES:
        shape = tuple(dt.shape or ())
        if dt.name not in data or not shape or shape[0] is not Axis.NFRAMES \
                or dt.name == "real_atom_types":
            continue
        name = dt.name if dt.name in _CORE_DPDATA else (dt.deepmd_name or dt.name)
        arrays[name] = data[dt.name]
        axes[name] = tuple(i - 1 for i, a in enumerate(shape) if a is Axis.NATOMS)
    names = data.get("real_atom_names", data["atom_names"])
    types = data.get("real_atom_types", data["atom_types"])
    return array_chunks(names, types, arrays, axes, not data.get("nopbc", False))


# -- the sub-command ----------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader pack``'s parser."""
    p = sub.add_parser("pack", parents=[common], help="write systems into one LMDB database",
                       description="Write every system of SRC (npy, HDF5, or a dpdata format "
                       "with --from) into the LMDB database DEST, one system id per source "
                       "system in mdloader's order; DeePMD-kit 3.2.0 reads it as is. "
                       "Options may come before, between or after SRC and DEST.")
    p.add_argument("src", nargs="+", help="systems, roots, globs or HDF5 files (one input with "
                   "--from)")
    p.add_argument("dest", help="the database to create, e.g. train.lmdb")
    p.add_argument("--from", dest="fmt", default=None, metavar="FMT",
                   help="read SRC with dpdata in this format (e.g. vasp/outcar, extxyz)")
    add_list_option(p, "--type-map", metavar="ELEM",
                    help="element order of the stored type ids (default: order of appearance)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DEST once the new database is complete")


def run(args: argparse.Namespace) -> int:
    """Pack; print one summary line."""
    report = pack(args.src, args.dest, fmt=args.fmt, type_map=args.type_map,
                  overwrite=args.overwrite)
    print(f"{report.dest}\t{len(report.systems)} systems\t{report.total_frames} frames\t"
          f"type_map {' '.join(report.type_map)}")
    return 0
