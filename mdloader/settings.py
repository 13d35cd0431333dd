"""Every tunable setting in one table: an argument, else an environment variable, else a default.

Each setting is declared once (:data:`SETTINGS`) with the variable that sets it, its default and
one sentence on what it controls; :func:`resolve` parses and validates it the same way
everywhere, and a bad value is a :class:`~mdloader.errors.ConfigError` naming the argument or
the variable. ``docs/hpc.md`` documents every variable (a test checks it).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from mdloader.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """One tunable: ``env`` overrides ``default`` unless an explicit argument is given.

    Numbers have a ``minimum``; words (``parse=str``) may list their ``choices``.
    """

    env: str
    default: Callable[[], float | str]
    parse: Callable[[str], float | str]
    minimum: float | None
    unit: str
    meaning: str
    choices: tuple[str, ...] = ()


#: Descriptors DeePMD-kit leaves free beside its cache of open files (``deepmd/env.py``).
_FREE_DESCRIPTORS = 128
#: The soft limit asked for when the hard one is unlimited.
_UNLIMITED_ASK = 1 << 20
_raised: list[tuple[int, int]] = []  # (from, to), once per process (a forked child inherits it)


def raise_open_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit, once; the soft limit now.

    A default ``ulimit -n`` of 1024 would otherwise cap the files a reader keeps open, and every
    file beyond it would be opened again at each use: metadata traffic on a shared file system.
    One log line says from and to; forked DataLoader workers inherit the raised limit.
    """
    try:
        import resource
    except ImportError:
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _raised or soft == resource.RLIM_INFINITY:
        return _UNLIMITED_ASK if soft == resource.RLIM_INFINITY else soft
    want = _UNLIMITED_ASK if hard == resource.RLIM_INFINITY else hard
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as exc:
            logging.getLogger(__name__).warning(
                "cannot raise the soft open-file limit (ulimit -n) from %d to %d: %s", soft,
                want, exc)
            want = soft
        else:
            logging.getLogger(__name__).info(
                "raised the soft open-file limit (ulimit -n) from %d to %d, the hard limit, so "
                "that data files stay open", soft, want)
    _raised.append((soft, max(soft, want)))
    return max(soft, want)


def _open_file_share() -> int:
    """Files one process keeps open: DeePMD-kit's rule (the soft limit less 128, or half of a
    small one) on the soft limit raised to the hard one (:func:`raise_open_file_limit`)."""
    soft = raise_open_file_limit()
    if soft > _FREE_DESCRIPTORS + 512:
        return soft - _FREE_DESCRIPTORS
    return max(16, soft // 2)


def _cache_root() -> str:
    """``$XDG_CACHE_HOME/mdloader``, else ``~/.cache/mdloader``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mdloader")


SETTINGS: dict[str, Setting] = {
    "build_timeout": Setting(
        "MDLOADER_BUILD_TIMEOUT", lambda: 1800.0, float, 1e-3, "second",
        "How long the other ranks wait for rank 0 to discover and describe the systems."),
    "collective_timeout": Setting(
        "MDLOADER_COLLECTIVE_TIMEOUT", lambda: 300.0, float, 1e-3, "second",
        "How long a rank waits in any other collective of mdloader: a batch of "
        "BroadcastingDataLoader, a gather of loader states for a checkpoint, the statistics, "
        "validation, box-check and stop-flag exchanges of `mdloader train`."),
    "group_timeout": Setting(
        "MDLOADER_GROUP_TIMEOUT", lambda: 600.0, float, 1e-3, "second",
        "The timeout of the process group that mdloader starts: how long a rank waits in a "
        "collective of training (DDP's gradient all-reduce, the loss averages) for the others; "
        "NCCL's watchdog aborts a stuck collective after it."),
    "stop_check_steps": Setting(
        "MDLOADER_STOP_CHECK_STEPS", lambda: 10, int, 1, "step",
        "How often the ranks of `mdloader train` and `mdloader dp` exchange a stop flag "
        "(SIGTERM, SIGUSR1): every this many steps; the checkpoint comes at most this many steps "
        "after the signal."),
    "stall_report": Setting(
        "MDLOADER_STALL_REPORT", lambda: 0, int, 0, "step",
        "How often rank 0 of `mdloader train` and `mdloader dp` reports the data stalls of every "
        "rank (one line, one JSON line in stalls.jsonl beside lcurve.out; one gather each): "
        "every this many steps; 0: every disp_freq steps, with lcurve.out."),
    "task_draw": Setting(
        "MDLOADER_TASK_DRAW", lambda: "per-rank", str, None, "mode",
        "How `mdloader dp` picks the task of each multi-task step: each rank its own draw "
        "(per-rank, DeePMD-kit's rule) or the same task on every rank (same).",
        choices=("per-rank", "same")),
    "dp_workers": Setting(
        "MDLOADER_DP_WORKERS", lambda: "one", str, None, "mode",
        "How `mdloader dp` reads the trainer's data streams: one pool of DeePMD-kit's "
        "NUM_WORKERS DataLoader workers for every task and role (one) or a pool of NUM_WORKERS "
        "per task and role, DeePMD-kit's arrangement (per-loader).",
        choices=("one", "per-loader")),
    "build_workers": Setting(
        "MDLOADER_BUILD_WORKERS", lambda: 32, int, 1, "thread",
        "Most threads rank 0 uses to walk the tree, describe systems and check an index when "
        "it measures that the file system makes them wait (processes for large CPU-bound "
        "builds: at most one per core)."),
    "index_mode": Setting(
        "MDLOADER_INDEX", lambda: "check", str, None, "mode",
        "What rank 0 does with a saved system index: check it is still true and use it "
        "(check), rebuild it (refresh), use it unchecked (trust), or neither read nor write "
        "one (off).", choices=("check", "refresh", "trust", "off")),
    "cache_dir": Setting(
        "MDLOADER_CACHE_DIR", _cache_root, str, None, "folder",
        "The cache folder: system indexes in its index/ (when input.json or the index_file= "
        "argument names none), per-system statistics in its statistics/; `mdloader cache` "
        "shows and prunes it."),
    "stats_mode": Setting(
        "MDLOADER_STATS", lambda: "check", str, None, "mode",
        "What the statistics before training do with their per-system cache "
        "($MDLOADER_CACHE_DIR/statistics): use entries whose data is unchanged (check), compute "
        "everything again and overwrite them (refresh), or neither read nor write (off).",
        choices=("check", "refresh", "off")),
    "stat_frames": Setting(
        "MDLOADER_STAT_FRAMES", lambda: "sample", str, None, "mode",
        "Which frames the statistics before training (descriptor davg/dstd, energy bias and "
        "out_std of `mdloader dp`; the energy bias and feature scales of `mdloader train`) "
        "read: each system's first data_stat_nbatch batches of a one-rank job (sample, "
        "DeePMD-kit's rule) or every frame of every training system (all: exact, independent "
        "of the sample).", choices=("sample", "all")),
    "index_settle": Setting(
        "MDLOADER_INDEX_SETTLE", lambda: 2.0, float, 0.0, "second",
        "A file changed less than this long before an index was built counts as changed at "
        "the next start (file times are coarse, and clocks differ between machines)."),
    "max_open_files": Setting(
        "MDLOADER_MAX_OPEN_FILES", _open_file_share, int, 1, "file",
        "npy files one process keeps open, each a file descriptor read with pread (default: "
        "DeePMD-kit's rule, the soft ulimit -n less 128, after raising it to the hard limit)."),
    "direct_reads": Setting(
        "MDLOADER_DIRECT_READS", lambda: "0", str, None, "mode",
        "1: npy rows, and rows of contiguous, unfiltered HDF5 datasets, are read with "
        "O_DIRECT, around the page cache, at the file system's block size (a data set larger "
        "than the node's memory: bytes from storage near the rows asked for, not whole 4 KiB "
        "pages); 0: through the page cache (a warm data set stays in memory). A file system "
        "that refuses O_DIRECT, and a chunked or compressed HDF5 dataset, are read through the "
        "page cache.",
        choices=("0", "1")),
    "num_workers": Setting(
        "NUM_WORKERS", lambda: min(4, os.cpu_count() or 1), int, 0, "worker",
        "DataLoader worker processes per rank (DeePMD-kit's variable, with its default); it "
        "also sets the outer epoch length, total_batch x max(NUM_WORKERS, 1)."),
    "torch_threads": Setting(
        "MDLOADER_TORCH_THREADS", lambda: 0, int, 0, "thread",
        "Intra-op threads of torch in each rank's main process of `mdloader train`/`bench`; "
        "0: OMP_NUM_THREADS if set, else the cores available // (ranks on the node x "
        "(1 + DataLoader workers)), at least 1."),
    "max_open_h5": Setting(
        "MDLOADER_MAX_OPEN_H5", lambda: 32, int, 1, "file",
        "HDF5 files one process keeps open."),
    "max_open_lmdb": Setting(
        "MDLOADER_MAX_OPEN_LMDB", lambda: 16, int, 1, "database",
        "LMDB databases one process keeps open (each maps its file and holds a descriptor)."),
    "stage_dir": Setting(
        "MDLOADER_STAGE_DIR", lambda: "", str, None, "folder",
        "A node-local folder ($SLURM_TMPDIR, /local, /dev/shm) to which the first rank of each "
        "node copies the job's data before step 1, every rank then reading the copy; empty: "
        "read the shared tree (no staging)."),
    "stage_bytes": Setting(
        "MDLOADER_STAGE_BYTES", lambda: 0, int, 0, "byte",
        "Most bytes the staged copies in $MDLOADER_STAGE_DIR may hold, this job's and others'; "
        "0: as much as the free space allows."),
}


def resolve(name: str, value: float | str | None = None, *,
            argument: str | None = None) -> float | str:
    """``value`` if given, else ``$ENV`` if set and not empty, else the default of ``name``.

    ``argument`` names the explicit value in errors (default: the setting's name).
    """
    spec = SETTINGS[name]
    where, raw = (argument or name, value) if value is not None else (spec.env,
                                                                       os.environ.get(spec.env))
    if raw is None or raw == "":
        return spec.default()
    if spec.parse is str:
        if spec.choices and raw not in spec.choices:
            raise ConfigError(f"expected one of {', '.join(spec.choices)}, found {raw!r}",
                              path=where)
        return str(raw)
    try:
        parsed = spec.parse(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        kind = "a whole number" if spec.parse is int else "a number"
        raise ConfigError(f"expected {kind} of {spec.unit}s, found {raw!r}", path=where) from None
    if spec.minimum is not None and not parsed >= spec.minimum:
        unit = spec.unit if spec.minimum == 1 else spec.unit + "s"
        raise ConfigError(f"expected at least {spec.minimum:g} {unit}, found {raw!r}",
                          path=where)
    return parsed


@functools.cache
def _cached(name: str, raw: str | None) -> float | str:
    return resolve(name)


def cached(name: str) -> float | str:
    """:func:`resolve` without an argument, re-read only when the variable changes (hot paths)."""
    return _cached(name, os.environ.get(SETTINGS[name].env))


#: What the cache folder holds, one sub-folder each: system indexes, per-system statistics.
CACHE_KINDS = ("index", "statistics")


def cache_folder(kind: str, root: str | None = None) -> str:
    """The folder of ``kind`` (one of :data:`CACHE_KINDS`) in the cache ``root`` (default:
    ``$MDLOADER_CACHE_DIR``), absolute."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"no cache kind {kind!r}: expected one of {', '.join(CACHE_KINDS)}")
    base = str(resolve("cache_dir", root, argument="cache_dir"))
    return os.path.join(os.path.abspath(os.path.expanduser(base)), kind)
