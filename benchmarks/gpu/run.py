"""The GPU check, parts (a) to (d), in one command of at most 8 minutes on one H100 (run it
through ``benchmarks/gpu/run.sh``, which sets up Python first; docs/benchmarks.md, "On a GPU").

(a) the NCCL broadcast of a packet and of a failure at W = 1, and the pinned road of a batch
    (:mod:`benchmarks.gpu.checks`);
(b) ``mdloader train``, (c) ``mdloader dp --pt train`` and (d) DeePMD-kit's own ``dp --pt train``
    on CUDA, on the water example and a small DPA-2, with 0 and 2 DataLoader workers
    (:mod:`benchmarks.gpu.jobs`): steps per second, and for mdloader the share of step time spent
    waiting for data (:mod:`benchmarks.gpu.measure`).

Without a CUDA device each CUDA part is skipped with one line; ``--cpu`` runs (b) to (d) on the
CPU instead, and ``--smoke`` (4 steps) runs stand-ins there: (a) on gloo and one short
``mdloader train``. Runs go in order of :func:`benchmarks.gpu.jobs.plan` until ``--budget`` seconds
are spent; each later one is skipped with a line. The table goes to stdout and to
``<out>/gpu-<UTC time>.md``, every run's record to ``<out>/gpu.jsonl``. Exit code 1 when a part
ran and failed, or when a piece it needs is missing (one line, before anything runs).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks import REPO, RESULTS
from benchmarks.gpu import jobs, measure
from benchmarks.launch import rank_env, run_logged

OUT = os.path.join(RESULTS, "gpu")
WHEELS_HINT = ("carry the wheels of benchmarks/gpu/wheels.txt in .whl/ "
               "(bash benchmarks/gpu/run.sh --fetch-wheels where pip reaches an index)")
SKIPPED = {"a": "(a) NCCL broadcast of a packet and of a failure",
           "b": "(b) mdloader train on CUDA", "c": "(c) mdloader dp --pt train on CUDA",
           "d": "(d) dp --pt train (DeePMD-kit's own loader) on CUDA"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="4 steps per run; without CUDA, stand-ins on the CPU")
    p.add_argument("--cpu", action="store_true",
                   help="without CUDA, run (b) to (d) on the CPU (slow: a check of the harness)")
    p.add_argument("--steps", type=int, help="steps per run (default 300; --smoke: 4)")
    p.add_argument("--disp-freq", type=int, help="steps between display lines (default 50; "
                   "--smoke: 1)")
    p.add_argument("--budget", type=float, default=450.0,
                   help="seconds for the whole command; runs that would start later are skipped")
    p.add_argument("--run-timeout", type=float, default=150.0, help="seconds per run at most")
    p.add_argument("--jobs", nargs="+", choices=jobs.JOBS, default=list(jobs.JOBS),
                   help="the inputs to train (default: both)")
    p.add_argument("--no-deepmd", action="store_true",
                   help="skip (c) and (d) (no DeePMD-kit where this runs)")
    p.add_argument("--python", default=sys.executable, help="the interpreter of mdloader train")
    p.add_argument("--deepmd-python", default=os.environ.get("MDLOADER_DEEPMD_PYTHON")
                   or sys.executable, help="the interpreter with DeePMD-kit 3.2.0")
    p.add_argument("--out", default=OUT, help="folder of the results (default %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the job folders (logs, outputs)")
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.smoke else 300)
    args.disp_freq = args.disp_freq or (1 if args.smoke else 50)
    return args


def _environment(cuda: bool) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cpus": os.cpu_count(), "started": datetime.datetime.now(datetime.timezone.utc)
           .strftime("%Y-%m-%dT%H:%M:%SZ")}
    if cuda:
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def deepmd_version(python: str) -> str:
    """DeePMD-kit's version under ``python``, with mdloader's seam imported beside it; exits
    with one line when either cannot be imported."""
    # econf_embd: what DeePMD-kit's input statistics import later (mendeleev)
    code = ("import deepmd.pt.entrypoints.main, deepmd.utils.econf_embd, "
            "mdloader.integrations.deepmd.patching, deepmd; print(deepmd.__version__)")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=rank_env(), timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"gpu check: cannot run (c) and (d): {python} cannot import DeePMD-kit with "
                 f"mdloader: {last}; {WHEELS_HINT}, or pass --no-deepmd")
    return done.stdout.strip().splitlines()[-1]


def check_mdloader() -> None:
    """mdloader's training job imports here (its dependencies are installed); else one line."""
    try:
        importlib.import_module("mdloader.train.job")
    except ImportError as exc:
        sys.exit(f"gpu check: cannot run (b): {sys.executable} cannot import mdloader's training "
                 f"job: {exc}; {WHEELS_HINT}")


def part_a(cuda: bool, stand_in: bool) -> dict[str, Any] | None:
    """The NCCL checks (gloo as a stand-in without CUDA); their JSON result."""
    if not cuda:
        print(f"skipped: {SKIPPED['a']}: no CUDA device")
        if not stand_in:
            return None
    backend = "nccl" if cuda else "gloo"
    if not cuda:
        print("(a) stand-in on the CPU: the same checks with backend gloo")
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.checks", "--backend", backend],
                          capture_output=True, text=True, cwd=REPO, env=rank_env(), timeout=180)
    lines = done.stdout.strip().splitlines()
    for line in lines[:-1]:
        print(line)
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        result = {"backend": backend, "ok": False}
        print(f"(a) FAILED: no result; the end of its output:\n{done.stderr[-2000:]}")
    return result


def runs_to_do(args: argparse.Namespace, cuda: bool) -> tuple[list[jobs.Run], str, list[str]]:
    """The training runs, their device, and a line for each part (b) to (d) not run on CUDA."""
    trainers = ("mdloader train",) if args.no_deepmd else tuple(jobs.PARTS)
    notes = [f"skipped: {SKIPPED[part]}: --no-deepmd" for part in "cd" if args.no_deepmd]
    workers = (0,) if args.smoke else (0, 2)
    every = jobs.plan(trainers, tuple(args.jobs), workers)
    if cuda:
        return every, "cuda", notes
    notes += [f"skipped: {SKIPPED[jobs.PARTS[t]]}: no CUDA device" for t in trainers]
    if args.cpu:
        return every, "cpu", notes + ["(b) to (d) on the CPU instead (--cpu)"]
    if args.smoke:
        return ([jobs.Run("mdloader train", "water", 0)], "cpu",
                notes + ["(b) stand-in on the CPU: mdloader train, water, 0 workers"])
    return [], "cpu", notes


def run_one(run: jobs.Run, device: str, args: argparse.Namespace,
            timeout: float) -> dict[str, Any]:
    """One run in a fresh folder; its record."""
    folder = tempfile.mkdtemp(prefix=f"mdloader-gpu-{run.name}-")
    jobs.write_input(folder, run.job, args.steps, args.disp_freq)
    cmd, extra = jobs.command(run, args.python, args.deepmd_python)
    env = rank_env(**extra)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    out = run_logged(cmd, folder, env, timeout)
    rate, steps = measure.step_rate(out["lines"], measure.display_pattern(run.trainer))
    rec: dict[str, Any] = {
        "part": run.part, "trainer": run.trainer, "job": run.job, "workers": run.workers,
        "device": device, "steps": args.steps, "status": out["status"], "wall_s": out["wall_s"],
        "steps_per_s": None if rate is None else round(rate, 3), "steps_timed": steps,
        "wait_share": None if run.trainer == "dp" else measure.wait_share(folder)}
    if out["status"] != "ok" or rate is None:
        rec["tail"] = [line for _t, line in out["lines"][-15:]]
    if args.keep:
        rec["folder"] = folder
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return rec


def write_results(out: str, env: dict[str, Any], text: str, records: list[dict]) -> str:
    """The table as ``gpu-<time>.md`` and the records appended to ``gpu.jsonl``; the table's
    path."""
    os.makedirs(out, exist_ok=True)
    stamp = env["started"].replace(":", "").replace("-", "")
    path = os.path.join(out, f"gpu-{stamp}.md")
    with open(path, "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(out, "gpu.jsonl"), "a") as fh:
        for rec in records:
            fh.write(json.dumps({"env": env, **rec}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.monotonic()
    cuda = torch.cuda.is_available()
    env = _environment(cuda)
    print(f"gpu check: {env.get('gpu', 'no CUDA device')}, torch {env['torch']}, "
          f"Python {env['python']}, {env['cpus']} CPUs; {args.steps} steps per run")
    runs, device, notes = runs_to_do(args, cuda)
    if runs:
        check_mdloader()
    if any(r.trainer != "mdloader train" for r in runs):
        env["deepmd"] = deepmd_version(args.deepmd_python)
        print(f"gpu check: DeePMD-kit {env['deepmd']} under {args.deepmd_python}")
    checks = part_a(cuda, args.smoke or args.cpu)
    for line in notes:
        print(line)
    failed = checks is not None and not checks.get("ok")
    records = []
    for run in runs:
        left = args.budget - (time.monotonic() - start)
        if left < 45:
            print(f"skipped: ({run.part}) {run.trainer}, {run.job}, {run.workers} workers: the "
                  f"{args.budget:g} s budget is spent")
            continue
        rec = run_one(run, device, args, min(args.run_timeout, left - 5))
        records.append(rec)
        share = rec["wait_share"]
        print(f"({run.part}) {run.trainer}, {run.job}, {run.workers} workers, {device}: "
              f"{rec['status']} in {rec['wall_s']:.0f} s, "
              f"{measure.cell(rec['steps_per_s'], '.1f')} steps/s, data wait "
              f"{f'{share:.1%}' if isinstance(share, float) else measure.cell(share, '')}")
        for line in rec.get("tail", []):
            print(f"    {line}")
        failed |= rec["status"] != "ok"
    head = (f"GPU check, {env['started']}: {env.get('gpu', 'no CUDA device')}, torch "
            f"{env['torch']}, DeePMD-kit {env.get('deepmd', '—')}, {args.steps} steps per run; "
            f"(a): {'—' if checks is None else ('ok' if checks.get('ok') else 'FAILED')}"
            + (f", 1 MiB broadcast {checks['broadcast_1mib_ms']} ms"
               if checks and "broadcast_1mib_ms" in checks else ""))
    text = head + "\n\n" + measure.table(records)
    print("\n" + text)
    if checks is not None:
        records.insert(0, {"part": "a", **checks})
    print(f"written: {write_results(args.out, env, text, records)}")
    print(f"gpu check: {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
