"""Logging set-up for the command line: rank 0 speaks, the other ranks only report problems.

Under ``torchrun`` every rank runs the same command; N copies of every INFO line help nobody.
By default rank 0 logs at the requested level and the other ranks at WARNING and above (they
still report their own failures). ``--log-all-ranks`` opens them all up, each line prefixed
with its rank, and each rank writing its own ``--log-path`` file (``<path>.rank<N>``).
"""

from __future__ import annotations

import logging
import sys

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
