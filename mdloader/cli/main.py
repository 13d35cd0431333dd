"""The ``mdloader`` entry point: the table of sub-commands, and how their outcome becomes an
exit code.

Each sub-command is a module of :mod:`mdloader.cli` (as lhotse's ``bin/modes``) that provides
``register(sub, common)``, which adds its parser, and ``run(args) -> int``, which calls
keyword-only functions that tests also call directly (``check_input``, ``run_bench``,
``train``, ``convert``, ``pack``, ``run_index``); optionally ``session()``, a context the whole
run happens in (``train``: stop signals), and ``UNPARSED``, the attribute of ``args`` that
receives everything after the command name unparsed (``dp``: ``dp_args``). Adding a command is
one module and one entry of :data:`COMMANDS`. A command module imports torch only inside
``run``, so that ``--help`` and argument errors stay fast.

This module parses, sets up logging, and turns exceptions into the exit codes of
:data:`EXIT_CODES` (which ``mdloader --help`` and the reference page list).

User errors (:class:`~mdloader.errors.MdloaderError`) print one ``mdloader: error: ...`` line
on stderr without a traceback unless ``--debug``; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType

from mdloader import __version__
from mdloader.cli import bench, cache, check, convert, dp, index, pack, report, stat, train
from mdloader.cli.arguments import LIST_RULE, untangle
from mdloader.errors import ConfigError, MdloaderError, RemoteError, StopRequested
from mdloader.logs import LEVELS, setup_logging
from mdloader.train.signals import EXIT_STOPPED
from mdloader.world import World

#: Every exit code of ``mdloader``, and what it means (``mdloader --help`` prints them).
EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "a failure: bad data, a failed check, a distributed error",
    2: "a usage or configuration error: bad arguments, a bad input.json, a system path that "
       "does not exist (the same in every command)",
    130: "interrupted (Ctrl-C)",
    141: "the reader of the output went away (e.g. `| head`): the output stops quietly",
    143: "`train` stopped by SIGTERM or SIGUSR1 after writing a checkpoint, or before its first "
         "step with nothing to save",
}

#: The sub-commands, in ``mdloader --help`` order.
COMMANDS: dict[str, ModuleType] = {
    "check": check, "bench": bench, "train": train, "convert": convert, "pack": pack,
    "index": index, "cache": cache, "stat": stat, "dp": dp, "report": report}


def common_options() -> argparse.ArgumentParser:
    """The options every sub-command takes (logging and errors)."""
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


def build_parser() -> argparse.ArgumentParser:
    """The full parser (also used to render ``--help`` in the docs)."""
    common = common_options()
    parser = argparse.ArgumentParser(
        prog="mdloader", description="Distributed loader of DeePMD data systems: check, "
        "benchmark, convert, and a reference training job.", epilog=exit_codes_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"mdloader {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS.values():
        command.register(sub, common)
    return parser


def exit_codes_text() -> str:
    """The exit codes and the rule of list options, as ``mdloader --help`` ends with them."""
    return "exit codes:\n" + "\n".join(
        textwrap.fill(meaning, 90, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
        for code, meaning in EXIT_CODES.items()) + "\n\noptions that take a list:\n" + \
        textwrap.fill(LIST_RULE, 90, initial_indent="  ", subsequent_indent="  ",
                      break_on_hyphens=False)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mdloader`` and ``python -m mdloader``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    unparsed = COMMANDS.get(argv[0]) if argv else None
    dest = getattr(unparsed, "UNPARSED", None)
    if unparsed is not None and dest is not None:
        # Everything after the command belongs to it (DeePMD-kit's ``--pt`` included).
        args = argparse.Namespace(command=argv[0], **{dest: argv[1:]})
        return leave(guarded(lambda: unparsed.run(args), debug="--debug" in argv))
    if unparsed is not None:
        try:
            argv = untangle(argv)
        except ConfigError as exc:  # a list option written ambiguously: how to write it
            tell(f"mdloader: error: {exc}")
            return 2
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2)
        return int(exc.code or 0)
    setup_logging(args.log_level, args.log_path, all_ranks=args.log_all_ranks)
    command = COMMANDS[args.command]
    session = getattr(command, "session", contextlib.nullcontext)
    with session():
        return leave(guarded(lambda: command.run(args), debug=args.debug))


def tell(line: str) -> None:
    """One line on stderr in a single write: under torchrun every rank shares the stream, and
    ``print`` writes the text and its newline separately when Python runs unbuffered
    (``PYTHONUNBUFFERED``), so two ranks' lines could interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def guarded(job: Callable[[], int], *, debug: bool) -> int:
    """Run ``job``; user errors become one line on stderr and an exit code."""
    try:
        code = job()
        sys.stdout.flush()  # here, so that a closed pipe is noticed while it can be handled
        return code
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:
        tell("mdloader: interrupted")
        return 130
    except StopRequested as exc:
        tell(f"mdloader: stopped on rank {World.from_env().rank}: {exc}")
        return EXIT_STOPPED
    except MdloaderError as exc:
        if debug or _is_bug(exc):
            traceback.print_exc()
        text = str(exc) if debug else getattr(exc, "summary", str(exc))
        tell(f"mdloader: error: {text}")
        return 2 if _is_config_error(exc) else 1


def _reader_gone() -> int:
    """The reader of stdout closed it (``| head``): stop quietly with 141 (128 + SIGPIPE, what
    a shell reports for a program that SIGPIPE ends), and send what is left of the output to
    the null device, so that Python's own flush at exit does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


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
        failure.depart(code)
    return code
