"""``mdloader stat``: the neighbour statistics of an input.json's training data, before a job.

For each descriptor block of the model section (its ``rcut``, ``sel``, mixed type or not; of
each task's model for a multi-task input) it prints what ``dp --pt train`` will find before step
1: the minimal pair distance (``min_nbor_dist``), the most neighbours of each type within
``rcut``, and the ``sel`` DeePMD-kit resolves from them (``"auto"``, ``"auto:R"``, or the user's
list with its warnings). The per-system cache of :mod:`mdloader.loading.statistics` is used and
filled, so a later ``dp`` job reuses the work; ``--refresh`` computes everything again. Under
``torchrun`` the systems are shared out over the ranks as in training.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mdloader.config.input_json import Config
from mdloader.errors import ConfigError

#: Descriptor types whose neighbour list does not distinguish types (one ``sel``).
MIXED_TYPES = {"se_atten", "dpa1", "se_atten_v2", "dpa2", "dpa3"}


@dataclass(frozen=True)
class Block:
    """One neighbour-list block of the descriptor: where in input.json, its cut-off and sel."""

    path: str
    rcut: float
    sel: Any
    mixed_type: bool


def descriptor_blocks(descriptor: Mapping[str, Any], path: str = "model.descriptor",
                      ) -> list[Block]:
    """The neighbour-list blocks of a descriptor section (hybrid: each of its list)."""
    kind = str(descriptor.get("type", "se_e2_a"))
    if kind == "hybrid":
        return [b for i, d in enumerate(descriptor.get("list", []))
                for b in descriptor_blocks(d, f"{path}.list[{i}]")]
    if kind == "dpa2":
        return [Block(f"{path}.{part}", float(descriptor[part]["rcut"]),
                      descriptor[part]["nsel"], True)
                for part in ("repinit", "repformer") if part in descriptor]
    if kind == "dpa3":
        flow = descriptor.get("repflow", {})
        return [Block(f"{path}.repflow.{p}", float(flow[f"{p}_rcut"]), flow[f"{p}_sel"], True)
                for p in ("e", "a") if f"{p}_rcut" in flow]
    if "rcut" not in descriptor or "sel" not in descriptor:
        raise ConfigError(f"descriptor type {kind!r} has no rcut/sel that mdloader stat knows",
                          path=path)
    return [Block(path, float(descriptor["rcut"]), descriptor["sel"], kind in MIXED_TYPES)]


def run_stat(input_json: str, *, refresh: bool = False, as_json: bool = False) -> int:
    """Compute (or read from the cache) and print the neighbour statistics; exit code 0.

    A multi-task input gives them per task, each under its own descriptor; statistics are
    cached per system, so tasks on the same systems compute them once (``--refresh``
    recomputes a training section shared by several tasks once)."""
    from mdloader.config.multitask import JobConfig, load_job
    from mdloader.distributed.group import current_world

    config = load_job(input_json)
    if isinstance(config, JobConfig):
        refreshed: set[Any] = set()
        tasks = {}
        for task in config.tasks:
            descriptor = task.descriptor
            if descriptor is None:
                raise ConfigError("the task has no descriptor section",
                                  path=f"model.model_dict.{task.name}.descriptor")
            tasks[task.name] = stat_rows(task.config, descriptor, refresh=refresh,
                                         path=f"model.model_dict.{task.name}.descriptor",
                                         refreshed=refreshed)
        if current_world().is_main:
            print(json.dumps({"tasks": tasks}, indent=2) if as_json else "\n\n".join(
                f"=== task {name}\n" + format_rows(t["blocks"], t["type_map"], t["systems"])
                for name, t in tasks.items()))
        return 0
    with open(input_json, encoding="utf-8") as fh:
        raw = json.load(fh)
    descriptor = raw.get("model", {}).get("descriptor")
    if not isinstance(descriptor, Mapping):
        raise ConfigError("no descriptor section", path="model.descriptor")
    result = stat_rows(config, descriptor, refresh=refresh)
    if current_world().is_main:
        print(json.dumps(result, indent=2) if as_json else
              format_rows(result["blocks"], result["type_map"], result["systems"]))
    return 0


def stat_rows(config: Config, descriptor: Mapping[str, Any], *, refresh: bool = False,
              path: str = "model.descriptor", refreshed: set[Any] | None = None
              ) -> dict[str, Any]:
    """The neighbour statistics of ``config``'s training systems for each block of
    ``descriptor``: ``{"systems", "type_map", "blocks"}``. With ``refresh``, a (systems,
    block) already in ``refreshed`` reads the cache that was just refreshed."""
    from mdloader.loading.build import build_systems
    from mdloader.loading.statistics import neighbour_statistics
    from mdloader.stats.neighbours import min_nbor_dist, resolve_sel

    blocks = descriptor_blocks(descriptor, path)
    type_map = list(config.type_map) if config.type_map else None
    data = config.training_data
    datasets = build_systems(list(data.systems), type_map, rglob_patterns=data.rglob_patterns,
                             index_file=data.index_file, key=data.json_path + ".systems")
    rows = []
    for block in blocks:
        key = (data.systems, data.rglob_patterns, tuple(type_map or ()), block.rcut,
               block.mixed_type)
        again = refresh and (refreshed is None or key not in refreshed)
        if refreshed is not None and refresh:
            refreshed.add(key)
        stats = neighbour_statistics(datasets, block.rcut, type_map=type_map,
                                     mixed_type=block.mixed_type,
                                     mode="refresh" if again else None)
        sel, warnings = resolve_sel(block.sel, stats)
        rows.append({"block": block.path, "rcut": block.rcut, "mixed_type": block.mixed_type,
                     "min_nbor_dist": min_nbor_dist(stats),
                     "max_neighbours": [int(n) for n in stats.max_neighbours],
                     "sel": sel if not block.mixed_type else int(sum(sel)),
                     "sel_given": block.sel, "warnings": warnings})
    return {"systems": len(datasets), "type_map": type_map, "blocks": rows}


def format_rows(rows: Sequence[Mapping[str, Any]], type_map: Sequence[str] | None,
                systems: int) -> str:
    """The human-readable table of :func:`run_stat`."""
    lines = [f"neighbour statistics of {systems} training systems"]
    for r in rows:
        names = (["all types"] if r["mixed_type"] else
                 list(type_map or [str(t) for t in range(len(r["max_neighbours"]))]))
        most = ", ".join(f"{n}: {m}" for n, m in zip(names, r["max_neighbours"]))
        lines += [f"{r['block']} (rcut {r['rcut']:g}{', mixed type' if r['mixed_type'] else ''})",
                  f"  min_nbor_dist   {r['min_nbor_dist']:.6f}",
                  f"  max neighbours  {most}",
                  f"  sel             {r['sel']}  (given: {json.dumps(r['sel_given'])})"]
        lines += [f"  warning: {w}" for w in r["warnings"]]
    return "\n".join(lines)


# -- the sub-command ----------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader stat``'s parser."""
    p = sub.add_parser("stat", parents=[common], help="neighbour statistics (min_nbor_dist, "
                       "sel) of the training data", description="Compute the neighbour "
                       "statistics DeePMD-kit computes before step 1 (minimal distance, most "
                       "neighbours per type, the resolved sel) for each descriptor block of "
                       "an input.json, using and filling mdloader's per-system cache.")
    p.add_argument("input", help="DeePMD-kit input.json")
    p.add_argument("--refresh", action="store_true",
                   help="compute every system again and overwrite its cache entry")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """The exit code of :func:`run_stat`."""
    return run_stat(args.input, refresh=args.refresh, as_json=args.json)
