"""torch's thread count per rank: the share of the node's cores (mdloader/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mdloader.errors import ConfigError
from mdloader.threads import share_of_cores, torch_threads
from mdloader.world import World

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("cores", "ranks", "workers", "want"), [
    (2, 1, 0, 2), (2, 1, 2, 1), (2, 2, 0, 1), (64, 4, 3, 4), (64, 8, 4, 1), (48, 4, 2, 4),
    (1, 8, 8, 1), (16, 0, 0, 16)])
def test_share_of_cores(cores: int, ranks: int, workers: int, want: int) -> None:
    assert share_of_cores(cores, ranks, workers) == want


def test_order_of_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(rank=0, world_size=2, local_rank=0, local_world_size=2)
    monkeypatch.delenv("MDLOADER_TORCH_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    assert torch_threads(2, world=world)[0] == 2  # 12 // (2 x 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert torch_threads(2, world=world)[0] is None  # torch already follows OMP_NUM_THREADS
    monkeypatch.setenv("MDLOADER_TORCH_THREADS", "3")
    assert torch_threads(2, world=world) == (3, "MDLOADER_TORCH_THREADS")
    assert torch_threads(2, world=world, threads=7) == (7, "set explicitly")
    monkeypatch.setenv("MDLOADER_TORCH_THREADS", "-1")
    with pytest.raises(ConfigError, match="MDLOADER_TORCH_THREADS"):
        torch_threads(2, world=world)


def _threads_of_bench(tmp_path: Path, env_extra: dict[str, str]) -> str:
    from mdloader.testing import make_system

    make_system(tmp_path, "sys", natoms=4, nframes=4)
    (tmp_path / "in.json").write_text(
        '{"model": {"type_map": ["O", "H"]}, "training": {"training_data": '
        '{"systems": ["sys"]}, "numb_steps": 1}}')
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MDLOADER_TORCH_THREADS", "NUM_WORKERS")}
    env.update(PYTHONPATH=str(REPO), **env_extra)
    out = subprocess.run([sys.executable, "-m", "mdloader", "bench", "in.json", "--batches",
                          "2", "--num-workers", "1"], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stderr.splitlines() if "torch threads per rank" in x)
    return line.split("torch threads per rank: ")[1]


@pytest.mark.timeout(600)
def test_a_single_process_does_not_oversubscribe_its_cores(tmp_path: Path) -> None:
    """One rank with one worker on this machine's cores: half of them, not all (torch's own
    default, which made single-process runs 2.5-4x slower on a shared 2-core machine)."""
    cores = len(os.sched_getaffinity(0))
    assert _threads_of_bench(tmp_path, {}).startswith(f"{max(1, cores // 2)} (")
    assert _threads_of_bench(tmp_path / "omp", {"OMP_NUM_THREADS": "1"}) == "1 (OMP_NUM_THREADS)"
