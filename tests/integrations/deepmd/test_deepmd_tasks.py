"""mdloader's multi-task schedule under DeePMD-kit's own trainer (``mdloader dp``).

DeePMD-kit's own DPA-2 multi-task example (two heads sharing a DPA-2 descriptor, on the water
data), shrunk to tiny sizes and a few steps, trains at W = 1 and 2: two launches at W = 2 train
the same tasks and write the same ``lcurve.out``; its ``num_epoch_dict`` variant meets the
per-task targets exactly at W = 1. (The same task on every rank on request,
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

import pytest
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


def dpa2_example(tmp_path: Path, name: str, training: dict) -> Path:
    """DeePMD-kit's example ``name`` in its layout (``water/data`` beside it), shrunk, with
    ``training`` merged into its training section; returns the folder to run it in."""
    root = tmp_path / "examples"
    if not root.exists():
        shutil.copytree(EXAMPLE, root / "water_multi_task")
        (root / "water").mkdir()
        (root / "water" / "data").symlink_to(REPO / "examples" / "water" / "data")
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


def test_schedule_of_reads_deepmd_kit_training_section(monkeypatch: pytest.MonkeyPatch) -> None:
    from mdloader.errors import ConfigError, MdloaderError
    from mdloader.integrations.deepmd.training import ScheduledTasks, schedule_of

    monkeypatch.delenv("MDLOADER_TASK_DRAW", raising=False)
    drawn = schedule_of(7, {"seed": 7}, [0.25, 0.75], 10)
    assert (drawn.seed, drawn.window, drawn.same_task_across_ranks) == (7, 0, False)
    exact = schedule_of(11, {"seed": None, "num_epoch_dict": {"a": 1, "b": 1}}, [0.6, 0.4], 5)
    assert (exact.seed, exact.window) == (11, 5)
    assert exact.counts(0, 0, 5).tolist() == [3, 2]
    monkeypatch.setenv("MDLOADER_TASK_DRAW", "same")
    assert schedule_of(7, {"seed": 7}, [0.5, 0.5], 4).same_task_across_ranks
    monkeypatch.setenv("MDLOADER_TASK_DRAW", "both")
    with pytest.raises(ConfigError, match="MDLOADER_TASK_DRAW"):
        schedule_of(7, {"seed": 7}, [0.5, 0.5], 4)
    with pytest.raises(MdloaderError, match="outside Trainer.run"):
        ScheduledTasks().choice(2, p=[0.5, 0.5])


class _Trainer:
    """Stands for a trainer (kept by weak reference)."""


def test_an_unseeded_job_adopts_the_schedule_seed_of_its_loader_state() -> None:
    from mdloader.errors import StateDictError
    from mdloader.integrations.deepmd import training

    trainer = _Trainer()
    saved = dict(training.SCHEDULED_TASKS.training)
    try:
        training.SCHEDULED_TASKS.training = {"seed": None}
        drawn = training.schedule_seed(trainer)          # rank 0's random seed (one process)
        assert training.schedule_seed(trainer) == drawn  # drawn once per trainer
        training.restore_schedule_seed(trainer, 12345)
        assert training.schedule_seed(trainer) == 12345
        training.SCHEDULED_TASKS.training = {"seed": 7}
        with pytest.raises(StateDictError, match="seed 12345 but the input has training.seed 7"):
            training.restore_schedule_seed(_Trainer(), 12345)
    finally:
        training.SCHEDULED_TASKS.training = saved


def test_deepmd_kits_full_validation_is_refused_in_one_line() -> None:
    from mdloader.errors import ConfigError
    from mdloader.integrations.deepmd.training import refusing_full_validation

    class Trainer:
        def __init__(self, full: bool) -> None:
            self.full_validator = object() if full else None

    Trainer.__init__ = refusing_full_validation(Trainer.__init__)
    assert Trainer(False).full_validator is None
    with pytest.raises(ConfigError, match=r"^validating.full_validation: DeePMD-kit's full "):
        Trainer(True)
