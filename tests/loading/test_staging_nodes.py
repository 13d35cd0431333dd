"""Node-local staging on two "nodes" of one machine: two ``torchrun --nnodes=2`` agents on a
localhost c10d rendezvous, each with its own ``MDLOADER_STAGE_DIR``, so that node identity
(torchrun's ``GROUP_RANK``), the stager of each node and the lockstep between nodes run as on a
cluster. Opens and path lookups under the shared tree are counted with strace, per node."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from support.distributed_utils import free_port
from support.inputs import write_input

from mdloader.catalog.staging import copy_path
from mdloader.testing import make_system

ROOT = Path(__file__).resolve().parents[2]
SLOW_COPY = ROOT / "tests" / "support" / "slow_staging"
BOUND = 60.0
"""Seconds from a fault to the end of both agents: a hang guard."""
NSYS, NFRAMES = 4, 8

pytestmark = [pytest.mark.distributed]
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")


@dataclass
class Node:
    """One finished torchrun agent: exit code, output, strace file (or ``None``)."""

    returncode: int
    output: str
    trace: Path | None

    def errors(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("mdloader: error:")]


def _env(tmp_path: Path, node: int, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "MDLOADER_CACHE_DIR": str(tmp_path / "cache"),
            "MDLOADER_STAGE_DIR": str(tmp_path / f"stage{node}"), **extra}


def _start(tmp_path: Path, args: list[str], envs: list[dict[str, str]], *,
           strace: bool) -> list[tuple[subprocess.Popen, Path, Path | None]]:
    port = free_port()
    started = []
    for node, env in enumerate(envs):
        log = tmp_path / f"node{node}-{time.monotonic_ns()}.log"
        trace = tmp_path / f"node{node}-{time.monotonic_ns()}.strace" if strace else None
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
               f"--rdzv-id=staging{port}", "-m", "mdloader", "train", *args]
        if trace is not None:
            cmd = ["strace", "-f", "-qq", "-e", "trace=openat,open,stat,lstat,newfstatat,statx",
                   "-o", str(trace), *cmd]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        started.append((proc, log, trace))
    return started


def _finish(started: list[tuple[subprocess.Popen, Path, Path | None]],
            deadline: float) -> list[Node]:
    end = time.monotonic() + deadline
    for proc, log, _ in started:
        try:
            proc.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _, _ in started:
                os.killpg(other.pid, signal.SIGKILL)
            tails = "\n".join(log.read_text()[-3000:] for _, log, _ in started)
            pytest.fail(f"the two nodes did not end within {deadline} s:\n{tails}")
    return [Node(p.returncode, log.read_text(), trace) for p, log, trace in started]


def _run(tmp_path: Path, args: list[str], envs: list[dict[str, str]], *, strace: bool = False,
         deadline: float = 240.0) -> list[Node]:
    return _finish(_start(tmp_path, args, envs, strace=strace), deadline)


_CALL = re.compile(r'^\d+\s+(\w+)\((?:AT_FDCWD, )?"([^"]*)"')


def _touches(trace: Path, root: Path, cwd: Path) -> tuple[collections.Counter, collections.Counter]:
    """(opens, path lookups) of each file under ``root`` in an strace file (failed calls too)."""
    opens: collections.Counter = collections.Counter()
    lookups: collections.Counter = collections.Counter()
    prefix = str(root) + os.sep
    for line in trace.read_text().splitlines():
        found = _CALL.match(line)
        if found is None:
            continue
        call, path = found.groups()
        path = os.path.normpath(os.path.join(cwd, path))
        if path.startswith(prefix) and path.endswith((".npy", ".raw")):
            (opens if call in ("openat", "open") else lookups)[path] += 1
    return opens, lookups


def _curve(path: Path) -> list[str]:
    return path.read_text().splitlines()[1:]


@pytest.fixture()
def job(tmp_path: Path) -> Path:
    for i in range(NSYS):
        make_system(tmp_path / "data", f"sys{i}", natoms=6, nframes=NFRAMES, nsets=2, seed=i,
                    keys=("energy", "force"))
    raw = {"model": {"type_map": ["O", "H"]},
           "training": {"training_data": {"systems": ["data"], "batch_size": 2},
                        "numb_steps": 40, "seed": 3, "disp_freq": 1, "save_freq": 20}}
    return write_input(tmp_path, raw)


def _files(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "data").rglob("*") if p.is_file())


@needs_strace
@pytest.mark.timeout(900)
def test_two_nodes_stage_once_restart_exactly_and_restage_a_rewritten_file(
        tmp_path: Path, job: Path) -> None:
    """40 steps of 2 ranks x 2 frames read the 32 frames 5 times, with 2 npy files kept open
    per process: each shared file is opened at most twice per node (a header read by the build
    on rank 0's node, the copy), looked up at most twice, and never again by a restart that
    finds the copies fresh; the restart continues exactly; a file rewritten between two runs is
    staged again and read as it now is."""
    files = _files(tmp_path)
    args = [str(job), "--rcut", "2.5", "--num-workers", "1", "-o", "out"]
    envs = [_env(tmp_path, n, MDLOADER_MAX_OPEN_FILES="2") for n in range(2)]
    first = _run(tmp_path, args, envs, strace=True)
    assert [n.returncode for n in first] == [0, 0], first[0].output[-3000:] + first[1].output
    for node in first:
        opens, lookups = _touches(node.trace, tmp_path / "data", tmp_path)  # type: ignore[arg-type]
        assert set(opens) == {str(f) for f in files}  # every file staged ...
        assert max(opens.values()) <= 2 and max(lookups.values()) <= 2, (opens, lookups)
    straight = _curve(tmp_path / "out" / "lcurve.out")
    assert len(straight) == 40
    for n in range(2):
        for f in files:  # ... to its node's own folder
            rel = f.relative_to(tmp_path / "data")
            system = str(tmp_path / "data" / rel.parts[0])
            copied = Path(copy_path(str(tmp_path / f"stage{n}"), system), *rel.parts[1:])
            assert copied.read_bytes() == f.read_bytes()

    again = _run(tmp_path, [*args, "--restart", "out/model.ckpt-20.pt"], envs, strace=True)
    assert [n.returncode for n in again] == [0, 0], again[0].output[-3000:]
    assert _curve(tmp_path / "out" / "lcurve.out") == straight  # steps 21-40 as the first time
    for node in again:
        opens, lookups = _touches(node.trace, tmp_path / "data", tmp_path)  # type: ignore[arg-type]
        assert not opens and max(lookups.values()) <= 2, (opens, lookups)  # fresh: reused

    energy = tmp_path / "data" / "sys1" / "set.001" / "energy.npy"
    np.save(energy, np.full(NFRAMES // 2, 7.0, dtype=np.float32))  # same shape, new values
    third = _run(tmp_path, [*args, "--restart", "out/model.ckpt-40.pt", "--numb-steps", "44"],
                 envs, strace=True)
    assert [n.returncode for n in third] == [0, 0], third[0].output[-3000:]
    for n, node in enumerate(third):
        opens, _ = _touches(node.trace, tmp_path / "data", tmp_path)  # type: ignore[arg-type]
        # the one rewritten system is copied again (its files, once each); nothing else
        assert set(opens) == {str(f) for f in (tmp_path / "data" / "sys1").rglob("*")
                              if f.is_file()}
        assert max(opens.values()) == 1
        copied = Path(copy_path(str(tmp_path / f"stage{n}"), str(tmp_path / "data" / "sys1")))
        np.testing.assert_array_equal(np.load(copied / "set.001" / "energy.npy"),
                                      np.full(NFRAMES // 2, 7.0, dtype=np.float32))


@pytest.mark.timeout(300)
def test_a_full_stage_folder_ends_every_rank_in_one_line(tmp_path: Path, job: Path) -> None:
    envs = [_env(tmp_path, 0), _env(tmp_path, 1, MDLOADER_STAGE_BYTES="1000")]
    nodes = _run(tmp_path, [str(job), "--rcut", "2.5", "--num-workers", "0", "-o", "out"], envs)
    lines = [n.errors() for n in nodes]
    assert all(n.returncode != 0 for n in nodes)
    assert [len(x) for x in lines] == [1, 1], nodes[0].output[-3000:] + nodes[1].output[-3000:]
    assert lines[0] == lines[1]
    assert f"in {tmp_path / 'stage1'}, 1000 available (MDLOADER_STAGE_BYTES=1000" in lines[0][0]
    assert "StagingError: node-local staging needs " in lines[0][0]
    assert not (tmp_path / "out" / "lcurve.out").exists()


@pytest.mark.timeout(300)
def test_a_stager_killed_while_staging_ends_every_rank(tmp_path: Path, job: Path) -> None:
    marker = tmp_path / "stager.pid"
    slow = {"PYTHONPATH": f"{ROOT}{os.pathsep}{SLOW_COPY}",
            "MDLOADER_TEST_SLOW_COPY": str(marker)}
    envs = [_env(tmp_path, 0), _env(tmp_path, 1, **slow)]
    started = _start(tmp_path, [str(job), "--rcut", "2.5", "--num-workers", "0", "-o", "out"],
                     envs, strace=False)
    waited = time.monotonic()
    while not (marker.exists() and marker.read_text()):
        if time.monotonic() - waited > 120 or any(p.poll() is not None for p, _, _ in started):
            for proc, _, _ in started:
                with contextlib.suppress(ProcessLookupError):  # a node that already ended
                    os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the stager of node 1 never began to copy:\n"
                        + "\n".join(log.read_text()[-2000:] for _, log, _ in started))
        time.sleep(0.05)
    killed = time.monotonic()
    os.kill(int(marker.read_text()), signal.SIGKILL)
    nodes = _finish(started, BOUND)
    print(f"stager killed: both nodes ended {time.monotonic() - killed:.1f} s later")
    assert all(n.returncode != 0 for n in nodes)
    survivor = nodes[0]
    ended = [line for line in survivor.output.splitlines()
             if line.startswith(("mdloader: error:", "mdloader: stopped on rank"))]
    assert len(ended) == 1, survivor.output[-3000:]
    print(ended[0])
    assert "left the job while the nodes staged their data" in ended[0] or \
        "stopped on rank" in ended[0], ended
