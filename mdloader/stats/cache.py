"""Per-system cache entries of partial statistics: a key and a (de)serialisation, no storage.

The key is a SHA-256 digest of everything a partial result depends on: the system's freshness
stamp (opaque, given by the caller), the kind of statistics, their settings (``rcut``,
``rcut_smth``, ``sel``, descriptor type and options), the type map and which frames entered.
Payloads are msgpack maps with arrays as (dtype, shape, raw bytes), floats as IEEE doubles, so
a result read back is bit-identical; nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from mdloader.errors import CorruptFileError
from mdloader.stats.env_mat import EnvMatSums
from mdloader.stats.moments import FeatureMoments
from mdloader.stats.neighbours import Finding, NeighbourStats
from mdloader.stats.output import OutputSamples

#: Bumped when a statistic's definition changes: older entries then miss.
FORMAT = 1


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, np.ndarray):
        return _canonical(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value).hex()  # exact, and inf/nan representable
    if isinstance(value, bytes):
        return value.hex()
    return value


def frames_digest(frames: Sequence[int] | None) -> str:
    """``"all"`` or a digest of the sorted distinct frame ids."""
    if frames is None:
        return "all"
    ids = np.unique(np.asarray(frames, dtype=np.int64))
    return hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()


def cache_key(stamp: str | bytes | int, kind: str, settings: Mapping[str, Any],
              type_map: Sequence[str] | None, frames: Sequence[int] | None = None) -> str:
    """The hex digest naming one system's partial ``kind`` statistics under ``settings``."""
    body = {"format": FORMAT, "stamp": _canonical(stamp), "kind": kind,
            "settings": _canonical(dict(settings)),
            "type_map": None if type_map is None else list(type_map),
            "frames": frames_digest(frames)}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _array(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _unarray(d: Mapping[str, Any]) -> np.ndarray:
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def dumps(result: NeighbourStats | EnvMatSums | OutputSamples | FeatureMoments) -> bytes:
    """The msgpack bytes of a partial result, as the statistics cache stores them."""
    if isinstance(result, NeighbourStats):
        body = {"kind": "neighbours", "rcut": result.rcut, "mixed_type": result.mixed_type,
                "max_neighbours": list(result.max_neighbours),
                "min_distance2": result.min_distance2,
                "findings": [[f.system, f.file, f.frame, f.message] for f in result.findings]}
    elif isinstance(result, EnvMatSums):
        body = {"kind": "env_mat", "number": _array(result.number),
                "total": _array(result.total), "squared": _array(result.squared),
                "frames": result.frames}
    elif isinstance(result, OutputSamples):
        body = {"kind": "output", "key": result.key, "counts": _array(result.counts),
                "labels": _array(result.labels), "positions": _array(result.positions)}
    elif isinstance(result, FeatureMoments):
        body = {"kind": "moments", "count": result.count, "total": _array(result.total),
                "squared": _array(result.squared)}
    else:
        raise TypeError(f"no cache format for {type(result).__name__}")
    return msgpack.packb({"format": FORMAT, **body}, use_bin_type=True)


def loads(payload: bytes, *, source: str | None = None
          ) -> NeighbourStats | EnvMatSums | OutputSamples | FeatureMoments:
    """The partial result of :func:`dumps` bytes; ``source`` names the entry in errors."""
    try:
        body = msgpack.unpackb(payload, raw=False)
        if body.get("format") != FORMAT:
            raise CorruptFileError("cache entry of another format", file=source,
                                   expected=f"format {FORMAT}", found=body.get("format"))
        kind = body["kind"]
        if kind == "neighbours":
            return NeighbourStats(float(body["rcut"]), bool(body["mixed_type"]),
                                  tuple(int(v) for v in body["max_neighbours"]),
                                  float(body["min_distance2"]),
                                  tuple(Finding(*f) for f in body["findings"]))
        if kind == "env_mat":
            return EnvMatSums(_unarray(body["number"]), _unarray(body["total"]),
                              _unarray(body["squared"]), int(body["frames"]))
        if kind == "output":
            return OutputSamples(body["key"], _unarray(body["counts"]),
                                 _unarray(body["labels"]), _unarray(body["positions"]))
        if kind == "moments":
            return FeatureMoments(int(body["count"]), _unarray(body["total"]),
                                  _unarray(body["squared"]))
        raise CorruptFileError("cache entry of an unknown kind", file=source,
                               expected="neighbours, env_mat, output or moments", found=kind)
    except CorruptFileError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError,
            msgpack.UnpackException) as exc:
        raise CorruptFileError("cache entry cannot be read", file=source,
                               expected="a msgpack statistics entry",
                               found=f"{type(exc).__name__}: {exc}") from None

