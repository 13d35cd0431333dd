"""The ``mdloader`` command line: a parser and a thin ``main(argv) -> int``.

Each subcommand calls keyword-only functions that tests also call directly (``check_input``,
``run_bench``, ``train``, ``convert``, ``pack``); this module only parses, sets up logging,
prints, and turns exceptions into exit codes:

* 0 — success;
* 1 — failure: bad data, a failed check, a distributed error;
* 2 — usage or configuration error (bad arguments, a bad ``input.json``);
* 130 — interrupted;
* 143 — ``train`` stopped by SIGTERM or SIGUSR1 after writing a checkpoint.

User errors (:class:`~mdloader.errors.MdloaderError`) print one ``mdloader: error: ...`` line
on stderr without a traceback unless ``--debug``; anything else is a bug and keeps its
traceback (:mod:`mdloader.cli.main`). Everything after ``mdloader dp`` goes unparsed to
DeePMD-kit's own ``dp`` (see :mod:`mdloader.integrations.deepmd`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mdloader import __version__
from mdloader.errors import ConfigError, MdloaderError, RemoteError
from mdloader.logs import LEVELS, setup_logging
from mdloader.train.signals import EXIT_STOPPED, StopSignals
from mdloader.world import World

if TYPE_CHECKING:
    from mdloader.config.input_json import Config

log = logging.getLogger(__name__)

def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("logging and errors")
    group.add_argument("-v", "--log-level", default="INFO", type=str.upper,
                       choices=list(LEVELS), help="log level on rank 0 (default: INFO)")
    group.add_argument("-l", "--log-path", default=None,
                       help="also write the log to this file (rank 0)")
    group.add_argument("--log-all-ranks", action="store_true",
                       help="log on every rank, not only rank 0")
    group.add_argument("--debug", action="store_true",
                       help="show tracebacks for user errors too")
    return common


def _add_check(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("check", parents=[common],
                       help="validate the data of an input.json, or systems and folders",
                       description="Discover, build and validate every training and "
                       "validation system of an input.json, or every system under the paths "
                       "given; print a summary. Exit 0 when all is well, 1 with every problem "
                       "listed otherwise.")
    p.add_argument("input", nargs="+", metavar="INPUT",
                   help="a DeePMD-kit input.json, or system directories, folders searched "
                   "recursively, globs and HDF5 files")
    p.add_argument("--type-map", nargs="+", default=None, metavar="ELEM",
                   help="model type map for system paths (an input.json has its own)")
    p.add_argument("--batch-size", default="auto", metavar="RULE",
                   help="batch size or rule for system paths (default: auto)")
    p.add_argument("--deep", action="store_true",
                   help="also read every array: NaN/inf frames, frame counts that disagree")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_bench(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("bench", parents=[common], help="time the loader on an input.json",
                       description="Build the loader as training would and pull N batches "
                       "through the outer DataLoader; report per rank.")
    p.add_argument("input", help="DeePMD-kit input.json")
    p.add_argument("--batches", type=int, default=200, help="batches to pull (default 200)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader workers (default: NUM_WORKERS or min(4, cpus))")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def _add_train(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("train", parents=[common], help="reference DDP training job",
                       description="Train a small energy/force potential with "
                       "DistributedDataParallel (one process per rank under torchrun).")
    p.add_argument("input", help="DeePMD-kit input.json")
    p.add_argument("--restart", default=None, metavar="CKPT",
                   help="continue from this checkpoint (model, optimizer and loader state), "
                   "on the same or on another number of ranks")
    p.add_argument("--numb-steps", type=int, default=None, metavar="N",
                   help="override training.numb_steps (0: only the statistics and the "
                   "untrained model, as DeePMD-kit)")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="stop after this step with a checkpoint (e.g. to fit a job's wall "
                   "time); continue later with --restart")
    p.add_argument("-o", "--output", default=".", metavar="DIR",
                   help="folder for lcurve.out and checkpoints (default: .)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader workers (default: NUM_WORKERS or min(4, cpus))")
    p.add_argument("--rcut", type=float, default=4.0,
                   help="cutoff radius of the reference model in Angstrom (default: 4)")
    p.add_argument("--full-validation", action="store_true",
                   help="at every checkpoint, validate every validation frame once, shared by "
                   "the ranks; results in full_valid.out")
    p.add_argument("--nonfinite", choices=["stop", "skip"], default="stop",
                   help="a NaN/inf loss on any rank stops every rank with the step, system and "
                   "file (stop, the default), or every rank skips that step's update (skip)")


def _add_convert(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("convert", parents=[common], help="convert data to DeePMD with dpdata",
                       description="Read SRC with dpdata and write DeePMD system(s) to DEST.")
    p.add_argument("src", help="input file or folder")
    p.add_argument("dest", help="output folder (deepmd/npy) or .h5 file (deepmd/hdf5)")
    p.add_argument("--from", dest="fmt", required=True, metavar="FMT",
                   help="dpdata format of SRC, e.g. vasp/outcar, lammps/dump, extxyz")
    p.add_argument("--to", default="deepmd/npy", choices=["deepmd/npy", "deepmd/hdf5"],
                   help="output layout (default: deepmd/npy)")
    p.add_argument("--type-map", nargs="+", default=None, metavar="ELEM",
                   help="element order of the written type_map.raw")
    p.add_argument("--set-size", type=int, default=5000, help="frames per set.* (default 5000)")


def _add_pack(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("pack", parents=[common], help="write systems into one LMDB database",
                       description="Write every system of SRC (npy, HDF5, or a dpdata format "
                       "with --from) into the LMDB database DEST, one system id per source "
                       "system in mdloader's order; DeePMD-kit 3.2.0 reads it as is.")
    p.add_argument("src", nargs="+", help="systems, roots, globs or HDF5 files (one input with "
                   "--from)")
    p.add_argument("dest", help="the database to create, e.g. train.lmdb")
    p.add_argument("--from", dest="fmt", default=None, metavar="FMT",
                   help="read SRC with dpdata in this format (e.g. vasp/outcar, extxyz)")
    p.add_argument("--type-map", nargs="+", default=None, metavar="ELEM",
                   help="element order of the stored type ids (default: order of appearance)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DEST once the new database is complete")


def _add_index(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("index", parents=[common], help="build, refresh or inspect system "
                       "indexes", description="Describe the training and validation systems "
                       "of an input.json once and save their indexes, so that every job "
                       "starts from them (see the HPC guide).")
    p.add_argument("action", choices=["build", "refresh", "inspect"],
                   help="build: describe what changed and save; refresh: describe everything "
                   "again; inspect: show what an index holds and what changed, write nothing")
    p.add_argument("input", help="DeePMD-kit input.json (inspect: or an index file)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def build_parser() -> argparse.ArgumentParser:
    """The full parser (also used to render ``--help`` in the docs)."""
    common = _common_options()
    parser = argparse.ArgumentParser(
        prog="mdloader", description="Distributed loader of DeePMD data systems: check, "
        "benchmark, convert, and a reference training job.")
    parser.add_argument("--version", action="version", version=f"mdloader {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_check, _add_bench, _add_train, _add_convert, _add_pack, _add_index,
                _add_dp):
        add(sub, common)
    return parser


def _add_dp(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "dp", help="run DeePMD-kit's `dp` with mdloader as its data loader",
        description="Everything after `dp` is passed to DeePMD-kit, e.g. "
        "`mdloader dp --pt train input.json`; works under torchrun. Needs DeePMD-kit "
        "(pip install 'mdloader[deepmd]').", add_help=False)
    p.add_argument("dp_args", nargs=argparse.REMAINDER)


def _run_check(args: argparse.Namespace) -> int:
    from mdloader.cli.check import check_input, format_check_report

    report = check_input(_check_config(args), deep=args.deep)
    if World.from_env().is_main:  # under torchrun, one copy of the report
        print(report.to_json() if args.json else format_check_report(report))
    return 0 if report.ok else 1


def _check_config(args: argparse.Namespace) -> Config:
    """One ``*.json`` file is an input.json; anything else is a list of system paths."""
    from mdloader.cli.check import config_for_paths
    from mdloader.config.input_json import load_config

    inputs = list(args.input)
    if len(inputs) == 1 and inputs[0].endswith(".json") and not os.path.isdir(inputs[0]):
        if args.type_map is not None or args.batch_size != "auto":
            raise ConfigError("--type-map and --batch-size apply to system paths; an "
                              "input.json gives model.type_map and its batch_size",
                              path="--type-map" if args.type_map is not None else "--batch-size")
        return load_config(inputs[0])
    if any(i.endswith(".json") and os.path.isfile(i) for i in inputs):
        raise ConfigError("give either one input.json or system paths, not both", path="INPUT")
    batch: int | str = int(args.batch_size) if args.batch_size.isdigit() else args.batch_size
    return config_for_paths(inputs, type_map=args.type_map, batch_size=batch)


def _run_bench(args: argparse.Namespace) -> int:
    from mdloader.cli.bench import format_bench_rows, run_bench
    from mdloader.config.input_json import load_config

    if args.batches < 1:
        raise ConfigError(f"must be a positive integer, got {args.batches}", path="--batches")
    rows = run_bench(load_config(args.input), batches=args.batches,
                     num_workers=args.num_workers)
    if rows is not None:  # rank 0 only: the gathered rows of every rank
        print(format_bench_rows(rows, as_json=args.json))
    return 0


def _run_train(args: argparse.Namespace) -> int:
    from mdloader.config.input_json import load_config
    from mdloader.train.job import ModelOptions, train

    if not args.rcut > 0:
        raise ConfigError(f"must be a positive number, got {args.rcut}", path="--rcut")
    result = train(load_config(args.input), output=args.output, restart=args.restart,
                   numb_steps=args.numb_steps, stop_after=args.stop_after,
                   num_workers=args.num_workers, options=ModelOptions(rcut=args.rcut),
                   full_validation=args.full_validation, nonfinite=args.nonfinite)
    return EXIT_STOPPED if result.stopped_by else 0


def _run_convert(args: argparse.Namespace) -> int:
    from mdloader.cli.convert import convert

    report = convert(args.src, args.dest, fmt=args.fmt, to=args.to, type_map=args.type_map,
                     set_size=args.set_size)
    for address, nframes, natoms in zip(report.systems, report.nframes, report.natoms):
        print(f"{address}\t{nframes} frames\t{natoms} atoms")
    return 0


def _run_pack(args: argparse.Namespace) -> int:
    from mdloader.cli.pack import pack

    report = pack(args.src, args.dest, fmt=args.fmt, type_map=args.type_map,
                  overwrite=args.overwrite)
    print(f"{report.dest}\t{len(report.systems)} systems\t{report.total_frames} frames\t"
          f"type_map {' '.join(report.type_map)}")
    return 0


def _run_index(args: argparse.Namespace) -> int:
    from mdloader.cli.index import run_index

    return run_index(args.action, args.input, as_json=args.json)


RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "check": _run_check, "bench": _run_bench, "train": _run_train, "convert": _run_convert,
    "pack": _run_pack, "index": _run_index}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mdloader`` and ``python -m mdloader``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dp"]:
        # Everything after `dp` belongs to DeePMD-kit (``--pt`` included): no parsing here.
        from mdloader.integrations.deepmd import run_dp

        return leave(guarded(lambda: run_dp(argv[1:]), debug="--debug" in argv))
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2)
        return int(exc.code or 0)
    setup_logging(args.log_level, args.log_path, all_ranks=args.log_all_ranks)
    runner = RUNNERS[args.command]
    # mdloader train: a signal sets the stop flag for the whole run, teardown included
    with StopSignals() if args.command == "train" else contextlib.nullcontext():
        return leave(guarded(lambda: runner(args), debug=args.debug))


def tell(line: str) -> None:
    """One line on stderr in a single write: under torchrun every rank shares the stream, and
    ``print`` writes the text and its newline separately when Python runs unbuffered
    (``PYTHONUNBUFFERED``), so two ranks' lines could interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def guarded(job: Callable[[], int], *, debug: bool) -> int:
    """Run ``job``; user errors become one line on stderr and an exit code."""
    try:
        return job()
    except KeyboardInterrupt:
        tell("mdloader: interrupted")
        return 130
    except MdloaderError as exc:
        if debug or _is_bug(exc):
            traceback.print_exc()
        text = str(exc) if debug else getattr(exc, "summary", str(exc))
        tell(f"mdloader: error: {text}")
        return 2 if _is_config_error(exc) else 1


def _is_config_error(exc: MdloaderError) -> bool:
    """A ConfigError, here or on the rank whose failure this rank reports."""
    return isinstance(exc, ConfigError) or getattr(exc, "exc_type", None) == "ConfigError"


def _is_bug(exc: BaseException) -> bool:
    """A failure of this very rank that is no mdloader error: its traceback is what a bug
    report needs (the line alone would hide where it came from)."""
    cause = exc.__cause__
    return (isinstance(exc, RemoteError) and cause is not None
            and not isinstance(cause, MdloaderError) and exc.exc_type == type(cause).__name__
            and exc.origin_rank == World.from_env().rank)


def leave(code: int) -> int:
    """``code``, or leave the process now with it when a job of this process ended the group it
    had started (only such a job imported the module that knows)."""
    failure = sys.modules.get("mdloader.distributed.failure")
    if failure is not None and failure.ended_a_group():
        failure.exit_now(code)
    return code
