"""What a user watching ``mdloader train`` sees: log lines above the terminal's progress bar,
and progress lines when the output goes to a pipe or a file."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from mdloader.testing import make_system

ROOT = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path) -> list[str]:
    for i, n in enumerate((5, 6)):
        make_system(tmp_path / "data", f"s{i}", natoms=n, nframes=8, seed=i,
                    keys=("energy", "force"))
    (tmp_path / "in.json").write_text(json.dumps({
        "model": {"type_map": ["O", "H"]},
        "training": {"training_data": {"systems": ["data/s0", "data/s1"], "batch_size": 2},
                     "numb_steps": 6, "seed": 1, "disp_freq": 2, "save_freq": 3}}))
    return [sys.executable, "-m", "mdloader", "train", "in.json", "-o", "out", "--rcut", "2.5",
            "--num-workers", "0"]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "MDLOADER_CACHE_DIR": str(tmp_path / "cache")}


@pytest.mark.timeout(300)
def test_log_lines_do_not_land_on_the_progress_bar(tmp_path: Path) -> None:
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a window
    proc = subprocess.Popen(_job(tmp_path), cwd=tmp_path, env=_env(tmp_path), stdin=child,
                            stdout=child, stderr=child, close_fds=True)
    os.close(child)
    raw, deadline = b"", time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([parent], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(parent, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                raw += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0, raw.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(parent)
    text = raw.decode(errors="replace")
    assert "train:" in text  # the bar was drawn: this is a terminal
    pieces = [p for p in re.split(r"[\r\n]", text) if "saved checkpoint" in p]
    assert len(pieces) == 2
    for piece in pieces:  # each log line starts a line of its own, with its timestamp
        assert re.match(r"\s*\d{4}-\d\d-\d\d ", piece), repr(piece)


@pytest.mark.timeout(300)
def test_a_pipe_gets_a_progress_line_at_every_display(tmp_path: Path) -> None:
    out = subprocess.run(_job(tmp_path), cwd=tmp_path, env=_env(tmp_path), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:]
    steps = re.findall(r"step (\d+)/6: rmse_f_trn \S+, lr \S+ \(\S+ steps/s\)", out.stdout)
    assert steps == ["1", "2", "4", "6"]
    assert "train:" not in out.stdout  # no bar in a pipe
