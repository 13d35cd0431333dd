"""How far ``mdloader dp``'s input statistics on a sample are from DeePMD-kit's own ``dp``.

One command::

    python -m benchmarks.statistics.sample_difference INPUT.json [INPUT.json ...] [--timeout S]

Each input (its own ``data_stat_nbatch``, default 10, and batch size; ``systems`` taken from the
input's folder; validation data left out) trains one step three times, in fresh one-rank jobs:
DeePMD-kit's own ``dp --pt train``, ``mdloader dp --pt train`` (the sample of a one-rank job,
other frames than DeePMD-kit's loader draws from the same seed) and ``mdloader dp`` with
``MDLOADER_STAT_FRAMES=all`` (every frame). Of every statistic the checkpoints save (descriptor
``mean``/``stddev``, ``out_bias``, ``out_std``) it prints the largest difference relative to
DeePMD-kit's largest magnitude of that statistic; records go to
``benchmarks/results/input_stat_subset/sample_difference.jsonl``.
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

import numpy as np

from benchmarks import REPO, RESULTS
from benchmarks.launch import rank_env, run_logged

OUT = os.path.join(RESULTS, "input_stat_subset", "sample_difference.jsonl")
DEEPMD_DP = "import sys; from deepmd.main import main; sys.exit(main(sys.argv[1:]))"
RUNS = {"dp": (["-c", DEEPMD_DP], {}),
        "mdloader sample": (["-m", "mdloader", "dp"], {}),
        "mdloader every frame": (["-m", "mdloader", "dp"], {"MDLOADER_STAT_FRAMES": "all"})}
STATISTICS = (".mean", ".stddev", "davg", "dstd", "out_bias", "out_std")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("inputs", nargs="+", help="DeePMD-kit input.json files")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--python", default=os.environ.get("MDLOADER_DEEPMD_PYTHON")
                   or os.path.join(REPO, ".venv-deepmd", "bin", "python"),
                   help="the interpreter with DeePMD-kit 3.2 (scripts/deepmd-env.sh)")
    p.add_argument("--out", default=OUT)
    return p.parse_args(argv)


def one_step(path: str) -> dict[str, Any]:
    """The input at ``path`` for one step: absolute ``systems``, no validation data."""
    with open(path) as fh:
        config = json.load(fh)
    base = os.path.dirname(os.path.abspath(path))
    training = config["training"]
    training.pop("validation_data", None)
    data = training["training_data"]
    systems = [data["systems"]] if isinstance(data["systems"], str) else data["systems"]
    data["systems"] = [os.path.normpath(os.path.join(base, s)) for s in systems]
    training.update(numb_steps=1, disp_freq=1, save_freq=1)
    training.pop("stat_file", None)
    return config


def saved(checkpoint: str, python: str) -> dict[str, np.ndarray]:
    """The statistics a DeePMD-kit checkpoint saved, by parameter name."""
    import torch

    state = torch.load(checkpoint, weights_only=True, map_location="cpu")["model"]
    return {k: v.double().numpy() for k, v in state.items()
            if torch.is_tensor(v) and any(w in k for w in STATISTICS)}


def difference(theirs: dict[str, np.ndarray], ours: dict[str, np.ndarray]) -> dict[str, float]:
    """Per statistic: the largest difference over DeePMD-kit's largest magnitude."""
    out = {}
    for key, x in theirs.items():
        scale = float(np.abs(x).max()) or 1.0
        out[key] = float(np.abs(ours[key] - x).max()) / scale
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    run_id = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(args.out, "a") as fh:
        for path in args.inputs:
            config = one_step(path)
            stats: dict[str, dict[str, np.ndarray]] = {}
            seconds: dict[str, float] = {}
            for name, (entry, extra) in RUNS.items():
                job = tempfile.mkdtemp(prefix="mdl-sample-diff-")
                try:
                    with open(os.path.join(job, "input.json"), "w") as out:
                        json.dump(config, out, indent=1)
                    env = rank_env(MDLOADER_CACHE_DIR=os.path.join(job, "cache"), **extra)
                    run = run_logged([args.python, *entry, "--pt", "train", "input.json"], job,
                                     env, args.timeout)
                    if run["status"] != "ok":
                        print(f"{path}: {name} {run['status']}", flush=True)
                        break
                    seconds[name] = round(run["lines"][-1][0], 1) if run["lines"] else 0.0
                    stats[name] = saved(os.path.join(job, "model.ckpt-1.pt"), args.python)
                finally:
                    shutil.rmtree(job, ignore_errors=True)
            if len(stats) < len(RUNS):
                continue
            row = {"kind": "sample_difference", "run": run_id,
                   "input": "/".join(os.path.abspath(path).split(os.sep)[-3:]),
                   "data_stat_nbatch": config["model"].get("data_stat_nbatch", 10),
                   "batch_size": config["training"]["training_data"].get("batch_size", "auto"),
                   "sample": difference(stats["dp"], stats["mdloader sample"]),
                   "every_frame": difference(stats["dp"], stats["mdloader every frame"]),
                   "seconds": seconds}
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            worst = {k: max(row[k].values(), default=0.0) for k in ("sample", "every_frame")}
            print(f"{path}: largest relative difference to dp: sample {worst['sample']:.3g}, "
                  f"every frame {worst['every_frame']:.3g}", flush=True)
            for key in row["sample"]:
                print(f"  {key:60s} sample {row['sample'][key]:.3g}  every frame "
                      f"{row['every_frame'][key]:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
