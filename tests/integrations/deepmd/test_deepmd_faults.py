"""Faults during DeePMD-kit's training under ``mdloader dp``, 2 gloo ranks under real torchrun:
every rank ends within seconds with the same one line naming the rank, the system and the file;
one process without torchrun ends with one line too, in mdloader's words, never torch's traceback.

A DeePMD-kit launch costs most of this file's time: each test is one launch (the stop signal's
two: the stop and its restart, which ends with the NaN labels), on a tiny model and tiny systems.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from support.deepmd_env import require_deepmd_python

from mdloader.testing import make_system

REPO = Path(__file__).resolve().parents[3]
DEADLINE = 300.0  # a hang guard for the whole job, several times a run's length here
DESCRIPTOR = {"type": "se_e2_a", "sel": [12, 24], "rcut_smth": 0.5, "rcut": 4.0,
              "neuron": [4, 8], "axis_neuron": 4, "seed": 1}
LOSS = {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
        "limit_pref_f": 1}

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _systems(root: Path, n: int = 2) -> list[Path]:
    return [Path(make_system(root / "data", f"sys{i}", natoms=6, nframes=30, seed=i,
                             keys=("energy", "force"))) for i in range(n)]


def _input(root: Path, *, save_freq: int = 100000) -> list[Path]:
    """A single-task input over two systems; their ``force.npy`` files."""
    systems = _systems(root)
    config = {
        "model": {"type_map": ["O", "H"], "descriptor": DESCRIPTOR, "data_stat_nbatch": 1,
                  "fitting_net": {"neuron": [8, 8], "seed": 1}},
        "learning_rate": {"type": "exp", "decay_steps": 50, "start_lr": 1e-3, "stop_lr": 1e-5},
        "loss": LOSS,
        "training": {"training_data": {"systems": [str(s) for s in systems], "batch_size": 1},
                     "numb_steps": 100000, "seed": 7, "disp_freq": 1, "save_freq": save_freq},
    }
    (root / "input.json").write_text(json.dumps(config))
    return [s / "set.000" / "force.npy" for s in systems]


def _multitask_input(root: Path) -> list[Path]:
    """Two heads sharing one descriptor, each over its own system; their ``force.npy``."""
    systems = _systems(root)
    descriptor = DESCRIPTOR
    heads = {name: {"type_map": "type_map_all", "descriptor": "shared_descriptor",
                    "fitting_net": {"neuron": [8, 8], "seed": i}}
             for i, name in enumerate(("head_a", "head_b"))}
    config = {
        "model": {"shared_dict": {"type_map_all": ["O", "H"], "shared_descriptor": descriptor},
                  "model_dict": heads, "data_stat_nbatch": 1},
        "learning_rate": {"type": "exp", "decay_steps": 50, "start_lr": 1e-3, "stop_lr": 1e-5},
        "loss_dict": {name: LOSS for name in heads},
        "training": {"model_prob": {"head_a": 0.5, "head_b": 0.5},
                     "data_dict": {name: {"training_data": {"systems": [str(s)],
                                                            "batch_size": 1}}
                                   for name, s in zip(heads, systems)},
                     "numb_steps": 100000, "seed": 7, "disp_freq": 1, "save_freq": 100000},
    }
    (root / "input.json").write_text(json.dumps(config))
    return [s / "set.000" / "force.npy" for s in systems]


class Job:
    """``torchrun --nproc_per_node=2 -m mdloader dp --pt train input.json`` in ``root``
    (``torchrun=False``: ``python -m mdloader dp ...``, one process, no group)."""

    def __init__(self, root: Path, *args: str, workers: int = 1, torchrun: bool = True,
                 **env: str) -> None:
        self.root, self.torchrun = root, torchrun
        environ = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                       NUM_WORKERS=str(workers), MDLOADER_CACHE_DIR=str(root / "cache"), **env)
        launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
                    if torchrun else [])
        self.proc = subprocess.Popen(
            [require_deepmd_python(), *launcher, "-m", "mdloader", "dp", "--pt", "train",
             "input.json", *args], cwd=root, env=environ, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
            preexec_fn=_ctrl_c_as_in_a_terminal)
        self.fault = 0.0

    def wait_for_steps(self, lines: int = 3) -> None:
        """Until ``lcurve.out`` holds ``lines`` lines past its header (training runs)."""
        curve, start = self.root / "lcurve.out", time.monotonic()
        while not (curve.exists() and len(curve.read_text().splitlines()) > lines):
            if self.proc.poll() is not None:
                pytest.fail(self.proc.stdout.read()[-4000:])  # type: ignore[union-attr]
            if time.monotonic() - start > DEADLINE:
                self.kill()
                pytest.fail("training never started")
            time.sleep(0.1)

    def ranks(self) -> dict[int, int]:
        """The pid of each rank, by its ``RANK``."""
        if not self.torchrun:
            return {0: self.proc.pid}
        found = {}
        for pid in _children(self.proc.pid):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [e for e in environ if e.startswith(b"RANK=")]
            if rank:
                found[int(rank[0][5:])] = pid
        return found

    def end(self, bound: float = DEADLINE) -> str:
        """The job's output once it ended (at most ``bound`` seconds after the fault)."""
        try:
            out, _ = self.proc.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {bound} s of the fault")
        self.seconds = time.monotonic() - self.fault
        return out

    def kill(self) -> None:
        """torchrun and its ranks (each in a session of its own)."""
        for pid in [*self.ranks().values(), self.proc.pid]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.communicate()


def _ctrl_c_as_in_a_terminal() -> None:
    """In the job before it starts: Ctrl-C at its default, as in a terminal (a test run started
    in the background of a shell ignores it, and so would the job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _one_line_on_every_rank(out: str) -> str:
    errors = [line for line in out.splitlines() if line.startswith("mdloader: error:")]
    assert len(errors) == 2 and errors[0] == errors[1], out[-4000:]
    assert "Bus error" not in out and "shared memory" not in out, out[-4000:]
    return errors[0]


# A file moved away mid-training is no failure any more: a process that holds it open reads on
# the file it opened (no path look-up per batch); one that opens it later finds it gone
# (tests/data/formats/test_npy_changed_while_open.py).
FAULTS = {
    "truncated": (lambda target: os.truncate(target, target.stat().st_size // 3),
                  "CorruptFileError: the npy file "),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case,tasks", [("truncated", "single"), ("truncated", "multi")])
def test_a_force_file_changed_mid_training_is_one_line_on_every_rank(tmp_path: Path,
                                                                      case: str,
                                                                      tasks: str) -> None:
    """Truncated, it used to kill a DataLoader worker with SIGBUS (torch's shared-memory hint)
    and the other rank with gloo's "Connection closed by peer"; also on a two-head input (each
    head's system loses its file). "shrank while it was read" where the reading process had
    the file open, "shorter than its header says" where it had not yet: both name system and
    file."""
    damage, said = FAULTS[case]
    targets = (_input if tasks == "single" else _multitask_input)(tmp_path)
    job = Job(tmp_path)
    job.wait_for_steps()
    for target in targets:
        damage(target)
    job.fault = time.monotonic()
    out = job.end()
    print(f"{case} under mdloader dp ({tasks}-task): every rank ended {job.seconds:.1f} s "
          "after the fault")  # shown with -s
    line = _one_line_on_every_rank(out)
    assert job.proc.returncode != 0
    assert said in line and "failed (DeePMD-kit's training)" in line, line
    assert any(f"file: {target}" in line for target in targets), line


@pytest.mark.timeout(400)
def test_a_killed_dataloader_worker_is_one_line_on_every_rank(tmp_path: Path) -> None:
    """A worker of rank 1 killed from outside (the out-of-memory killer): every rank says so."""
    _input(tmp_path)
    job = Job(tmp_path)
    job.wait_for_steps()
    worker = _children(job.ranks()[1])[0]
    os.kill(worker, signal.SIGKILL)
    job.fault = time.monotonic()
    out = job.end()
    print(f"killed worker under mdloader dp: every rank ended {job.seconds:.1f} s after")
    line = _one_line_on_every_rank(out)
    assert "rank 1 failed (DeePMD-kit's training): WorkerLostError: DataLoader worker " \
           f"(pid {worker}) is killed by signal SIGKILL" in line, line


ALONE = {
    "truncated": (lambda job, targets: [os.truncate(t, t.stat().st_size // 3) for t in targets],
                  "mdloader: error: the npy file shrank "),
    "killed worker": (lambda job, targets: os.kill(_children(job.proc.pid)[0], signal.SIGKILL),
                      "mdloader: error: DataLoader worker (pid "),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(ALONE))
def test_a_worker_fault_without_torchrun_is_one_line_in_mdloaders_words(tmp_path: Path,
                                                                         case: str) -> None:
    """One process, no group: a worker's mdloader error used to print torch's "Caught
    CorruptFileError in DataLoader worker process 0" and the worker's traceback, a killed
    worker torch's RuntimeError with the main process's traceback."""
    damage, said = ALONE[case]
    targets = _input(tmp_path)
    job = Job(tmp_path, torchrun=False)
    job.wait_for_steps()
    damage(job, targets)
    job.fault = time.monotonic()
    out = job.end()
    print(f"{case} under mdloader dp without torchrun: ended {job.seconds:.1f} s after")
    errors = [line for line in out.splitlines() if line.startswith("mdloader: error:")]
    assert len(errors) == 1 and errors[0].startswith(said), out[-4000:]
    assert "Traceback" not in out and "Caught" not in out, out[-4000:]
    assert job.proc.returncode == 1, out[-4000:]
    if case == "truncated":
        assert any(f"file: {target}" in errors[0] for target in targets), errors[0]


@pytest.mark.timeout(400)
def test_a_killed_rank_with_workers_ends_the_survivor_within_seconds(tmp_path: Path) -> None:
    """``kill -9`` of rank 1 mid-training, 2 DataLoader workers per rank: rank 0 says that a rank
    left. Its workers used to hold rank 1's gloo sockets open until they noticed their parent
    was gone (torch polls every 5 s): rank 0 sat in DDP's all-reduce that long."""
    _input(tmp_path)
    job = Job(tmp_path, workers=2)
    job.wait_for_steps()
    os.kill(job.ranks()[1], signal.SIGKILL)
    job.fault = time.monotonic()
    out = job.end(bound=60)
    survivor = [line for line in out.splitlines() if line.startswith("mdloader: error:")]
    print(f"killed rank under mdloader dp, 2 workers: rank 0 ended {job.seconds:.1f} s after")
    assert len(survivor) == 1, out[-4000:]
    assert "rank 0 failed (DeePMD-kit's training): DistributedError: another rank left the " \
           "job during DeePMD-kit's training" in survivor[0], survivor[0]
    assert job.seconds < 15, f"rank 0 took {job.seconds:.1f} s (a hang guard: ~1-2 s expected)"


def _steps_done(root: Path) -> int:
    rows = [line.split() for line in (root / "lcurve.out").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return int(rows[-1][0]) if rows else 0


@pytest.mark.timeout(500)
def test_a_stop_signal_writes_a_checkpoint_that_resumes_and_nan_labels_end_the_restart(
        tmp_path: Path) -> None:
    """SIGUSR1 to rank 0 and SIGTERM to rank 1 mid-training (each to the rank's process group,
    as ``torchrun`` and Slurm send them): every rank stops after the same step, rank 0 writes a
    checkpoint with its loader state, every rank exits 143 with one line. DeePMD-kit's own loop
    has no signal handler: its ranks died at once, no checkpoint of that step.

    The restart continues from it; then NaN written into one system's forces: DeePMD-kit's loop
    stopped at its next display on rank 0 (``RuntimeError: NaN detected at batch 10``, no system
    or file); now the rank that draws the batch names the frames, the system and the file,
    before the update (checked on the CPU, before the batch moves to the device)."""
    targets = _input(tmp_path)
    job = Job(tmp_path)
    job.wait_for_steps()
    ranks = job.ranks()
    os.killpg(ranks[0], signal.SIGUSR1)
    os.killpg(ranks[1], signal.SIGTERM)
    job.fault = time.monotonic()
    out = job.end(bound=60)
    print(f"SIGUSR1/SIGTERM to the ranks under mdloader dp: every rank ended {job.seconds:.1f} s "
          "after")
    stopped = dict((r, (name, step)) for r, name, step, _ in re.findall(
        r"mdloader: stopped on rank (\d): (SIG\w+) after step (\d+): (.*)", out))
    assert sorted(stopped) == ["0", "1"], out[-4000:]
    assert stopped["0"][0] == "SIGUSR1" and stopped["0"][1] == stopped["1"][1], stopped
    step = int(stopped["0"][1])
    assert f"checkpoint model.ckpt-{step}.pt written with its loader state" in out, out[-4000:]
    assert (tmp_path / f"model.ckpt-{step}.pt").exists()
    assert (tmp_path / f"model.ckpt-{step}.pt.mdloader").exists()
    assert "mdloader: error:" not in out and job.proc.returncode != 0, out[-4000:]

    again = Job(tmp_path, "--restart", f"model.ckpt-{step}.pt")
    start = time.monotonic()
    while _steps_done(tmp_path) <= step + 1:
        assert again.proc.poll() is None, again.proc.stdout.read()[-4000:]  # type: ignore
        assert time.monotonic() - start < DEADLINE, "the restart never trained"
        time.sleep(0.1)
    forces = np.load(targets[1], mmap_mode="r+")
    forces[:] = np.nan
    forces.flush()
    del forces
    again.fault = time.monotonic()
    out = again.end()
    print(f"NaN labels under mdloader dp: every rank ended {again.seconds:.1f} s after")
    assert "restored the loader state" in out, out[-4000:]
    line = _one_line_on_every_rank(out)
    assert "NonFiniteError: force holds NaN/inf in frames" in line, line
    assert re.search(r"of the batch of training step (\d+)", line), line
    assert int(re.search(r"training step (\d+)", line)[1]) > step, line
    assert f"file: {targets[1]}" in line and f"system: {targets[1].parent.parent}" in line, line


@pytest.mark.timeout(300)
def test_a_missing_systems_entry_is_rank_0s_build_error_on_every_rank(tmp_path: Path) -> None:
    """Found by rank 0's build and sent to every rank, which raise it together: one line
    naming rank 0 and the JSON path, and the exit code of a configuration error (2). It used to
    be published as one rank's failure, whichever came first, in DeePMD-kit's training (1)."""
    _input(tmp_path)
    config = json.loads((tmp_path / "input.json").read_text())
    config["training"]["training_data"]["systems"].append(str(tmp_path / "nowhere"))
    (tmp_path / "input.json").write_text(json.dumps(config))
    job = Job(tmp_path)
    job.fault = time.monotonic()
    out = job.end()
    line = _one_line_on_every_rank(out)
    assert line.startswith("mdloader: error: rank 0 failed (discovering and building the "
                           "systems): ConfigError: training.training_data.systems[2]: "), line
    assert f"{tmp_path / 'nowhere'} does not exist" in line, line
    # each rank's exit code, as torchrun's report of the failed ranks gives it (torchrun's own
    # is 1 whenever a rank failed)
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", out)) == {"2"}, out[-4000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("section, key, value, message", [
    # one launch: every refusal is the same function at the same moment; each key, section and
    # task's line is checked without a launch in tests/config/test_strict_keys.py
    ("training_data", "batch_size", "mix:4",
     "mix:N batches frames of different atom counts from one LMDB database (DeePMD-kit 3.2's "
     "rule); these systems are "),
])
def test_what_mdloader_dp_does_not_serve_is_refused_before_any_set_up(
        tmp_path: Path, section: str, key: str, value: object, message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """One line naming the key, before DeePMD-kit's set-up (no neighbour statistics, no
    model): DeePMD-kit's strict check used to stop the run with a traceback that named neither
    mdloader nor what to do, and ``mix:N`` stopped it after the neighbour statistics. The
    line and exit code are ``mdloader check --for dp``'s. Every such key in every section:
    tests/config/test_strict_keys.py."""
    from mdloader.cli.main import main

    _input(tmp_path)
    config = json.loads((tmp_path / "input.json").read_text())
    config["training"][section] = dict(config["training"]["training_data"], **{key: value})
    (tmp_path / "input.json").write_text(json.dumps(config))
    job = Job(tmp_path, torchrun=False)
    job.fault = time.monotonic()
    out = job.end()
    errors = [line for line in out.splitlines() if line.startswith("mdloader: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"mdloader: error: training.{section}.{key}: {message}"), out[-4000:]
    assert job.proc.returncode == 2 and "Traceback" not in out, out[-4000:]
    assert "neighbor" not in out.lower() and "Model Params" not in out, out[-4000:]
    capsys.readouterr()
    assert main(["check", str(tmp_path / "input.json"), "--for", "dp"]) == 2
    assert capsys.readouterr().err.splitlines() == errors


@pytest.mark.timeout(300)
def test_ctrl_c_with_workers_alive_ends_the_run(tmp_path: Path) -> None:
    """Ctrl-C mid-training (SIGINT to the whole process group, workers included, as a terminal
    sends it): the run ends within seconds, its workers with it."""
    _input(tmp_path)
    job = Job(tmp_path, torchrun=False, workers=2)
    job.wait_for_steps()
    os.killpg(job.proc.pid, signal.SIGINT)
    job.fault = time.monotonic()
    out = job.end(bound=60)
    print(f"Ctrl-C under mdloader dp with 2 workers: ended {job.seconds:.1f} s after")
    assert job.proc.returncode == 130 and "mdloader: interrupted" in out, out[-4000:]
    deadline = time.monotonic() + 10  # a hang guard: nothing of the session is left at once
    while time.monotonic() < deadline:
        try:
            os.killpg(job.proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("a DataLoader worker outlived its job")
