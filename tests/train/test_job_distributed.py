"""Faults during training on 2 real gloo ranks under torchrun: docs/distributed.md's fault matrix.

Each job is ``python -m torch.distributed.run --standalone --nproc_per_node=2 -m mdloader train``
on a copy of one generated data set. The fault happens at a known moment through real means: the
test truncates, moves or overwrites a file once rank 0 has logged the model statistics (the last
read before training), kills a DataLoader worker, or sends SIGTERM. Which rank reads the damaged
file first is computed from the sampler's pure key streams, so "read by rank 1" is a fact of the
data, not a race. Every job must end on every rank with the same one ``mdloader: error:`` line
on each rank naming the rank, the system and the file; :data:`BOUND` is a hang guard (the
figures measured are in ``docs/distributed.md``), and what shows that no rank waited for the
launcher's SIGKILL is its exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from support.inputs import write_input

from mdloader import DpLoaderSet, get_sampler_from_params
from mdloader.distributed.torch_versions import launcher_keeps_the_store
from mdloader.loading.build import build_systems
from mdloader.testing import make_system
from mdloader.world import World

ROOT = Path(__file__).resolve().parents[2]
BOUND = 60.0
"""Seconds from the fault to the end of the job on every rank (torchrun's exit): a hang guard,
several times the 1-4 s measured, which took 16 s on a loaded machine."""
NSYS, NFRAMES, SET0 = 6, 24, 12  # two sets of 12 frames; the faults go into set.001
FIRST = 20  # the earliest step at which the damaged file may be read: time to damage it
MARGIN = 10  # steps between the first reader's read and the other rank's first read

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated data set for the module; each job works on its own copy."""
    data = tmp_path_factory.mktemp("faults") / "data"
    for i in range(NSYS):
        make_system(data, f"sys{i}", natoms=6, nframes=NFRAMES, nsets=2, seed=i,
                    keys=("energy", "force"))
    return data


@dataclass
class Job:
    """A finished torchrun job: exit code, stderr lines with their arrival times, the moments
    of the fault and of the end (``time.monotonic()``)."""

    returncode: int
    lines: list[tuple[float, str]]
    fault_at: float
    ended_at: float
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def errors(self) -> list[str]:
        return [line for _, line in self.lines if line.startswith("mdloader: error:")]

    def exit_codes(self) -> list[int]:
        """The ranks' exit codes, from torchrun's summary of a failed job (torchrun itself
        exits with 1 whatever they were)."""
        return [int(line.split(":", 1)[1].split()[0]) for _, line in self.lines
                if line.strip().startswith("exitcode  :")]

    @property
    def seconds(self) -> float:
        return self.ended_at - self.fault_at


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "mdloader", "train", *args]


def _job(args: list[str], cwd: Path, *, ready: Callable[[Job], bool] | None = None,
         fault: Callable[[subprocess.Popen], object] | None = None,
         deadline: float = 120.0) -> Job:
    """Run ``mdloader train args`` on 2 ranks; once ``ready(job so far)``, call ``fault``.

    Without ``ready`` the fault time is the start. The whole process group is killed and the
    test fails after ``deadline`` seconds: a hang must fail, not stall CI.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(_torchrun(args), cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    job = Job(0, [], start, start)
    reader = threading.Thread(target=_read, args=(proc, job.lines), daemon=True)
    reader.start()
    try:
        if ready is not None:
            while not ready(job):
                if proc.poll() is not None or time.monotonic() - start > deadline:
                    pytest.fail(f"the fault's moment never came:\n{job.stderr[-3000:]}")
                time.sleep(0.02)
            job.extra["fault"] = fault(proc) if fault else None
            job.fault_at = time.monotonic()
        job.returncode = proc.wait(timeout=max(1.0, deadline - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end within {deadline} s:\n{job.stderr[-3000:]}")
    job.ended_at = time.monotonic()
    reader.join(10)
    return job


def _read(proc: subprocess.Popen, lines: list[tuple[float, str]]) -> None:
    for line in proc.stderr:  # type: ignore[union-attr]
        lines.append((time.monotonic(), line.rstrip("\n")))


def _logged(text: str) -> Callable[[Job], bool]:
    return lambda job: any(text in line for _, line in job.lines)


def _lcurve_lines(path: Path, n: int) -> Callable[[Job], bool]:
    return lambda job: path.exists() and len(path.read_text().splitlines()) > n


AFTER_STATISTICS = _logged("mdloader.train.statistics: energy bias")


def _input(tmp_path: Path, dataset: Path, *, seed: int, systems: list[str] | None = None,
           steps: int = 300) -> Path:
    shutil.copytree(dataset, tmp_path / "data")
    raw = {"model": {"type_map": ["O", "H"]},
           "training": {"training_data": {"systems": systems or ["data"], "batch_size": 2},
                        "numb_steps": steps, "seed": seed, "disp_freq": 1, "save_freq": 1000}}
    return write_input(tmp_path, raw)


def _first_reads(systems: list, seed: int, rank: int, steps: int = 80) -> dict[int, int]:
    """System -> the first step at which ``rank`` reads a frame of its ``set.001``."""
    ls = DpLoaderSet(systems, 2, ["O", "H"], seed=seed, world=World(rank=rank, world_size=2))
    sampler = get_sampler_from_params(ls, {}, num_workers=0)
    first: dict[int, int] = {}
    for step in range(1, steps + 1):
        key = sampler.next_key()
        if max(key.fids) >= SET0:
            first.setdefault(key.sid, step)
    return first


def _read_first_by(dataset: Path, rank: int) -> tuple[int, str, int]:
    """(seed, system, step): a job seed and a system whose ``set.001`` rank ``rank`` reads
    first, at ``step`` >= FIRST, the other rank not before ``step + MARGIN``."""
    systems = build_systems([str(dataset)], ["O", "H"])  # once: the seeds only change the order
    for seed in range(300):
        mine, other = _first_reads(systems, seed, rank), _first_reads(systems, seed, 1 - rank)
        for sid, step in sorted(mine.items()):
            if step >= FIRST and other.get(sid, 10**6) > step + MARGIN:
                return seed, f"sys{sid}", step
    raise AssertionError("no seed makes one rank read a system first")


def _check_one_line(job: Job, case: str, code: int, *parts: str, alone: int | None = None
                    ) -> str:
    """Both ranks exited with ``code`` and printed the same single error line, naming every one
    of ``parts``. Where rank 0 hosts the job's store (torchrun of torch 2.3), a failure of rank
    0 ``alone`` leaves with the store: the other rank's line says that rank 0 left."""
    assert job.returncode != 0 and job.exit_codes() == [code, code], job.stderr[-4000:]
    errors = job.errors()
    first = min(t for t, line in job.lines if line.startswith("mdloader: error:"))
    print(f"{case}: every rank ended {job.seconds:.1f} s after the fault, "  # shown with -s
          f"{job.ended_at - first:.1f} s after the first error line")
    assert len(errors) == 2, job.stderr[-4000:]
    if alone == 0 and not launcher_keeps_the_store():
        errors.sort(key=lambda line: "another rank left the job" in line)
        assert "another rank left the job during training step" in errors[1], errors
    else:
        assert errors[0] == errors[1], job.stderr[-4000:]
    assert all(part in errors[0] for part in parts), (parts, errors[0])
    assert job.seconds < BOUND, f"{case}: {job.seconds:.1f} s after the fault\n{job.stderr}"
    return errors[0]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("rank, workers", [(1, "1"), (0, "0")])
def test_a_file_truncated_after_the_build(tmp_path: Path, dataset: Path, rank: int,
                                          workers: str) -> None:
    """Rank 1 used to hang for the whole build timeout; rank 0 failed after 32 s with 123 lines
    (SIGBUS without workers). The reader's size check names the file on every rank."""
    seed, system, _ = _read_first_by(dataset, rank)
    path = _input(tmp_path, dataset, seed=seed)
    target = tmp_path / "data" / system / "set.001" / "force.npy"
    job = _job([str(path), "--rcut", "2.5", "--num-workers", workers, "-o", "out"], tmp_path,
               ready=AFTER_STATISTICS,
               fault=lambda proc: os.truncate(target, target.stat().st_size - 64))
    line = _check_one_line(job, f"truncated, read by rank {rank}", 1,
                           f"rank {rank} failed (training step ", "CorruptFileError",
                           f"system: {tmp_path / 'data' / system}; file: {target}", alone=rank)
    assert "shorter than its header says" in line
    assert not (tmp_path / "out" / "model.ckpt.pt").exists()


@pytest.mark.timeout(200)
def test_a_file_moved_away(tmp_path: Path, dataset: Path) -> None:
    seed, system, _ = _read_first_by(dataset, 1)
    path = _input(tmp_path, dataset, seed=seed)
    target = tmp_path / "data" / system / "set.001" / "force.npy"
    job = _job([str(path), "--rcut", "2.5", "--num-workers", "1", "-o", "out"], tmp_path,
               ready=AFTER_STATISTICS, fault=lambda proc: target.rename(tmp_path / "away.npy"))
    _check_one_line(job, "moved away, read by rank 1", 1, "rank 1 failed (training step ",
                    "MissingDataError: the npy file is gone",
                    f"system: {tmp_path / 'data' / system}; file: {target}")


@pytest.mark.timeout(200)
def test_nan_labels_stop_every_rank_at_the_step(tmp_path: Path, dataset: Path) -> None:
    """NaN written into a label file that rank 1 reads first: both ranks stop at that step with
    its system, frames and file; no checkpoint (it would hold NaN weights)."""
    seed, system, step = _read_first_by(dataset, 1)
    path = _input(tmp_path, dataset, seed=seed)
    target = tmp_path / "data" / system / "set.001" / "force.npy"

    def poison(proc: subprocess.Popen) -> None:
        forces = np.load(target, mmap_mode="r+")  # in place: the ranks' maps see it
        forces[:] = np.nan
        forces.flush()

    job = _job([str(path), "--rcut", "2.5", "--num-workers", "1", "-o", "out"], tmp_path,
               ready=AFTER_STATISTICS, fault=poison)
    line = _check_one_line(job, "NaN labels, read by rank 1", 1,
                           f"rank 1 failed (training step {step}): NonFiniteError: the loss is "
                           f"not finite (nan) at step {step} on rank 1: force holds NaN/inf in "
                           "frames", f"system: {tmp_path / 'data' / system}; file: {target}")
    assert "found: batch frames [" in line
    steps = [int(row.split()[0]) for row in
             (tmp_path / "out" / "lcurve.out").read_text().splitlines()[1:]]
    assert steps == list(range(1, step)) and "nan" not in (tmp_path / "out" / "lcurve.out"
                                                           ).read_text()
    assert not (tmp_path / "out" / "model.ckpt.pt").exists()


def _ranks_of(torchrun: int) -> dict[int, int]:
    """RANK -> pid of the processes torchrun started (from /proc)."""
    ranks = {}
    for pid in _children(torchrun):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for item in env:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = pid
    return ranks


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


@pytest.mark.timeout(200)
def test_a_killed_dataloader_worker_on_rank_1(tmp_path: Path, dataset: Path) -> None:
    path = _input(tmp_path, dataset, seed=1)
    curve = tmp_path / "out" / "lcurve.out"

    def kill_worker(proc: subprocess.Popen) -> int:
        for _ in range(200):
            workers = _children(_ranks_of(proc.pid)[1])
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                return workers[0]
            time.sleep(0.01)
        raise AssertionError("rank 1 has no DataLoader worker")

    job = _job([str(path), "--rcut", "2.5", "--num-workers", "1", "-o", "out"], tmp_path,
               ready=_lcurve_lines(curve, 3), fault=kill_worker)
    line = _check_one_line(job, "killed DataLoader worker of rank 1", 1,
                           "rank 1 failed (training step ", "WorkerLostError: DataLoader worker",
                           str(job.extra["fault"]), "out of memory")
    # read from the worker process itself, wherever torch noticed the loss
    assert "is killed by signal SIGKILL" in line, line


@pytest.mark.timeout(300)
def test_sigterm_saves_a_checkpoint_and_restart_continues(tmp_path: Path, dataset: Path) -> None:
    """SIGTERM to rank 1's process group (how torchrun passes a signal on; Slurm signals every
    process): both ranks stop after the same step, with one checkpoint, and exit with 143; the
    DataLoader workers, signalled too, live until then. --restart continues, and lcurve.out has
    every step once."""
    path = _input(tmp_path, dataset, seed=1, steps=2000)
    curve = tmp_path / "out" / "lcurve.out"
    job = _job([str(path), "--rcut", "2.5", "--num-workers", "1", "-o", "out"], tmp_path,
               ready=_lcurve_lines(curve, 3),
               fault=lambda proc: os.killpg(_ranks_of(proc.pid)[1], signal.SIGTERM))
    print(f"SIGTERM: every rank ended {job.seconds:.1f} s after the signal")
    assert job.seconds < BOUND and not job.errors(), job.stderr[-4000:]
    assert job.exit_codes() == [143, 143], job.stderr[-4000:]
    stopped = [line for _, line in job.lines if "stopped after step" in line]
    assert len(stopped) == 1 and "(a signal on another rank): continue with --restart " \
        "out/model.ckpt-" in stopped[0], job.stderr[-4000:]
    step = int(stopped[0].split("stopped after step ")[1].split()[0])
    assert os.readlink(tmp_path / "out" / "model.ckpt.pt") == f"model.ckpt-{step}.pt"
    more = _job([str(path), "--rcut", "2.5", "--num-workers", "1", "-o", "out", "--restart",
                 "out/model.ckpt.pt", "--numb-steps", str(step + 3)], tmp_path)
    assert more.returncode == 0, more.stderr[-4000:]
    steps = [int(row.split()[0]) for row in curve.read_text().splitlines()[1:]]
    assert steps == list(range(1, step + 4))  # every step once: none lost, none twice


@pytest.mark.timeout(200)
def test_a_systems_entry_that_does_not_exist(tmp_path: Path, dataset: Path) -> None:
    """It used to be a warning, and the job trained on the rest."""
    path = _input(tmp_path, dataset, seed=1, systems=["data/sys0", "data/nope"])
    job = _job([str(path), "--rcut", "2.5", "--num-workers", "0", "-o", "out"], tmp_path)
    _check_one_line(job, "missing systems entry (from the start)", 2,
                    "ConfigError: training.training_data.systems[1]: ",
                    f"{tmp_path / 'data' / 'nope'} does not exist")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_before_the_first_step(tmp_path: Path, dataset: Path, victim: int) -> None:
    """kill -9 of one rank right after the build: the other used to wait in the creation of a
    gloo group (its 300 s timeout) until torchrun's SIGKILL, deaf to torchrun's SIGTERM. Now it
    ends by itself: an error naming the rank that left, or stopped by torchrun's SIGTERM."""
    path = _input(tmp_path, dataset, seed=1)
    job = _job([str(path), "--rcut", "2.5", "--num-workers", "1", "-o", "out"], tmp_path,
               ready=_logged("---Summary of DataSystem: training"),
               fault=lambda proc: os.kill(_ranks_of(proc.pid)[victim], signal.SIGKILL))
    print(f"rank {victim} killed: the job ended {job.seconds:.1f} s later")
    codes = job.exit_codes()
    assert sorted(codes) in ([-9, 1], [-9, 143]), job.stderr[-4000:]  # never SIGKILLed
    ended = [line for _, line in job.lines if line.startswith(("mdloader: error:",
                                                               "mdloader: stopped on rank"))]
    assert len(ended) == 1, job.stderr[-4000:]
    assert ("another rank left the job" in ended[0] or f"rank {1 - victim}" in ended[0]), ended
    assert job.seconds < BOUND


@pytest.mark.timeout(300)
def test_sigterm_to_torchrun_during_a_long_full_validation(tmp_path: Path,
                                                            dataset: Path) -> None:
    """torchrun passes SIGTERM on and SIGKILLs its ranks 30 s later: the full validation is cut,
    the checkpoint written before it kept, every rank exits 143 by itself."""
    path = _input(tmp_path, dataset, seed=1, steps=2000)
    for i in range(2):
        make_system(tmp_path / "valid", f"v{i}", natoms=6, nframes=1500, seed=20 + i,
                    keys=("energy", "force"))
    raw = json.loads(path.read_text())
    raw["training"].update(save_freq=5, validation_data={"systems": ["valid"], "batch_size": 1})
    write_input(tmp_path, raw)
    job = _job([str(path), "--rcut", "2.5", "--num-workers", "1", "-o", "out",
                "--full-validation"], tmp_path,
               ready=_logged("full validation at step 5: started"),
               fault=lambda proc: os.kill(proc.pid, signal.SIGTERM))
    print(f"SIGTERM to torchrun during the full validation: the job ended {job.seconds:.1f} s "
          "later")
    assert "full validation at step 5 cut by a stop signal" in job.stderr, job.stderr[-4000:]
    stopped = [line for _, line in job.lines if "stopped after step" in line]
    assert len(stopped) == 1 and "stopped after step 5 (SIGTERM): continue with --restart " \
        "out/model.ckpt-5.pt" in stopped[0], job.stderr[-4000:]
    assert not job.errors() and "exitcode  : -9" not in job.stderr, job.stderr[-4000:]
    assert (tmp_path / "out" / "full_valid.out").read_text().splitlines()[1:] == []
    assert job.seconds < BOUND
