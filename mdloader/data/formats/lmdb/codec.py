"""The msgpack values of an LMDB database, as dpdata's ``deepmd/lmdb`` writer stores them and
DeePMD-kit's ``LmdbDataReader`` reads them: maps whose arrays are encoded as
``{"type": dtype name, "shape": [...], "data": C-order bytes}``."""

from __future__ import annotations

from typing import Any

import numpy as np

from mdloader.data.formats.lmdb.environment import entry_of
from mdloader.errors import CorruptFileError


def unpack(raw: Any, what: str, path: str, key: bytes) -> Any:
    """msgpack-decode one entry; a corrupt value is a :class:`CorruptFileError` naming it."""
    import msgpack

    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError) as exc:
        raise CorruptFileError(f"cannot decode {what} (not msgpack)", system=path,
                               file=entry_of(path, key), found=f"{type(exc).__name__}: {exc}"
                               ) from exc


def pack(value: Any) -> bytes:
    """msgpack-encode an entry as dpdata does (binary type for bytes, string keys)."""
    import msgpack

    return msgpack.packb(value, use_bin_type=True)


def is_encoded_array(value: Any) -> bool:
    """Whether ``value`` is an ``{"type", "data"}`` map (string or byte keys)."""
    return isinstance(value, dict) and (("type" in value and "data" in value)
                                        or (b"type" in value and b"data" in value))


def decode_array(value: dict[Any, Any]) -> np.ndarray:
    """An encoded array as a read-only view of its bytes (``shape`` absent: one dimension).

    Raises ``ValueError``/``TypeError`` when the dtype is unknown or the bytes do not fill the
    shape; callers turn that into an error naming the frame.
    """
    def get(name: str) -> Any:
        return value[name] if name in value else value.get(name.encode())

    kind = get("type")
    dtype = np.dtype(kind.decode() if isinstance(kind, bytes) else kind)
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects")
    data = get("data")
    shape = get("shape")
    array = np.frombuffer(data, dtype=dtype)
    return array if shape is None else array.reshape(tuple(shape))


_DTYPE_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """The NumPy name of ``dtype`` (``float64``), as dpdata stores it; cached (``str`` is slow)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """``{"type", "shape", "data"}`` with numpy's dtype name, as dpdata writes it."""
    array = np.asarray(array)  # not ascontiguousarray: it turns a 0-d energy into shape (1,)
    return {"type": dtype_name(array.dtype), "shape": list(array.shape),
            "data": array.tobytes(order="C")}
