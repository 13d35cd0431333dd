"""Exact resume and a stream per task under DeePMD-kit's own trainer (``mdloader dp``).

A run stopped at step N and restarted from its checkpoint writes, after step N, the same
``lcurve.out`` rows as an uninterrupted run (a constant learning rate, so that ``numb_steps``
does not change the schedule). On another number of ranks (2 -> 1) each interrupted pass is
finished exactly once, counted on the batches the trainer trained (tests/support/deepmd_spy.py)
against the definitions of docs/sampling.md (tests/support/elastic_ledger.py). ``--init-model``
and ``--finetune`` start fresh streams. Each task draws its own stream, and its display-time
batches from another one: adding a task, or logging more often, leaves a task's batches
unchanged. A run upgraded between two checkpoints continues exactly: from the loader states of
``tests/fixtures/legacy-states``, written beside DeePMD-kit's checkpoint of step 3 by the release
before the feed (``mdloader-deepmd-loader-state`` of version 1), this release trains, step for
step and task for task, what that release trained after them. Every attribute of DeePMD-kit's
trainer that mdloader's code touched in these runs is in the seam. Each group of launches is
made once per module and asserted on by several tests.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.deepmd_inputs import (
    BATCH,
    NFRAMES,
    make_task_data,
    multi_task_input,
    single_task_input,
)
from support.deepmd_spy import dp_train, lcurve_rows, spied
from support.elastic_ledger import Ledger

from mdloader.integrations.deepmd.seam import SEAM, TRAINING
from mdloader.loading import feed_state

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "legacy-states"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_task_data(tmp_path_factory.mktemp("data"))


def _copy_checkpoint(source: Path, name: str, target: Path) -> None:
    """A checkpoint and its loader state, as real files in another job folder."""
    target.mkdir(parents=True)
    for suffix in ("", ".mdloader"):
        shutil.copy(source / f"{name}{suffix}", target / f"{name}{suffix}")


def _drained_exactly_once(state: dict, before: list[list], after: list[list]) -> None:
    """``before``: each old rank's trained batches; ``after``: the one new rank's. Every frame
    an interrupted pass of the old ranks did not serve is served once, before fresh passes."""
    ledger = Ledger(NFRAMES, BATCH, int(state["seed"]))
    first = ledger.generation([[tuple(b) for b in rank] for rank in before], len(before))
    owed = dict(ledger.owed)
    second = ledger.generation([[tuple(b) for b in after]], 1, drained=True)
    for sid in range(len(NFRAMES)):
        assert second["from_leftover"][sid] == owed[sid], "owed frames lost or served twice"
        assert first["prefix"][sid] + second["from_leftover"][sid] == first["units"][sid]
    assert sum(owed.values(), start=type(owed[0])()), "no pass was interrupted: nothing checked"


# -- one task, one rank: restart, --init-model, --finetune -----------------------------------

@pytest.fixture(scope="module")
def single(data: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("single")
    run = SimpleNamespace(whole=root / "whole", parts=root / "parts")
    dp_train(run.whole, single_task_input(data), steps=6)
    run.whole_drawn = spied(run.whole)[0]["drawn"]["Default"]
    dp_train(run.parts, single_task_input(data), steps=3)
    run.state_files = sorted((p.name, p.resolve().name) for p in run.parts.glob("*.mdloader"))
    run.link = (run.parts / "model.ckpt.pt").is_symlink()
    run.restart_log = dp_train(run.parts, single_task_input(data), "--restart",
                               "model.ckpt.pt", steps=6)
    run.restart_drawn = spied(run.parts)[0]["drawn"]["Default"]
    source = str(run.parts / "model.ckpt-3.pt")
    assert (run.parts / "model.ckpt-3.pt.mdloader").is_file()
    run.fresh = {}
    for option in ("--init-model", "--finetune"):
        job = root / option.strip("-")
        run.fresh[option] = (dp_train(job, single_task_input(data), option, source, steps=3),
                             spied(job)[0]["drawn"]["Default"])
    return run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_restart_continues_the_streams_of_an_uninterrupted_run(single: SimpleNamespace
                                                                  ) -> None:
    # one state, and DeePMD-kit's link to the latest checkpoint's files links it too
    assert single.state_files == [("model.ckpt-3.pt.mdloader", "model.ckpt-3.pt.mdloader"),
                                  ("model.ckpt.pt.mdloader", "model.ckpt-3.pt.mdloader")]
    assert single.link
    assert "restored the loader state" in single.restart_log
    assert "lr_scheduler.step()" not in single.restart_log  # torch's warning, from the skip
    assert lcurve_rows(single.parts, 3) == lcurve_rows(single.whole, 3)
    assert len(lcurve_rows(single.whole, 3)) == 3
    assert single.restart_drawn == single.whole_drawn[3:]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("option", ["--init-model", "--finetune"])
def test_init_model_and_finetune_start_fresh_streams(single: SimpleNamespace,
                                                     option: str) -> None:
    log, drawn = single.fresh[option]
    assert single.whole_drawn[:3] != single.whole_drawn[3:], "the check could not tell"
    assert drawn == single.whole_drawn[:3]
    assert "restored the loader state" not in log and "no mdloader loader state" not in log


def test_a_checkpoint_without_loader_state_restarts_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from mdloader.integrations.deepmd.hooks import restart_state
    from mdloader.loading import feed_state

    checkpoint = tmp_path / "model.ckpt-6.pt"
    checkpoint.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        assert restart_state(SimpleNamespace(rank=0), str(checkpoint)) is None
        assert restart_state(SimpleNamespace(rank=1), str(checkpoint)) is None
    assert [r.getMessage().count("no mdloader loader state beside it")
            for r in caplog.records] == [1], "rank 0 says it, once"
    state = feed_state.document({}, next_step=3, world_size=1, seed=7)
    feed_state.write_beside(checkpoint, state)
    assert restart_state(SimpleNamespace(rank=0), str(checkpoint)) == state
    assert restart_state(SimpleNamespace(rank=0), None) is None  # no --restart


# -- one task, 2 -> 1 ranks ------------------------------------------------------------------

@pytest.fixture(scope="module")
def single_elastic(data: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    job = tmp_path_factory.mktemp("single_elastic")
    dp_train(job, single_task_input(data), steps=3, world=2)
    run = SimpleNamespace(before=[r["drawn"]["Default"] for r in spied(job, 2)])
    run.state = json.loads((job / "model.ckpt-3.pt.mdloader").read_text())
    run.log = dp_train(job, single_task_input(data), "--restart", "model.ckpt.pt", steps=9)
    run.after = spied(job)[0]["drawn"]["Default"]
    run.steps = [int(row.split()[0]) for row in lcurve_rows(job, 3)]
    return run


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_two_ranks_restarted_on_one_finish_each_interrupted_pass_once(
        single_elastic: SimpleNamespace) -> None:
    run = single_elastic
    assert run.state["world_size"] == 2 and run.state["next_step"] == 3
    assert set(run.state["streams"]) == {"training", "validation"}
    assert "restored the loader state" in run.log and run.steps == [4, 5, 6, 7, 8, 9]
    _drained_exactly_once(run.state["streams"]["training"], run.before, run.after)


# -- two tasks, two ranks: restart on 2, and on 1 --------------------------------------------

@pytest.fixture(scope="module")
def multi(data: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("multi")
    run = SimpleNamespace(whole=root / "whole", parts=root / "parts", elastic=root / "elastic")
    same = {"MDLOADER_TASK_DRAW": "same"}   # the per-rank default: test_deepmd_tasks.py
    dp_train(run.whole, multi_task_input(data), steps=6, world=2, env=same)
    run.whole_ranks = spied(run.whole, 2)
    dp_train(run.parts, multi_task_input(data), steps=3, world=2, env=same)
    run.before = spied(run.parts, 2)
    run.state = json.loads((run.parts / "model.ckpt-3.pt.mdloader").read_text())
    _copy_checkpoint(run.parts, "model.ckpt-3.pt", run.elastic)
    dp_train(run.parts, multi_task_input(data), "--restart", "model.ckpt.pt", steps=6, world=2,
             env=same)
    run.restarted = spied(run.parts, 2)
    dp_train(run.elastic, multi_task_input(data), "--restart", "model.ckpt-3.pt", steps=24)
    run.after = spied(run.elastic)[0]
    run.touched = {tuple(t) for spy in [*run.whole_ranks, *run.before, *run.restarted,
                                        run.after] for t in spy["touched"]}
    return run


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_multi_task_restart_on_two_ranks_equals_an_uninterrupted_run(
        multi: SimpleNamespace) -> None:
    # MDLOADER_TASK_DRAW=same: every rank trains the step's task; both tasks are trained
    ranks = [rank["tasks"] for rank in multi.whole_ranks]
    assert ranks[0] == ranks[1] and len(ranks[0]) == 6 and len(set(ranks[0])) == 2
    # two launches write the same rows (the stopped run's 3 are the whole run's first 3)
    assert lcurve_rows(multi.parts)[:3] == lcurve_rows(multi.whole)[:3]
    assert lcurve_rows(multi.parts, 3) == lcurve_rows(multi.whole, 3)
    assert len(lcurve_rows(multi.whole, 3)) == 3
    # every task's training, validation and display streams, and the schedule's seed
    assert set(multi.state["streams"]) == {f"{role}.{t}" for role in
                                           ("training", "validation", "display")
                                           for t in ("a", "b")}
    assert multi.state["seed"] == 7


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_multi_task_run_on_two_ranks_restarted_on_one_finishes_each_pass_once(
        multi: SimpleNamespace) -> None:
    assert len(multi.after["tasks"]) == 24 - 3
    for task in ("a", "b"):
        before = [rank["drawn"].get(task, []) for rank in multi.before]
        _drained_exactly_once(multi.state["streams"][f"training.{task}"], before,
                              multi.after["drawn"][task])


# -- a stream per task, and one more for the display -----------------------------------------

@pytest.fixture(scope="module")
def tasks(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("tasks")
    inputs = {"two": multi_task_input(data),
              "two, displayed once": multi_task_input(data, disp_freq=100),
              "three": multi_task_input(data, ("a", "b", "c"), data={"c": "a"})}
    inputs["three"]["training"]["model_prob"]["c"] = 0.5   # b and c each train in 8 steps
    runs = {}
    for name, config in inputs.items():
        job = root / name.replace(", ", "-").replace(" ", "_")
        dp_train(job, config, steps=8)
        runs[name] = spied(job)[0]
    return runs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_adding_a_task_leaves_another_tasks_batches_unchanged(tasks: dict[str, dict]) -> None:
    before, after = tasks["two"]["drawn"], tasks["three"]["drawn"]
    for task in ("a", "b"):
        common = min(len(before[task]), len(after[task]))
        assert common >= 1
        assert after[task][:common] == before[task][:common]
    # c trains on a's systems, from a stream of its own
    common = min(len(after["a"]), len(after["c"]))
    assert common >= 1 and after["c"][:common] != after["a"][:common]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_logging_at_every_step_trains_the_same_batches(tasks: dict[str, dict]) -> None:
    """At a display step DeePMD-kit evaluates a batch of every task not trained: from the
    task's display stream, so a display at every step (8 of them, each drawing the other
    task's batch) trains what a display at the first step only trains."""
    often, once = tasks["two"], tasks["two, displayed once"]
    assert often["tasks"] == once["tasks"] and len(set(often["tasks"])) == 2
    assert often["drawn"] == once["drawn"]


def test_a_tasks_seed_folds_in_its_key_and_a_single_task_keeps_the_job_seed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mdloader.integrations.deepmd import systems
    from mdloader.sampling.order import AgreedSeed
    from mdloader.sampling.tasks import display_stream_seed, task_stream_seed

    def job(config: dict) -> systems.DeepmdJob:
        return systems.DeepmdJob(config, {})

    data = {"training_data": {"systems": ["/d"], "batch_size": 1}}
    multi = job({"model": {"model_dict": {"a": {}, "b": {}}},
                 "training": {"data_dict": {"a": data, "b": data}, "seed": 7}})
    a, b = systems.Place("a", "training"), systems.Place("b", "training")
    assert multi.stream_seed(a, [0, 7]) == AgreedSeed(task_stream_seed(7, "a"), True)
    assert multi.stream_seed(a, 7) == multi.stream_seed(a, [0, 7])
    assert multi.stream_seed(b, 7).value != multi.stream_seed(a, 7).value
    assert multi.stream_seed(a, 8).value != multi.stream_seed(a, 7).value
    unseeded = job({"model": {"model_dict": {"a": {}}},
                    "training": {"data_dict": {"a": data}}})
    drawn = unseeded.job_seed()  # agreed once (one process: drawn here), the job's for all
    assert not drawn.given and unseeded.job_seed() is drawn
    assert unseeded.stream_seed(a, None) == AgreedSeed(task_stream_seed(drawn.value, "a"), False)
    single = job({"training": {**data, "seed": 7}})
    assert single.stream_seed(systems.Place(None, "training"), [0, 7]) == AgreedSeed(7, True)
    assert single.sections[systems.Place(None, "training")].key == \
        "training.training_data.systems"
    seeds = {display_stream_seed(task_stream_seed(7, t)) for t in ("a", "b")}
    assert len(seeds | {task_stream_seed(7, "a"), task_stream_seed(7, "b")}) == 4


# -- an upgrade between two checkpoints; the seam -----------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["single", "multi", "multi-unseeded"])
def test_a_loader_state_of_the_earlier_format_continues_exactly(
        data: Path, single: SimpleNamespace, multi: SimpleNamespace, tmp_path: Path,
        name: str) -> None:
    """DeePMD-kit's checkpoint of step 3 of this module's runs (the weights choose no batch:
    the two-task one serves the job without a seed too), with the earlier release's loader
    state beside it; and the loader state this release writes next holds the same stream
    positions (an unseeded job adopts the saved schedule and stream seeds)."""
    config = single_task_input(data) if name == "single" else multi_task_input(data)
    if name.endswith("unseeded"):
        del config["training"]["seed"]
    expected = json.loads((FIXTURES / f"deepmd-{name}.json").read_text())
    shutil.copy((single.parts if name == "single" else multi.parts) / "model.ckpt-3.pt",
                tmp_path / "model.ckpt-3.pt")
    shutil.copy(FIXTURES / f"deepmd-{name}.mdloader", tmp_path / "model.ckpt-3.pt.mdloader")
    log = dp_train(tmp_path, config, "--restart", "model.ckpt-3.pt", steps=6)
    assert "restored the loader state" in log
    (run,) = spied(tmp_path)
    assert (run["tasks"], run["drawn"]) == (expected["tasks"], expected["drawn"])
    final = feed_state.read_beside(tmp_path / "model.ckpt-6.pt")
    old = feed_state.read(expected["final"])
    assert final is not None and final["streams"] == old["streams"]
    assert final["next_step"] == old["next_step"] == 6
    if old["seed"] is not None:
        assert final["seed"] == old["seed"]


@pytest.mark.slow
def test_mdloader_dp_touches_only_trainer_attributes_the_seam_lists(
        multi: SimpleNamespace) -> None:
    """Recorded in this module's two-task runs (tests/support/deepmd_spy.py: a run, a stopped
    one and its restart on two ranks, an elastic restart on one): every attribute of
    DeePMD-kit's trainer that mdloader's code read or wrote is a name of the seam, and a written
    one is listed as written."""
    listed = {e.name.split(".", 1)[1]: e.use for e in SEAM
              if e.module == TRAINING and e.name.startswith("Trainer.")}
    names = {name for _, name in multi.touched}
    assert sorted(names - set(listed)) == [], "touched, and not in the seam"
    written = {name for use, name in multi.touched if use == "write"}
    assert sorted(n for n in written if listed[n] != "write") == [], "written, listed otherwise"
    # the recorder saw the adapter at work: the feed's iterators, the restart, the tasks
    assert {"training_data", "start_step", "scheduler", "model_keys", "model_prob"} <= names

