"""Exception types with messages a user can act on.

Every error raised because of bad *input* (a data system, a file, a config key) is an
:class:`MdloaderError`. The data errors carry the system and the file concerned plus what was
expected and what was found, so that the same facts can travel from rank 0 to every other rank
(see :mod:`mdloader.distributed.packets`) and be printed by the command line without a traceback.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any


class MdloaderError(Exception):
    """Base class of every error mdloader raises on purpose.

    Subclasses with keyword-only constructor arguments list them in :meth:`_arguments`, so that
    pickle rebuilds the same error in another process (DataLoader workers, other ranks).
    """

    every_rank = False
    """True for errors that every rank of a job raises at the same point (a framed error, a
    failed agreement): the ranks can then meet once more to tear the job down together."""

    def _arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.args, {}

    def __reduce__(self) -> tuple[Any, ...]:
        args, kwargs = self._arguments()
        return (_rebuild, (type(self), args, kwargs))


def _rebuild(cls: type[MdloaderError], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> MdloaderError:
    return cls(*args, **kwargs)


class DataError(MdloaderError, ValueError):
    """A DeePMD system on disk is missing something or is inconsistent.

    Parameters
    ----------
    message
        What went wrong, in words.
    system
        The system's address (a directory, or ``file.h5#/group``).
    file
        The file (or HDF5 dataset) concerned, when there is one.
    expected, found
        What the format requires and what is on disk, when that can be said.
    """

    def __init__(
        self,
        message: str,
        *,
        system: str | None = None,
        file: str | None = None,
        expected: Any = None,
        found: Any = None,
    ) -> None:
        self.message = message
        self.system = system
        self.file = file
        self.expected = expected
        self.found = found
        super().__init__(self._format())

    def _format(self) -> str:
        parts = [self.message]
        if self.system is not None:
            parts.append(f"system: {self.system}")
        if self.file is not None:
            parts.append(f"file: {self.file}")
        if self.expected is not None:
            parts.append(f"expected: {self.expected}")
        if self.found is not None:
            parts.append(f"found: {self.found}")
        return "; ".join(parts)

    def _arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (self.message,), {"system": self.system, "file": self.file,
                                 "expected": self.expected, "found": self.found}


class MissingDataError(DataError, FileNotFoundError):
    """A file or dataset the format requires is absent (no ``set.*``, no ``coord.npy`` ...)."""


class ShapeError(DataError):
    """Array shapes disagree with each other or with ``type.raw``."""


class TypeMapError(DataError):
    """Atom types fall outside ``type_map.raw`` or elements are missing from the model type map."""


class CorruptFileError(DataError):
    """A file cannot be parsed (truncated npy header, not an HDF5 file, unreadable text)."""


class StaleDataError(DataError):
    """A file changed after its system was described (at start-up, or in a saved index)."""

    def described_by(self, origin: str | None) -> StaleDataError:
        """The same error, saying where the description came from and how to refresh it."""
        if origin is None:
            where = ("described when this job started; the data changed while it ran: restart "
                     "the job")
        else:
            where = (f"described by the index {origin}, now removed: the next start "
                     "describes the systems again; a shared copy is refreshed with `mdloader "
                     "index refresh input.json`, MDLOADER_INDEX=refresh or index_mode='refresh'")
        return StaleDataError(f"{self.message} ({where})", system=self.system, file=self.file,
                              expected=self.expected, found=self.found)


class UnreadableFileError(DataError):
    """A file of a built system cannot be read any more (permissions, I/O error)."""


class UnknownFormatError(DataError):
    """No registered storage format recognises an address, or none has the name asked for."""


class NonFiniteError(DataError):
    """NaN or infinity where training needs finite numbers: labels, a loss, the weights."""


class NoSystemsFoundError(MdloaderError, FileNotFoundError):
    """Discovery found no directory or HDF5 group holding ``type.raw``."""


class ConfigError(MdloaderError, ValueError):
    """A configuration value (``input.json`` or an argument) is wrong.

    ``path`` is the JSON path of the offending key, e.g. ``training.training_data.batch_size``.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.message = message
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)

    def _arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (self.message,), {"path": self.path}


class DistributedError(MdloaderError, RuntimeError):
    """Something went wrong in a collective step (verification, protocol, timeout)."""


class AgreementError(DistributedError):
    """The ranks compared what they hold and disagree; every rank raises it at once."""

    every_rank = True


class WorkerLostError(MdloaderError, RuntimeError):
    """A DataLoader worker of this rank died (killed, out of memory, a crash in native code)."""


class RemoteError(DistributedError):
    """Rank 0 (or a source rank) failed; this rank re-raises its failure.

    The attributes carry what the failing rank knew: the exception type name, its message, the
    system and file concerned (for :class:`DataError`), and its formatted traceback.
    """

    every_rank = True

    def __init__(
        self,
        *,
        origin_rank: int,
        exc_type: str,
        exc_message: str,
        context: str,
        system: str | None = None,
        file: str | None = None,
        traceback_text: str = "",
    ) -> None:
        self.origin_rank = origin_rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.context = context
        self.system = system
        self.file = file
        self.traceback_text = traceback_text
        where = []
        if system is not None:
            where.append(f"system: {system}")
        if file is not None:
            where.append(f"file: {file}")
        head = f"rank {origin_rank} failed ({context}): {exc_type}: {exc_message}"
        if where and not all(w in exc_message for w in where):
            head += " [" + "; ".join(where) + "]"
        self.summary = head
        """The message without rank 0's traceback (what the command line prints by default)."""
        if traceback_text:
            head += f"\n--- traceback on rank {origin_rank} ---\n{traceback_text.rstrip()}"
        super().__init__(head)

    FIELDS = ("origin_rank", "exc_type", "exc_message", "context", "system", "file",
              "traceback_text")

    def _arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (), {name: getattr(self, name) for name in self.FIELDS}


class RankFailedError(RemoteError):
    """One rank failed on its own during the job (a read error, a lost worker, any exception in
    its step); the rank itself and every rank that learned of it raise this.

    The ranks did not fail together, so they do not meet again: the process should exit, and the
    launcher stops the ranks that have not noticed yet.
    """

    every_rank = False


class CollectiveTimeoutError(DistributedError, TimeoutError):
    """A collective did not complete in time (rank 0 may still be building)."""


class StateDictError(MdloaderError, ValueError):
    """A saved loader/sampler state does not fit this loader (other world size, seed, systems)."""


class WriteError(MdloaderError, OSError):
    """A file of a job's output (a checkpoint, a training log) could not be written (disk full,
    no permission); the message names it and says what was kept."""


class StagingError(MdloaderError, OSError):
    """The node-local copy of the data cannot be made: the stage folder is full or the copy
    failed (the message names the folder, or the file, and the bytes)."""


class StopRequested(BaseException):
    """A stop signal (SIGTERM, SIGUSR1) arrived while the run had nothing to save yet: the run
    ends at once. A ``BaseException``, as ``KeyboardInterrupt``, so that no ``except Exception``
    swallows it."""

    def __init__(self, signal_name: str) -> None:
        self.signal_name = signal_name
        super().__init__(f"{signal_name} before the first training step: nothing to save")


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` as PEP 678 does (``__notes__``), on Python 3.10 too."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]


def traceback_text(exc: BaseException) -> str:
    """The formatted traceback of ``exc`` with its notes (which Python 3.10 does not print)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if sys.version_info < (3, 11):
        text += "".join(f"{note}\n" for note in getattr(exc, "__notes__", ()))
    return text
