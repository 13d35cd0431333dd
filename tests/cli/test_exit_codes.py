"""What a new user meets first: exit codes that agree, a closed pipe, fast argument errors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.inputs import write_input

from mdloader.cli.main import EXIT_CODES, main
from mdloader.testing import make_system

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "MDLOADER_CACHE_DIR": os.environ.get("MDLOADER_CACHE_DIR", "")}


def _water_like(tmp_path: Path, systems: list[str]) -> Path:
    make_system(tmp_path / "data", "s0", natoms=4, nframes=4, keys=("energy", "force"))
    return write_input(tmp_path, {"model": {"type_map": ["O", "H"]}, "training": {
        "training_data": {"systems": systems, "batch_size": 1}, "numb_steps": 2}})


def test_help_lists_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    codes = out[out.index("exit codes:"):]
    for code in EXIT_CODES:
        assert f"\n  {code:<5}" in codes
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert all(f"| {code} |" in page for code in EXIT_CODES)


@pytest.mark.timeout(300)
def test_a_missing_system_path_gives_the_same_code_in_every_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    path = str(_water_like(tmp_path, ["data/s0", "data/nope"]))
    commands = [["check", path], ["train", path, "--num-workers", "0", "-o", "out"],
                ["bench", path, "--num-workers", "0"], ["index", "build", path],
                ["check", "data/nope"]]
    for argv in commands:
        assert main(argv) == 2, argv
        seen = capsys.readouterr()
        assert "nope does not exist" in seen.err + seen.out, argv
        if argv[0] != "check" or argv[1] == path:  # the error names its JSON path
            assert "training.training_data.systems" in seen.err + seen.out, argv


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv", [["check", "{input}", "--json"],
                                  ["index", "inspect", "{input}", "--json"]])
def test_a_reader_that_leaves_early_ends_the_output_quietly(tmp_path: Path,
                                                            argv: list[str]) -> None:
    """``mdloader check ... --json | head -1``: no BrokenPipeError traceback, exit 141."""
    path = _water_like(tmp_path, ["data/s0"])
    cmd = [sys.executable, "-m", "mdloader", *(a.format(input=path) for a in argv)]
    env = dict(_env(), MDLOADER_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read()
    assert proc.wait(timeout=240) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err, err


@pytest.mark.parametrize("argv", [["train", "in.json", "--numb-steps", "-5"],
                                  ["train", "in.json", "--rcut", "0"],
                                  ["bench", "in.json", "--batches", "0"],
                                  ["bench", "in.json", "--num-workers", "-1"],
                                  ["dp", "--pt", "train", "in.json"]])
def test_argument_errors_come_before_torch(argv: list[str]) -> None:
    """A bad argument is answered before torch is imported (which takes seconds)."""
    if argv[0] == "dp":
        probe = "import sys; sys.modules['deepmd'] = None; "
    else:
        probe = "import sys; "
    code = (probe + "from mdloader.cli.main import main; rc = main(sys.argv[1:]); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *argv], env=_env(), text=True,
                         capture_output=True, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
