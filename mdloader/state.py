"""One protocol for everything that can be saved and resumed, and one strict way to load it.

Every stateful class of mdloader (the sampler and its epoch iterator, :class:`StatefulLoader`,
``DpLoaderSet``, ``BroadcastingDataLoader``) implements :class:`Stateful` -- torchdata's protocol,
so ``torchdata.stateful_dataloader.StatefulDataLoader`` can drive them -- and returns a dict of
plain integers (and nested such dicts) with a ``version``. Loading is strict: unknown or missing
keys, another version, or a value that belongs to another job raise
:class:`~mdloader.errors.StateDictError` quoting both values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from mdloader.errors import StateDictError


@runtime_checkable
class Stateful(Protocol):
    """``state_dict()`` returns what :meth:`load_state_dict` needs to continue exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def check_keys(state: Any, *, kind: str, version: int, keys: Iterable[str]) -> None:
    """``state`` is a mapping with exactly ``keys`` (plus ``version``) and this ``version``."""
    if not isinstance(state, Mapping):
        raise StateDictError(f"{kind} state must be a dict, got {type(state).__name__}")
    expected = set(keys) | {"version"}
    unknown, missing = sorted(set(state) - expected), sorted(expected - set(state))
    if unknown or missing:
        raise StateDictError(f"{kind} state has unknown keys {unknown} and lacks keys {missing}")
    if state["version"] != version:
        raise StateDictError(f"{kind} state version {state['version']} is not supported "
                             f"(this mdloader writes version {version})")


def check_same(kind: str, label: str, saved: Any, mine: Any, hint: str = "") -> None:
    """A saved value that must equal this job's: raise quoting both (and ``hint``, what to do
    or what stands behind them) when it does not."""
    if saved != mine:
        raise StateDictError(f"cannot resume the {kind}: the saved state has {label} {saved} "
                             f"but this loader has {mine}{hint}")
