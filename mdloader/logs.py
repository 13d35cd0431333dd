"""Logging set-up for the command line: rank 0 speaks, the other ranks only report problems.

Under ``torchrun`` every rank runs the same command; N copies of every INFO line help nobody.
By default rank 0 logs at the requested level and the other ranks at WARNING and above (they
still report their own failures). ``--log-all-ranks`` opens them all up, each line prefixed
with its rank, and each rank writing its own ``--log-path`` file (``<path>.rank<N>``).

Long work reports its progress through :func:`progress`, the same way in every command: a tqdm
bar on a terminal, a plain log line now and then in a batch job's log, and nothing from the
other ranks.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import sys
from collections.abc import Iterator
from typing import Any

from mdloader.world import World

LEVELS: dict[str, int] = {"DEBUG": logging.DEBUG, "INFO": logging.INFO,
                          "WARNING": logging.WARNING, "ERROR": logging.ERROR}

_HANDLER_TAG = "_mdloader_cli_handler"


def setup_logging(level: str = "INFO", path: str | None = None, *, world: World | None = None,
                  all_ranks: bool = False) -> None:
    """Configure the ``mdloader`` logger (idempotent: earlier CLI handlers are replaced).

    Parameters
    ----------
    level
        One of :data:`LEVELS` (case-insensitive) for rank 0 (or every rank with ``all_ranks``).
    path
        Also write the log to this file (rank 0 only unless ``all_ranks``).
    world
        The job topology; read from the environment when omitted.
    all_ranks
        Log on every rank at ``level``.
    """
    world = world if world is not None else World.from_env()
    speak = world.is_main or all_ranks
    numeric = LEVELS[level.upper()] if speak else max(LEVELS[level.upper()], logging.WARNING)
    prefix = f"[rank {world.rank}] " if world.distributed else ""
    fmt = logging.Formatter(f"%(asctime)s {prefix}%(levelname)-7s %(name)s: %(message)s",
                            datefmt="%Y-%m-%d %H:%M:%S")
    logger = logging.getLogger("mdloader")
    for handler in list(logger.handlers):
        if getattr(handler, _HANDLER_TAG, False):
            logger.removeHandler(handler)
            handler.close()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if path is not None and speak:
        target = f"{path}.rank{world.rank}" if (all_ranks and world.distributed) else path
        handlers.append(logging.FileHandler(target, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(fmt)
        setattr(handler, _HANDLER_TAG, True)
        logger.addHandler(handler)
    logger.setLevel(numeric)
    logger.propagate = False


#: Work shorter than this (seconds) shows no progress at all: tqdm's ``delay``.
PROGRESS_DELAY = 2.0
#: Least seconds between two progress lines in a log (stderr not a terminal).
PROGRESS_LOG_INTERVAL = 10.0
_LINE_FORMAT = ("{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%), {elapsed} elapsed, "
                "{remaining} left")
_progress_log = logging.getLogger("mdloader.progress")


class _LogLines(io.TextIOBase):
    """The file a log-line tqdm draws on: each line it draws becomes one INFO record (the
    same line twice, as at the end of the work, once)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = ""

    def write(self, text: str) -> int:
        line = text.strip("\r\n ")
        if line and line != self.last:
            _progress_log.info("%s", line)
            self.last = line
        return len(text)


@functools.cache
def _bar_class() -> type:
    from tqdm import tqdm

    class Bar(tqdm):  # type: ignore[misc]
        """tqdm without its monitor thread. A bar starts that thread, even disabled; a thread
        starting while a DataLoader forks its workers can deadlock the child on Python 3.10
        (its after-fork code takes a lock of the interpreter that thread may hold)."""

        monitor_interval = 0

    return Bar


def bar(**kwargs: Any) -> Any:
    """A tqdm bar (``tqdm(**kwargs)``) that starts no thread: every bar mdloader draws."""
    return _bar_class()(**kwargs)


@contextlib.contextmanager
def progress(total: int, desc: str, *, unit: str = "sys", enabled: bool = True,
             main: bool | None = None) -> Iterator[Any]:
    """A tqdm to ``update`` as work of ``total`` units gets done, shown only on ``main``.

    On a terminal (stderr) it is a bar, drawn once the work has lasted ``PROGRESS_DELAY``
    seconds, with the ``mdloader`` log lines printed above it; otherwise (a batch job's log) a
    line on the ``mdloader.progress`` logger every ``PROGRESS_LOG_INTERVAL`` seconds, and one
    at the end, for work that lasts longer, so that a log shows progress without filling up. With
    ``enabled`` false, or on another rank than ``main`` (default: rank 0 of the environment),
    nothing is shown: N copies of a bar help nobody.
    """
    from tqdm.contrib.logging import logging_redirect_tqdm

    tqdm = _bar_class()
    main = World.from_env().is_main if main is None else main
    if not (enabled and main):
        with tqdm(total=total, disable=True) as bar:
            yield bar
    elif sys.stderr.isatty():
        logger = logging.getLogger("mdloader")  # only a logger that prints on the terminal
        redirect = [logger] if any(getattr(h, "stream", None) is sys.stderr
                                   for h in logger.handlers) else []
        with logging_redirect_tqdm(redirect), \
                tqdm(total=total, desc=f"mdloader: {desc}", unit=unit, file=sys.stderr,
                     dynamic_ncols=True, delay=PROGRESS_DELAY) as bar:
            yield bar
    else:
        with tqdm(total=total, desc=desc, unit=unit, file=_LogLines(), bar_format=_LINE_FORMAT,
                  mininterval=PROGRESS_LOG_INTERVAL, delay=PROGRESS_DELAY) as bar:
            yield bar
