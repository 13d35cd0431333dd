"""How a command ends: its exit code, and for a failure one ``mdloader: error:`` line.

A user error (:class:`~mdloader.errors.MdloaderError`) is one line on stderr, without a
traceback unless ``--debug``; a failure of this rank that is not one (a bug) keeps its traceback
too. A rank of a job of several ranks leaves the process at once when the job is over
(:func:`mdloader.distributed.failure.exit_now`): after failing alone it must not tear the group
down, and after any end ``torchrun`` may already be sending it SIGTERM.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from mdloader.errors import ConfigError, MdloaderError, RemoteError
from mdloader.world import World


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
