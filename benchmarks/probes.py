"""Measurement probes used inside one benchmark rank.

Both loaders are measured with the same probes so that their numbers compare:

* collectives are counted at the transport level: ``torch.distributed.broadcast`` (which
  ``broadcast_object_list`` calls for its size and payload tensors) and the other tensor
  collectives are wrapped, and every call records its tensor bytes and its start/end time on the
  machine-wide monotonic clock (so rank 0's send can be lined up with rank 1's receive);
* memory is read from ``/proc/self/status``; the kernel's peak (``VmHWM``) is reset at the
  baseline through ``/proc/self/clear_refs`` so that the peak covers the build only;
* the file-system probe is external (strace); this module only emits *marker* calls, ``stat`` of
  a path that cannot exist, which bracket the build in the trace of each rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks import REPO

MARKER_DIR = "/.mdloader-bench-marker"
_COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor",
                "reduce", "scatter", "gather", "send", "recv")


@dataclass
class CollectiveLog:
    """Every tensor collective made by this process while the probe was installed."""

    calls: list[tuple[str, int, float, float]] = field(default_factory=list)
    """(name, bytes, start, end) per call; times from ``time.monotonic``."""

    def summary(self, since: float = 0.0) -> dict[str, Any]:
        """Bytes and windows of the calls that started at or after ``since``."""
        sel = [c for c in self.calls if c[2] >= since]
        bcast = [c for c in sel if c[0] == "broadcast"]
        return {
            "bcast_calls": len(bcast),
            "bcast_bytes": sum(c[1] for c in bcast),
            "bcast_first_start": min((c[2] for c in bcast), default=None),
            "bcast_last_end": max((c[3] for c in bcast), default=None),
            "bcast_inside_s": sum(c[3] - c[2] for c in bcast),
            "other_coll_calls": len(sel) - len(bcast),
            "other_coll_bytes": sum(c[1] for c in sel if c[0] != "broadcast"),
        }


def _tensor_bytes(obj: Any) -> int:
    """Bytes of a tensor or of a list of tensors (all_gather's output list is not counted)."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return int(obj.element_size() * obj.numel())
    return 0


def install_collective_probe() -> CollectiveLog:
    """Wrap the tensor collectives of ``torch.distributed`` (module and ``distributed_c10d``).

    It must run before the measured package is imported, in case that package binds the
    functions by name at import time.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    log = CollectiveLog()
    for name in _COLLECTIVES:
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        wrapped = _wrap(name, orig, log)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is orig:
            setattr(dist, name, wrapped)
    return log


def _wrap(name: str, orig: Callable[..., Any], log: CollectiveLog) -> Callable[..., Any]:
    def wrapped(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        out = orig(tensor, *args, **kwargs)
        log.calls.append((name, _tensor_bytes(tensor), t0, time.monotonic()))
        return out

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def proc_status_kib(field_name: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return -1


def read_bytes() -> int:
    """Bytes this process (all its threads) caused to be read from storage
    (``/proc/self/io`` ``read_bytes``; page-cache hits are not counted); -1 if unavailable."""
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter of this process (Linux ``clear_refs`` value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def marker(name: str, rank: int) -> float:
    """Emit a file-system marker for the strace parser and return the monotonic time."""
    try:
        os.stat(f"{MARKER_DIR}/{name}-rank{rank}")
    except OSError:
        pass
    return time.monotonic()


def scrubbed(text: str) -> str:
    """``text`` (log lines) with every path in the repository written relative to it and the
    home folder written ``~``, wherever they occur."""
    return text.replace(REPO + "/", "").replace(os.path.expanduser("~") + "/", "~/")


def shown(value: str) -> str:
    """``value`` as results record it: paths in the repository relative to it, the home folder
    written ``~``, so that no record names a path of the machine it ran on."""
    for prefix, short in ((REPO + "/", ""), (os.path.expanduser("~") + "/", "~/")):
        if prefix != "//" and value.startswith(prefix):
            return short + value[len(prefix):]
    return value


def memory_mib(pid: int | str = "self") -> dict[str, float]:
    """RSS of a process, split into anonymous memory (its own) and file pages (the database's
    and the libraries' pages it maps: shared with every process mapping them)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                name = line.split(":")[0]
                if name in ("VmRSS", "RssAnon", "RssFile"):
                    out[name] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def children_memory_mib() -> list[dict[str, float]]:
    """:func:`memory_mib` of every process below this one (DataLoader workers, decoders)."""
    import psutil

    return [memory_mib(child.pid) for child in psutil.Process().children(recursive=True)]
