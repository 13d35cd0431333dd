"""DeePMD-kit 3.2's full validation (``validating.full_validation``) under ``mdloader dp``: every
validation frame once, sharded over the ranks, with DeePMD-kit's figures, ``val.log``, best
checkpoints and ``train_infos``, compared with DeePMD-kit's own one-rank ``dp --pt train`` on the
same input at W = 1 and W = 2 (gloo under torchrun); resumed as DeePMD-kit resumes it; a
truncated validation file during a pass is one line on every rank.

The pure merge of the ranks' sums is tested without a launch."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from support.deepmd_env import require_deepmd_python
from support.deepmd_inputs import full_validation_input

from mdloader.integrations.deepmd.full_validation import (
    add_sums,
    merged_metrics,
    weighted_sums,
)

REPO = Path(__file__).resolve().parents[3]

#: Runs ``dp`` (``dp ...``) or mdloader's command line (``mdloader dp ...``) with each full
#: validation's unrounded metrics appended to ``metrics.jsonl`` (rank 0, DeePMD-kit's
#: ``_log_result``), and under mdloader each rank's evaluated frames in ``frames.rank<R>.jsonl``
#: (one line per pass: ``[sid, fid]`` pairs). ``MDLOADER_TEST_TRUNCATE``: rank 0 truncates that
#: file as the first pass starts; ``MDLOADER_TEST_SIGTERM_PASS``: rank 0 sends itself SIGTERM as
#: that pass (1-based) starts.
SPY = r'''
import json, os, signal, sys
from deepmd.pt_expt.train import validation
own_log = validation.FullValidator._log_result
def _log_result(self, result):
    with open("metrics.jsonl", "a") as out:
        out.write(json.dumps({"step": result.display_step, "metrics": result.metrics,
                              "best": result.saved_best_path}) + "\n")
    return own_log(self, result)
validation.FullValidator._log_result = _log_result
if sys.argv[1] == "dp":
    from deepmd.main import main
    main(sys.argv[2:])
    sys.exit(0)
from mdloader.integrations.deepmd import full_validation as fv
rank = int(os.environ.get("RANK", "0"))
own_share, own_errors = fv.ShardedEvaluation._evaluate_share, fv.ShardedEvaluation.batch_errors
seen, passes = [], []
def _evaluate_share(self):
    target = os.environ.get("MDLOADER_TEST_TRUNCATE")
    if target and rank == 0 and os.path.getsize(target) > 200:
        os.truncate(target, os.path.getsize(target) // 3)
    passes.append(1)
    if rank == 0 and os.environ.get("MDLOADER_TEST_SIGTERM_PASS") == str(len(passes)):
        os.kill(os.getpid(), signal.SIGTERM)
    seen.clear()
    result = own_share(self)
    with open(f"frames.rank{rank}.jsonl", "a") as out:
        out.write(json.dumps(seen) + "\n")
    return result
def batch_errors(self, batch):
    seen.extend([int(batch["sid"]), int(f)] for f in batch["fid"])
    return own_errors(self, batch)
fv.ShardedEvaluation._evaluate_share = _evaluate_share
fv.ShardedEvaluation.batch_errors = batch_errors
from mdloader.cli.main import main
sys.exit(main(sys.argv[2:]))
'''

VALIDATION_FRAMES = [5, 3, 4, 3]  # full_validation_input's validation systems


def _launch(root: Path, *args: str, ranks: int = 0, check: bool = True,
            **env: str) -> subprocess.CompletedProcess[str]:
    """The spy in ``root`` with ``args`` (``ranks``: under torchrun with that many gloo ranks)."""
    spy = root / "spy.py"
    spy.write_text(SPY)
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks else [])
    full = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUM_WORKERS="0",
                MDLOADER_CACHE_DIR=str(root / "cache"), **env)
    proc = subprocess.run([require_deepmd_python(), *launcher, str(spy), *args], cwd=root,
                          env=full, capture_output=True, text=True, timeout=400)
    if check:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _job(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "input.json").write_text(json.dumps(config))
    return root


def _metrics(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def _assert_same_figures(theirs: list[dict], ours: list[dict]) -> float:
    """The same steps, metrics and best checkpoints; the largest relative difference."""
    assert [(m["step"], sorted(m["metrics"]), m["best"]) for m in ours] == \
        [(m["step"], sorted(m["metrics"]), m["best"]) for m in theirs]
    worst = 0.0
    for mine, ref in zip(ours, theirs):
        for key, value in ref["metrics"].items():
            worst = max(worst, abs(mine["metrics"][key] - value) / abs(value))
    assert worst <= 1e-10, worst
    return worst


def _best_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("best*.ckpt-*.pt"))


def _train_infos(checkpoint: Path) -> dict:
    infos = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]["_extra_state"]
    return infos["train_infos"]


def _records_close(theirs: dict, ours: dict) -> None:
    assert ours["full_validation_metric"] == theirs["full_validation_metric"]
    mine, ref = ours["full_validation_topk_records"], theirs["full_validation_topk_records"]
    assert [r["step"] for r in mine] == [r["step"] for r in ref]
    assert all(math.isclose(a["metric"], b["metric"], rel_tol=1e-10) for a, b in zip(mine, ref))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_full_validation_equals_deepmd_kits_at_one_and_two_ranks_and_resumes_as_it(
        tmp_path: Path) -> None:
    """DeePMD-kit's one-rank figures within 1e-10 at W = 1 and W = 2, for the live and the EMA
    weights, each frame evaluated once over the ranks (8 and 7 of 15 on 2), the same
    ``val.log`` and ``val_ema.log`` (5-digit figures), best checkpoints and ``train_infos``; a
    ``--restart`` continues them as DeePMD-kit's does."""
    config = full_validation_input(tmp_path / "data")
    config["training"]["enable_ema"] = True  # and the EMA weights' flow beside the live one's
    config["validating"]["ema_full_validation"] = True
    ref = _job(tmp_path / "dp", config)
    _launch(ref, "dp", "--pt", "train", "input.json")
    theirs = _metrics(ref)
    assert [m["step"] for m in theirs] == [2, 2, 4, 4, 6, 6]
    for ranks in (1, 2):
        job = _job(tmp_path / f"w{ranks}", config)
        _launch(job, "mdloader", "dp", "--pt", "train", "input.json",
                ranks=ranks if ranks > 1 else 0)
        worst = _assert_same_figures(theirs, _metrics(job))
        print(f"full validation under mdloader dp, W = {ranks}: largest relative difference "
              f"from dp's {worst:.1e}")
        for log in ("val.log", "val_ema.log"):
            assert (job / log).read_text() == (ref / log).read_text()
        assert _best_files(job) == _best_files(ref) == [
            "best.ckpt-2.t-1.pt", "best.ckpt-4.t-2.pt", "best_ema.ckpt-2.t-1.pt",
            "best_ema.ckpt-4.t-2.pt"]
        _records_close(_train_infos(ref / "model.ckpt-6.pt"), _train_infos(job / "model.ckpt-6.pt"))
        passes = [[json.loads(line) for line in (job / f"frames.rank{r}.jsonl").read_text()
                   .splitlines()] for r in range(ranks)]
        for number in range(6):  # every pass: every frame once over the ranks, 15 / W each
            frames = [tuple(f) for rank in passes for f in rank[number]]
            assert sorted(frames) == [(s, f) for s, n in enumerate(VALIDATION_FRAMES)
                                      for f in range(n)]
            assert [len(rank[number]) for rank in passes] == [[15], [8, 7]][ranks - 1]
    # --restart from the step-3 checkpoint: validations 4 and 6 again, val.log appended, the
    # best records as dp's restart leaves them (it starts them afresh: best.ckpt-4.t-1.pt);
    # dp runs step 3 again, mdloader dp skips it
    for name, command, ranks in (("dp", ["dp"], 0), ("w2", ["mdloader", "dp"], 2)):
        again = tmp_path / f"{name}-restart"
        shutil.copytree(tmp_path / name, again)
        (again / "metrics.jsonl").unlink()
        _launch(again, *command, "--pt", "train", "input.json", "--restart", "model.ckpt-3.pt",
                ranks=ranks)
    ref, ours = tmp_path / "dp-restart", tmp_path / "w2-restart"
    assert [m["step"] for m in _metrics(ref)] == [4, 4, 6, 6]
    _assert_same_figures(_metrics(ref), _metrics(ours))
    for log in ("val.log", "val_ema.log"):
        assert (ours / log).read_text() == (ref / log).read_text()
    assert _best_files(ours) == _best_files(ref)
    _records_close(_train_infos(ref / "model.ckpt-6.pt"), _train_infos(ours / "model.ckpt-6.pt"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_truncated_validation_file_during_a_pass_is_one_line_on_every_rank(
        tmp_path: Path) -> None:
    """Rank 0 truncates a validation ``force.npy`` as the first pass starts: the rank that
    reads it fails, the gather of the pass carries its error, and both ranks print the same
    line naming the system and the file (no hang, no DeePMD-kit traceback)."""
    job = _job(tmp_path / "job", full_validation_input(tmp_path / "data"))
    target = tmp_path / "data" / "valid" / "v0" / "set.000" / "force.npy"
    proc = _launch(job, "mdloader", "dp", "--pt", "train", "input.json", ranks=2, check=False,
                   MDLOADER_TEST_TRUNCATE=str(target))
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("mdloader: error:")]
    assert len(errors) == 2 and errors[0] == errors[1], out[-4000:]
    assert "force.npy" in errors[0] and "v0" in errors[0], errors[0]
    assert "full validation at step 2" in errors[0], errors[0]
    print(f"truncated validation file during a full validation, 2 ranks: {errors[0]}")
    assert proc.returncode != 0 and not (job / "val.log").exists(), out[-4000:]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_sigterm_during_a_pass_stops_every_rank_after_its_step_and_the_restart_continues(
        tmp_path: Path) -> None:
    """SIGTERM to rank 0 as the pass of step 4 starts: rank 0 cuts its share, the gather tells
    rank 1, and both stop there as after a training step (the checkpoint of step 4 with its
    loader state, one line each, exit 143), with no ``val.log`` line for step 4. The restart
    from it validates step 6; its best records start afresh, as DeePMD-kit 3.2's restart's do
    (the comparison with ``dp --restart`` above)."""
    job = _job(tmp_path / "job", full_validation_input(tmp_path / "data"))
    proc = _launch(job, "mdloader", "dp", "--pt", "train", "input.json", ranks=2, check=False,
                   MDLOADER_TEST_SIGTERM_PASS="2", MDLOADER_STOP_CHECK_STEPS="1000")
    out = proc.stdout + proc.stderr
    stopped = re.findall(r"mdloader: stopped on rank (\d): (SIG\w+) after step (\d+)", out)
    assert sorted(stopped) == [("0", "SIGTERM", "4"), ("1", "SIGTERM", "4")], out[-4000:]
    assert "checkpoint model.ckpt-4.pt written with its loader state" in out, out[-4000:]
    assert (job / "model.ckpt-4.pt.mdloader").exists() and proc.returncode != 0
    assert [m["step"] for m in _metrics(job)] == [2]
    _launch(job, "mdloader", "dp", "--pt", "train", "input.json", "--restart",
            "model.ckpt-4.pt", ranks=2)
    assert [m["step"] for m in _metrics(job)] == [2, 6]
    steps = [line.split()[0] for line in (job / "val.log").read_text().splitlines()
             if not line.startswith("#")]
    assert steps == ["2", "6"]
    records = _train_infos(job / "model.ckpt-6.pt")["full_validation_topk_records"]
    assert [r["step"] for r in records] == [6]


def test_the_ranks_sums_merge_to_the_metrics_of_every_frame_at_once() -> None:
    """DeePMD-kit's per-system (value, weight) pairs of any partition of the frames, summed and
    merged, are the MAE and RMSE of all the frames at once."""
    rng = np.random.default_rng(3)
    diffs = [rng.normal(size=n) for n in (5, 3, 4, 1)]
    parts = []
    for share in ([0, 2], [1, 3], []):  # the ranks' shares, one of them empty
        total: dict[str, list[list[float]]] = {}
        for d in (diffs[i] for i in share):
            errors = {"mae_x": (float(np.mean(np.abs(d))), d.size),
                      "rmse_x": (float(np.sqrt(np.mean(d * d))), d.size)}
            add_sums(total, weighted_sums(errors))
        parts.append({k: (math.fsum(s), math.fsum(w)) for k, (s, w) in total.items()})
    every = np.concatenate(diffs)
    merged = merged_metrics(parts)
    assert math.isclose(merged["mae_x"], float(np.mean(np.abs(every))), rel_tol=1e-14)
    assert math.isclose(merged["rmse_x"], float(np.sqrt(np.mean(every * every))), rel_tol=1e-14)
