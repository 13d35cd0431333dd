"""The command line: every subcommand in-process, as a real program, and under torchrun."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support.inputs import write_input

from mdloader.cli.main import main
from mdloader.distributed.torch_versions import launcher_keeps_the_store
from mdloader.logs import setup_logging
from mdloader.testing import make_system
from mdloader.world import World

ROOT = Path(__file__).resolve().parents[2]


def _data(tmp_path: Path, *, broken: dict[str, str] | None = None) -> Path:
    """Two good training systems, one validation system, plus named broken ones."""
    data = tmp_path / "data"
    for i, n in enumerate((5, 6)):
        make_system(data, f"train{i}", natoms=n, nframes=8, seed=i, keys=("energy", "force"))
    make_system(data / "valid", "v0", natoms=6, nframes=4, seed=5, keys=("energy", "force"))
    for name, kind in (broken or {}).items():
        make_system(data, name, natoms=5, nframes=4, broken=kind, keys=("energy", "force"))
    return data


def _input(tmp_path: Path, training: dict | None = None, data: dict | None = None) -> Path:
    raw = {"model": {"type_map": ["O", "H"], "descriptor": {"type": "se_e2_a", "rcut": 6.0}},
           "loss": {"type": "ener"},
           "training": {"training_data": {"systems": ["data"], "rglob_patterns": ["train*"],
                                          "batch_size": 2, **(data or {})},
                        "validation_data": {"systems": "data/valid", "batch_size": 1},
                        "numb_steps": 4, "seed": 3, "disp_freq": 2, "save_freq": 2,
                        **(training or {})}}
    return write_input(tmp_path, raw)


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("check", "bench", "train", "convert", "dp"):
        assert command in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "mdloader 0.1.0"
    assert main([]) == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2


def test_check_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _data(tmp_path)
    assert main(["check", str(_input(tmp_path)), "--deep"]) == 0
    out = capsys.readouterr().out
    assert "== training_data: 2 system(s)" in out and "== validation_data: 1 system(s)" in out
    assert out.rstrip().endswith("OK: no problem found")
    row = next(line for line in out.splitlines() if line.startswith(str(tmp_path / "data/train0")))
    assert row.split()[1:] == ["5", "8", "2", "4", "0.500", "T"]
    assert main(["check", str(_input(tmp_path)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["problems"] == [] and report["deep"] is False
    assert report["sections"]["training_data"]["totals"] == {
        "systems": 2, "frames": 16, "atoms": 88, "batches": 8, "prob": 1.0}


def test_check_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _data(tmp_path, broken={"train_nobox": "no_box", "train_short": "frame_mismatch"})
    assert main(["check", str(_input(tmp_path))]) == 1
    out = capsys.readouterr().out
    assert "2 problem(s):" in out
    assert "a periodic system needs box.npy" in out and "train_nobox" in out
    assert "frame counts disagree within set.000" in out and "train_short" in out


def test_check_deep_finds_nan_frames(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _data(tmp_path)
    force = data / "train1" / "set.000" / "force.npy"
    arr = np.load(force)
    arr[[2, 5], 4] = [np.nan, np.inf]
    np.save(force, arr)
    assert main(["check", str(_input(tmp_path))]) == 0  # headers are fine, and it says so
    assert capsys.readouterr().out.endswith(
        "(headers only: the values were not read; --deep reads every array and finds NaN/inf)"
        "\nOK: no problem found\n")
    assert main(["check", str(_input(tmp_path)), "--deep", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert problems == [{"section": "training_data", "system": str(data / "train1"),
                         "message": f"NaN/inf in {force}: 2 frame(s), system frame ids 2, 5",
                         "config": False}]


def test_check_deep_reads_hdf5(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import h5py

    address = make_system(tmp_path, "grp", natoms=4, nframes=3, backend="hdf5",
                          keys=("energy", "force"))
    with h5py.File(tmp_path / "data.h5", "r+") as fh:
        fh["grp/set.000/energy.npy"][1] = np.nan
    config = {"training": {"training_data": {"systems": "data.h5", "batch_size": 1}}}
    assert main(["check", str(write_input(tmp_path, config, "in.json")), "--deep"]) == 1
    out = capsys.readouterr().out
    assert address in out
    assert "NaN/inf in " in out and "energy.npy: 1 frame(s), system frame ids 1" in out


def test_check_reports_config_level_problems(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _data(tmp_path)
    path = _input(tmp_path, data={"batch_size": [1, 2, 3]})
    assert main(["check", str(path)]) == 2  # a configuration error, as in train
    assert ("[training_data] training.training_data.batch_size: batch size list has 3 entries "
            "but there are 2 systems") in capsys.readouterr().out
    path = _input(tmp_path, data={"rglob_patterns": ["nothing*"]})
    assert main(["check", str(path)]) == 1
    assert "no DeePMD system" in capsys.readouterr().out
    path = _input(tmp_path, data={"systems": ["data", "nope"]})
    assert main(["check", str(path)]) == 2
    assert (f"[training_data] training.training_data.systems[1]: {tmp_path / 'nope'} does not "
            "exist") in capsys.readouterr().out


def test_config_errors_exit_2_without_traceback(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = _input(tmp_path, data={"batch_size": "auto:x"})
    for command in (["check"], ["bench"], ["train"]):
        assert main(command + [str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mdloader: error: training.training_data.batch_size: Unsupported "
                              "batch size rule: auto:x")
        assert "Traceback" not in err
    assert main(["check", str(path), "--debug"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the input file" in capsys.readouterr().err
    assert main(["bench", str(path), "--batches", "0"]) == 2
    assert main(["train", str(path), "--rcut", "0"]) == 2
    good = _input(tmp_path)
    capsys.readouterr()
    assert main(["train", str(good), "--stop-after", "0"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("mdloader train: error: argument "
                                                        "--stop-after: must be at least 1, got 0")
    assert main(["train", str(good), "--numb-steps", "-1", "--rcut", "2.5"]) == 2


def test_index_build_inspect_refresh(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _data(tmp_path)
    monkeypatch.setenv("MDLOADER_INDEX_SETTLE", "0.05")
    time.sleep(0.1)  # the data's file times fall behind the build by the settling margin
    named = tmp_path / "indexes" / "train.mdlidx"
    inp = _input(tmp_path, data={"index_file": "indexes/train.mdlidx"})
    assert main(["index", "inspect", str(inp)]) == 1  # nothing built yet
    assert "training.training_data: missing: " + str(named) in capsys.readouterr().out
    assert main(["index", "build", str(inp)]) == 0
    out = capsys.readouterr().out
    assert f"training.training_data: built: {named} (2 systems, 16 frames; 2 described" in out
    assert "training.validation_data: built: " in out and named.is_file()
    assert main(["index", "inspect", str(inp), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["state"], r["systems"], r["changed"]) for r in rows] == [("unchanged", 2, 0),
                                                                         ("unchanged", 1, 0)]
    assert rows[0]["header"]["request"]["type_map"] == ["O", "H"]
    assert main(["index", "inspect", str(named)]) == 0
    assert capsys.readouterr().out.startswith(f"index: unchanged: {named} (2 systems")
    (tmp_path / "data" / "train1" / "nopbc").touch()
    assert main(["index", "inspect", str(named)]) == 1
    assert "1 systems changed since" in capsys.readouterr().out
    assert main(["index", "build", str(inp)]) == 0
    assert f"updated: {named} (2 systems, 16 frames; 1 described, 1 reused" in (
        capsys.readouterr().out)
    assert main(["index", "refresh", str(inp)]) == 0
    assert "2 described, 0 reused" in capsys.readouterr().out


def test_bench_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _data(tmp_path)
    assert main(["bench", str(_input(tmp_path)), "--batches", "6", "--num-workers", "1",
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["rank"], row["world_size"], row["nsys"], row["batches"]) == (0, 1, 2, 6)
    assert row["frame/s"] == pytest.approx(2 * row["batch/s"])
    assert row["rss_MB"] > 0 and row["setup_s"] >= row["build_s"]
    assert main(["bench", str(_input(tmp_path)), "--batches", "3", "--num-workers", "0"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["rank", "nsys", "setup_s"]
    assert main(["bench", str(_input(tmp_path)), "--batches", "3", "--num-workers", "-1"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "mdloader bench: error: argument --num-workers: must be at least 0, got -1")
    wrong = _input(tmp_path, data={"batch_size": [1, 2, 3]})  # 2 systems
    assert main(["bench", str(wrong), "--batches", "3", "--num-workers", "0"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "mdloader: error: training.training_data.batch_size: batch size list has 3 entries but "
        "there are 2 systems")
    assert table[-1].startswith("(1 rank(s), 0 DataLoader worker(s) per rank, 3 batches per "
                                "rank; batch/s, frame/s and atom/s count from the first batch on")


def test_train_in_process_and_log_file(tmp_path: Path) -> None:
    _data(tmp_path)
    log_path = tmp_path / "train.log"
    assert main(["train", str(_input(tmp_path)), "-o", str(tmp_path / "out"), "--rcut", "2.5",
                 "--num-workers", "0", "--log-path", str(log_path), "-v", "debug"]) == 0
    assert len((tmp_path / "out" / "lcurve.out").read_text().splitlines()) == 1 + 3
    text = log_path.read_text()
    assert "INFO    mdloader.train.job: saved checkpoint" in text and "DEBUG" in text


def test_other_ranks_only_warn(tmp_path: Path) -> None:
    setup_logging("DEBUG", world=World(rank=1, world_size=2))
    try:
        assert logging.getLogger("mdloader").level == logging.WARNING
        setup_logging("DEBUG", str(tmp_path / "l"), world=World(rank=1, world_size=2),
                      all_ranks=True)
        assert logging.getLogger("mdloader").level == logging.DEBUG
        assert (tmp_path / "l.rank1").exists()
    finally:
        setup_logging("INFO", world=World())


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run with a hard timeout that kills the whole process group (torchrun's children too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.timeout(180)
def test_real_program(tmp_path: Path) -> None:
    """``python -m mdloader`` and the ``mdloader`` console script, one run per subcommand."""
    _data(tmp_path)
    path = str(_input(tmp_path))
    py = [sys.executable, "-m", "mdloader"]
    runs = {
        "check": py + ["check", path],
        "bench": py + ["bench", path, "--batches", "4", "--num-workers", "0"],
        "train": py + ["train", path, "-o", "out", "--rcut", "2.5", "--num-workers", "0"],
        "convert": py + ["convert", str(tmp_path / "data" / "train0"), "conv.h5",
                         "--from", "deepmd/npy", "--to", "deepmd/hdf5"],
    }
    for name, cmd in runs.items():
        done = _run(cmd, tmp_path, 90)
        assert done.returncode == 0, f"{name}: {done.stderr}"
    assert (tmp_path / "out" / "lcurve.out").exists() and (tmp_path / "conv.h5").exists()
    bad = _run(py + ["check", str(tmp_path / "nope.json")], tmp_path, 60)
    assert bad.returncode == 2 and bad.stderr.startswith("mdloader: error: cannot read")
    script = shutil.which("mdloader")
    if script is not None:
        done = _run([script, "--version"], tmp_path, 60)
        assert (done.returncode, done.stdout.strip()) == (0, "mdloader 0.1.0")


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "mdloader", *args]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun_train_and_restart(tmp_path: Path) -> None:
    _data(tmp_path)
    path = str(_input(tmp_path, training={"numb_steps": 6}))
    common = ["--rcut", "2.5", "--num-workers", "1"]
    full = _run(_torchrun(["train", path, "-o", "full", *common]), tmp_path, 120)
    assert full.returncode == 0, full.stderr
    assert "[rank 0] INFO" in full.stderr and "[rank 1] INFO" not in full.stderr
    ckpt = torch.load(tmp_path / "full" / "model.ckpt.pt", weights_only=True)
    generations = ckpt["loader_state"]["streams"]["training"]["generations"]
    assert ckpt["world_size"] == 2 and generations == [[2, 6, 6]]
    part = _run(_torchrun(["train", path, "-o", "part", "--stop-after", "3", *common]),
                tmp_path, 120)
    assert part.returncode == 0, part.stderr
    one = _run([sys.executable, "-m", "mdloader", "train", path, "-o", "one", "--restart",
                "part/model.ckpt-3.pt", "--full-validation", *common], tmp_path, 120)
    assert one.returncode == 0, one.stderr
    assert "on 1 rank(s), written by 2: elastic resume" in one.stderr
    assert [line.split()[0] for line in (tmp_path / "one" / "lcurve.out").read_text()
            .splitlines()[1:]] == ["4", "6"]
    full_valid = (tmp_path / "one" / "full_valid.out").read_text().splitlines()
    assert [line.split()[0] for line in full_valid[1:]] == ["4", "6"]
    assert all(line.split()[3] == "4" for line in full_valid[1:])  # the 4 validation frames
    ckpt = torch.load(tmp_path / "one" / "model.ckpt.pt", weights_only=True)
    assert ckpt["loader_state"]["streams"]["training"]["generations"] == [[2, 3, 3], [1, 3]]
    rest = _run(_torchrun(["train", path, "-o", "part", "--restart", "part/model.ckpt-3.pt",
                           *common]), tmp_path, 120)
    assert rest.returncode == 0, rest.stderr
    full_curve = (tmp_path / "full" / "lcurve.out").read_text()
    assert (tmp_path / "part" / "lcurve.out").read_text() == full_curve
    assert len(full_curve.splitlines()) == 1 + 4  # steps 1, 2, 4, 6


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_torchrun_bench_gathers_rows(tmp_path: Path) -> None:
    _data(tmp_path)
    done = _run(_torchrun(["bench", str(_input(tmp_path)), "--batches", "4", "--num-workers",
                           "1", "--json"]), tmp_path, 150)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["rank"] for r in rows] == [0, 1] and all(r["world_size"] == 2 for r in rows)
    assert rows[0]["bcast_MB"] > 0 and rows[1]["bcast_MB"] == rows[0]["bcast_MB"]
    assert rows[1]["discover_s"] == 0.0  # only rank 0 walks the data tree


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_torchrun_train_fails_together(tmp_path: Path) -> None:
    """A label missing on disk: every rank reports the same error (from the shared metadata):
    each rank finds it on its own, the first to publish it in the store names itself."""
    data = tmp_path / "data"
    make_system(data, "train0", natoms=5, nframes=4, keys=("energy",))  # no force.npy
    make_system(data, "valid", natoms=5, nframes=4, keys=("energy", "force"))
    path = _input(tmp_path)
    done = _run(_torchrun(["train", str(path), "--rcut", "2.5", "--num-workers", "0"]),
                tmp_path, 150)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("mdloader: error:")]
    assert len(errors) == 2, done.stderr
    if launcher_keeps_the_store():  # else each rank may report its own, gone with rank 0's store
        assert errors[0] == errors[1], done.stderr
    assert re.match(r"mdloader: error: rank [01] failed \(building the loader\): "
                    r"MissingDataError: a required key is missing: force; system: ", errors[0])
    assert errors[0].endswith("train0/set.000/force.npy")


def test_rank0_failure_prints_one_line_without_debug(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A RemoteError carries rank 0's traceback; users see it only with --debug."""
    import mdloader.cli.main as cli
    from mdloader.errors import RemoteError

    def fail(args: object) -> int:
        raise RemoteError(origin_rank=0, exc_type="MissingDataError", exc_message="no coord",
                          context="building", system="/d/sys", file="/d/sys/set.000/coord.npy",
                          traceback_text="Traceback (most recent call last):\n  boom\n")

    monkeypatch.setattr(cli.COMMANDS["check"], "run", fail)
    assert main(["check", str(tmp_path / "input.json")]) == 1
    err = capsys.readouterr().err
    assert "rank 0 failed (building): MissingDataError: no coord" in err
    assert "/d/sys/set.000/coord.npy" in err and "Traceback" not in err
    assert main(["check", str(tmp_path / "input.json"), "--debug"]) == 1
    assert "Traceback (most recent call last):\n  boom" in capsys.readouterr().err


def test_error_line_is_one_write(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Ranks share stderr under torchrun: text and newline must leave in one write, or two
    ranks' lines interleave (``print`` writes them apart when Python runs unbuffered)."""
    import io

    import mdloader.cli.main as cli
    from mdloader.errors import MissingDataError

    class Recorder(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

    def fail(args: object) -> int:
        raise MissingDataError("a required key is missing: force", system="/d/s",
                               file="/d/s/set.000/force.npy")

    monkeypatch.setattr(cli.COMMANDS["check"], "run", fail)
    stderr = Recorder()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main(["check", str(tmp_path / "input.json")]) == 1
    lines = [w for w in stderr.writes if w.startswith("mdloader: error:")]
    assert len(lines) == 1 and lines[0].endswith("/d/s/set.000/force.npy\n"), stderr.writes


def test_dp_passes_every_argument_through(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`mdloader dp --pt train input.json`: DeePMD-kit's flags are not parsed by mdloader."""
    import mdloader.cli.dp
    import mdloader.integrations.deepmd as integration

    seen: list[list[str]] = []
    monkeypatch.setattr(mdloader.cli.dp, "deepmd_installed", lambda: True)
    monkeypatch.setattr(integration, "run_dp", lambda argv: seen.append(argv) or 0)
    assert main(["dp", "--pt", "train", "input.json", "--skip-neighbor-stat"]) == 0
    assert seen == [["--pt", "train", "input.json", "--skip-neighbor-stat"]]


def test_dp_without_deepmd_kit_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "deepmd", None)  # as if DeePMD-kit were not installed
    assert main(["dp", "--pt", "train", "input.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (
        'pip install -c scripts/deepmd-constraints.txt -e ".[deepmd]"' in err)
    assert main(["dp", "--help"]) == 0
    out = capsys.readouterr().out
    assert "DeePMD-kit is not installed here" in out and "deepmd-constraints.txt" in out
