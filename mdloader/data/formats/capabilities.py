"""What only some storage formats do, each a small protocol a backend has or has not.

A client asks :func:`has` (``isinstance`` against the protocol, remembered per backend:
it is asked per system) and otherwise applies the default written beside the protocol here: a
format that implements only the core :class:`~mdloader.data.formats.base.Backend` still
finds, describes and reads its systems. A format has a capability whole or not at all: the
registry refuses one that implements only some of a protocol's methods
(:func:`partly_implemented`). The diagnostics of ``check`` and the box check are in
:mod:`mdloader.data.formats.diagnostics`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from mdloader.data.formats.base import Backend, Listing, Location, SystemMeta


@runtime_checkable
class EntryExpansion(Protocol):
    """A ``systems`` entry stands for several systems (an HDF5 file's groups, a database's)."""

    def expand(self, loc: Location, patterns: Sequence[str] | None,
               known: list[str] | None = None) -> list[str]:
        """The systems the entry at ``loc`` stands for; ``known``: those an earlier discovery
        found in :meth:`container`, unchanged since."""

    def container(self, loc: Location) -> str | None:
        """The file whose freshness tells whether :meth:`expand`'s answer still holds (``None``:
        expanded again at every start)."""


@runtime_checkable
class FolderWalk(Protocol):
    """Systems are folders found by walking a ``systems`` entry (npy); a saved walk's folders
    are reused."""

    def list_folder(self, path: str) -> Listing:
        """(file names, folder names, folders that are links) of a folder the walk visits."""

    def walk_step(self, listing: Listing) -> tuple[bool, list[str], list[str]]:
        """(is the listed folder a system?, names of its subfolders the walk descends into,
        names of those it only looks at: links to folders, systems themselves or not)."""


@runtime_checkable
class Freshness(Protocol):
    """A saved description can be trusted while the paths it depends on are unchanged."""

    def freshness_paths(self, addresses: Sequence[str], layout: tuple[bool, tuple[str, ...]]
                        ) -> list[str] | None:
        """The paths whose change means the saved descriptions of ``addresses`` (systems of one
        ``layout``: has its own type map, its set names) may be wrong: each system's in turn,
        as many for each; ``None``: described again. One call for many systems, because a
        check of a large index builds half a million paths."""


@runtime_checkable
class Diagnostics(Protocol):
    """The format checks its systems itself, file by file, and names the file of a frame."""

    def deep_check(self, meta: SystemMeta) -> list[str]:
        """Every problem found by reading every frame (``check --deep``)."""

    def box_blocks(self, meta: SystemMeta) -> Iterator[tuple[str | None, int, np.ndarray]]:
        """(file, first frame id, ``(n, 9)`` boxes) of every stored block of a periodic
        system, for the box check before training."""

    def frame_file(self, meta: SystemMeta, key: str, fid: int) -> str | None:
        """The file (or entry) that holds ``key`` of the frame whose ``fid`` is ``fid``."""

    def notes(self, meta: SystemMeta) -> list[str]:
        """Lines ``check`` prints about how the system is read (arrays read reshaped)."""


CAPABILITIES = (EntryExpansion, FolderWalk, Freshness, Diagnostics)

#: (id of a backend, capability) -> (the backend, whether it has it); holding the backend
#: keeps its id from being reused while the answer is remembered.
_HAS: dict[tuple[int, type], tuple[Backend, bool]] = {}


def has(backend: Backend, capability: type) -> bool:
    """Whether ``backend`` has ``capability`` (one of :data:`CAPABILITIES`), remembered per
    backend object (the registry forgets it when the backend is unregistered)."""
    key = (id(backend), capability)
    found = _HAS.get(key)
    if found is None:
        found = _HAS[key] = (backend, isinstance(backend, capability))
    return found[1]


def forget(backend: Backend) -> None:
    """Drop what :func:`has` remembers of ``backend``."""
    for key in [k for k in _HAS if k[0] == id(backend)]:
        del _HAS[key]


def _methods(capability: type) -> list[str]:
    return [n for n, v in vars(capability).items() if callable(v) and not n.startswith("_")]


def partly_implemented(backend: Backend) -> list[str]:
    """The capabilities ``backend`` implements only in part, each with what it lacks (a
    format with ``deep_check`` but no ``box_blocks`` would be checked by the defaults)."""
    partial = []
    for capability in CAPABILITIES:
        methods = _methods(capability)
        missing = [m for m in methods if not callable(getattr(backend, m, None))]
        if missing and len(missing) < len(methods):
            partial.append(f"{capability.__name__} (missing {', '.join(missing)})")
    return partial


def systems_of_entry(backend: Backend, loc: Location, patterns: Sequence[str] | None,
                     known: list[str] | None = None) -> list[str]:
    """The systems the ``systems`` entry at ``loc`` stands for: by default itself."""
    if has(backend, EntryExpansion):
        return backend.expand(loc, patterns, known)  # type: ignore[attr-defined]
    return [loc.address]


def entry_container(backend: Backend, loc: Location) -> str | None:
    """The file whose freshness tells whether an entry's expansion still holds (``None``:
    expanded again at every start, the default)."""
    if has(backend, EntryExpansion):
        return backend.container(loc)  # type: ignore[attr-defined]
    return None


def walks_folders(backend: Backend) -> bool:
    """Whether the systems of ``backend`` are folders found by walking (:class:`FolderWalk`)."""
    return has(backend, FolderWalk)


def freshness_paths(backend: Backend, address: str, layout: tuple[bool, tuple[str, ...]]
                    ) -> list[str] | None:
    """The paths a saved description of ``address`` depends on; ``None`` (the default):
    never saved as fresh, described again at every start."""
    if has(backend, Freshness):
        return backend.freshness_paths([address], layout)  # type: ignore[attr-defined]
    return None
