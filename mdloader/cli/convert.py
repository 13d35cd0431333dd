"""Convert simulation outputs to DeePMD systems through dpdata.

dpdata already reads some eighty formats (VASP OUTCAR, LAMMPS dump, extxyz, ABACUS, CP2K, ...);
mdloader only adds what a command line needs: the format name checked against what dpdata can
read *before* anything is opened (with a suggestion for typos), dpdata's failures turned into
one :class:`~mdloader.errors.DataError` naming the file, and a short report of what was written.

How a source is read: DeePMD sources (``deepmd/npy``, ``deepmd/hdf5``: a system, a folder of
systems, ``file.h5`` or ``file.h5#/group``) are found by mdloader's own discovery and read one
system at a time. Other formats that can collect several systems (``dpdata.MultiSystems``, one
system per composition: a folder of OUTCARs, a multi-composition extxyz) are tried that way
first; when that reads nothing from a single file (one ``OUTCAR``), the file is read as one
``System``/``LabeledSystem``. A source may be a file prefix that the format completes (QE CP
``traj`` reads ``traj.pos``, ``traj.cel``, ...).
"""

from __future__ import annotations

import argparse
import difflib
import glob
import logging
import os
from dataclasses import dataclass
from typing import Any

from mdloader import logs
from mdloader.cli.arguments import add_list_option
from mdloader.errors import ConfigError, DataError, MissingDataError

log = logging.getLogger(__name__)

#: Output formats of ``mdloader convert`` (the two layouts the loader reads).
TARGETS: tuple[str, ...] = ("deepmd/npy", "deepmd/hdf5")


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion wrote: one entry per system (several for multi-composition input)."""

    source: str
    fmt: str
    target: str
    dest: str
    systems: tuple[str, ...]
    nframes: tuple[int, ...]
    natoms: tuple[int, ...]
    labeled: bool


def _overrides(cls: type, name: str) -> bool:
    from dpdata.format import Format

    method = getattr(cls, name, None)
    return method is not None and method is not getattr(Format, name, None)


def readable_formats() -> dict[str, str]:
    """Map each format dpdata can read to how: ``labeled``, ``system`` or ``multi``."""
    from dpdata.format import Format

    kinds: dict[str, str] = {}
    for name, cls in Format.get_formats().items():
        if _overrides(cls, "from_multi_systems"):
            kinds[name] = "multi"
        elif _overrides(cls, "from_labeled_system"):
            kinds[name] = "labeled"
        elif _overrides(cls, "from_system"):
            kinds[name] = "system"
    return dict(sorted(kinds.items()))


def check_format(fmt: str) -> str:
    """Return how ``fmt`` is read, or raise a ConfigError listing the known formats."""
    kinds = readable_formats()
    key = fmt.strip().lower()
    if key in kinds:
        return kinds[key]
    close = difflib.get_close_matches(key, list(kinds), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ConfigError(f"unknown input format '{fmt}'{hint}; dpdata reads: "
                      f"{', '.join(kinds)}", path="--from")


DEEPMD_SOURCES = ("deepmd/npy", "deepmd/hdf5")


def _single_kinds(fmt: str) -> list[str]:
    """How dpdata reads ``fmt`` as one system, best first (``labeled`` falls back to ``system``)."""
    from dpdata.format import Format

    cls = Format.get_formats()[fmt]
    return [k for k, method in (("labeled", "from_labeled_system"), ("system", "from_system"))
            if _overrides(cls, method)]


def _read(src: str, fmt: str, kind: str, type_map: list[str] | None) -> Any:
    """Read ``src`` with dpdata as a MultiSystems (``multi``) or one (Labeled)System."""
    import dpdata

    if kind == "multi":
        multi = dpdata.MultiSystems.from_file(src, fmt=fmt)
        if type_map:  # from_file ignores type_map; re-collect under the wanted order
            multi = dpdata.MultiSystems(*multi.systems.values(), type_map=type_map)
        return multi
    cls = dpdata.LabeledSystem if kind == "labeled" else dpdata.System
    return cls(src, fmt=fmt, type_map=type_map) if type_map else cls(src, fmt=fmt)


def _first_readable(src: str, fmt: str, kinds: list[str], type_map: list[str] | None) -> Any:
    """The first way of reading ``src`` that gives frames; else a DataError with the first
    error dpdata raised (the informative one)."""
    first: Exception | None = None
    for kind in kinds:
        try:
            data = _read(src, fmt, kind, type_map)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - dpdata raises anything from its ~80 parsers
            first = first or exc
            continue
        if data.get_nframes() > 0:
            return data
    if first is None:
        raise DataError(f"dpdata read no frame from the input as '{fmt}'", file=src)
    raise DataError(f"dpdata could not read the input as '{fmt}': "
                    f"{type(first).__name__}: {first}", file=src) from first


def _load_deepmd(src: str, fmt: str, type_map: list[str] | None) -> Any:
    """A DeePMD source, system by system as mdloader's discovery finds them."""
    import dpdata

    from mdloader.catalog.discover import discover_systems

    addresses = discover_systems(src)
    systems = []
    with logs.progress(len(addresses), "reading systems") as bar:
        for address in addresses:
            systems.append(_first_readable(address, fmt, _single_kinds(fmt), type_map))
            bar.update()
    if len(systems) == 1:
        return systems[0]
    return dpdata.MultiSystems(*systems, type_map=type_map)


def _load(src: str, fmt: str, kind: str, type_map: list[str] | None) -> Any:
    """Read ``src`` as the module docstring says."""
    if fmt in DEEPMD_SOURCES:
        return _load_deepmd(src, fmt, type_map)
    kinds = (["multi"] if kind == "multi" else []) + _single_kinds(fmt)
    return _first_readable(src, fmt, kinds, type_map)


def _exists(src: str, fmt: str) -> bool:
    """The source, its HDF5 file (``file.h5#/group``), or files it is the prefix of."""
    if fmt == "deepmd/hdf5":
        src = src.split("#", 1)[0]
    return os.path.exists(src) or bool(glob.glob(glob.escape(src) + ".*"))


def _systems_of(data: Any) -> list[Any]:
    import dpdata

    if isinstance(data, dpdata.MultiSystems):
        return list(data.systems.values())
    return [data]


def read_systems(src: str, fmt: str, type_map: list[str] | None = None) -> list[Any]:
    """The dpdata systems, with frames, that ``convert`` reads from ``src`` (``pack`` too)."""
    kind = check_format(fmt)
    fmt = fmt.strip().lower()
    if not _exists(src, fmt):
        raise MissingDataError("the input does not exist (nor files it is the prefix of)",
                               file=src)
    return [s for s in _systems_of(_load(src, fmt, kind, type_map)) if s.get_nframes() > 0]


def convert(src: str, dest: str, *, fmt: str, to: str = "deepmd/npy",
            type_map: list[str] | None = None, set_size: int = 5000) -> ConvertReport:
    """Read ``src`` as ``fmt`` with dpdata and write DeePMD system(s) at ``dest``.

    Parameters
    ----------
    src, dest
        Input file or folder; output folder (``deepmd/npy``) or HDF5 file (``deepmd/hdf5``).
    fmt
        A dpdata format name (``vasp/outcar``, ``lammps/dump``, ``extxyz``, ...).
    to
        ``deepmd/npy`` or ``deepmd/hdf5``.
    type_map
        Element order of the written ``type_map.raw`` (dpdata's ``type_map``).
    set_size
        Frames per ``set.*`` directory.
    """
    if to not in TARGETS:
        raise ConfigError(f"unknown output format '{to}': expected one of {', '.join(TARGETS)}",
                          path="--to")
    if set_size < 1:
        raise ConfigError(f"must be a positive integer, got {set_size}", path="--set-size")
    kind = check_format(fmt)
    fmt = fmt.strip().lower()
    if not _exists(src, fmt):
        raise MissingDataError("the input to convert does not exist (nor files it is the "
                               "prefix of)", file=src)
    data = _load(src, fmt, kind, type_map)
    systems = [s for s in _systems_of(data) if s.get_nframes() > 0]
    return _write(data, systems, src=src, dest=dest, fmt=fmt, to=to, set_size=set_size)


def _write(data: Any, systems: list[Any], *, src: str, dest: str, fmt: str, to: str,
           set_size: int) -> ConvertReport:
    import dpdata

    multi = isinstance(data, dpdata.MultiSystems)
    _write_each(data, to, dest, set_size)
    if to == "deepmd/npy":
        addresses = [os.path.join(dest, s.formula) if multi else dest for s in systems]
    else:
        addresses = [f"{dest}#/{s.formula}" if multi else f"{dest}#/" for s in systems]
    labeled = all(isinstance(s, dpdata.LabeledSystem) for s in systems)
    if not labeled:
        log.warning("%s holds no energies or forces (format '%s'): the written systems have "
                    "coordinates only", src, fmt)
    report = ConvertReport(
        source=src, fmt=fmt, target=to, dest=dest, systems=tuple(addresses),
        nframes=tuple(s.get_nframes() for s in systems),
        natoms=tuple(s.get_natoms() for s in systems), labeled=labeled)
    log.info("wrote %d system(s), %d frame(s) to %s", len(addresses), sum(report.nframes), dest)
    return report


def _write_each(data: Any, to: str, dest: str, set_size: int) -> None:
    """``data.to(to, dest)``, one system at a time as dpdata's ``MultiSystems.to`` writes them
    (each at the place the format gives it), so that the progress can be reported."""
    import dpdata
    from dpdata.format import Format

    if not isinstance(data, dpdata.MultiSystems):
        with logs.progress(1, "writing systems") as bar:
            data.to(to, dest, set_size=set_size)
            bar.update()
        return
    target = Format.get_formats()[to]()
    systems = list(data.systems.values())
    with logs.progress(len(systems), "writing systems") as bar:
        places = target.to_multi_systems([s.short_name for s in systems], dest)
        for place, system in zip(places, systems):
            system.to_fmt_obj(target, place, set_size=set_size)
            bar.update()


# -- the sub-command ----------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader convert``'s parser."""
    p = sub.add_parser("convert", parents=[common], help="convert data to DeePMD with dpdata",
                       description="Read SRC with dpdata and write DeePMD system(s) to DEST.")
    p.add_argument("src", help="input file or folder")
    p.add_argument("dest", help="output folder (deepmd/npy) or .h5 file (deepmd/hdf5)")
    p.add_argument("--from", dest="fmt", required=True, metavar="FMT",
                   help="dpdata format of SRC, e.g. vasp/outcar, lammps/dump, extxyz")
    p.add_argument("--to", default="deepmd/npy", choices=["deepmd/npy", "deepmd/hdf5"],
                   help="output layout (default: deepmd/npy)")
    add_list_option(p, "--type-map", metavar="ELEM",
                    help="element order of the written type_map.raw")
    p.add_argument("--set-size", type=int, default=5000, help="frames per set.* (default 5000)")


def run(args: argparse.Namespace) -> int:
    """Convert; print one line per system written."""
    report = convert(args.src, args.dest, fmt=args.fmt, to=args.to, type_map=args.type_map,
                     set_size=args.set_size)
    for address, nframes, natoms in zip(report.systems, report.nframes, report.natoms):
        print(f"{address}\t{nframes} frames\t{natoms} atoms")
    return 0
