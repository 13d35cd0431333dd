"""DeePMD-kit's example inputs through ``mdloader check``, as a DeePMD-kit user runs them.

The inputs are DeePMD-kit's own (``tests/fixtures/deepmd-examples``, see
``tests/fixtures/NOTICE.md``),
laid out as in DeePMD-kit's ``examples/`` with the repository's copy of the water data. Every
input that uses what mdloader supports passes; every other one is refused with one line naming
the feature and its JSON path. Also here: ``check`` on system paths and folders, every problem
of a system, and the flat ``aparam.npy`` of the fparam example read as DeePMD-kit reads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mdloader import DataRequirementItem, DeepmdDataSetForLoader
from mdloader.cli.main import main

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "tests" / "fixtures" / "deepmd-examples"
FPARAM = EXAMPLES / "fparam" / "data" / "e3000_i2000"
DP_MASK = REPO / "tests" / "fixtures" / "deepmd-tests" / "tf" / "data_dp_mask"

ACCEPTED = ["water/se_e2_a/input.json", "water/linear/input.json",
            "fparam/train/input_aparam.json"]
REFUSED = {
    "nopbc/mixed/input.json":
        "training.training_data.batch_size: the batch-size rule 'mixed:4' is TensorFlow-only",
    "spin/se_e2_a/input_tf.json":
        "model.spin.spin_norm: TensorFlow spin models (virtual spin atoms in type.raw) are not "
        "supported by mdloader",
}


MULTITASK = ["water_multi_task/pytorch_example/input_torch.json",
             "water_multi_task/pytorch_example/input_torch_num_epoch_dict.json",
             "water_multi_task/pytorch_example/input_torch_sharefit.json",
             "water_multi_task/pytorch_example/input_torch_with_alias.json",
             "water/dpa4/input_multitask.json"]


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeePMD-kit's layout: ``examples/water/data`` is the repository's identical copy."""
    root = tmp_path_factory.mktemp("examples")
    shutil.copytree(EXAMPLES, root, dirs_exist_ok=True)
    (root / "water" / "data").symlink_to(REPO / "examples" / "water" / "data")
    return root


@pytest.mark.parametrize("name", ACCEPTED)
def test_supported_example_inputs_pass(examples: Path, name: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert "_comment" in (examples / name).read_text()  # DeePMD-kit drops them; so must we
    assert main(["check", str(examples / name)]) == 0, capsys.readouterr()
    assert capsys.readouterr().out.rstrip().endswith("OK: no problem found")


@pytest.mark.parametrize("name", MULTITASK)
def test_multitask_example_inputs_report_every_task(examples: Path, name: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    tasks = list(json.loads((examples / name).read_text())["model"]["model_dict"])
    assert main(["check", str(examples / name), "--json"]) == 0, capsys.readouterr()
    report = json.loads(capsys.readouterr().out)
    assert list(report["tasks"]) == tasks and report["ok"]
    assert sum(report["weights"].values()) == pytest.approx(1.0)
    for task in report["tasks"].values():
        assert task["sections"]["training_data"]["totals"]["systems"] == 3
    assert main(["check", str(examples / name)]) == 0
    out = capsys.readouterr().out
    assert all(f"=== task {t}" in out for t in tasks)
    assert out.rstrip().endswith(f"OK: no problem found in {len(tasks)} task(s)")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_example_inputs_are_refused_in_one_line(examples: Path, name: str,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert main(["check", str(examples / name)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"mdloader: error: {REFUSED[name]}")


def test_lmdb_example_reads_databases_packed_from_the_water_data(
        examples: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DeePMD-kit's LMDB example, on databases `mdloader pack` writes from the water data."""
    folder, water = examples / "lmdb_downsample_data", REPO / "examples" / "water" / "data"
    train = [str(water / f"data_{i}") for i in range(3)]
    assert main(["pack", *train, str(folder / "water_training.lmdb")]) == 0
    assert main(["pack", str(water / "data_3"), str(folder / "water_validation.lmdb")]) == 0
    capsys.readouterr()
    assert main(["check", str(folder / "input_lmdb.json")]) == 0
    out = capsys.readouterr().out
    assert f"{folder}/water_training.lmdb#system=2,natoms=192" in out
    assert out.rstrip().endswith("OK: no problem found")


def test_fparam_example_notes_the_reshaped_aparam(examples: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(examples / "fparam/train/input_aparam.json"), "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["sections"]["training_data"]["notes"]
    assert notes == [f"{examples}/fparam/data/{s}/set.000/aparam.npy of shape (1, 5400) is read "
                     f"as (100, 54): frames x values" for s in ("e3000_i2000", "e8000_i2000")]


def test_flat_aparam_reads_as_deepmd_whole_set_reader() -> None:
    """DeePMD-kit's ``DeepmdData._load_data``: reshape the set to (frames, natoms * ndof), then
    put the atoms in type order; fparam (100,) is one value per frame."""
    ds = DeepmdDataSetForLoader(str(FPARAM))
    ds.add_data_requirement([DataRequirementItem("aparam", 1, atomic=True),
                             DataRequirementItem("fparam", 1)])
    raw = np.load(FPARAM / "set.000" / "aparam.npy").reshape(100, 54)
    order = np.argsort(np.loadtxt(FPARAM / "type.raw", dtype=int), kind="stable")
    fids = [0, 57, 99]
    batch = ds.get_batch(fids)
    np.testing.assert_array_equal(batch["aparam"].numpy()[..., 0], raw[fids][:, order])
    fparam = np.load(FPARAM / "set.000" / "fparam.npy")
    np.testing.assert_array_equal(batch["fparam"].numpy()[:, 0], fparam[fids])


def test_check_takes_system_paths_and_folders(capsys: pytest.CaptureFixture[str]) -> None:
    water = REPO / "examples" / "water" / "data"
    assert main(["check", str(water), str(water / "data_0"), "--type-map", "O", "H",
                 "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(str(water))]
    assert [r[0] for r in rows] == [str(water / f"data_{i}") for i in (0, 1, 2, 3, 0)]
    assert {r[3] for r in rows} == {"2"} and out.rstrip().endswith("OK: no problem found")


def test_check_reports_every_problem_of_a_system(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(DP_MASK), "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert [(p["system"], p["message"].split(";")[0]) for p in problems] == [
        (str(DP_MASK), "frame counts disagree within set.000: coord.npy has 4 frames")] * 2
    assert [p["message"].split("file: ")[1].split(";")[0] for p in problems] == [
        f"{DP_MASK}/set.000/box.npy", f"{DP_MASK}/set.000/energy.npy"]


def test_check_options_and_inputs_do_not_mix(examples: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    name = str(examples / "water/linear/input.json")
    assert main(["check", name, "--type-map", "O", "H"]) == 2
    assert capsys.readouterr().err.startswith("mdloader: error: --type-map: --type-map and "
                                              "--batch-size apply to system paths")
    assert main(["check", name, str(DP_MASK)]) == 2
    assert capsys.readouterr().err == ("mdloader: error: INPUT: give either one input.json or "
                                       "system paths, not both\n")
