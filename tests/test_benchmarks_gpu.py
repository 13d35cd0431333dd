"""The GPU check (benchmarks/gpu/run.sh) before any GPU: its fast path runs end to end here, every
CUDA part skipped in one line; its measurements are read from recorded log text and files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import jobs, measure

REPO = Path(__file__).resolve().parents[1]

# abridged from `mdloader train input.json` and `dp --pt train input.json` logs, as
# benchmarks.launch.run_logged stamps them (seconds since the launch)
TRAIN_LOG = [
    (9.10, "2026-12-05 13:03:00 INFO    mdloader.loading.feed: DataLoader workers: one pool"),
    (10.00, "2026-12-05 13:03:01 INFO    mdloader.train.job: step 1/300: rmse_f_trn 0.916, "
            "lr 3.0e-03 (1.24 steps/s)"),
    (12.00, "2026-12-05 13:03:03 INFO    mdloader.train.job: step 50/300: rmse_f_trn 0.8, "
            "lr 2.0e-03 (20.00 steps/s)"),
    (14.00, "2026-12-05 13:03:05 INFO    mdloader.train.job: step 100/300: rmse_f_trn 0.7, "
            "lr 1.0e-03 (25.00 steps/s)"),
    (22.00, "2026-12-05 13:03:13 INFO    mdloader.train.job: step 300/300: rmse_f_trn 0.3, "
            "lr 1.0e-04 (25.00 steps/s)"),
    (22.50, "2026-12-05 13:03:13 INFO    mdloader.train.job: saved checkpoint ./model.ckpt-300.pt"),
]
DEEPMD_LOG = [
    (30.0, "[2026-12-05 13:05:42,020] DEEPMD INFO    Batch       1: trn: rmse = 2.92e+01, "
           "rmse_e = 5.23e-01, rmse_f = 9.23e-01, lr = 3.00e-03"),
    (30.0, "[2026-12-05 13:05:42,020] DEEPMD INFO    Batch       1: val: rmse = 3.28e+01"),
    (30.0, "[2026-12-05 13:05:42,020] DEEPMD INFO    Batch       1: total wall time = 26.77 s"),
    (31.0, "[2026-12-05 13:05:43,020] DEEPMD INFO    Batch      50: trn: rmse = 2.08e+01, "
           "rmse_e = 4.35e-01, rmse_f = 1.12e+00, lr = 9.65e-04"),
    (31.0, "[2026-12-05 13:05:43,020] DEEPMD INFO    Batch      50: total wall time = 1.00 s"),
    (33.5, "[2026-12-05 13:05:45,520] DEEPMD INFO    Batch     300: trn: rmse = 8.92e+00, "
           "rmse_e = 1.51e-01, rmse_f = 8.51e-01, lr = 3.11e-04"),
]


def test_step_rate_runs_from_the_second_display_line_to_the_last() -> None:
    rate, steps = measure.step_rate(TRAIN_LOG, measure.display_pattern("mdloader train"))
    assert (rate, steps) == (pytest.approx(250 / 10.0), 250)
    for trainer in ("mdloader dp", "dp"):  # the same DeePMD-kit log lines; "val:" is no display
        rate, steps = measure.step_rate(DEEPMD_LOG, measure.display_pattern(trainer))
        assert (rate, steps) == (pytest.approx(250 / 2.5), 250)


def test_no_step_rate_without_an_interval_after_the_warm_up() -> None:
    assert measure.step_rate(TRAIN_LOG[:3], measure.DISPLAY["mdloader train"]) == (None, 0)
    assert measure.step_rate([], measure.DISPLAY["deepmd"]) == (None, 0)


def test_the_data_wait_is_the_summary_that_ends_the_stall_report(tmp_path: Path) -> None:
    assert measure.wait_share(str(tmp_path)) == measure.NO_STALL_REPORT == "no stall report"
    stalls = tmp_path / measure.STALLS
    stalls.write_text('{"kind": "step", "wait_ms": 1.5}\n')
    assert measure.wait_share(str(tmp_path)) == "stall report without a summary"
    stalls.write_text('{"kind": "step", "wait_ms": 1.5}\n{"kind": "summary", "wait_share": '
                      '0.125, "wait_ms_p50": 0.2, "wait_ms_p99": 3.0}\n\n')
    assert measure.wait_share(str(tmp_path)) == 0.125
    stalls.write_text('{"kind": "summ')
    assert measure.wait_share(str(tmp_path)) == "unreadable stall report"


def test_the_table_shows_rates_shares_and_what_was_not_measured() -> None:
    rec = {"part": "c", "trainer": "mdloader dp", "job": "dpa2", "workers": 2,
           "device": "cuda", "steps_timed": 250, "steps_per_s": 41.26, "wait_share": 0.0314,
           "status": "ok"}
    text = measure.table([rec, {**rec, "part": "d", "trainer": "dp", "wait_share": None},
                          {**rec, "wait_share": "no stall report", "status": "failed",
                           "steps_timed": 0, "steps_per_s": None}])
    lines = text.splitlines()
    assert lines[0] == ("| part | trainer | input | workers | device | steps timed | steps/s | "
                        "data wait | status |")
    assert lines[2] == "| (c) | mdloader dp | dpa2 | 2 | cuda | 250 | 41.3 | 3.1% | ok |"
    assert lines[3] == "| (d) | dp | dpa2 | 2 | cuda | 250 | 41.3 | — | ok |"
    assert lines[4] == "| (c) | mdloader dp | dpa2 | 2 | cuda | — | — | no stall report | failed |"


def test_the_plan_puts_the_trainers_side_by_side_and_mdloader_train_on_dpa2_last() -> None:
    runs = jobs.plan(tuple(jobs.PARTS))
    assert [(r.trainer, r.job, r.workers) for r in runs[:3]] == [
        ("mdloader train", "water", 0), ("mdloader dp", "water", 0), ("dp", "water", 0)]
    assert [(r.trainer, r.job) for r in runs[-2:]] == [("mdloader train", "dpa2")] * 2
    assert len(runs) == 12 and len(set(runs)) == 12
    assert {r.part for r in runs} == {"b", "c", "d"}


def test_the_inputs_are_the_water_example_and_a_small_dpa2_on_its_data(tmp_path: Path) -> None:
    water = json.loads(Path(jobs.write_input(str(tmp_path), "water", 300, 50)).read_text())
    training = water["training"]
    assert (training["numb_steps"], training["disp_freq"], training["save_freq"]) == (300, 50, 300)
    systems = training["training_data"]["systems"] + training["validation_data"]["systems"]
    assert len(systems) == 4 and all(os.path.isdir(s) for s in systems)
    dpa2 = jobs.dpa2_input(300, 50)
    assert dpa2["training"] == training and dpa2["model"]["type_map"] == ["O", "H"]
    descriptor = dpa2["model"]["descriptor"]
    assert descriptor["type"] == "dpa2" and descriptor["repformer"]["nlayers"] == 2
    assert isinstance(descriptor["repinit"]["nsel"], int)  # no neighbour statistics needed


def test_each_trainer_reads_its_worker_count() -> None:
    cmd, env = jobs.command(jobs.Run("mdloader train", "water", 2), "py", "dpy")
    assert cmd[:4] == ["py", "-m", "mdloader", "train"] and env == {}
    assert cmd[cmd.index("--num-workers") + 1] == "2"
    cmd, env = jobs.command(jobs.Run("mdloader dp", "dpa2", 0), "py", "dpy")
    assert cmd[:6] == ["dpy", "-m", "mdloader", "dp", "--pt", "train"] and env == {
        "NUM_WORKERS": "0"}
    cmd, _ = jobs.command(jobs.Run("dp", "dpa2", 0), "py", "dpy")
    assert cmd[:5] == ["dpy", "-m", "deepmd", "--pt", "train"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_smoke_run_skips_every_cuda_part_in_one_line_and_ends_with_code_0(
        tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run `bash benchmarks/gpu/run.sh --smoke` itself")
    env = dict(os.environ, MDLOADER_GPU_PYTHON=sys.executable,
               MDLOADER_GPU_WHEELS=str(tmp_path / "no-wheels"))  # never a checkout's .whl/
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu" / "run.sh"), "--smoke",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for part in "abcd":
        assert sum(line.startswith(f"skipped: ({part}) ") and line.endswith(": no CUDA device")
                   for line in lines) == 1, (part, done.stdout)
    assert "(a) the gloo channel puts its tensors on cpu: ok" in lines
    assert any(line.startswith("(a) an error packet, broadcast and gathered, is the same error: "
                               "rank 0 failed") for line in lines)
    [table] = list((tmp_path / "out").glob("gpu-*.md"))
    row = "| (b) | mdloader train | water | 0 | cpu | 2 |"
    assert any(line.startswith(row) and line.endswith("| ok |")
               for line in table.read_text().splitlines()), table.read_text()
    records = [json.loads(line) for line in (tmp_path / "out" / "gpu.jsonl").read_text()
               .splitlines()]
    assert [r["part"] for r in records] == ["a", "b"] and records[0]["ok"]
