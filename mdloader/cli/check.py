"""``mdloader check``: validate every system of an input.json (or of paths) before a job runs.

DeePMD-kit notices a missing ``box.npy`` or a short label file at the first batch that touches
it, possibly hours into training. ``check`` describes every system from its headers (the same
:func:`~mdloader.data.system.inspect_system` the loader's build uses), collects *every* problem
of every system instead of stopping at the first, notes arrays that are read reshaped (stored
flat, :mod:`mdloader.data.layout`), applies the batch-size rule and the probabilities exactly as
training would, and with ``--deep`` reads every array to find NaN/inf frames and data that is
shorter than its header says (for an LMDB database: decodes every frame).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mdloader.catalog.discover import discover_systems
from mdloader.config.input_json import Config, DataConfig, parse_config
from mdloader.data.formats import backend_of, parse_address
from mdloader.data.layout import stored_flat
from mdloader.data.system import SystemMeta, inspect_system
from mdloader.errors import MdloaderError
from mdloader.sampling.plan import LoaderPlan

#: Frames read at once by ``--deep`` (bounds memory on large sets).
DEEP_CHUNK = 1024


@dataclass
class SystemRow:
    """One line of the summary (``batch_size``/``batches``/``prob`` None when not computable)."""

    system: str
    natoms: int
    nframes: int
    pbc: bool | None  # None: known per frame (an LMDB group)
    batch_size: int | None = None
    batches: int | None = None
    prob: float | None = None


@dataclass
class Problem:
    """One thing wrong: in which section, which system (if any), what."""

    section: str
    message: str
    system: str | None = None


@dataclass
class SectionReport:
    """``training_data`` or ``validation_data``: its rows, systems dropped by ``filter:N``, and
    notes (arrays read reshaped)."""

    name: str
    rows: list[SystemRow] = field(default_factory=list)
    filtered: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def totals(self) -> dict[str, Any]:
        probs = [r.prob for r in self.rows if r.prob is not None]
        batches = [r.batches for r in self.rows if r.batches is not None]
        return {"systems": len(self.rows), "frames": sum(r.nframes for r in self.rows),
                "atoms": sum(r.nframes * r.natoms for r in self.rows),
                "batches": sum(batches) if batches else None,
                "prob": float(sum(probs)) if probs else None}


@dataclass
class CheckReport:
    """Everything ``check`` found; ``ok`` when there is no problem."""

    sections: list[SectionReport]
    problems: list[Problem]
    deep: bool = False  # were the values read (NaN/inf found), or the headers only?

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> str:
        return json.dumps({
            "ok": self.ok, "deep": self.deep,
            "sections": {s.name: {"systems": [asdict(r) for r in s.rows],
                                  "filtered": s.filtered, "notes": s.notes,
                                  "totals": s.totals()}
                         for s in self.sections},
            "problems": [asdict(p) for p in self.problems]}, indent=2)


def config_for_paths(paths: list[str], *, type_map: list[str] | None = None,
                     batch_size: int | str = "auto") -> Config:
    """The configuration ``check`` uses for bare system paths, folders, globs or HDF5 files."""
    model = {"type_map": type_map} if type_map else {}
    return parse_config({"model": model, "training": {"training_data": {
        "systems": paths, "batch_size": batch_size}}}, base_dir=os.getcwd())


def check_input(config: Config, *, deep: bool = False, threads: int = 4) -> CheckReport:
    """Check the training and validation data of ``config``; never stops at the first problem."""
    sections, problems = [], []
    for name, data in (("training_data", config.training_data),
                       ("validation_data", config.validation_data)):
        if data is None:
            continue
        section = SectionReport(name)
        sections.append(section)
        metas = _build_all(data, config.type_map, section, problems, threads)
        if metas is None:
            continue
        section.rows = [SystemRow(m.address, m.natoms, m.nframes,
                                  None if m.backend == "lmdb" else m.pbc) for m in metas]
        if not any(p.section == name for p in problems):
            _plan(data, metas, section, problems)
        if deep:
            for meta in dict.fromkeys(metas):
                problems.extend(Problem(name, msg, meta.address) for msg in deep_check(meta))
    return CheckReport(sections, problems, deep)


def _build_all(data: DataConfig, type_map: tuple[str, ...] | None, section: SectionReport,
               problems: list[Problem], threads: int) -> list[SystemMeta] | None:
    """The systems of ``data`` in order (a repeated entry repeats its system), every problem
    of each system in ``problems``, the reshaped arrays in ``section.notes``."""
    try:
        addresses = discover_systems(list(data.systems), data.rglob_patterns,
                                     key=f"{data.json_path}.systems")
    except MdloaderError as exc:
        problems.append(Problem(section.name, str(exc)))
        return None
    unique = list(dict.fromkeys(addresses))
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        inspected = dict(zip(unique, pool.map(lambda a: _inspect(a, type_map), unique)))
    for address, (meta, found) in inspected.items():
        problems.extend(Problem(section.name, str(exc), address) for exc in found)
        if meta is not None:
            section.notes.extend(flat_notes(meta))
    return [inspected[a][0] for a in addresses if inspected[a][0] is not None]


def _inspect(address: str, type_map: tuple[str, ...] | None
             ) -> tuple[SystemMeta | None, list[MdloaderError]]:
    try:
        return inspect_system(address, type_map)  # type: ignore[return-value]
    except MdloaderError as exc:  # not a data problem of the system (e.g. a config error)
        return None, [exc]


def flat_notes(meta: SystemMeta) -> list[str]:
    """One line per array stored flat, read reshaped as DeePMD-kit's whole-set reader does."""
    if meta.backend == "lmdb":  # frames stored one by one: nothing is stored flat
        return []
    loc = parse_address(meta.address)
    io = backend_of(loc)
    notes = []
    for s in meta.sets:
        for key, shape in io.set_shapes(loc, s.name).items():
            if stored_flat(shape, s.nframes):
                notes.append(f"{io.file_of(loc, s.name, key + '.npy')} of shape {shape} is "
                             f"read as ({s.nframes}, {s.width(key)}): frames x values")
    return notes


def _plan(data: DataConfig, metas: list[SystemMeta], section: SectionReport,
          problems: list[Problem]) -> None:
    """Batch sizes, batches (one rank) and probabilities, as the training loader computes them."""
    try:
        plan = LoaderPlan.build([m.natoms for m in metas], [m.nframes for m in metas],
                                data.batch_size_value(), seed=None, json_path=data.json_path,
                                sampler_params=data.sampler_params())
    except MdloaderError as exc:
        problems.append(Problem(section.name, str(exc)))
        return
    for index, size, nbatch, prob in zip(plan.kept, plan.batch_sizes, plan.nbatches,
                                         plan.probabilities):
        row = section.rows[int(index)]
        row.batch_size, row.batches, row.prob = int(size), int(nbatch), float(prob)
    kept_set = {int(i) for i in plan.kept}
    section.filtered = [m.address for i, m in enumerate(metas) if i not in kept_set]


def deep_check(meta: SystemMeta) -> list[str]:
    """Read every array of every set (every frame of an LMDB group); report NaN/inf frames and
    unreadable or short data."""
    if meta.backend == "lmdb":
        from mdloader.data.formats.lmdb.check import check_group

        return check_group(meta)
    loc = parse_address(meta.address)
    io = backend_of(loc)
    found: list[str] = []
    start = 0
    for s in meta.sets:
        for key in s.keys:
            where = io.file_of(loc, s.name, key + ".npy")
            try:
                bad = _nonfinite_frames(io, loc, s.name, key, s.nframes)
            except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file, any backend
                found.append(f"cannot read {s.nframes} frames from {where}: "
                             f"{type(exc).__name__}: {exc}")
                continue
            if len(bad):
                shown = ", ".join(str(start + int(f)) for f in bad[:10])
                more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
                found.append(f"NaN/inf in {where}: {len(bad)} frame(s), system frame ids "
                             f"{shown}{more}")
        start += s.nframes
    return found


def _nonfinite_frames(io: Any, loc: Any, set_name: str, key: str, nframes: int) -> np.ndarray:
    bad = []
    for lo in range(0, nframes, DEEP_CHUNK):
        rows = np.arange(lo, min(nframes, lo + DEEP_CHUNK))
        block = io.read_rows(loc, set_name, key, rows, nframes)
        if block.shape[0] != len(rows):
            raise ValueError(f"got {block.shape[0]} rows, expected {len(rows)}")
        if np.issubdtype(block.dtype, np.floating) or np.issubdtype(block.dtype,
                                                                   np.complexfloating):
            rows_bad = ~np.isfinite(block).all(axis=1)
            bad.append(rows[rows_bad])
    return np.concatenate(bad) if bad else np.empty(0, dtype=np.int64)


def format_check_report(report: CheckReport) -> str:
    """The human summary: one table per section, totals, then every problem."""
    lines: list[str] = []
    for section in report.sections:
        lines += _table(section)
        lines.append("")
    if not report.deep:
        lines.append("(headers only: the values were not read; --deep reads every array and "
                     "finds NaN/inf)")
    if report.ok:
        lines.append("OK: no problem found")
    else:
        lines.append(f"{len(report.problems)} problem(s):")
        for p in report.problems:
            lines.append(f"  [{p.section}] {p.message}")
    return "\n".join(lines)


def _fmt(value: Any, spec: str) -> str:
    """``format`` with ``-`` (aligned like the value) for what could not be computed."""
    return format("-", spec[:2]) if value is None else format(value, spec)


def _table(section: SectionReport) -> list[str]:
    width = max([len(r.system) for r in section.rows] + [len("system")])
    head = (f"{'system':<{width}}  {'natoms':>6}  {'nframes':>7}  {'bsz':>4}  {'batches':>7}  "
            f"{'prob':>6}  pbc")
    lines = [f"== {section.name}: {len(section.rows)} system(s)", head, "-" * len(head)]
    for r in section.rows:
        lines.append(f"{r.system:<{width}}  {r.natoms:>6}  {r.nframes:>7}  "
                     f"{_fmt(r.batch_size, '>4')}  {_fmt(r.batches, '>7')}  "
                     f"{_fmt(r.prob, '>6.3f')}  {'?' if r.pbc is None else 'TF'[not r.pbc]}")
    t = section.totals()
    lines.append("-" * len(head))
    lines.append(f"{'total':<{width}}  {'':>6}  {t['frames']:>7}  {'':>4}  "
                 f"{_fmt(t['batches'], '>7')}  {_fmt(t['prob'], '>6.3f')}")
    for address in section.filtered:
        lines.append(f"(removed by the batch-size filter: {address})")
    lines.extend(f"note: {note}" for note in section.notes)
    return lines
