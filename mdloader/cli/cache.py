"""``mdloader cache``: show what the cache folder holds, and prune it.

The cache (``$MDLOADER_CACHE_DIR``) holds one folder per kind: ``index/`` (system indexes of data
sections whose ``input.json`` names no ``index_file``) and ``statistics/`` (per-system statistics
entries, one folder per system as its files were). With ``$MDLOADER_STAGE_DIR`` set, the
node-local copies there are a third kind, ``stage`` (:mod:`mdloader.catalog.staging`). ``show``
counts the entries, their bytes and their last use per kind; ``prune`` removes the entries no
given data set uses any more (``--unmatched``) or not used for a number of days
(``--older-than``).

Pruning never breaks a running job that shares the cache: only finished entries are removed,
each renamed away before it is deleted (a reader that has it open keeps reading it, one that
finds it gone computes it again), and a writer's temporary file is never touched.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mdloader.cli.arguments import add_list_option
from mdloader.errors import ConfigError
from mdloader.persist import is_temporary, remove_entry, usage
from mdloader.settings import CACHE_KINDS, cache_folder, resolve

#: The file name ending of an entry of each kind.
SUFFIXES = {"index": ".mdlidx", "statistics": ".mdlstat"}
DAY = 86400.0


@dataclass(frozen=True)
class CacheEntry:
    """One finished entry: its kind, path, size, last use (seconds since the epoch) and what it
    belongs to (an index: its path; a statistics entry: its system's stamp)."""

    kind: str
    path: str
    bytes: int
    last_use: float
    owner: str


def cache_entries(root: str | None = None) -> list[CacheEntry]:
    """Every finished entry of the cache ``root`` (default ``$MDLOADER_CACHE_DIR``)."""
    found = []
    for kind in CACHE_KINDS:
        folder = cache_folder(kind, root)
        for base, _, names in os.walk(folder):
            for name in sorted(names):
                if is_temporary(name) or not name.endswith(SUFFIXES[kind]):
                    continue
                path = os.path.join(base, name)
                facts = usage(path)
                if facts is None:  # removed meanwhile
                    continue
                owner = path if kind == "index" else os.path.basename(base)
                found.append(CacheEntry(kind, path, facts[1], facts[0], owner))
    stage_dir = stage_folder()
    if stage_dir is not None:
        from mdloader.catalog.staging import staged_copies

        found.extend(CacheEntry("stage", c.path, c.bytes, c.last_use, c.source)
                     for c in staged_copies(stage_dir))
    return found


def stage_folder() -> str | None:
    """``$MDLOADER_STAGE_DIR`` (absolute), or ``None`` when no staging is set."""
    folder = str(resolve("stage_dir"))
    return os.path.abspath(os.path.expanduser(folder)) if folder else None


def _kinds() -> list[tuple[str, str]]:
    """(kind, folder) of every kind shown: the cache's, and the stage folder when set."""
    kinds = [(kind, cache_folder(kind, None)) for kind in CACHE_KINDS]
    stage_dir = stage_folder()
    return kinds + ([("stage", stage_dir)] if stage_dir is not None else [])


def show_cache(root: str | None = None, *, as_json: bool = False) -> str:
    """Per kind: the entries, their bytes, and the newest and oldest last use."""
    entries = cache_entries(root)
    rows = []
    for kind, folder in _kinds():
        mine = [e for e in entries if e.kind == kind]
        uses = [e.last_use for e in mine]
        rows.append({"kind": kind, "folder": cache_folder(kind, root) if kind != "stage"
                     else folder, "entries": len(mine),
                     "bytes": sum(e.bytes for e in mine),
                     "last_use": max(uses) if uses else None,
                     "oldest_use": min(uses) if uses else None})
    if as_json:
        return json.dumps(rows, indent=2)
    lines = []
    for r in rows:
        used = (f"last use {_when(r['last_use'])}, oldest {_when(r['oldest_use'])}"
                if r["entries"] else "empty")
        lines.append(f"{r['kind']}: {r['entries']} entries, {_size(r['bytes'])} in "
                     f"{r['folder']} ({used})")
    legacy = os.path.join(cache_folder("index", root), "stats")
    if os.path.isdir(legacy):
        lines.append(f"{legacy} holds the statistics of an older mdloader, which are not read "
                     "any more: it can be deleted")
    return "\n".join(lines)


def prune_cache(root: str | None = None, *, older_than: float | None = None,
                unmatched: Sequence[str] | None = None,
                dry_run: bool = False) -> list[CacheEntry]:
    """Remove the entries not used for ``older_than`` days, and those no data set of the
    ``unmatched`` input.json files uses (either rule removes an entry); returns them.

    ``dry_run``: remove nothing, only say what would go.
    """
    if older_than is None and not unmatched:
        raise ConfigError("say what to prune: --older-than DAYS, --unmatched INPUT_JSON..., "
                          "or both", path="mdloader cache prune")
    if older_than is not None and not (math.isfinite(older_than) and older_than >= 0):
        raise ConfigError(f"expected a finite number of days of at least 0, found "
                          f"{older_than:g}", path="--older-than")
    used = _used(unmatched) if unmatched else None  # first: it may take a while
    entries = cache_entries(root)
    now = time.time()
    doomed = [e for e in entries
              if (older_than is not None and now - e.last_use > older_than * DAY)
              or (used is not None and e.owner not in used)]
    if dry_run:
        return doomed
    removed = [e for e in doomed if _remove(e)]
    for entry in removed:  # an emptied system folder, and its prefix folder, go too
        folder = os.path.dirname(entry.path)
        for _ in range(2 if entry.kind == "statistics" else 0):
            try:
                os.rmdir(folder)  # fails when a writer put something in meanwhile: kept
            except OSError:
                break
            folder = os.path.dirname(folder)
    return removed


def _remove(entry: CacheEntry) -> bool:
    """Remove one entry (a staged copy: its manifest first, then its folder)."""
    if entry.kind != "stage":
        return remove_entry(entry.path)
    from mdloader.catalog.staging import remove_copy, staged_copies

    copies = [c for c in staged_copies(stage_folder() or "") if c.path == entry.path]
    return bool(copies) and remove_copy(copies[0])


def _used(inputs: Sequence[str]) -> set[str]:
    """What the data sets of ``inputs`` use: their index paths, their systems' stamps and
    their systems' containers (what a stage folder holds copies of).

    Their catalogs are obtained as a job's rank 0 would (from the index while it holds), but
    nothing is saved: pruning writes no index.
    """
    from mdloader.catalog.catalog import catalog_for
    from mdloader.catalog.describe import SystemFailed
    from mdloader.catalog.staging import sources_of
    from mdloader.config.input_json import load_config
    from mdloader.loading.build import resolve_workers
    from mdloader.loading.statistics import layout_of
    from mdloader.stats.store import system_stamp

    used: set[str] = set()
    for input_json in inputs:
        config = load_config(input_json)
        type_map = list(config.type_map) if config.type_map else None
        for data in (config.training_data, config.validation_data):
            if data is None:
                continue
            try:
                catalog = catalog_for(list(data.systems), type_map, data.rglob_patterns,
                                      workers=resolve_workers(), progress=False,
                                      index_file=data.index_file, mode="check",
                                      key=data.json_path + ".systems")
            except SystemFailed as failed:
                raise failed.original() from None
            if catalog.index_file is not None:
                used.add(catalog.index_file)
            table = catalog.table
            used.update(system_stamp(address, layout_of(table.meta(row)))
                        for row, address in enumerate(table.addresses()))
            used.update(os.path.abspath(s) for s in sources_of([table]))
    return used


def format_removed(removed: Sequence[CacheEntry], *, dry_run: bool, as_json: bool) -> str:
    """What ``prune`` removed (or would remove), one line per kind."""
    if as_json:
        return json.dumps([asdict(e) for e in removed], indent=2)
    verb = "would remove" if dry_run else "removed"
    lines = []
    for kind, _ in _kinds():
        mine = [e for e in removed if e.kind == kind]
        lines.append(f"{kind}: {verb} {len(mine)} entries, {_size(sum(e.bytes for e in mine))}")
    return "\n".join(lines)


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp))


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return f"{nbytes} B"  # pragma: no cover


# -- the sub-command ----------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader cache``'s parser."""
    p = sub.add_parser("cache", parents=[common], help="show or prune the cache folder",
                       description="Show what the cache folder ($MDLOADER_CACHE_DIR) holds, or "
                       "prune it; a running job that shares the cache is never broken.")
    p.add_argument("action", choices=["show", "prune"],
                   help="show: entries, bytes and last use per kind; prune: remove entries "
                   "by age or by the data sets still in use")
    p.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                   help="prune: remove entries not used for this many days")
    add_list_option(p, "--unmatched", metavar="INPUT_JSON",
                    help="prune: remove entries that no data set of these input.json files "
                    "uses any more (their systems are found and stamped)")
    p.add_argument("--dry-run", action="store_true",
                   help="prune: say what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """Show or prune the cache; exit code 0."""
    if args.action == "show":
        if args.older_than is not None or args.unmatched or args.dry_run:
            raise ConfigError("--older-than, --unmatched and --dry-run are options of prune",
                              path="mdloader cache show")
        print(show_cache(as_json=args.json))
        return 0
    removed = prune_cache(older_than=args.older_than, unmatched=args.unmatched,
                          dry_run=args.dry_run)
    print(format_removed(removed, dry_run=args.dry_run, as_json=args.json))
    return 0
