"""Count the calls and bytes under a data tree in the measured windows of an strace log.

The log comes from ``strace -f -y -ttt -s 0 -e trace=`` :data:`TRACED`: every call that names a
file, the ``fstat`` and ``read`` family on descriptors (``-y`` prints the path behind each
descriptor, so ``read(7</data/sys.3/set.000/coord.npy>, ...)`` is recognised as under the tree),
and the process calls. Every process in the log is the measured one or below it (DataLoader
workers, decoders, threads), and every call is counted: ``-ttt`` gives one clock to all of them,
and the windows are the times between the markers ``fst-<window>-begin``/``-end``
(:func:`benchmarks.probes.marker`). A call interrupted by another thread's (``<unfinished ...>``
then ``<... resumed>``) counts at its start, with the return value of its end.

The calls fall in :data:`KINDS`; a ``newfstatat``/``statx`` of an empty path on a descriptor
(``AT_EMPTY_PATH``: what glibc's ``fstat`` is) is an ``fstat``. Reads through a memory map make
no call and show only in the bytes from storage. ``reopens`` are the opens of a path that the
same process (threads joined to their process through the ``clone`` calls in the log) had
opened before, in the window or earlier since its configuration started reading (the marker
``fst-w<K>-start-begin``; the build's opens come before it): what a steady state shows once
every file has been met, however long a pass is.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

TRACED = "%file,%process,read,pread64,readv,preadv,preadv2,fstat"
KINDS = ("lookups", "opens", "fstats", "reads", "other")
COUNTED = (*KINDS, "reopens")
_LOOKUP = {"stat", "lstat", "newfstatat", "fstatat64", "statx", "access", "faccessat",
           "faccessat2", "readlink", "readlinkat"}
_OPEN = {"open", "openat", "openat2", "creat"}
_READ = {"read", "pread64", "readv", "preadv", "preadv2"}
_NOT_COUNTED = {"execve", "execveat", "clone", "clone3", "fork", "vfork", "exit", "exit_group",
                "wait4", "waitid", "kill", "tgkill"}
_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+) (.*)$")
_CALL = re.compile(r"^([a-z0-9_]+)\((.*)$")
_RESUMED = re.compile(r"^<\.\.\. ([a-z0-9_]+) resumed>(.*)$")
_RETURN = re.compile(r"\) += (-?\d+)")
_CWD = re.compile(r"AT_FDCWD<[^>]*>")
_PATH = re.compile(r'"([^"]*)"')
_MARK = re.compile(r"/\.mdloader-bench-marker/fst-(.+)-(begin|end)-rank0")


def kind_of(name: str, args: str) -> str:
    """Which of :data:`KINDS` a call is."""
    if name in _OPEN:
        return "opens"
    if name in ("fstat", "fstat64") or (name in ("newfstatat", "statx")
                                        and '""' in args and "AT_EMPTY_PATH" in args):
        return "fstats"
    if name in _LOOKUP:
        return "lookups"
    if name in _READ:
        return "reads"
    return "other"


def under(args: str, root: str) -> bool:
    """Whether the call's arguments name ``root`` or a path inside it (the working directory
    shown for ``AT_FDCWD`` excluded)."""
    head = _CWD.sub("AT_FDCWD", args.split("<unfinished")[0])
    bare = root.rstrip("/")
    return bare + "/" in head or f'"{bare}"' in head or f"<{bare}>" in head


def calls(lines: Iterable[str]) -> Iterable[tuple[float, int, str, str, int | None]]:
    """``(start time, thread, name, arguments, return value)`` of every complete call, an
    interrupted one joined to its end."""
    pending: dict[int, tuple[float, str, str]] = {}
    for raw in lines:
        m = _LINE.match(raw.rstrip("\n"))
        if not m:
            continue
        tid, ts, rest = int(m.group(1)), float(m.group(2)), m.group(3)
        resumed = _RESUMED.match(rest)
        if resumed:
            start = pending.pop(tid, None)
            if start is not None:
                # the arguments of both halves: an fstat's AT_EMPTY_PATH may be in the second
                yield (start[0], tid, start[1], start[2] + " " + resumed.group(2),
                       _returned(resumed.group(2)))
            continue
        call = _CALL.match(rest)
        if not call:
            continue
        if rest.endswith("<unfinished ...>"):
            pending[tid] = (ts, call.group(1), call.group(2))
        else:
            yield ts, tid, call.group(1), call.group(2), _returned(call.group(2))


def _returned(text: str) -> int | None:
    m = _RETURN.search(text)
    return None if m is None else int(m.group(1))


def count(lines: Iterable[str], root: str) -> dict[str, dict[str, Any]]:
    """Per window: calls under ``root`` by kind (and ``reopens``) and by name, and the bytes the
    reads among them returned (``bytes_requested``)."""
    events = list(calls(lines))
    marks: dict[str, list[float]] = {}
    process: dict[int, int] = {}  # thread -> the process it belongs to
    for _ts, tid, name, args, ret in events:
        m = _MARK.search(args)
        if m:
            marks.setdefault(m.group(1), [0.0, 0.0])[m.group(2) == "end"] = _ts
        if name in ("clone", "clone3", "fork", "vfork") and ret is not None and ret > 0:
            process[ret] = process.get(tid, tid) if "CLONE_THREAD" in args else ret
    opened_at: dict[tuple[int, str], list[float]] = {}  # (process, path) -> times opened
    for ts, tid, name, args, _ret in events:
        if name in _OPEN and under(args, root):
            path = _PATH.search(args)
            if path:
                opened_at.setdefault((process.get(tid, tid), path.group(1)), []).append(ts)
    out = {}
    for window, (lo, hi) in marks.items():
        if window.endswith("-start"):
            continue
        kinds: Counter[str] = Counter({k: 0 for k in COUNTED})
        names: Counter[str] = Counter()
        requested = 0
        for ts, tid, name, args, ret in events:
            if not lo <= ts <= hi or name in _NOT_COUNTED or not under(args, root):
                continue
            kind = kind_of(name, args)
            kinds[kind] += 1
            names[name] += 1
            if kind == "reads" and ret is not None and ret > 0:
                requested += ret
            if kind == "opens":
                path = _PATH.search(args)
                times = opened_at.get((process.get(tid, tid), path.group(1) if path else ""),
                                      [])
                since = marks.get(window.split("-", 1)[0] + "-start", [0.0])[0]
                kinds["reopens"] += any(since <= t < ts for t in times)
        out[window] = {**dict(kinds), "by_call": dict(names), "bytes_requested": requested}
    return out
