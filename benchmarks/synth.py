"""A system index of many systems that exist only in the index: load and broadcast at 10^6.

The descriptions are made column by column (no file, no SystemMeta per system) with the same
shapes as :mod:`benchmarks.generate`'s data (O/H systems of 3-24 atoms, one set of 20 frames
holding box, coord, energy and force), and saved where :mod:`mdloader.catalog.index`
looks for the index
of ``root`` with the benchmark's type map. Used in ``trust`` mode, nothing under ``root`` is
ever touched, so ``root`` need not exist.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.generate import NATOMS_RANGE, NFRAMES
from benchmarks.impls import TYPE_MAP


def synthesize_index(root: str, nsys: int, cache_dir: str, seed: int = 0) -> str:
    """Write the index of ``nsys`` synthetic systems under ``root``; its path."""
    from mdloader.catalog.index import index_header, index_request
    from mdloader.catalog.index_file import SavedIndex, write_index
    from mdloader.catalog.table import SystemTable
    from mdloader.data.system import restore_set

    rng = np.random.default_rng(seed)
    natoms = rng.integers(NATOMS_RANGE[0], NATOMS_RANGE[1] + 1, size=nsys)
    width = len(str(nsys - 1))
    names = "".join(f"sys.{i:0{width}d}" for i in range(nsys)).encode()
    sizes = list(range(NATOMS_RANGE[0], NATOMS_RANGE[1] + 1))
    sets = tuple(restore_set("set.000", NFRAMES, ("box", "coord", "energy", "force"),
                             (9, 3 * n, 1, 3 * n)) for n in sizes)
    types = np.concatenate([np.arange(n) % 2 for n in natoms]).astype(np.int8)
    small = np.min_scalar_type
    columns = {
        "folder_id": np.zeros(nsys, np.uint8),
        "name_len": np.full(nsys, 4 + width, small(4 + width)),
        "natoms": natoms.astype(np.uint8), "types": types,
        "type_map_id": np.zeros(nsys, np.uint8), "flags": np.ones(nsys, np.uint8),
        "nsets": np.ones(nsys, np.uint8), "set_ids": (natoms - NATOMS_RANGE[0]).astype(np.uint8),
        "idx_map_id": np.zeros(nsys, np.uint8)}
    table = SystemTable(columns, names, (root.rstrip("/") + "/",), (tuple(TYPE_MAP),), sets,
                        (None,))
    request = index_request(root, None, TYPE_MAP, cache_dir=cache_dir)
    saved = SavedIndex(table, time.time_ns())
    write_index(request.path, saved, index_header(request, saved))
    return request.path
