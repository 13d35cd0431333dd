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

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

from mdloader import logs
from mdloader.catalog.describe import SystemFailed, fan_out
from mdloader.catalog.discover import discover_systems
from mdloader.cli.arguments import add_list_option
from mdloader.config.input_json import Config, DataConfig, parse_config
from mdloader.config.multitask import JobConfig, weights_rule
from mdloader.config.unsupported import refuse_under_deepmd
from mdloader.data.formats import backend_of, diagnostics
from mdloader.data.formats.base import SystemMeta
from mdloader.data.system import inspect_system
from mdloader.errors import ConfigError, MdloaderError
from mdloader.sampling.batching import parse_rule
from mdloader.sampling.mixed import check_mixed_rule, is_mixed_rule
from mdloader.sampling.plan import LoaderPlan


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
    config: bool = False  # a configuration error (a missing system path): exit 2, as elsewhere


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
    statistics: list[dict[str, Any]] = field(default_factory=list)  # per descriptor block

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        """0 when all is well, 2 when a problem is a configuration error (as every command
        exits on one, e.g. a system path that does not exist), else 1."""
        return 0 if self.ok else 2 if any(p.config for p in self.problems) else 1

    def to_json(self) -> str:
        return json.dumps({
            "ok": self.ok, "deep": self.deep,
            "sections": {s.name: {"systems": [asdict(r) for r in s.rows],
                                  "filtered": s.filtered, "notes": s.notes,
                                  "totals": s.totals()}
                         for s in self.sections},
            "problems": [asdict(p) for p in self.problems],
            "statistics": self.statistics}, indent=2)


#: The commands ``check --for`` gives the verdict of.
TARGETS = ("train", "dp")

#: Rows of a section's table shown by default; ``--all`` (or ``--json``) lists every system.
TABLE_ROWS = 20


@dataclass
class JobCheckReport:
    """``check`` of a multi-task input: one :class:`CheckReport` per task, in ``model_dict``
    order, and the job's task weights (``None`` when a task's data could not be planned)."""

    tasks: dict[str, CheckReport]
    weights: dict[str, float] | None
    weights_rule: str
    problems: list[Problem] = field(default_factory=list)  # of the job, not of one task
    shared_descriptors: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.tasks.values())

    @property
    def exit_code(self) -> int:
        """As :attr:`CheckReport.exit_code`, over every task and the job."""
        if self.ok:
            return 0
        config = any(p.config for p in self.problems) or any(
            r.exit_code == 2 for r in self.tasks.values())
        return 2 if config else 1

    def to_json(self) -> str:
        return json.dumps({
            "ok": self.ok, "weights": self.weights, "weights_rule": self.weights_rule,
            "shared_descriptors": {k: list(v) for k, v in self.shared_descriptors.items()},
            "tasks": {name: json.loads(r.to_json()) for name, r in self.tasks.items()},
            "problems": [asdict(p) for p in self.problems]}, indent=2)


def check_job(job: JobConfig, *, deep: bool = False, threads: int = 4) -> JobCheckReport:
    """Check every task of a multi-task input as :func:`check_input` checks one input (with
    the task's own descriptor), then the job's task weights by DeePMD-kit's rule."""
    reports = {task.name: check_input(task.config, deep=deep, threads=threads,
                                      descriptor=task.descriptor,
                                      descriptor_path=f"model.model_dict.{task.name}.descriptor")
               for task in job.tasks}
    nsystems: dict[str, int] = {}
    nbatches: dict[str, int] = {}
    for name, report in reports.items():
        training = report.sections[0].totals()
        nsystems[name] = training["systems"]
        if training["batches"] is not None:
            nbatches[name] = training["batches"]
    problems: list[Problem] = []
    weights = None
    if not job.num_epoch_dict or job.model_prob or len(nbatches) == len(reports):
        try:
            weights = job.weights(nsystems=nsystems, nbatches=nbatches)
        except ConfigError as exc:
            problems.append(Problem("job", str(exc), config=True))
    return JobCheckReport(reports, weights, weights_rule(job), problems,
                          job.shared_descriptors())


def format_job_report(report: JobCheckReport, *, rows: int | None = TABLE_ROWS) -> str:
    """The human summary of a multi-task input: the job's tasks and weights, then each task's
    report under its heading."""
    lines = [f"multi-task input: {len(report.tasks)} task(s); weights by {report.weights_rule}"]
    for name in report.tasks:
        weight = "-" if report.weights is None else f"{report.weights[name]:.3f}"
        lines.append(f"  {name:<20} weight {weight}")
    for key, users in report.shared_descriptors.items():
        lines.append(f"  descriptor {key!r} shared by {', '.join(users)}")
    for name, task in report.tasks.items():
        lines += ["", f"=== task {name}", format_check_report(task, rows=rows)]
    lines.append("")
    if report.ok:
        lines.append(f"OK: no problem found in {len(report.tasks)} task(s)")
    else:
        count = len(report.problems) + sum(len(r.problems) for r in report.tasks.values())
        bad = [n for n, r in report.tasks.items() if not r.ok]
        lines.append(f"{count} problem(s)" + (f" in task(s) {', '.join(bad)}" if bad else ""))
        lines += [f"  [{p.section}] {p.message}" for p in report.problems]
    return "\n".join(lines)


def config_for_paths(paths: list[str], *, type_map: list[str] | None = None,
                     batch_size: int | str = "auto") -> Config:
    """The configuration ``check`` uses for bare system paths, folders, globs or HDF5 files."""
    model = {"type_map": type_map} if type_map else {}
    return parse_config({"model": model, "training": {"training_data": {
        "systems": paths, "batch_size": batch_size}}}, base_dir=os.getcwd())


def check_input(config: Config, *, deep: bool = False, threads: int = 4,
                descriptor: Mapping[str, Any] | None = None,
                descriptor_path: str = "model.descriptor") -> CheckReport:
    """Check the training and validation data of ``config``; never stops at the first problem.

    With the model's ``descriptor`` section, also say per neighbour-list block whether the
    neighbour statistics of the training systems are cached, or estimate their time.
    """
    sections, problems = [], []
    statistics: list[dict[str, Any]] = []
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
                                  None if backend_of(m.location).pbc_per_frame else m.pbc)
                        for m in metas]
        if not any(p.section == name for p in problems):
            _plan(data, metas, section, problems)
        if descriptor is not None and name == "training_data":
            statistics = statistics_status(metas, descriptor, config.type_map,
                                           path=descriptor_path)
        if deep:
            problems.extend(_deep_problems(name, metas))
    return CheckReport(sections, problems, deep, statistics)


def _deep_problems(section: str, metas: list[SystemMeta]) -> list[Problem]:
    """What reading every frame of each system finds, its progress reported (the longest part
    of a check)."""
    unique = list(dict.fromkeys(metas))
    problems = []
    with logs.progress(sum(m.nframes for m in unique), f"reading {section}",
                       unit="frame") as bar:
        for meta in unique:
            problems.extend(Problem(section, msg, meta.address) for msg in deep_check(meta))
            bar.update(meta.nframes)
    return problems


def statistics_status(metas: list[SystemMeta], descriptor: Mapping[str, Any],
                      type_map: tuple[str, ...] | None, *, path: str = "model.descriptor"
                      ) -> list[dict[str, Any]]:
    """Per descriptor block: systems, how many have cached neighbour statistics, and the
    estimated seconds (one rank) to compute the others at ``NEIGHBOUR_RATE``."""
    from mdloader.cli.stat import descriptor_blocks
    from mdloader.loading.statistics import NEIGHBOUR_RATE, cached_systems

    unique = list(dict.fromkeys(metas))
    ntypes = max([len(type_map or ())] + [m.ntypes for m in unique])
    work = sum(m.nframes * m.natoms for m in unique)
    try:
        blocks = descriptor_blocks(descriptor, path)
    except ConfigError:  # a descriptor mdloader stat does not know: nothing to say
        return []
    rows = []
    for block in blocks:
        cached = cached_systems(unique, block.rcut, type_map=type_map,
                                mixed_type=block.mixed_type, ntypes=ntypes)
        rows.append({"block": block.path, "rcut": block.rcut, "systems": len(unique),
                     "cached": cached,
                     "estimate_seconds": 0.0 if cached == len(unique) else
                     round(work * (1 - cached / max(len(unique), 1)) / NEIGHBOUR_RATE, 1)})
    return rows


def _build_all(data: DataConfig, type_map: tuple[str, ...] | None, section: SectionReport,
               problems: list[Problem], threads: int) -> list[SystemMeta] | None:
    """The systems of ``data`` in order (a repeated entry repeats its system), every problem
    of each system in ``problems``, the reshaped arrays in ``section.notes``."""
    try:
        addresses = discover_systems(list(data.systems), data.rglob_patterns,
                                     key=f"{data.json_path}.systems")
    except MdloaderError as exc:
        problems.append(Problem(section.name, str(exc), config=isinstance(exc, ConfigError)))
        return None
    unique = list(dict.fromkeys(addresses))
    try:
        inspected = dict(zip(unique, fan_out(unique, partial(_inspect, type_map=type_map),
                                             max(1, threads))))
    except SystemFailed as failed:  # not a problem of the data: a bug, or the machine
        raise failed.original() from None
    for address, (meta, found) in inspected.items():
        problems.extend(Problem(section.name, str(exc), address, isinstance(exc, ConfigError))
                        for exc in found)
        if meta is not None:
            section.notes.extend(flat_notes(meta))
    return [inspected[a][0] for a in addresses if inspected[a][0] is not None]


def _inspect(address: str, listing: object = None, *, type_map: tuple[str, ...] | None = None
             ) -> tuple[SystemMeta | None, list[MdloaderError]]:
    try:
        return inspect_system(address, type_map,  # type: ignore[return-value]
                              listing=listing)  # type: ignore[arg-type]
    except MdloaderError as exc:  # not a data problem of the system (e.g. a config error)
        return None, [exc]


def flat_notes(meta: SystemMeta) -> list[str]:
    """One line per array read reshaped (stored flat, as DeePMD-kit's whole-set reader reads it),
    from the system's format."""
    return diagnostics.layout_notes(meta)


def _plan(data: DataConfig, metas: list[SystemMeta], section: SectionReport,
          problems: list[Problem]) -> None:
    """Batch sizes, batches (one rank) and probabilities, as the training loader computes them."""
    spec = data.sampling
    if is_mixed_rule(spec.batch_size):  # the rows give the statistics' per-system sizes
        rule = check_mixed_rule(str(spec.batch_size), spec.key("batch_size"))
        spec = replace(spec, batch_size=f"max:{rule.value}")
    try:
        plan = LoaderPlan.build([m.natoms for m in metas], [m.nframes for m in metas],
                                spec, seed=None).with_spec_probabilities()
    except MdloaderError as exc:
        problems.append(Problem(section.name, str(exc), config=isinstance(exc, ConfigError)))
        return
    for index, size, nbatch, prob in zip(plan.kept, plan.batch_sizes, plan.nbatches,
                                         plan.probabilities):
        row = section.rows[int(index)]
        row.batch_size, row.batches, row.prob = int(size), int(nbatch), float(prob)
    kept_set = {int(i) for i in plan.kept}
    section.filtered = [m.address for i, m in enumerate(metas) if i not in kept_set]


def deep_check(meta: SystemMeta) -> list[str]:
    """Every problem found by reading every frame of the system: NaN/inf frames, unreadable or
    short data (:func:`mdloader.data.formats.diagnostics.deep_check`)."""
    return diagnostics.deep_check(meta)


def format_check_report(report: CheckReport, *, rows: int | None = TABLE_ROWS) -> str:
    """The human summary: one table per section (its first ``rows`` systems, ``None``: all),
    totals, then every problem."""
    lines: list[str] = []
    for section in report.sections:
        lines += _table(section, rows)
        lines.append("")
    if any(r.pbc is None for s in report.sections for r in s.rows):
        lines.append("(pbc ?: an LMDB database stores periodicity with each frame, not per "
                     "system; frames without a box are read as non-periodic)")
    if not report.deep:
        lines.append("(headers only: the values were not read; --deep reads every array and "
                     "finds NaN/inf)")
    for row in report.statistics:
        if row["cached"] == row["systems"]:
            lines.append(f"neighbour statistics ({row['block']}, rcut {row['rcut']:g}): cached "
                         f"for all {row['systems']} systems")
        else:
            lines.append(f"neighbour statistics ({row['block']}, rcut {row['rcut']:g}): cached "
                         f"for {row['cached']} of {row['systems']} systems; computing the rest "
                         f"takes roughly {row['estimate_seconds']:g} s on one rank (an "
                         "estimate; divided among the ranks of a job; mdloader stat computes "
                         "and caches them)")
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


def _prob(value: float | None) -> str:
    """A probability in 7 characters: 3 decimals, or 2 significant digits below 0.001 (with
    thousands of systems every probability is that small, and ``0.000`` says nothing)."""
    if value is None:
        return format("-", ">7")
    return format(value, ">7.3f" if value == 0 or value >= 1e-3 else ">7.1e")


def _table(section: SectionReport, limit: int | None = None) -> list[str]:
    shown = section.rows if limit is None else section.rows[:limit]
    width = max([len(r.system) for r in shown] + [len("system")])
    head = (f"{'system':<{width}}  {'natoms':>6}  {'nframes':>7}  {'bsz':>4}  {'batches':>7}  "
            f"{'prob':>7}  pbc")
    lines = [f"== {section.name}: {len(section.rows)} system(s)", head, "-" * len(head)]
    for r in shown:
        lines.append(f"{r.system:<{width}}  {r.natoms:>6}  {r.nframes:>7}  "
                     f"{_fmt(r.batch_size, '>4')}  {_fmt(r.batches, '>7')}  "
                     f"{_prob(r.prob)}  {'?' if r.pbc is None else 'TF'[not r.pbc]}")
    if len(shown) < len(section.rows):
        lines.append(f"... {len(section.rows) - len(shown)} more system(s): --all lists "
                     "every one, --json gives them all")
    t = section.totals()
    lines.append("-" * len(head))
    lines.append(f"{'total':<{width}}  {'':>6}  {t['frames']:>7}  {'':>4}  "
                 f"{_fmt(t['batches'], '>7')}  {_prob(t['prob'])}")
    for address in section.filtered:
        lines.append(f"(removed by the batch-size filter: {address})")
    lines.extend(f"note: {note}" for note in section.notes)
    return lines


# -- the sub-command ----------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader check``'s parser."""
    p = sub.add_parser("check", parents=[common],
                       help="validate the data of an input.json, or systems and folders",
                       description="Discover, build and validate every training and "
                       "validation system of an input.json, or every system under the paths "
                       "given; print a summary. Exit 0 when all is well; otherwise every "
                       "problem is listed, and the exit code is 2 when one of them is a "
                       "configuration "
                       "error (such as a system path that does not exist), else 1.")
    p.add_argument("input", nargs="+", metavar="INPUT",
                   help="a DeePMD-kit input.json, or system directories, folders searched "
                   "recursively, globs and HDF5 files")
    add_list_option(p, "--type-map", metavar="ELEM",
                    help="model type map for system paths (an input.json has its own)")
    p.add_argument("--batch-size", default="auto", metavar="RULE",
                   help="batch size or rule for system paths (default: auto)")
    p.add_argument("--for", dest="target", choices=TARGETS, default=None,
                   help="the command that will run the input.json, whose verdict check gives: "
                   "`dp` refuses first, in the same line and exit code, what `mdloader dp` "
                   "refuses before any set-up; `train` what `mdloader train` refuses "
                   "(default: dp for a multi-task input, which only `mdloader dp` trains; "
                   "train for a single-task one)")
    p.add_argument("--deep", action="store_true",
                   help="also read every array: NaN/inf frames, frame counts that disagree")
    p.add_argument("--all", action="store_true",
                   help=f"list every system (default: the first {TABLE_ROWS} of each section)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Check, print the report (rank 0); the exit code of :attr:`CheckReport.exit_code`."""
    from mdloader.world import World

    rows = None if args.all else TABLE_ROWS
    config = _check_config(args)
    if isinstance(config, JobConfig):
        job = check_job(config, deep=args.deep)
        if World.from_env().is_main:
            print(job.to_json() if args.json else format_job_report(job, rows=rows))
        return job.exit_code
    report = check_input(config, deep=args.deep, descriptor=_descriptor(args))
    if World.from_env().is_main:  # under torchrun, one copy of the report
        print(report.to_json() if args.json else format_check_report(report, rows=rows))
    return report.exit_code


def _descriptor(args: argparse.Namespace) -> Mapping[str, Any] | None:
    """The model's descriptor section of an input.json (``None`` for system paths, or when the
    model section has none)."""
    inputs = list(args.input)
    if len(inputs) != 1 or not inputs[0].endswith(".json") or os.path.isdir(inputs[0]):
        return None
    with open(inputs[0], encoding="utf-8") as fh:
        descriptor = json.load(fh).get("model", {}).get("descriptor")
    return descriptor if isinstance(descriptor, Mapping) else None


def _check_config(args: argparse.Namespace) -> Config | JobConfig:
    """One ``*.json`` file is an input.json (single- or multi-task), read as the command of
    ``--for`` reads it; anything else is a list of system paths."""
    inputs = list(args.input)
    if len(inputs) == 1 and inputs[0].endswith(".json") and not os.path.isdir(inputs[0]):
        if args.type_map is not None or args.batch_size != "auto":
            raise ConfigError("--type-map and --batch-size apply to system paths; an "
                              "input.json gives model.type_map and its batch_size",
                              path="--type-map" if args.type_map is not None else "--batch-size")
        return load_for(inputs[0], args.target)
    if any(i.endswith(".json") and os.path.isfile(i) for i in inputs):
        raise ConfigError("give either one input.json or system paths, not both", path="INPUT")
    if args.target is not None:
        raise ConfigError("--for applies to an input.json; system paths are checked as every "
                          "command reads them", path="--for")
    batch: int | str = int(args.batch_size) if args.batch_size.isdigit() else args.batch_size
    if isinstance(batch, str):
        parse_rule(batch, key="--batch-size")
    elif batch < 1:
        raise ConfigError(f"a batch size must be a positive integer, got {batch}",
                          path="--batch-size")
    return config_for_paths(inputs, type_map=args.type_map, batch_size=batch)


def load_for(path: str, target: str | None = None) -> Config | JobConfig:
    """The input.json at ``path`` as ``mdloader <target>`` reads it, refused in the line that
    command gives: ``dp`` through :func:`~mdloader.config.unsupported.refuse_under_deepmd`
    (what ``mdloader dp`` refuses before any set-up), ``train`` through
    :func:`~mdloader.config.input_json.load_config` (one task; ``mix:N`` on one LMDB
    database). ``None``: ``dp`` for a
    multi-task input, the only command that trains one, else ``train``."""
    from mdloader.config.input_json import load_config, read_input_json
    from mdloader.config.multitask import is_multitask, load_job

    data = read_input_json(path)
    if target is None:
        target = "dp" if is_multitask(data) else "train"
    if target == "dp":
        refuse_under_deepmd(data)
        return load_job(path, mixed=True)
    return load_config(path, mixed=True)
