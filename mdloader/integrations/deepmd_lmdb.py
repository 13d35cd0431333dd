"""LMDB under DeePMD-kit's trainer: the two names :func:`mdloader.integrations.deepmd.install`
rebinds in ``deepmd.pt.entrypoints.main`` so that an LMDB ``systems`` is read by mdloader.

``main`` takes its LMDB branch when ``is_lmdb(systems)``; answering ``False`` sends the path to
``DpLoaderSet`` like any other, and mdloader's build expands the database into its groups on
rank 0. ``main`` also calls ``get_data`` on the training data for the neighbour statistics, which
on an LMDB path must stay DeePMD-kit's own ``make_neighbor_stat_data``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def not_lmdb(systems: Any) -> bool:
    """``main.is_lmdb``: the trainer's LMDB branch is never taken, mdloader reads the path."""
    return False


def lmdb_neighbor_stat(original: Callable[..., Any]) -> Callable[..., Any]:
    """``main.get_data``, which ``main`` calls only for neighbour statistics: an LMDB path goes
    to DeePMD-kit's ``make_neighbor_stat_data``, as DeePMD-kit itself does."""

    def get_data(jdata: Any, rcut: Any, type_map: Any, modifier: Any, *args: Any,
                 **kwargs: Any) -> Any:
        from deepmd.dpmodel.utils.lmdb_data import is_lmdb, make_neighbor_stat_data

        systems = jdata.get("systems") if hasattr(jdata, "get") else None
        if isinstance(systems, str) and is_lmdb(systems):
            return make_neighbor_stat_data(systems, type_map)
        return original(jdata, rcut, type_map, modifier, *args, **kwargs)

    return get_data
