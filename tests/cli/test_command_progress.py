"""The progress of the long commands (``pack``, ``convert``, ``index build``, ``stat``,
``check --deep``), run as the command line runs them: a bar on a terminal, plain lines in a
log, nothing from another rank, and nothing at all for work shorter than the delay."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from support.inputs import write_input
from support.terminal import drawn_bar, stderr

from mdloader import logs
from mdloader.cli.main import main
from mdloader.testing import make_system


def _systems(tmp_path: Path) -> Path:
    for i, natoms in enumerate((5, 6)):  # two formulas: two systems for dpdata too
        make_system(tmp_path / "data", f"s{i}", natoms=natoms, nframes=4, seed=i,
                    keys=("energy", "force"))
    return tmp_path / "data"


def _input(tmp_path: Path) -> str:
    data = _systems(tmp_path)
    return str(write_input(tmp_path, {
        "model": {"type_map": ["O", "H"], "fitting_net": {},
                  "descriptor": {"type": "se_e2_a", "sel": [8, 8], "rcut": 4.0,
                                 "rcut_smth": 0.5}},
        "training": {"training_data": {"systems": [str(data / "s0"), str(data / "s1")],
                                       "batch_size": 1}, "numb_steps": 1}}))


#: Each command, and the work whose progress it reports.
COMMANDS: dict[str, tuple[Callable[[Path], list[str]], list[str]]] = {
    "pack": (lambda t: ["pack", str(_systems(t)), str(t / "out.lmdb")],
             ["describing systems: 2/2 sys", "packing: 8/8 frame"]),
    "convert": (lambda t: ["convert", str(_systems(t)), str(t / "out.h5"), "--from",
                           "deepmd/npy", "--to", "deepmd/hdf5"],
                ["reading systems: 2/2 sys", "writing systems: 2/2 sys"]),
    "index build": (lambda t: ["index", "build", _input(t)], ["describing systems: 2/2 sys"]),
    "stat": (lambda t: ["stat", _input(t)], ["describing systems: 2/2 sys",
                                             "statistics: 2/2 sys"]),
    "check --deep": (lambda t: ["check", _input(t), "--deep"],
                     ["reading training_data: 8/8 frame"]),
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing cached from another test: every command does its work."""
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_terminal_shows_a_bar(command: str, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    argv, reports = COMMANDS[command]
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 0.0)  # every piece of work counts as long
    err = stderr(monkeypatch, tty=True)
    assert main(argv(tmp_path)) == 0
    text = err.getvalue()
    assert drawn_bar(text)
    for report in reports:
        desc, _, done = report.partition(": ")
        assert f"mdloader: {desc}: 100%" in text and done.split()[0] in text, text
    assert "mdloader.progress" not in text  # no progress log lines


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_log_gets_plain_lines(command: str, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    argv, reports = COMMANDS[command]
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 0.0)
    err = stderr(monkeypatch, tty=False)
    assert main(argv(tmp_path)) == 0
    text = err.getvalue()
    assert not drawn_bar(text) and "\r" not in text
    for report in reports:
        assert f"INFO    mdloader.progress: {report} (100%), " in text, text


@pytest.mark.parametrize("tty", [True, False])
@pytest.mark.parametrize("command", ["pack", "check --deep"])
def test_another_rank_shows_nothing(command: str, tty: bool, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    argv, reports = COMMANDS[command]
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 0.0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = stderr(monkeypatch, tty=tty)
    assert main(argv(tmp_path)) == 0
    text = err.getvalue()
    assert not drawn_bar(text) and "mdloader.progress" not in text
    assert not any(f"mdloader: {r.partition(':')[0]}" in text for r in reports), text


@pytest.mark.parametrize("command", ["pack", "stat"])
def test_short_work_shows_no_progress(command: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    argv, reports = COMMANDS[command]
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 60.0)  # far longer than the work
    err = stderr(monkeypatch, tty=True)
    assert main(argv(tmp_path)) == 0
    text = err.getvalue()
    assert not drawn_bar(text) and "mdloader.progress" not in text
    assert not any(f"mdloader: {r.partition(':')[0]}" in text for r in reports), text
