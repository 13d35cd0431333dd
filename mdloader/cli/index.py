"""``mdloader index``: build, refresh or inspect the system indexes of an ``input.json``.

For people who prepare data once and train many times: ``mdloader index build input.json`` on a
login node describes every training and validation system and saves their indexes (the files
named by ``index_file`` in the data sections, else in ``$MDLOADER_CACHE_DIR``), so that every job
starts from them; ``refresh`` describes everything again; ``inspect`` says what an index holds and
what changed since, without writing anything.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from mdloader.catalog.catalog import catalog_for
from mdloader.catalog.freshness import check_saved
from mdloader.catalog.index import index_request, inspect, load
from mdloader.catalog.index_file import MAGIC, IndexFileError, open_index, read_index
from mdloader.config.input_json import Config, DataConfig
from mdloader.config.multitask import JobConfig, load_job
from mdloader.data.formats import backend_of
from mdloader.fs_calls import Overlap
from mdloader.settings import resolve
from mdloader.world import World


@dataclass
class IndexSummary:
    """One data section's index after ``build``/``refresh``, or as ``inspect`` found it."""

    section: str
    path: str
    state: str  # built, unchanged, updated, missing, unusable, changed
    systems: int = 0
    frames: int = 0
    changed: int = 0  # systems changed since the index was saved (inspect)
    described: int = 0
    reused: int = 0
    seconds: float = 0.0
    #: systems of a format whose descriptions an index does not keep (LMDB groups: the
    #: database's own metadata is read at every start instead, which is as cheap)
    unindexed: int = 0


def run_index(action: str, target: str, *, as_json: bool) -> int:
    """``mdloader index ACTION TARGET``: print the summary; the exit code (inspect: 1 when an
    index is missing, unusable or out of date)."""
    if not World.from_env().is_main:  # under torchrun: rank 0 does it once
        return 0
    if action == "inspect":
        rows = inspect_target(target)
        print(format_summaries(rows, as_json))
        return 0 if all(r["state"] == "unchanged" for r in rows) else 1
    summaries = build_indexes(load_job(target), refresh=action == "refresh")
    print(format_summaries(summaries, as_json))
    return 0


def build_indexes(config: Config | JobConfig, *, refresh: bool = False,
                  progress: bool = True) -> list[IndexSummary]:
    """Describe the systems of every data section and save their indexes (rank 0's job); for
    a multi-task input, those of :func:`job_index_sections`. ``progress``: report how far
    describing is (:func:`mdloader.logs.progress`)."""
    out = []
    for data, type_map in _sections(config):
        start = time.monotonic()
        catalog = catalog_for(list(data.systems), type_map, data.rglob_patterns,
                              workers=int(resolve("build_workers")), progress=progress,
                              index_file=data.index_file,
                              mode="refresh" if refresh else "check",
                              key=f"{data.json_path}.systems")
        catalog.save()
        table = catalog.saved.table
        state = {"built": "built", "index": "unchanged"}.get(catalog.source, "updated")
        unindexed = sum(not backend_of(a).indexable for a in set(table.addresses()))
        out.append(IndexSummary(data.json_path, catalog.index_file or "", state, len(table),
                                int(table.nframes().sum()),
                                described=max(0, catalog.described - unindexed),
                                reused=catalog.reused, seconds=time.monotonic() - start,
                                unindexed=unindexed))
    return out


def inspect_target(target: str) -> list[dict[str, Any]]:
    """Header and freshness of an index file, or of every index of an ``input.json``."""
    if _is_index(target):
        return [_inspect_file(target, section=None)]
    config = load_job(target)
    rows = []
    for data, type_map in _sections(config):
        request = index_request(list(data.systems), data.rglob_patterns, type_map,
                                data.index_file)
        if not os.path.exists(request.path):
            rows.append(asdict(IndexSummary(data.json_path, request.path, "missing")))
        elif load(request) is None:
            rows.append(asdict(IndexSummary(data.json_path, request.path, "unusable")))
        else:
            rows.append(_inspect_file(request.path, section=data.json_path))
    return rows


def _inspect_file(path: str, section: str | None) -> dict[str, Any]:
    header = inspect(path)
    _, saved = read_index(path)
    settle = int(float(resolve("index_settle")) * 1e9)
    check = check_saved(saved, saved.since_ns - settle, Overlap(int(resolve("build_workers"))))
    kept = len(saved.table)
    systems = int(header.get("systems", kept)) if saved.partial else kept
    frames = (int(header.get("frames", 0)) if saved.partial
              else int(saved.table.nframes().sum()))
    # systems the index does not keep (LMDB groups) are described at every start, by design:
    # they do not make the index out of date
    return {"section": section, "path": path, "state": "unchanged"
            if check.nothing_stored_changed else "changed", "systems": systems,
            "frames": frames, "unindexed": systems - kept, "changed": int(check.systems.sum()),
            "folders_changed": int(check.folders.sum()), "files_changed": int(check.files.sum()),
            "entries_changed": check.entries, "header": header}


def format_summaries(rows: list[IndexSummary] | list[dict[str, Any]], as_json: bool) -> str:
    """The ``mdloader index`` report: one line per index built or inspected, or JSON."""
    items = [asdict(r) if isinstance(r, IndexSummary) else r for r in rows]
    if as_json:
        return json.dumps(items, indent=2)
    lines = []
    for item in items:
        what = f"{item['systems']} systems, {item['frames']} frames"
        if item.get("header"):
            head = item["header"]
            what += (f"; made by mdloader {head.get('mdloader')} on {head.get('host')} at "
                     f"{head.get('created')}; {item['changed']} systems changed since")
        elif "seconds" in item and item["state"] in ("built", "updated", "unchanged"):
            what += (f"; {item['described']} described, {item['reused']} reused, "
                     f"{item['seconds']:.2f} s")
        if item.get("unindexed"):
            what += (f"; {item['unindexed']} not kept in the index (LMDB groups: their "
                     "database's metadata is read at every start)")
        lines.append(f"{item['section'] or 'index'}: {item['state']}: {item['path']} ({what})")
    return "\n".join(lines)


def job_index_sections(job: JobConfig) -> list[tuple[DataConfig, tuple[str, ...] | None]]:
    """The data sections whose indexes a multi-task job reads, each with its type map: every
    distinct training and validation section of every task, once (two tasks on the same
    section share its index). ``index build`` and ``index inspect`` of a multi-task input go
    through this one function, which is where the job's single catalog, over every task's
    systems, plugs in."""
    return job.data_sections()


def _sections(config: Config | JobConfig) -> list[tuple[DataConfig, tuple[str, ...] | None]]:
    if isinstance(config, JobConfig):
        return job_index_sections(config)
    return [(d, config.type_map) for d in (config.training_data, config.validation_data)
            if d is not None]


def _is_index(path: str) -> bool:
    try:
        with open_index(path) as fh:
            return fh.read(len(MAGIC)) == MAGIC
    except (OSError, IndexFileError):
        return False


# -- the sub-command ----------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader index``'s parser."""
    p = sub.add_parser("index", parents=[common], help="build, refresh or inspect system "
                       "indexes", description="Describe the training and validation systems "
                       "of an input.json once and save their indexes, so that every job "
                       "starts from them (see the HPC guide).")
    p.add_argument("action", choices=["build", "refresh", "inspect"],
                   help="build: describe what changed and save; refresh: describe everything "
                   "again; inspect: show what an index holds and what changed, write nothing")
    p.add_argument("input", help="DeePMD-kit input.json (inspect: or an index file)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    """Build, refresh or inspect; the exit code of :func:`run_index`."""
    return run_index(args.action, args.input, as_json=args.json)
