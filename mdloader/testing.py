"""Small DeePMD systems on demand, for tests, benchmarks and docs.

Everything is deterministic in ``seed``. Broken variants (``broken=...``) produce each defect
the loader must report, so tests state the defect by name instead of hand-editing files.
:func:`make_lmdb` packs generated systems into an LMDB database, with mdloader's writer or
dpdata's. This module sits above the library (it uses the writer); the library never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

BROKEN = ("no_sets", "no_coord", "no_box", "corrupt_header", "truncated", "frame_mismatch",
          "bad_width", "type_outside_map", "empty_type", "mixed_sets")

_WIDTH = {"energy": 1, "virial": 9}  # global keys; everything else named here is per-atom x3


def make_system(
    root: str | os.PathLike[str],
    name: str = "sys",
    *,
    natoms: int = 6,
    nframes: int = 5,
    nsets: int = 1,
    type_map: Sequence[str] | None = ("O", "H"),
    types: Sequence[int] | None = None,
    backend: str = "npy",
    h5_file: str = "data.h5",
    pbc: bool = True,
    mixed_type: bool = False,
    keys: Sequence[str] = ("energy", "force", "virial"),
    extra_keys: dict[str, np.ndarray] | None = None,
    one_frame_1d: bool = False,
    seed: int = 0,
    dtype: type = np.float32,
    broken: str | None = None,
) -> str:
    """Write one system and return its address.

    ``types`` (which then fixes ``natoms``) defaults to a mix of ``len(type_map)`` types;
    ``extra_keys`` maps a key to an array of shape ``(nframes, width)`` written as is;
    ``nsets`` splits the frames as evenly as possible. ``broken`` is one of :data:`BROKEN`.
    """
    rng = np.random.default_rng(seed)
    ntypes = len(type_map) if type_map else 2
    natoms = len(types) if types is not None else natoms
    atom_types = np.asarray(types if types is not None else np.arange(natoms) % ntypes)
    if broken == "type_outside_map":
        atom_types = atom_types.copy()
        atom_types[-1] = ntypes
    arrays = _frame_arrays(rng, natoms, nframes, keys, pbc, dtype)
    if mixed_type:
        arrays["real_atom_types"] = np.stack([rng.permutation(atom_types) for _ in range(nframes)])
        atom_types = np.zeros(natoms, dtype=int)
    arrays.update(extra_keys or {})
    files = _layout(arrays, atom_types, type_map, nframes, nsets, pbc, broken, one_frame_1d)
    if backend == "npy":
        return _write_npy(os.path.join(os.fspath(root), name), files, broken)
    if backend == "hdf5":
        return _write_h5(os.path.join(os.fspath(root), h5_file), name, files, broken)
    raise ValueError(f"backend must be 'npy' or 'hdf5', got {backend!r}")


def _frame_arrays(rng: np.random.Generator, natoms: int, nframes: int, keys: Sequence[str],
                  pbc: bool, dtype: type) -> dict[str, np.ndarray]:
    cell = 2.0 * natoms ** (1 / 3) + 2.0
    arrays = {"coord": (rng.random((nframes, natoms * 3)) * cell).astype(dtype)}
    if pbc:
        arrays["box"] = np.tile(np.diag([cell] * 3).reshape(1, 9), (nframes, 1)).astype(dtype)
    for key in keys:
        width = _WIDTH.get(key, 3 * natoms)
        arrays[key] = rng.normal(size=(nframes, width)).astype(dtype)
    return arrays


def _layout(arrays: dict[str, np.ndarray], atom_types: np.ndarray,
            type_map: Sequence[str] | None, nframes: int, nsets: int, pbc: bool,
            broken: str | None, one_frame_1d: bool) -> dict[str, object]:
    """Relative file name -> content (arrays for npy files, text for .raw, None for markers)."""
    files: dict[str, object] = {}
    files["type.raw"] = "" if broken == "empty_type" else " ".join(map(str, atom_types)) + "\n"
    if type_map:
        files["type_map.raw"] = "\n".join(type_map) + "\n"
    if not pbc:
        files["nopbc"] = None
    if broken == "no_sets":
        return files
    bounds = np.linspace(0, nframes, nsets + 1).astype(int)
    for i in range(nsets):
        for key, arr in arrays.items():
            part = arr[bounds[i]:bounds[i + 1]]
            if one_frame_1d and len(part) == 1:
                part = part[0] if key != "energy" else part.reshape(())
            files[f"set.{i:03d}/{key}.npy"] = part
    _break(files, broken)
    return files


def _break(files: dict[str, object], broken: str | None) -> None:
    if broken == "no_coord":
        del files["set.000/coord.npy"]
    elif broken == "no_box":
        files.pop("set.000/box.npy", None)
    elif broken == "frame_mismatch":
        files["set.000/energy.npy"] = files["set.000/energy.npy"][:-1]
    elif broken == "bad_width":
        files["set.000/force.npy"] = files["set.000/force.npy"][:, :-3]
    elif broken == "mixed_sets":
        files.pop("set.001/real_atom_types.npy", None)
    elif broken is not None and broken not in BROKEN:
        raise ValueError(f"unknown broken variant {broken!r}; known: {BROKEN}")


def _write_npy(path: str, files: dict[str, object], broken: str | None) -> str:
    os.makedirs(path, exist_ok=True)
    for rel, content in files.items():
        full = os.path.join(path, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if isinstance(content, np.ndarray):
            np.save(full, content)
        else:
            with open(full, "w") as fh:
                fh.write(content or "")
    coord = os.path.join(path, "set.000", "coord.npy")
    if broken == "corrupt_header":
        with open(coord, "r+b") as fh:
            fh.write(b"\x00NOTNPY\x00\x00\x00")
    elif broken == "truncated":
        size = os.path.getsize(coord)
        with open(coord, "r+b") as fh:
            fh.truncate(size - 8)
    return path


def _write_h5(path: str, group: str, files: dict[str, object], broken: str | None) -> str:
    import h5py

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with h5py.File(path, "a") as fh:
        base = fh.require_group(group) if group else fh
        for rel, content in files.items():
            if rel == "type.raw":
                base.create_dataset(rel, data=np.array(str(content).split(), dtype=np.int64))
            elif rel == "type_map.raw":
                base.create_dataset(rel, data=np.array(str(content).split(), dtype="S"))
            elif rel == "nopbc":
                base.create_dataset(rel, data=True)
            else:
                base.create_dataset(rel, data=content)
    return f"{path}#/{group}" if group else f"{path}#/"


def make_dataset(
    root: str | os.PathLike[str], nsys: int, *, natoms_range: tuple[int, int] = (3, 24),
    nframes: int = 20, seed: int = 0, backend: str = "npy",
    keys: Sequence[str] = ("energy", "force"),
) -> list[str]:
    """``nsys`` O/H systems with natoms drawn from ``natoms_range`` (inclusive); their addresses."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(natoms_range[0], natoms_range[1] + 1, size=nsys)
    width = len(str(max(nsys - 1, 1)))
    return [make_system(root, f"sys.{i:0{width}d}", natoms=int(n), nframes=nframes,
                        seed=seed * 1_000_003 + i, backend=backend, keys=keys,
                        h5_file="dataset.h5")
            for i, n in enumerate(sizes)]


LMDB_BROKEN = ("no_metadata", "corrupt_metadata", "nframes_mismatch", "nlocs_mismatch",
               "missing_frame", "corrupt_frame", "bad_array", "bad_type_id", "atoms_mismatch")


def make_lmdb(path: str | os.PathLike[str], systems: Sequence[str], *,
              type_map: Sequence[str] | None = None, writer: str = "mdloader",
              drop_metadata: Sequence[str] = (), broken: str | None = None) -> str:
    """Write the systems at ``systems`` (e.g. made by :func:`make_system`) into an LMDB database.

    ``writer`` is ``"mdloader"``
    (:class:`~mdloader.data.formats.lmdb.writer.LmdbWriter`, one system id
    per system, in the order given) or ``"dpdata"`` (dpdata's ``dump_systems``, for
    cross-checks). ``drop_metadata`` removes keys from ``__metadata__`` (e.g. ``frame_nlocs``);
    ``broken`` is one of :data:`LMDB_BROKEN`. Returns the database path.
    """
    path = os.path.abspath(os.fspath(path))
    if writer == "mdloader":
        _write_lmdb_mdloader(path, systems, type_map)
    elif writer == "dpdata":
        _write_lmdb_dpdata(path, systems, type_map)
    else:
        raise ValueError(f"writer must be 'mdloader' or 'dpdata', got {writer!r}")
    if drop_metadata or broken:
        _edit_lmdb(path, drop_metadata, broken)
    return path


def _write_lmdb_mdloader(path: str, systems: Sequence[str],
                         type_map: Sequence[str] | None) -> None:
    from mdloader.data.formats.lmdb.sources import element_names, system_chunks
    from mdloader.data.formats.lmdb.writer import LmdbWriter
    from mdloader.data.system import build_system_meta

    metas = [build_system_meta(s) for s in systems]
    names = [element_names(m, type_map) for m in metas]
    elements = list(type_map) if type_map else list(dict.fromkeys(n for ns in names for n in ns))
    with LmdbWriter(path, elements, overwrite=True) as out:
        for meta, meta_names in zip(metas, names):
            sid = out.new_system()
            for chunk in system_chunks(meta, meta_names):
                out.write(sid, chunk)


def _write_lmdb_dpdata(path: str, systems: Sequence[str],
                       type_map: Sequence[str] | None) -> None:
    import dpdata
    from dpdata.data_type import Axis, DataType
    from dpdata.formats.deepmd.lmdb import dump_systems

    # dpdata's npy reader loads fparam/aparam only once they are registered (process-wide)
    shapes = {"fparam": (Axis.NFRAMES, -1), "aparam": (Axis.NFRAMES, Axis.NATOMS, -1)}
    for name, shape in shapes.items():
        for cls in (dpdata.System, dpdata.LabeledSystem):
            cls.register_data_type(DataType(name, np.ndarray, shape, required=False))
    loaded = [dpdata.LabeledSystem(s, fmt="deepmd/npy") for s in systems]
    dump_systems(loaded, path, type_map=list(type_map) if type_map else None)


def _edit_lmdb(path: str, drop: Sequence[str], broken: str | None) -> None:
    """Rewrite entries in place to produce a defect (tests only: no atomicity needed)."""
    import lmdb
    import msgpack

    if broken is not None and broken not in LMDB_BROKEN:
        raise ValueError(f"unknown broken variant {broken!r}; known: {LMDB_BROKEN}")
    env = lmdb.open(path, map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            meta = msgpack.unpackb(txn.get(b"__metadata__"), raw=False)
            for key in drop:
                meta.pop(key, None)
            key0 = format(0, meta.get("frame_idx_fmt", "012d")).encode()
            frame0 = msgpack.unpackb(txn.get(key0), raw=False)
            _break_lmdb(txn, meta, key0, frame0, broken)
    finally:
        env.close()


def _break_lmdb(txn: object, meta: dict, key0: bytes, frame0: dict, broken: str | None) -> None:
    import msgpack

    def put(key: bytes, value: object) -> None:
        txn.put(key, value if isinstance(value, bytes) else msgpack.packb(value, use_bin_type=True))

    if broken == "nframes_mismatch":
        meta["nframes"] += 1
    elif broken == "nlocs_mismatch":
        meta["frame_nlocs"] = meta["frame_nlocs"][:-1]
    elif broken == "missing_frame":
        txn.delete(format(meta["nframes"] // 2, meta.get("frame_idx_fmt", "012d")).encode())
        put(b"zzz_stray", {})
    elif broken == "corrupt_frame":
        put(key0, b"\xc1 not msgpack")
    elif broken == "bad_array":
        frame0["coords"]["data"] = frame0["coords"]["data"][:-8]
        put(key0, frame0)
    elif broken == "bad_type_id":
        types = np.frombuffer(frame0["atom_types"]["data"], dtype=np.int32).copy()
        types[0] = len(meta["type_map"]) + 3
        frame0["atom_types"]["data"] = types.tobytes()
        put(key0, frame0)
    elif broken == "atoms_mismatch":
        meta["frame_nlocs"][0] += 1
    if broken == "no_metadata":
        txn.delete(b"__metadata__")
    elif broken == "corrupt_metadata":
        put(b"__metadata__", b"\x93\x01")
    else:
        put(b"__metadata__", meta)
