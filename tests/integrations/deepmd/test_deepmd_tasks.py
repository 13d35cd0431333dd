"""mdloader's multi-task schedule under DeePMD-kit's own trainer (``mdloader dp``).

DeePMD-kit's own DPA-2 multi-task example (two heads sharing a DPA-2 descriptor, on the water
data), shrunk to tiny sizes and a few steps, trains at W = 1 and 2: two launches at W = 2 train
the same tasks and write the same ``lcurve.out``; its ``num_epoch_dict`` variant meets the
per-task targets exactly at W = 1; one step of it by DeePMD-kit at W = 1 and by ``mdloader dp``
at W = 1 and 2 saves the same statistics, from one build and one statistics pass of the job
(its two heads share their systems and descriptor). (The same task on every rank on request,
``MDLOADER_TASK_DRAW=same``, is asserted on the two-rank runs of test_deepmd_resume.py.) A spy
(tests/support/deepmd_spy.py) records the task of every step on every rank.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from support.deepmd_env import require_deepmd_python
from support.deepmd_ref import DEEPMD_DP, assert_statistics_equal, run_job, saved_statistics
from support.deepmd_spy import dp_train, lcurve_rows, spied

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "tests" / "fixtures" / "deepmd-examples" / "water_multi_task"

#: DeePMD-kit's DPA-2 example with every size cut down; its switches (three-body repinit,
#: the repformer's updates and gates) are kept.
TINY_REPINIT = {"tebd_dim": 4, "rcut": 3.0, "rcut_smth": 0.5, "nsel": 40, "neuron": [4, 8],
                "axis_neuron": 4, "three_body_sel": 10, "three_body_rcut": 2.5,
                "three_body_rcut_smth": 2.0}
TINY_REPFORMER = {"rcut": 2.5, "rcut_smth": 2.0, "nsel": 12, "nlayers": 1, "g1_dim": 8,
                  "g2_dim": 4, "attn2_hidden": 4, "attn2_nhead": 1, "attn1_hidden": 8,
                  "attn1_nhead": 1}


def dpa2_example(tmp_path: Path, name: str, training: dict, frames: int | None = None) -> Path:
    """DeePMD-kit's example ``name`` in its layout (``water/data`` beside it), shrunk, with
    ``training`` merged into its training section; returns the folder to run it in.
    ``frames``: each set of the water data cut to its first ``frames`` frames."""
    root = tmp_path / "examples"
    if not root.exists():
        shutil.copytree(EXAMPLE, root / "water_multi_task")
        (root / "water").mkdir()
        water = REPO / "examples" / "water" / "data"
        if frames is None:
            (root / "water" / "data").symlink_to(water)
        else:
            _cut_copy(water, root / "water" / "data", frames)
    folder = root / "water_multi_task" / "pytorch_example"
    config = json.loads((folder / name).read_text())
    descriptor = config["model"]["shared_dict"]["dpa2_descriptor"]
    descriptor["repinit"].update(TINY_REPINIT)
    descriptor["repformer"].update(TINY_REPFORMER)
    for head in config["model"]["model_dict"].values():
        head["fitting_net"]["neuron"] = [8]
    config["training"].update({"disp_freq": 1, "save_freq": 100, **training})
    (folder / "tiny.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_dpa2_example_twice_on_two_ranks_trains_the_same_tasks_and_lcurve(
        tmp_path: Path) -> None:
    runs = []
    for launch in ("first", "second"):
        job = dpa2_example(tmp_path / launch, "input_torch.json", {"numb_steps": 3})
        dp_train(job, None, world=2, input_name="tiny.json")
        runs.append((spied(job, 2), lcurve_rows(job)))
    (first, first_curve), (second, second_curve) = runs
    assert [r["tasks"] for r in first] == [r["tasks"] for r in second]
    assert first_curve == second_curve and len(first_curve) == 3
    assert all(len(r["tasks"]) == 3 for r in first)
    assert first[0]["tasks"] != first[1]["tasks"]  # per-rank draws by default


def _cut_copy(source: Path, dest: Path, frames: int) -> None:
    """The systems under ``source`` in ``dest``, each set cut to its first ``frames`` frames."""
    for path in source.rglob("*"):
        target = dest / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".npy":
            np.save(target, np.load(path)[:frames])
        elif path.suffix == ".raw":
            shutil.copyfile(path, target)


@pytest.fixture(scope="module")
def dpa2_statistics(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One step of the shrunk DPA-2 example (neighbour statistics included) by DeePMD-kit at
    W = 1 and by ``mdloader dp`` at W = 1 and 2: each run's saved statistics and log. Its
    systems keep 4 frames a set, so ``data_stat_nbatch`` (10) takes every frame: the frames a
    subset takes are mdloader's draw, not DeePMD-kit's (docs/statistics.md)."""
    peer = require_deepmd_python()
    root = tmp_path_factory.mktemp("dpa2")
    launches = {"deepmd": [peer, "-c", DEEPMD_DP], 1: [peer, "-m", "mdloader", "dp"],
                2: [peer, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "-m", "mdloader", "dp"]}
    runs = {}
    for name, launch in launches.items():
        job = dpa2_example(root / str(name), "input_torch.json",
                           {"numb_steps": 1, "save_freq": 1}, frames=4)
        runs[name] = {"log": run_job([*launch, "--pt", "train", "tiny.json"], job),
                      "stats": saved_statistics(job / "model.ckpt-1.pt")}
    return runs


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2])
def test_the_dpa2_example_saves_deepmd_kits_statistics_from_one_build_and_pass(
        dpa2_statistics: dict, world: int) -> None:
    ours = dpa2_statistics[world]
    log = ours["log"]
    # water_1's training and validation, water_2's training (water_1's systems): 2 requests
    assert log.count("job systems: one build of 3 sections (2 distinct requests") == 1, log
    passes = re.findall(r"statistics pass: (\d+) statistics, (\d+) parts of (\d+) systems .*"
                        r"one all-gather on (\d+) ranks", log)
    # 2 heads x (3 descriptor blocks + the output), the shared systems' 12 parts computed once
    assert passes == [("8", "12", "3", str(world))], log[-4000:]
    # the shared descriptor's neighbour statistics: one pass per block's rcut, not per head
    assert len(re.findall(r"neighbour statistics: 3 systems in", log)) == 2, log[-4000:]
    theirs = dpa2_statistics["deepmd"]["stats"]
    assert {k for k in theirs if "out_bias" in k} and {k for k in theirs if ".mean" in k}
    assert {k.split(".")[1] for k in theirs} >= {"water_1", "water_2"}, sorted(theirs)
    assert_statistics_equal(theirs, ours["stats"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_dpa2_num_epoch_dict_example_meets_its_targets_exactly(tmp_path: Path) -> None:
    """DeePMD-kit turns ``num_epoch_dict`` into per-task target steps (its log line says them)
    and draws each step's task at random, meeting them in expectation only; the schedule trains
    each task exactly its target."""
    job = dpa2_example(tmp_path, "input_torch_num_epoch_dict.json",
                       {"num_epoch_dict": {"water_1": 2.9 / 240, "water_2": 1.9 / 240}})
    log = dp_train(job, None, input_name="tiny.json")
    targets = ast.literal_eval(re.search(r"per-task target steps: (\{.*?\})", log).group(1))
    (run,) = spied(job)
    assert Counter(run["tasks"]) == targets and min(targets.values()) >= 2
    assert len(lcurve_rows(job)) == sum(targets.values())


def _trainer(multi_task: bool, **attrs: object) -> object:
    """What DeePMD-kit's trainer holds that shapes its loop."""
    from types import SimpleNamespace

    base = {"multi_task": multi_task, "disp_freq": 5, "display_in_training": True,
            "disp_avg": False, "num_steps": 10, "model_keys": ["a", "b"],
            "model_prob": [0.25, 0.75], "valid_numb_batch": {"a": 1, "b": 2} if multi_task
            else 3}
    return SimpleNamespace(**{**base, **attrs})


def test_the_loop_of_deepmd_kits_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the feed reads ahead follows the trainer: its tasks and probabilities, its
    displays and validation batches; ``num_epoch_dict`` makes the run one exact-count window;
    ``MDLOADER_TASK_DRAW=same`` one task for all ranks."""
    from mdloader.errors import ConfigError, MdloaderError
    from mdloader.integrations.deepmd import hooks
    from mdloader.sampling.loop import TrainingLoop

    monkeypatch.delenv("MDLOADER_TASK_DRAW", raising=False)
    assert hooks.trainer_loop(_trainer(False), {}) == TrainingLoop(disp_freq=5, validation=(3,))
    drawn = hooks.trainer_loop(_trainer(True), {"seed": 7})
    assert (drawn.tasks, drawn.probs, drawn.window, drawn.validation) == (
        ("a", "b"), (0.25, 0.75), 0, (1, 2))
    assert drawn.display_draws and not drawn.same_task_across_ranks
    assert not hooks.trainer_loop(_trainer(True, disp_avg=True), {}).display_draws
    exact = {"num_epoch_dict": {"a": 1, "b": 1}}
    assert hooks.trainer_loop(_trainer(True), exact).window == 10
    monkeypatch.setenv("MDLOADER_TASK_DRAW", "same")
    assert hooks.trainer_loop(_trainer(True), {}).same_task_across_ranks
    monkeypatch.setenv("MDLOADER_TASK_DRAW", "both")
    with pytest.raises(ConfigError, match="MDLOADER_TASK_DRAW"):
        hooks.trainer_loop(_trainer(True), {})
    with pytest.raises(MdloaderError, match="outside Trainer.run"):
        hooks.ScheduledTasks().choice(2, p=[0.5, 0.5])


@pytest.mark.parametrize("change, line", [
    ({"model": {"model_dict": {}}}, "validating.full_validation only supports single-task "
     "energy training; multi-task training is not supported."),
    ({"loss": {"type": "dos"}}, "validating.full_validation only supports single-task energy "
     "or spin-energy training; got loss.type='dos'."),
    ({"training": {"numb_steps": 2}}, "full validation requires `training.validation_data`. "
     "It is only supported for single-task energy or spin-energy training."),
    ({"training": {"validation_data": {"systems": ["v"]}, "zero_stage": 2}},
     "validating.full_validation only supports single-task energy training with "
     "training.zero_stage < 2."),
])
def test_a_full_validation_deepmd_kit_refuses_is_refused_before_set_up_in_its_words(
        change: dict, line: str) -> None:
    """DeePMD-kit's own refusals (its ``validate_full_validation_config``, run after it read the
    input), made by ``mdloader dp`` before any set-up; what it accepts is sharded
    (test_deepmd_full_validation.py)."""
    from mdloader.config.unsupported import full_validation_runs, refuse_under_deepmd
    from mdloader.errors import ConfigError

    data = {"validating": {"full_validation": True}, **change}
    with pytest.raises(ConfigError) as refused:
        refuse_under_deepmd(data)
    assert str(refused.value) == line
    for off in ({"full_validation": False}, {"full_validation": True, "full_val_start": 1.0},
                {"ema_full_validation": True}):  # EMA's flow needs training.enable_ema
        refuse_under_deepmd({**data, "validating": off})
    assert full_validation_runs({"validating": {"ema_full_validation": True},
                                 "training": {"enable_ema": True}})
    accepted = {"validating": {"full_validation": True}, "loss": {"type": "ener_spin"},
                "training": {"validation_data": {"systems": ["v"]}, "zero_stage": 1}}
    refuse_under_deepmd(accepted)
