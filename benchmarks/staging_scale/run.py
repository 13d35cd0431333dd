"""Reading the data once per job: staging designs simulated at up to 1 000 nodes in one process.

    python -m benchmarks.staging_scale.run            # 10⁵ systems, 100 and 1 000 nodes
    python -m benchmarks.staging_scale.run --quick    # 10⁴ systems, 10 and 100 nodes (seconds)

Node-local staging (``MDLOADER_STAGE_DIR``) copies, on every node, what that node's ranks read:
with N nodes the shared file system serves the data N times. The designs compared, per job:

* ``no staging``: every batch read from the shared tree; the bytes of its payload alone are
  counted (a data set larger than the page cache, at the best read amplification of 1);
* ``per-node eager``: every node stages every file before step 1 (what ships);
* ``per-node lazy``: every node stages a file when one of its ranks first reads it;
* ``partition + exchange``: node k stages the files it owns (rendezvous hashing), then the
  nodes send each other their partitions, so every node holds everything, read once from the
  shared tree;
* ``partition + fetch``: node k holds only the files it owns; a rank's frame held by another
  node comes from it over the network, sent ahead of the step (the draws are a pure function of
  seed, pass, rank and world size, so every node knows what the others will read);
* ``partition, local draws``: each node samples only from what it owns (no traffic at all, but
  a rank no longer draws from every system: the sampling guarantees are lost).

The draws are mdloader's: probabilities by batch count (``prob_sys_size``), ``batch_size:
auto:32``, one batch per rank per step. Synthetic sizes as in :mod:`benchmarks.scale.run`
(3-200 atoms, 10-1 000 frames per system); a frame's bytes are its coordinates and forces
(float64) with its box, energy and virial. An elastic change of nodes is priced as the bytes
whose owner changes (staged anew from the shared tree), by rendezvous hashing and by a plain
``system mod N``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import numpy as np

from benchmarks import RESULTS
from mdloader.sampling.batching import rule_auto
from mdloader.sampling.probability import prob_sys_size

DEFAULT = os.path.join(RESULTS, "staging_scale", "sim.jsonl")
RANKS_PER_NODE = 8
STEPS = 400  # simulated steps: the per-step traffic is their mean
JOB_STEPS = (10_000, 1_000_000)  # job lengths the per-job figures are given for
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def dataset(nsys: int) -> dict[str, np.ndarray]:
    """Atoms, frames, bytes per frame and per system, batch frames and draw probabilities."""
    rng = np.random.default_rng(nsys)
    natoms, nframes = rng.integers(3, 201, nsys), rng.integers(10, 1001, nsys)
    frame_bytes = natoms * 6 * 8 + (9 + 1 + 9) * 8
    batch = rule_auto(natoms, 32).batch_sizes
    nbatch = -(-nframes // batch)
    return {"natoms": natoms, "nframes": nframes, "frame_bytes": frame_bytes,
            "bytes": nframes * frame_bytes, "batch_bytes": batch * frame_bytes,
            "p": prob_sys_size(nbatch)}


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash of each entry."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) & _MASK


def owners(nsys: int, nodes: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """The node that stages each system: the highest hash of (system, node) (rendezvous hashing),
    so that adding or removing a node moves only the systems it gains or held."""
    node_keys = _mix(nodes.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    out = np.empty(nsys, dtype=np.int64)
    for start in range(0, nsys, chunk):
        keys = _mix(np.arange(start, min(start + chunk, nsys), dtype=np.uint64))
        out[start:start + len(keys)] = nodes[np.argmax(_mix(keys[:, None] ^ node_keys[None, :]),
                                                       axis=1)]
    return out


def _moved(data: dict[str, np.ndarray], before: np.ndarray, after: np.ndarray) -> float:
    """The share of the data's bytes whose owner differs."""
    return float(data["bytes"][before != after].sum() / data["bytes"].sum())


def simulate(nsys: int, nnodes: int, *, steps: int = STEPS, seed: int = 0) -> dict[str, Any]:
    """Bytes from the shared tree, between nodes and held per node, for every design."""
    data, rng = dataset(nsys), np.random.default_rng(seed)
    total, nranks = float(data["bytes"].sum()), nnodes * RANKS_PER_NODE
    nodes = np.arange(nnodes)
    t0 = time.perf_counter()
    owner = owners(nsys, nodes)
    owning_s = time.perf_counter() - t0
    draws = rng.choice(nsys, size=(steps, nranks), p=data["p"])
    rank_node = np.arange(nranks) // RANKS_PER_NODE
    payload = data["batch_bytes"][draws]
    remote = owner[draws] != rank_node[None, :]
    step_payload = float(payload.sum() / steps)
    step_remote = float(payload[remote].sum() / steps)
    held = np.bincount(owner, weights=data["bytes"], minlength=nnodes)
    mass = np.bincount(owner, weights=data["p"], minlength=nnodes)
    # expected share of the bytes a node's ranks read at least once in a job of J steps
    used = {j: float((data["bytes"] * -np.expm1(RANKS_PER_NODE * j * np.log1p(-data["p"]))).sum()
                     / total) for j in JOB_STEPS}
    row: dict[str, Any] = {
        "nsys": nsys, "nodes": nnodes, "ranks": nranks, "data_bytes": total,
        "step_payload_bytes": step_payload, "owners_s": owning_s,
        "designs": {
            "no staging": {"shared": {j: step_payload * j / total for j in JOB_STEPS},
                           "network_per_job": 0.0, "held": 0.0, "network_per_step": 0.0},
            "per-node eager": {"shared": nnodes, "network_per_job": 0.0, "held": 1.0,
                               "network_per_step": 0.0},
            "per-node lazy": {"shared": {j: nnodes * used[j] for j in JOB_STEPS},
                              "network_per_job": 0.0, "held": used[JOB_STEPS[-1]],
                              "network_per_step": 0.0},
            "partition + exchange": {"shared": 1.0, "network_per_job": float(nnodes - 1),
                                     "held": 1.0, "network_per_step": 0.0},
            "partition + fetch": {"shared": 1.0, "network_per_step": step_remote / step_payload,
                                  "network_per_job": {j: step_remote * j / total
                                                      for j in JOB_STEPS},
                                  "held": float(held.max() / total)},
            "partition, local draws": {"shared": 1.0, "network_per_job": 0.0,
                                       "network_per_step": 0.0,
                                       "held": float(held.max() / total),
                                       "mass_spread": float(mass.max() * nnodes),
                                       "rank_reach": float(mass.max())},
        },
    }
    elastic = {}
    for label, after_nodes in (("lose one", nodes[:-1]), ("add one", np.arange(nnodes + 1)),
                               ("x1.2", np.arange(int(nnodes * 1.2)))):
        modulo = np.arange(nsys) % len(nodes), np.arange(nsys) % len(after_nodes)
        elastic[label] = {"rendezvous": _moved(data, owner, owners(nsys, after_nodes)),
                          "modulo": _moved(data, *modulo)}
    row["elastic"] = elastic
    return row


def _f(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: per design and size, the shared tree's bytes per job (× the data), the
    network's per job (× the data) and per step (× the step's payload), the most a node holds."""
    lines = ["| systems | nodes | design | shared tree, per job (× data) | between nodes, per job "
             "(× data) | between nodes, per step (× payload) | most held by a node (× data) |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        for name, d in row["designs"].items():
            shared = d["shared"]
            shared = ("; ".join(f"{_f(v)} ({int(j):,} steps)" for j, v in shared.items())
                      if isinstance(shared, dict) else _f(shared))
            net = d["network_per_job"]
            net = ("; ".join(f"{_f(v)} ({int(j):,} steps)" for j, v in net.items())
                   if isinstance(net, dict) else _f(net))
            lines.append(f"| {row['nsys']:,} | {row['nodes']:,} | {name} | {shared} | {net} | "
                         f"{_f(d['network_per_step'])} | {_f(d['held'])} |")
    lines += ["", "| systems | nodes | change of nodes | bytes staged anew, rendezvous | "
              "bytes staged anew, system mod N |", "|---:|---:|---|---:|---:|"]
    for row in rows:
        for label, moved in row["elastic"].items():
            lines.append(f"| {row['nsys']:,} | {row['nodes']:,} | {label} | "
                         f"{moved['rendezvous']:.1%} | {moved['modulo']:.1%} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10⁴ systems, 10 and 100 nodes")
    parser.add_argument("--out", default=DEFAULT)
    args = parser.parse_args(argv)
    grid = [(10_000, 10), (10_000, 100)] if args.quick else [(100_000, 100), (100_000, 1_000)]
    rows = []
    for nsys, nnodes in grid:
        start = time.perf_counter()
        row = simulate(nsys, nnodes)
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        meta = {"kind": "meta", "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "cpus": os.cpu_count(), "python": platform.python_version(),
                "quick": args.quick, "ranks_per_node": RANKS_PER_NODE, "steps": STEPS}
        fh.write(json.dumps(meta) + "\n")
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print("\n".join(table(rows)))
    for row in rows:
        d = row["designs"]["partition, local draws"]
        print(f"{row['nsys']:,} systems, {row['nodes']:,} nodes: {row['seconds']:.1f} s; local "
              f"draws: a rank reaches at most {d['rank_reach']:.2%} of the draw probability, the "
              f"heaviest node holds {d['mass_spread']:.2f}x its share of it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
