"""Time to first step: launch → first optimizer step, DeePMD-kit's ``dp --pt train``,
``mdloader dp --pt train`` and ``mdloader train``.

One command (defaults: 20 water systems, W = 1 and 2, all three, 600 s per launch)::

    python -m benchmarks.first_step.run [--systems 200 2000] [--world 1 2]
                                    [--only mdloader|deepmd|mdloader-train ...] [--timeout S]
                                    [--tasks 8] [--steps N]

With ``--tasks T`` (``mdloader dp`` and DeePMD-kit only) the input is multi-task: T heads
sharing the water descriptor, each trained on its own ``--systems`` water systems (another
seed per task), with equal ``model_prob``.

For every (systems, W) each loader runs twice in fresh ``torchrun --standalone`` jobs (gloo,
CPU, one OpenMP thread per rank) on DeePMD-kit's water example ``input.json`` with
``numb_steps: 1`` (``--steps N``: N): a **first start** (empty job folder, empty mdloader cache)
and a **restart** (``--restart model.ckpt.pt`` in the same folder, with whatever the first start
cached). The meta record keeps the mdloader settings and ``NUM_WORKERS`` set in the environment.
DeePMD-kit runs as ``python -m benchmarks.first_step.dp_cpu`` (its own ``dp`` with CPU
fallbacks only), mdloader as ``python -m mdloader dp``, both with the DeePMD-kit venv's python
(``scripts/deepmd-env.sh``); ``mdloader train`` (its own reference model, no DeePMD-kit import)
runs with the same python.
Every output line is time-stamped as it arrives; :mod:`benchmarks.first_step.phases` splits the
log into phases. A poller samples each rank's processes (the rank and its DataLoader workers)
for resident memory and CPU time. A launch that exceeds ``--timeout`` is stopped and recorded as
such, with the phases it reached. Records are appended to
``benchmarks/results/first_step/first_step.jsonl``; ``python -m benchmarks.report`` prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from benchmarks import REPO, RESULTS, probes
from benchmarks.data import DEFAULT_BASE, ensure_water
from benchmarks.first_step import phases as fsp
from benchmarks.launch import Poller, can_import, rank_env, run_logged, torchrun

OUT = os.path.join(RESULTS, "first_step", "first_step.jsonl")
ENTRY = {"deepmd": ["-m", "benchmarks.first_step.dp_cpu", "--pt", "train"],
         "mdloader": ["-m", "mdloader", "dp", "--pt", "train"],
         "mdloader-train": ["-m", "mdloader", "train"]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--systems", type=int, nargs="+", default=[20])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2])
    p.add_argument("--only", nargs="+", choices=tuple(ENTRY))
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per launch; a longer one is stopped and recorded as > T s")
    p.add_argument("--starts", nargs="+", default=["first", "restart"],
                   choices=("first", "restart"))
    p.add_argument("--python", default=os.environ.get("MDLOADER_DEEPMD_PYTHON")
                   or os.path.join(REPO, ".venv-deepmd", "bin", "python"),
                   help="the interpreter with DeePMD-kit 3.2 (scripts/deepmd-env.sh)")
    p.add_argument("--data-base", default=DEFAULT_BASE)
    p.add_argument("--out", default=OUT)
    p.add_argument("--keep-jobs", action="store_true", help="keep the job folders (logs)")
    p.add_argument("--tasks", type=int, default=1,
                   help="T > 1: a multi-task input of T heads, each on its own systems")
    p.add_argument("--steps", type=int, default=1,
                   help="steps of the first start (the restart trains one more): more steps "
                   "let the worker and memory peaks cover every task's loaders")
    p.add_argument("--stat-nbatch", type=int, default=None,
                   help="model.data_stat_nbatch (default: the example's); a large value makes "
                   "the input statistics use every frame, mdloader's sharded case")
    return p.parse_args(argv)


def job_input(root: str, steps: int, stat_nbatch: int | None = None) -> dict[str, Any]:
    """DeePMD-kit's water ``input.json`` on ``root``, ``steps`` steps, a line and a checkpoint
    per step (validation data left out: it is not part of the first step), and
    ``data_stat_nbatch`` when given."""
    with open(os.path.join(REPO, "examples", "water", "input.json")) as fh:
        config = json.load(fh)
    config.pop("_comment", None)
    training = config["training"]
    training.pop("validation_data", None)
    training["training_data"]["systems"] = root
    training.update(numb_steps=steps, disp_freq=1, save_freq=1)
    if stat_nbatch is not None:
        config["model"]["data_stat_nbatch"] = stat_nbatch
    return config


def multitask_input(roots: list[str], steps: int, stat_nbatch: int | None = None
                    ) -> dict[str, Any]:
    """:func:`job_input` as a multi-task input: one head per root, the water model's
    descriptor and type map shared, each head its own fitting net, loss and systems."""
    single = job_input(roots[0], steps, stat_nbatch)
    model, training = single["model"], single["training"]
    heads = [f"task{t}" for t in range(len(roots))]
    head = {"type_map": "my_type_map", "descriptor": "my_descriptor",
            "fitting_net": model["fitting_net"]}
    if stat_nbatch is not None:
        head["data_stat_nbatch"] = stat_nbatch
    data = {h: {"training_data": {**training["training_data"], "systems": root}}
            for h, root in zip(heads, roots, strict=True)}
    rest = {k: v for k, v in training.items() if k != "training_data"}
    return {"model": {"shared_dict": {"my_type_map": model["type_map"],
                                      "my_descriptor": model["descriptor"]},
                      "model_dict": {h: dict(head) for h in heads}},
            "learning_rate": single["learning_rate"],
            "loss_dict": {h: single["loss"] for h in heads},
            "training": {**rest, "model_prob": {h: 1.0 for h in heads}, "data_dict": data}}


def write_input(job: str, roots: list[str], steps: int, stat_nbatch: int | None) -> None:
    """The job's ``input.json``: single-task on one root, else one task per root."""
    config = (job_input(roots[0], steps, stat_nbatch) if len(roots) == 1
              else multitask_input(roots, steps, stat_nbatch))
    with open(os.path.join(job, "input.json"), "w") as out:
        json.dump(config, out, indent=1)


def record(run: dict[str, Any], world: int, impl: str) -> dict[str, Any]:
    """What one launch adds to the results: phases, time to first step, CPU and memory."""
    found = fsp.find_markers(run["lines"], impl)
    durations, ready = fsp.phases(found, end=run["wall_s"])
    windows = fsp.phase_windows(found, end=run["wall_s"])
    poller: Poller = run["poller"]
    ranks = [str(r) for r in range(world)]
    cpu = {name: [fsp.window_cpu(poller.cpu.get(r, []), a, b) for r in ranks]
           for name, (a, b) in windows.items()}
    mib = 1 / 2**20
    rec = {"status": run["status"], "wall_s": run["wall_s"],
           "ready_s": None if ready is None else round(ready, 3), "phases": durations,
           "cpu_s": cpu,
           "peak_rss_mib": [round(poller.peak_rss.get(r, 0) * mib, 1) for r in ranks],
           "peak_tree_rss_mib": [round(poller.peak_tree.get(r, 0) * mib, 1) for r in ranks],
           "workers": [poller.peak_workers.get(r, 0) for r in ranks],
           "markers": {k: [round(t, 3), probes.scrubbed(line)[:200]]
                       for k, (t, line) in found.items()}}
    if run["status"] != "ok" or ready is None:
        rec["tail"] = probes.scrubbed("\n".join(line for _t, line in run["lines"][-25:]))[-3000:]
    return rec


def run_pair(python: str, impl: str, roots: list[str], nsys: int, world: int,
             args: argparse.Namespace, fh: Any, run_id: str) -> None:
    """A first start and a restart of one loader in one job folder."""
    job = tempfile.mkdtemp(prefix=f"mdl-first-step-{impl}-n{nsys}-w{world}-")
    env = rank_env(MDLOADER_CACHE_DIR=os.path.join(job, "mdloader-cache"))
    first_ok = False
    for start in ("first", "restart"):
        base = {"kind": "first_step", "run": run_id, "impl": impl, "nsys": nsys, "world": world,
                "tasks": len(roots),
                "start": start, "timeout_s": args.timeout, "stat_nbatch": args.stat_nbatch,
                "steps": args.steps + (start == "restart"),
                "loadavg_1min": round(os.getloadavg()[0], 2)}
        if start == "first":  # a restart needs the first start's checkpoint
            first_ok, rec = _launch_first(python, impl, job, roots, world, env, args)
            if "first" not in args.starts:
                continue
        elif start not in args.starts:
            continue
        elif not first_ok:
            rec = {"status": "not run (the first start did not finish)", "phases": {},
                   "ready_s": None}
        else:
            write_input(job, roots, args.steps + 1, args.stat_nbatch)
            cmd = _cmd(python, impl, world, ["--restart", "model.ckpt.pt"])
            rec = record(run_logged(cmd, job, env, args.timeout), world, impl)
        fh.write(json.dumps({**base, **rec}) + "\n")
        fh.flush()
        shown = (f"{rec['ready_s']:.1f} s to first step" if rec["ready_s"] is not None
                 else rec["status"])
        print(f"  {impl:8s} n={nsys:<5d} W={world} {start:7s} {shown} "
              f"(phases {rec['phases']})", flush=True)
    if args.keep_jobs:
        print(f"  job folder kept: {job}", flush=True)
    else:
        shutil.rmtree(job, ignore_errors=True)


def _cmd(python: str, impl: str, world: int, extra: list[str]) -> list[str]:
    return torchrun(python, world, [*ENTRY[impl], "input.json", *extra])


def _launch_first(python: str, impl: str, job: str, roots: list[str], world: int,
                  env: dict[str, str], args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    write_input(job, roots, args.steps, args.stat_nbatch)
    rec = record(run_logged(_cmd(python, impl, world, []), job, env, args.timeout), world,
                 impl)
    ok = rec["status"] == "ok" and os.path.exists(os.path.join(job, "model.ckpt.pt"))
    return ok, rec


def settings_in_force() -> dict[str, str]:
    """The mdloader settings and ``NUM_WORKERS`` set in the environment (values, never the
    interpreter or cache paths of this machine)."""
    from mdloader.settings import SETTINGS

    names = {s.env for s in SETTINGS.values()} - {"MDLOADER_CACHE_DIR"} | {"NUM_WORKERS"}
    return {k: v for k, v in os.environ.items() if k in names}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not can_import(args.python, "deepmd.pt.train.training"):
        print(f"{args.python} cannot import DeePMD-kit: run bash scripts/deepmd-env.sh "
              "or pass --python", file=sys.stderr)
        return 2
    impls = list(args.only or ENTRY)
    if args.tasks > 1:  # mdloader train refuses multi-task inputs
        impls = [i for i in impls if i != "mdloader-train"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    run_id = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(args.out, "a") as fh:
        fh.write(json.dumps({"kind": "first_step-meta", "run": run_id, "cpus": os.cpu_count(),
                             "systems": args.systems, "worlds": args.world, "impls": impls,
                             "tasks": args.tasks,
                             "timeout_s": args.timeout, "loadavg": os.getloadavg(),
                             "env": settings_in_force()})
                 + "\n")
        for nsys in args.systems:
            roots = [ensure_water(nsys, base=args.data_base, seed=t) for t in range(args.tasks)]
            for i, world in enumerate(args.world):
                for impl in (impls if i % 2 == 0 else impls[::-1]):
                    run_pair(args.python, impl, roots, nsys, world, args, fh, run_id)
    print(f"results: {os.path.relpath(args.out, REPO)}; the page: "
          "python -m benchmarks.report benchmarks/results/*.jsonl", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
