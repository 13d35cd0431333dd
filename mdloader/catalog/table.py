"""Many system descriptions as a few columns: what rank 0 broadcasts and what an index stores.

A list of :class:`~mdloader.data.formats.base.SystemMeta` pickles compactly, but pickle builds one
Python object per system on every rank, which dominates the start-up at 10^5 to 10^6 systems
(``docs/benchmarks.md``). A :class:`SystemTable` keeps the same facts column by column: numpy
arrays, plus tables of the few distinct folders, type maps and sets. It pickles as a handful of
buffers and makes a ``SystemMeta`` only when a system is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from mdloader.data.formats.base import SetMeta, SystemMeta, interned

_PBC, _MIXED = 1, 2
_COLUMNS = ("folder_id", "name_len", "natoms", "types", "type_map_id", "flags", "nsets",
            "set_ids", "idx_map_id", "backend_id")


def _smallest(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """``values`` in the smallest unsigned integer type that holds them (fewer bytes to send)."""
    array = np.asarray(values, dtype=np.int64)
    top = int(array.max(initial=0))
    return array.astype(np.min_scalar_type(top) if top >= 0 else np.int64)


class _Distinct:
    """Distinct values in order of first appearance, and the id of each value added."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._ids: dict[Any, int] = {}

    def id(self, value: Any) -> int:
        found = self._ids.get(value)
        if found is None:
            found = self._ids[value] = len(self.values)
            self.values.append(value)
        return found


class TableBuilder:
    """Collects systems one by one (new descriptions, or rows of an older table) into a table."""

    def __init__(self) -> None:
        self._folders, self._maps, self._sets, self._idx = (_Distinct(), _Distinct(),
                                                            _Distinct(), _Distinct())
        self._backends = _Distinct()
        self._cols: dict[str, list[int]] = {name: [] for name in _COLUMNS if name != "types"}
        self._names: list[bytes] = []
        self._types: list[np.ndarray] = []

    def add(self, meta: SystemMeta) -> None:
        if not isinstance(meta, SystemMeta):
            raise TypeError(f"entry {len(self._names)} of the system descriptions is not a "
                            f"SystemMeta (found {type(meta).__name__})")
        folder, sep, name = meta.address.rpartition("/")
        encoded = name.encode()
        self._names.append(encoded)
        self._push(folder + sep, len(encoded), meta.atom_types, meta.type_map,
                   int(meta.pbc) * _PBC | int(meta.mixed_type) * _MIXED, meta.sets,
                   meta.mixed_idx_map, meta.location.backend)

    def add_row(self, table: SystemTable, row: int) -> None:
        """Row ``row`` of ``table``, copied without making a SystemMeta."""
        c = table._columns
        a, b = table._name_ends[row] - c["name_len"][row], table._name_ends[row]
        self._names.append(table._names[a:b])
        t0, t1 = table._type_ends[row] - c["natoms"][row], table._type_ends[row]
        s0, s1 = table._set_ends[row] - c["nsets"][row], table._set_ends[row]
        self._push(table._folders[c["folder_id"][row]], int(c["name_len"][row]),
                   c["types"][t0:t1], table._type_maps[c["type_map_id"][row]],
                   int(c["flags"][row]), tuple(table._sets[j] for j in c["set_ids"][s0:s1]),
                   table._idx_maps[c["idx_map_id"][row]],
                   table.backend_names[c["backend_id"][row]])

    def _push(self, folder: str, name_len: int, types: np.ndarray, type_map: Any, flags: int,
              sets: tuple[SetMeta, ...], idx_map: Any, backend: str) -> None:
        cols = self._cols
        cols["folder_id"].append(self._folders.id(folder))
        cols["name_len"].append(name_len)
        cols["natoms"].append(len(types))
        self._types.append(types)
        cols["type_map_id"].append(self._maps.id(type_map))
        cols["flags"].append(flags)
        cols["nsets"].append(len(sets))
        cols["set_ids"].extend(self._sets.id(s) for s in sets)
        cols["idx_map_id"].append(self._idx.id(idx_map))
        cols["backend_id"].append(self._backends.id(backend))

    def table(self, origin: str | None = None) -> SystemTable:
        columns = {name: _smallest(values) for name, values in self._cols.items()}
        types = np.concatenate(self._types) if self._types else np.zeros(0, np.int64)
        columns["types"] = types.astype(np.int8 if types.max(initial=0) < 127 else np.int16)
        return SystemTable(columns, b"".join(self._names), tuple(self._folders.values),
                           tuple(self._maps.values), tuple(self._sets.values),
                           tuple(self._idx.values), origin, tuple(self._backends.values))


class SystemTable(Sequence):
    """The descriptions of many systems, in columns; ``table[i]`` is system ``i``'s SystemMeta.

    ``origin`` says where the descriptions come from (the index file, or ``None`` for a fresh
    build), so that a read that finds a changed file can say what to refresh. Each row names
    its storage format (``backend_names``, decided once when the system was described), so a
    check of many rows need not parse every address again.
    """

    def __init__(self, columns: dict[str, np.ndarray], names: bytes, folders: tuple[str, ...],
                 type_maps: tuple[Any, ...], sets: tuple[SetMeta, ...],
                 idx_maps: tuple[Any, ...], origin: str | None = None,
                 backends: tuple[str, ...] = ("npy",)) -> None:
        if "backend_id" not in columns:  # every row of the one format ``backends`` names
            if len(backends) != 1:
                raise ValueError("a table without a backend_id column names one format")
            columns = {**columns, "backend_id": np.zeros(len(columns["natoms"]), np.uint8)}
        self._columns, self._names, self._folders = columns, names, folders
        self._type_maps, self._sets, self._idx_maps = type_maps, sets, idx_maps
        self.backend_names = backends
        self.origin = origin
        self._name_ends = np.cumsum(columns["name_len"], dtype=np.int64)
        self._type_ends = np.cumsum(columns["natoms"], dtype=np.int64)
        self._set_ends = np.cumsum(columns["nsets"], dtype=np.int64)

    @classmethod
    def from_metas(cls, metas: Iterable[SystemMeta], origin: str | None = None) -> SystemTable:
        builder = TableBuilder()
        for meta in metas:
            builder.add(meta)
        return builder.table(origin)

    def parts(self) -> dict[str, Any]:
        """The columns and lookup tables (what :meth:`from_parts` takes back)."""
        return {"columns": self._columns, "names": self._names, "folders": self._folders,
                "type_maps": self._type_maps, "sets": self._sets, "idx_maps": self._idx_maps,
                "backends": self.backend_names}

    @classmethod
    def from_parts(cls, *, columns: dict[str, np.ndarray], names: bytes,
                   folders: tuple[str, ...], type_maps: tuple[Any, ...],
                   sets: tuple[SetMeta, ...], idx_maps: tuple[Any, ...],
                   backends: tuple[str, ...]) -> SystemTable:
        """A table from :meth:`parts` (read from a file): the columns are checked for length."""
        n = len(columns["natoms"])
        for name in ("folder_id", "name_len", "type_map_id", "flags", "nsets", "idx_map_id",
                     "backend_id"):
            if len(columns[name]) != n:
                raise ValueError(f"column {name} has {len(columns[name])} rows, expected {n}")
        if n and int(columns["backend_id"].max()) >= len(backends):
            raise ValueError("a backend_id names no stored format")
        table = cls(columns, names, folders, type_maps, sets, idx_maps, None, backends)
        if (table._type_ends[-1:].sum() != len(columns["types"])
                or table._set_ends[-1:].sum() != len(columns["set_ids"])
                or table._name_ends[-1:].sum() != len(names)):
            raise ValueError("the columns do not add up to the types, sets and names stored")
        return table

    def with_origin(self, origin: str | None) -> SystemTable:
        """The same descriptions, saying they come from ``origin``."""
        return SystemTable(self._columns, self._names, self._folders, self._type_maps,
                           self._sets, self._idx_maps, origin, self.backend_names)

    def relocated(self, move: Callable[[str], str],
                  restate: Callable[[SetMeta], SetMeta] | None = None) -> SystemTable:
        """The same descriptions at other paths: each address's path (the part before ``#``)
        becomes ``move(path)``, asked once per distinct path (a node-local copy of the data);
        ``restate`` rewrites each distinct set, for what a description says of the files it was
        read from (an LMDB group's stamp of its ``data.mdb``)."""
        moved: dict[str, str] = {}
        folders = _Distinct()
        folder_ids, name_lens, names = [], [], []
        for address in self.addresses():
            path, sep, group = address.partition("#")
            target = moved.get(path)
            if target is None:
                target = moved[path] = move(path)
            folder, slash, name = (target + sep + group).rpartition("/")
            encoded = name.encode()
            folder_ids.append(folders.id(folder + slash))
            name_lens.append(len(encoded))
            names.append(encoded)
        columns = {**self._columns, "folder_id": _smallest(folder_ids),
                   "name_len": _smallest(name_lens)}
        sets = self._sets if restate is None else tuple(restate(x) for x in self._sets)
        return SystemTable(columns, b"".join(names), tuple(folders.values), self._type_maps,
                           sets, self._idx_maps, self.origin, self.backend_names)

    def __reduce__(self) -> tuple[Any, ...]:
        # Columns as raw bytes: a pickled ndarray costs ~100 bytes of framing, noticeable for
        # the few systems of a small job.
        raw = tuple((name, col.dtype.str, col.tobytes()) for name, col in self._columns.items())
        return (_from_raw, (raw, self._names, self._folders, self._type_maps, self._sets,
                            self._idx_maps, self.origin, self.backend_names))

    def __len__(self) -> int:
        return len(self._columns["natoms"])

    def __getitem__(self, row: int) -> SystemMeta:  # type: ignore[override]
        if not -len(self) <= row < len(self):
            raise IndexError(f"system {row} out of range for {len(self)} systems")
        return self.meta(int(row) % len(self))

    def __iter__(self) -> Iterator[SystemMeta]:
        return (self.meta(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, SystemTable) and len(self) == len(other)
                and all(a == b for a, b in zip(self, other)))

    __hash__ = None  # type: ignore[assignment]

    def address(self, row: int) -> str:
        c = self._columns
        end = self._name_ends[row]
        name = self._names[end - c["name_len"][row]:end].decode()
        return self._folders[c["folder_id"][row]] + name

    def addresses(self) -> list[str]:
        """Every system's address, in order (decoded in one pass)."""
        text = self._names.decode()
        folders = [self._folders[i] for i in self._columns["folder_id"].tolist()]
        ends = self._name_ends.tolist()
        if len(text) != len(self._names):  # not ASCII: byte offsets are not string offsets
            return [self.address(i) for i in range(len(self))]
        starts = [0] + ends[:-1]
        return [f + text[a:b] for f, a, b in zip(folders, starts, ends)]

    def layouts(self) -> list[tuple[bool, tuple[str, ...]]]:
        """Per system: (has a ``type_map.raw`` of its own, its set names); interned tuples."""
        has_map = [m is not None for m in self._type_maps]
        names = [s.name for s in self._sets]
        ids = self._columns["set_ids"].tolist()
        ends = self._set_ends.tolist()
        maps = self._columns["type_map_id"].tolist()
        seen: dict[tuple[int, tuple[int, ...]], tuple[bool, tuple[str, ...]]] = {}
        out = []
        for row, (end, count) in enumerate(zip(ends, self._columns["nsets"].tolist())):
            key = (maps[row], tuple(ids[end - count:end]))
            layout = seen.get(key)
            if layout is None:
                layout = seen[key] = (has_map[key[0]], tuple(names[j] for j in key[1]))
            out.append(layout)
        return out

    def rows_by_backend(self) -> dict[str, np.ndarray]:
        """The rows of each storage format, by its registered name (ascending rows)."""
        ids = self._columns["backend_id"]
        if len(self.backend_names) == 1:
            return {self.backend_names[0]: np.arange(len(self))} if len(self) else {}
        return {name: np.flatnonzero(ids == i) for i, name in enumerate(self.backend_names)
                if (ids == i).any()}

    def meta(self, row: int) -> SystemMeta:
        """System ``row``'s description (a new object on each call; callers keep it)."""
        c = self._columns
        t0, t1 = self._type_ends[row] - c["natoms"][row], self._type_ends[row]
        types = c["types"][t0:t1].astype(np.int32)
        types.flags.writeable = False
        s0, s1 = self._set_ends[row] - c["nsets"][row], self._set_ends[row]
        flags = int(c["flags"][row])
        return SystemMeta(address=self.address(row),
                          backend=self.backend_names[c["backend_id"][row]], atom_types=types,
                          type_map=self._type_maps[c["type_map_id"][row]],
                          pbc=bool(flags & _PBC), mixed_type=bool(flags & _MIXED),
                          sets=interned(tuple(self._sets[j] for j in c["set_ids"][s0:s1])),
                          mixed_idx_map=self._idx_maps[c["idx_map_id"][row]])

    def set_ids(self, row: int) -> np.ndarray:
        """Positions of system ``row``'s sets in the table of distinct sets (``parts()``)."""
        return self._columns["set_ids"][self._set_ends[row] - self._columns["nsets"][row]:
                                        self._set_ends[row]]

    def has_type_map(self, row: int) -> bool:
        """Whether system ``row`` has a type map of its own (``type_map.raw``)."""
        return self._type_maps[self._columns["type_map_id"][row]] is not None

    def natoms(self) -> np.ndarray:
        """Atoms per system (int64)."""
        return self._columns["natoms"].astype(np.int64)

    def nframes(self) -> np.ndarray:
        """Frames per system (int64): the frames of each system's sets, summed."""
        per_set = np.fromiter((s.nframes for s in self._sets), dtype=np.int64,
                              count=len(self._sets))
        frames = per_set[self._columns["set_ids"].astype(np.int64)]
        starts = self._set_ends - self._columns["nsets"]
        out = np.zeros(len(self), dtype=np.int64)
        has = self._columns["nsets"] > 0
        if has.any():
            out[has] = np.add.reduceat(frames, starts[has])
        return out


def _from_raw(raw: tuple[tuple[str, str, bytes], ...], names: bytes, folders: tuple[str, ...],
              type_maps: tuple[Any, ...], sets: tuple[SetMeta, ...], idx_maps: tuple[Any, ...],
              origin: str | None, backends: tuple[str, ...]) -> SystemTable:
    columns = {name: np.frombuffer(data, dtype=np.dtype(dtype)) for name, dtype, data in raw}
    return SystemTable(columns, names, folders, type_maps, sets, idx_maps, origin, backends)
