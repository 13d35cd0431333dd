"""``mdloader check --for`` gives the verdict of the command that will run the input: under
``--for dp`` the same line and exit code as ``mdloader dp``'s pre-flight
(:func:`~mdloader.config.unsupported.refuse_under_deepmd`, one place for the rules), under
``--for train`` ``mdloader train``'s. A launch of ``mdloader dp`` compares the lines
(tests/integrations/deepmd/test_deepmd_faults.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from support.inputs import write_input

from mdloader.cli.main import main
from mdloader.config.unsupported import refuse_under_deepmd
from mdloader.errors import ConfigError
from mdloader.testing import make_lmdb, make_system


def _single(tmp_path: Path) -> dict:
    system = make_system(tmp_path / "data", "s0", natoms=4, nframes=4, keys=("energy", "force"))
    return {"model": {"type_map": ["O", "H"]}, "training": {
        "training_data": {"systems": [str(system)], "batch_size": 1}, "numb_steps": 2}}


def _multitask(tmp_path: Path) -> dict:
    single = _single(tmp_path)
    return {"model": {"model_dict": {t: {"type_map": ["O", "H"]} for t in ("a", "b")}},
            "training": {"data_dict": {t: copy.deepcopy(single["training"]) for t in ("a", "b")},
                         "numb_steps": 2}}


def _dp_line(data: dict) -> str:
    """The line ``mdloader dp`` prints for ``data`` (its pre-flight, through ``main``'s one
    line for a ConfigError)."""
    with pytest.raises(ConfigError) as refused:
        refuse_under_deepmd(data)
    return f"mdloader: error: {refused.value}"


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["check", *argv])
    return code, capsys.readouterr().err.splitlines()


def _full_validation(data: dict) -> str:
    """A full validation DeePMD-kit refuses: multi-task, or without validation data."""
    data["validating"] = {"full_validation": True}
    if "data_dict" in data["training"]:
        return "validating.full_validation only supports single-task energy training"
    return "full validation requires `training.validation_data`"


def _mix(data: dict) -> str:
    holder = data["training"].get("data_dict", {}).get("b", data["training"])
    holder["training_data"]["batch_size"] = "mix:4"
    path = "training.data_dict.b" if "data_dict" in data["training"] else "training"
    return (f"{path}.training_data.batch_size: mix:N batches frames of different atom counts "
            "from one LMDB database")


def _train_only_key(data: dict) -> str:
    holder = data["training"].get("data_dict", {}).get("b", data["training"])
    holder["validation_data"] = dict(holder["training_data"], index_file="index.json")
    path = "training.data_dict.b" if "data_dict" in data["training"] else "training"
    return f"{path}.validation_data.index_file: read by mdloader train only"


def _balance_outside_training_data(data: dict) -> str:
    holder = data["training"].get("data_dict", {}).get("b", data["training"])
    holder["validation_data"] = dict(holder["training_data"], balance_window=4)
    path = "training.data_dict.b" if "data_dict" in data["training"] else "training"
    return f"{path}.validation_data.balance_window: balanced steps apply to training data"


@pytest.mark.parametrize("make", [_single, _multitask])
@pytest.mark.parametrize("spoil", [_full_validation, _mix, _train_only_key,
                                   _balance_outside_training_data])
def test_check_for_dp_refuses_in_the_line_and_code_of_mdloader_dp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], make, spoil) -> None:
    data = make(tmp_path)
    start = spoil(data)
    path = str(write_input(tmp_path, data))
    code, err = _check(capsys, path, "--for", "dp")
    assert (code, err) == (2, [_dp_line(data)])
    assert err[0].startswith(f"mdloader: error: {start}"), err
    if make is _multitask:  # the default for a multi-task input is dp: the only command
        assert _check(capsys, path) == (2, err)


def test_check_for_train_passes_what_mdloader_train_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mdloader train`` leaves DeePMD-kit's ``validating`` to ``dp``: its verdict, the
    default for a single-task input, is OK; ``--for dp`` refuses."""
    data = _single(tmp_path)
    start = _full_validation(data)
    path = str(write_input(tmp_path, data))
    assert _check(capsys, path, "--for", "train") == (0, [])
    assert _check(capsys, path) == (0, [])
    code, err = _check(capsys, path, "--for", "dp")
    assert code == 2 and err == [_dp_line(data)] and start in err[0], err


def test_balanced_steps_pass_every_verdict_of_a_single_task_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both trainers read ``balance_window`` (``mdloader dp`` takes it out of the input before
    DeePMD-kit's strict check)."""
    data = _single(tmp_path)
    data["training"]["training_data"].update(balance_window=4, balance_cost="atoms")
    path = str(write_input(tmp_path, data))
    for extra in ((), ("--for", "train"), ("--for", "dp")):
        assert _check(capsys, path, *extra) == (0, []), extra


def test_balanced_steps_of_a_multitask_input_need_the_same_task_on_every_rank(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under per-rank task draws (the default) ``check`` refuses in ``mdloader dp``'s line,
    naming the key and the setting; with ``MDLOADER_TASK_DRAW=same`` both accept."""
    data = _multitask(tmp_path)
    data["training"]["data_dict"]["b"]["training_data"]["balance_window"] = 4
    path = str(write_input(tmp_path, data))
    monkeypatch.delenv("MDLOADER_TASK_DRAW", raising=False)
    code, err = _check(capsys, path, "--for", "dp")
    assert (code, err) == (2, [_dp_line(data)]), err
    assert err[0].startswith("mdloader: error: training.data_dict.b.training_data."
                             "balance_window: balanced steps of a multi-task job need the same "
                             "task on every rank at each step; set MDLOADER_TASK_DRAW=same"), err
    assert _check(capsys, path) == (2, err)
    monkeypatch.setenv("MDLOADER_TASK_DRAW", "same")
    assert _check(capsys, path, "--for", "dp") == (0, [])


def test_check_for_train_refuses_a_multitask_input_as_mdloader_train_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(write_input(tmp_path, _multitask(tmp_path)))
    code, err = _check(capsys, path, "--for", "train")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("mdloader: error: model.model_dict: a multi-task input: mdloader "
                             "train trains one task"), err
    assert _check(capsys, path, "--for", "dp")[0] == 0


def test_mix_is_refused_by_every_verdict_on_npy_data(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """On npy systems a batch comes from one system: ``dp`` refuses ``mix:N`` in its line,
    ``train`` (the default for a single-task input) in its own."""
    data = _single(tmp_path)
    _mix(data)
    path = str(write_input(tmp_path, data))
    assert _check(capsys, path, "--for", "dp") == (2, [_dp_line(data)])
    train = ("mdloader: error: training.training_data.batch_size: mix:N batches frames of "
             "different atom counts from one LMDB database (DeePMD-kit 3.2's rule); these "
             "systems are ")
    for extra in ((), ("--for", "train")):
        code, err = _check(capsys, path, *extra)
        assert code == 2 and len(err) == 1 and err[0].startswith(train), (extra, err)


def test_mix_on_one_lmdb_database_passes_for_both_trainers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mdloader dp`` and ``mdloader train`` train ``mix:N`` on an LMDB database: ``--for dp``
    and ``--for train`` pass it, with the statistics' per-system sizes (``max:N``) in the
    table; ``num_epoch`` beside it is refused for dp."""
    data = _single(tmp_path)
    systems = [make_system(tmp_path / "src", f"s{n}", natoms=n, nframes=3, seed=n,
                           keys=("energy", "force")) for n in (3, 5)]
    data["training"]["training_data"] = {"systems": make_lmdb(tmp_path / "t.lmdb", systems),
                                         "batch_size": "mix:10"}
    path = str(write_input(tmp_path, data))
    assert _check(capsys, path, "--for", "dp") == (0, [])
    assert _check(capsys, path, "--for", "train") == (0, [])
    data["training"]["num_epoch"] = 2
    path = str(write_input(tmp_path, data))
    code, err = _check(capsys, path, "--for", "dp")
    assert (code, err) == (2, [_dp_line(data)]) and "training.num_epoch with a mix:N" in err[0]


def test_batch_size_of_system_paths_is_refused_by_its_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """For system paths the rule is ``--batch-size``'s, not a key of a file the user never
    wrote; ``--for`` applies to an input.json only."""
    system = make_system(tmp_path / "data", "s0", natoms=4, nframes=4)
    code, err = _check(capsys, system, "--batch-size", "mix:4")
    assert code == 2 and len(err) == 1 and err[0].startswith(
        "mdloader: error: --batch-size: Unsupported batch size rule: mix:4 (DeePMD-kit"), err
    assert _check(capsys, system, "--batch-size", "0") == (
        2, ["mdloader: error: --batch-size: a batch size must be a positive integer, got 0"])
    code, err = _check(capsys, system, "--for", "dp")
    assert code == 2 and err[0].startswith("mdloader: error: --for: --for applies to an "
                                           "input.json"), err
