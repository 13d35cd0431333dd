"""Count each rank's file-system calls under the dataset tree during the build, from strace.

The run is traced with ``strace -f -y -ttt --seccomp-bpf -e trace=%file,%process``: every
syscall that takes a file name (open/openat, stat family, access, readlink, ...), plus the process
calls used to map threads and forked children to the rank process that made them. ``-y`` prints
the path behind a directory fd, so ``newfstatat(5</data/sys.1>, "type.raw")`` is recognised as
under the tree. A call counts when its arguments (not its return value, not the working
directory shown for ``AT_FDCWD``) name a path under the data root, between that rank's
``build-begin`` and ``build-end`` markers (:func:`benchmarks.probes.marker`). Directory reads
(``getdents64``) are fd calls, outside ``%file``; each directory listed still shows up as its
``openat``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+) (.*)$")
_CLONE = re.compile(r"^(?:<\.\.\. )?(clone3?|fork|vfork)\b.*= (\d+)$")
_CALL = re.compile(r"^([a-z0-9_]+)\((.*)$")
_CWD = re.compile(r"AT_FDCWD<[^>]*>")
_NOT_COUNTED = {"execve", "execveat", "clone", "clone3", "fork", "vfork", "exit", "exit_group",
                "wait4", "waitid", "kill", "tgkill"}


def parse_trace(path: str, rank_pids: dict[int, int], data_root: str) -> dict[int, dict[str, Any]]:
    """Per rank: number of %file calls under ``data_root`` inside the build window, by syscall."""
    root = data_root.rstrip("/") + "/"
    parent: dict[int, int] = {}
    events: list[tuple[int, float, str, str]] = []
    with open(path, errors="replace") as fh:
        for raw in fh:
            m = _LINE.match(raw.rstrip("\n"))
            if not m:
                continue
            tid, ts, rest = int(m.group(1)), float(m.group(2)), m.group(3)
            c = _CLONE.match(rest)
            if c:
                parent[int(c.group(2))] = tid
                continue
            call = _CALL.match(rest)
            if call:
                events.append((tid, ts, call.group(1), call.group(2)))
    owner = _owner_map(parent, set(rank_pids.values()))
    windows = _windows(events, owner, rank_pids)
    pid_rank = {pid: r for r, pid in rank_pids.items()}
    counts: dict[int, Counter[str]] = {r: Counter() for r in rank_pids}
    for tid, ts, name, args in events:
        pid = owner(tid)
        if pid not in pid_rank or name in _NOT_COUNTED:
            continue
        r = pid_rank[pid]
        lo, hi = windows.get(r, (None, None))
        if lo is None or hi is None or not lo <= ts <= hi:
            continue
        if _under(args, root, data_root):
            counts[r][name] += 1
    return {r: {"fs_calls": sum(c.values()) if None not in windows[r] else None,
                "by_call": dict(c), "window_s": _span(windows[r])}
            for r, c in counts.items()}


def _span(window: tuple[float | None, float | None]) -> float | None:
    lo, hi = window
    return None if lo is None or hi is None else hi - lo


def _under(args: str, root: str, bare_root: str) -> bool:
    """Whether the call's arguments name a path inside the tree (cwd annotations excluded)."""
    head = args.split(") = ")[0].split("<unfinished")[0]
    head = _CWD.sub("AT_FDCWD", head)
    bare = bare_root.rstrip("/")
    return root in head or f'"{bare}"' in head or f"<{bare}>" in head


def _owner_map(parent: dict[int, int], roots: set[int]) -> Any:
    cache: dict[int, int | None] = {}

    def owner(tid: int) -> int | None:
        seen = []
        cur: int | None = tid
        while cur is not None and cur not in roots and cur not in cache:
            seen.append(cur)
            cur = parent.get(cur)
        result = cur if cur in roots else cache.get(cur) if cur is not None else None
        for s in seen:
            cache[s] = result
        return result

    return owner


def _windows(events: list[tuple[int, float, str, str]], owner: Any,
             rank_pids: dict[int, int]) -> dict[int, tuple[float | None, float | None]]:
    out: dict[int, list[float | None]] = {r: [None, None] for r in rank_pids}
    for _tid, ts, _name, args in events:
        if "/.mdloader-bench-marker/" not in args:
            continue
        m = re.search(r"/\.mdloader-bench-marker/build-(begin|end)-rank(\d+)", args)
        if m and int(m.group(2)) in out:
            out[int(m.group(2))][0 if m.group(1) == "begin" else 1] = ts
    return {r: (w[0], w[1]) for r, w in out.items()}
