"""One pool of DataLoader workers for every stream of DeePMD-kit's trainer (``mdloader dp``).

Three heads with validation data on two ranks, two workers per DataLoader: DeePMD-kit's own
arrangement (``MDLOADER_DP_WORKERS=per-loader``: a pool per task and role) runs 3 x 2 pools of
2 workers each per rank; the one pool runs 2 workers for all of them and trains the same
batches, validates on the same batches (equal ``lcurve.out``), and resumes exactly from a
checkpoint taken while its workers read ahead. On one rank the pool is the same code without a
process group; the resume tests run it there with ``NUM_WORKERS=0`` (every batch read on demand
in the main process).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from support.deepmd_inputs import make_task_data, multi_task_input
from support.deepmd_spy import dp_train, lcurve_rows, spied

pytestmark = pytest.mark.slow

TASKS = ("a", "b", "c")
STEPS = 10


def _input(root: Path) -> dict:
    return multi_task_input(root, TASKS, data={"c": "a"}, disp_freq=3)


def _run(job: Path, root: Path, world: int, mode: str, *extra: str,
         steps: int = STEPS) -> SimpleNamespace:
    log = dp_train(job, _input(root), *extra, steps=steps, world=world,
                   env={"NUM_WORKERS": "2", "MDLOADER_DP_WORKERS": mode})
    return SimpleNamespace(log=log, spies=spied(job, world), lcurve=lcurve_rows(job))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = make_task_data(tmp_path_factory.mktemp("data"))
    jobs = tmp_path_factory.mktemp("jobs")
    found = SimpleNamespace()
    for mode in ("per-loader", "one"):  # two ranks: every rank's pool is its own
        setattr(found, f"{mode.replace('-', '_')}2", _run(jobs / f"{mode}2", root, 2, mode))
    parts = jobs / "parts"
    _run(parts, root, 2, "one", steps=5)
    found.restarted = _run(parts, root, 2, "one", "--restart", "model.ckpt.pt")
    return found


def test_one_pool_trains_and_validates_on_deepmd_kits_batches(runs: SimpleNamespace) -> None:
    own, pooled = runs.per_loader2, runs.one2
    for rank in range(2):
        assert pooled.spies[rank]["tasks"] == own.spies[rank]["tasks"]
        assert pooled.spies[rank]["drawn"] == own.spies[rank]["drawn"]
        assert set(own.spies[rank]["tasks"]) == set(TASKS), "every head trained"
    assert pooled.lcurve == own.lcurve, "validation and display batches are DeePMD-kit's too"
    assert [int(r.split()[0]) for r in pooled.lcurve] == [1, 3, 6, 9]  # each with validation
    assert "DataLoader workers: one pool of 2 for 9 stream(s)" in pooled.log
    # the forecast was DeePMD-kit's loop: 10 training batches, and at each of 4 displays 2
    # display-time and 3 x 2 validation batches, each in flight when asked for, none held
    assert ("DataLoader worker pool: 42 batches served, 0 asked for out of turn, at most 0 "
            "held") in pooled.log
    assert "DataLoader workers: 6 pools of 2 for 9 stream(s)" in own.log


def test_one_pool_runs_num_workers_processes_per_rank(runs: SimpleNamespace) -> None:
    own, pooled = runs.per_loader2, runs.one2
    assert [s["most_children"] for s in pooled.spies] == [2, 2]
    assert [s["most_children"] for s in own.spies] == [12, 12]  # 3 tasks x 2 roles x 2


def test_a_restart_of_pooled_workers_continues_the_uninterrupted_run(
        runs: SimpleNamespace) -> None:
    """The checkpoint of step 5 was saved while the workers had read ahead: the restarted run
    trains and validates exactly what the uninterrupted one did after it."""
    assert "restored the loader state" in runs.restarted.log
    def after_step_5(rows: list[str]) -> list[str]:
        return [r for r in rows if int(r.split()[0]) > 5]

    assert runs.restarted.lcurve[:2] == runs.one2.lcurve[:2]  # the first part's rows
    assert after_step_5(runs.restarted.lcurve) == after_step_5(runs.one2.lcurve)
    for rank in range(2):
        whole = runs.one2.spies[rank]
        again = runs.restarted.spies[rank]
        assert again["tasks"] == whole["tasks"][5:]
        for task, batches in again["drawn"].items():
            assert batches == whole["drawn"][task][-len(batches):]
