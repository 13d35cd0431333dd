"""Process faults of the reference job, in one process: damaged checkpoints, write errors, a bad
``--output``, and stop signals before the first step or during a full validation."""

from __future__ import annotations

import logging
import os
import resource
import signal
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from support.distributed_utils import errors, run_ranks
from support.inputs import write_input

from mdloader.cli.main import main
from mdloader.config.input_json import parse_config
from mdloader.errors import StateDictError, WriteError
from mdloader.testing import make_system
from mdloader.train.io import load_checkpoint, save_checkpoint
from mdloader.train.job import ModelOptions, train

SMALL = ModelOptions(rcut=2.5, nbasis=4, hidden=(8,))


def _raw(tmp_path: Path, steps: int = 8, valid_frames: int = 0, **training: object) -> dict:
    for i, n in enumerate((5, 7)):
        make_system(tmp_path / "data", f"sys{i}", natoms=n, nframes=6, seed=i,
                    keys=("energy", "force"))
    raw = {"model": {"type_map": ["O", "H"]},
           "training": {"training_data": {"systems": ["data/sys0", "data/sys1"],
                                          "batch_size": 2},
                        "numb_steps": steps, "seed": 7, "disp_freq": 1, "save_freq": 4,
                        **training}}
    if valid_frames:
        make_system(tmp_path / "data", "val", natoms=6, nframes=valid_frames, seed=9,
                    keys=("energy", "force"))
        raw["training"]["validation_data"] = {"systems": "data/val", "batch_size": 1,
                                              "numb_btch": 1}
    return raw


def _checkpoints(tmp_path: Path) -> Path:
    """A run of 8 steps: checkpoints of steps 4 and 8 in ``tmp_path/o``."""
    cfg = parse_config(_raw(tmp_path), base_dir=str(tmp_path))
    train(cfg, output=str(tmp_path / "o"), num_workers=0, options=SMALL)
    return tmp_path / "o"


def _member_offset(path: Path, suffix: str) -> int:
    """Where the bytes of the zip member ending in ``suffix`` start in the file."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len


def _flip(path: Path, offset: int, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_tensor_bytes_are_caught_on_restart(tmp_path: Path) -> None:
    """torch loads such a file without complaint; the checksum names it and the previous one."""
    out = _checkpoints(tmp_path)
    target = out / "model.ckpt-8.pt"
    weights = load_checkpoint(str(target))["model"]
    name = max(weights, key=lambda k: weights[k].numel())
    raw = weights[name].numpy().tobytes()
    _flip(target, target.read_bytes().index(raw))
    assert not torch.equal(torch.load(target, weights_only=True)["model"][name], weights[name])
    cfg = parse_config(_raw(tmp_path, steps=12), base_dir=str(tmp_path))
    with pytest.raises(StateDictError, match=rf"^checkpoint {out}/model.ckpt.pt is damaged: its "
                       r"content does not match the checksum written with it; restart from "
                       rf"the previous checkpoint, --restart {out}/model.ckpt-4.pt$"):
        train(cfg, output=str(out), num_workers=0, options=SMALL,
              restart=str(out / "model.ckpt.pt"))
    assert load_checkpoint(str(out / "model.ckpt-4.pt"))["step"] == 4


def test_flipped_pickle_bytes_advise_no_unsafe_load(tmp_path: Path) -> None:
    out = _checkpoints(tmp_path)
    target = out / "model.ckpt-8.pt"
    _flip(target, _member_offset(target, "data.pkl") + 40)
    with pytest.raises(StateDictError) as info:
        load_checkpoint(str(target))
    text = str(info.value)
    assert text.startswith(f"cannot read checkpoint {target}: damaged or not a checkpoint (") \
        or text.startswith(f"checkpoint {target} is damaged"), text
    assert text.endswith(f"restart from the previous checkpoint, --restart {out}/model.ckpt-4.pt")
    assert "weights_only" not in text and "\n" not in text


@contextmanager
def _file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes beyond ``nbytes`` fail with EFBIG, as on a full disk they fail with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_failed_checkpoint_write_names_the_file_and_keeps_the_last(tmp_path: Path) -> None:
    out = _checkpoints(tmp_path)
    state = load_checkpoint(str(out / "model.ckpt-8.pt"))
    state = {k: v for k, v in state.items() if k not in ("format", "version", "step")}
    with _file_size_limit(4096), pytest.raises(WriteError) as info:
        save_checkpoint(str(out), "model.ckpt", 12, state)
    assert str(info.value) == (f"cannot write {out}/model.ckpt-12.pt: File too large; no "
                               f"checkpoint of step 12 was written; {out}/model.ckpt-8.pt is "
                               "still the latest checkpoint")
    assert sorted(os.listdir(out)) == ["checkpoint", "lcurve.out", "model.ckpt-4.pt",
                                       "model.ckpt-8.pt", "model.ckpt.pt",
                                       "stalls.jsonl"]  # no .tmp
    assert load_checkpoint(str(out / "model.ckpt.pt"))["step"] == 8


def _input(tmp_path: Path, raw: dict) -> str:
    return str(write_input(tmp_path, raw))


@pytest.mark.parametrize("kind", ["file", "under a file"])
def test_an_unusable_output_fails_before_the_build(tmp_path: Path, kind: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").write_text("")
    output = tmp_path / "taken" if kind == "file" else tmp_path / "taken" / "out"
    raw = _raw(tmp_path)
    raw["training"]["training_data"]["systems"] = ["data/none"]  # the build would fail
    assert main(["train", _input(tmp_path, raw), "-o", str(output)]) == 2
    err = capsys.readouterr().err.splitlines()
    said = (f"{output} exists and is not a folder" if kind == "file"
            else f"cannot write in {output}: Not a directory")
    assert err == [f"mdloader: error: --output: {said}"]


class _SignalAt(logging.Handler):
    """Sends ``signum`` to this process when a record's message starts with ``text``."""

    def __init__(self, text: str, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.text, self.signum, self.sent = text, signum, 0

    def emit(self, record: logging.LogRecord) -> None:
        if not self.sent and record.getMessage().startswith(self.text):
            self.sent += 1
            os.kill(os.getpid(), self.signum)


@contextmanager
def _signal_at(logger: str, text: str) -> Iterator[_SignalAt]:
    handler = _SignalAt(text)
    logging.getLogger(logger).addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger(logger).removeHandler(handler)


def test_sigterm_during_the_build_stops_at_once(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing to save yet: no box check, no statistics, exit 143 at the signal."""
    path = _input(tmp_path, _raw(tmp_path))
    with _signal_at("mdloader.loading.loader", "---Summary of DataSystem: training") as sent:
        code = main(["train", path, "--rcut", "2.5", "--num-workers", "0", "-o",
                     str(tmp_path / "o"), "-v", "DEBUG"])
    err = capsys.readouterr().err
    assert sent.sent == 1 and code == 143, err
    assert err.splitlines()[-1] == ("mdloader: stopped on rank 0: SIGTERM before the first "
                                    "training step: nothing to save")
    assert "energy bias" not in err and not (tmp_path / "o" / "lcurve.out").exists()


def _full_valid(path: Path) -> dict[int, list[str]]:
    """step -> (rmse_e, rmse_f, frames) of full_valid.out."""
    rows = [line.split() for line in path.read_text().splitlines()[1:]]
    return {int(row[0]): row[1:4] for row in rows}


@pytest.mark.timeout(300)
def test_sigterm_cuts_a_full_validation_and_the_restart_does_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _input(tmp_path, _raw(tmp_path, steps=8, valid_frames=40))
    args = ["train", path, "--rcut", "2.5", "--num-workers", "0", "--full-validation"]
    assert main([*args, "-o", str(tmp_path / "whole")]) == 0
    whole = _full_valid(tmp_path / "whole" / "full_valid.out")
    assert sorted(whole) == [4, 8]
    out = tmp_path / "cut"
    with _signal_at("mdloader.train.job", "full validation at step 4: started"):
        assert main([*args, "-o", str(out)]) == 143
    err = capsys.readouterr().err
    assert "full validation at step 4 cut by a stop signal" in err
    assert f"stopped after step 4 (SIGTERM): continue with --restart {out}/model.ckpt-4.pt" in err
    assert _full_valid(out / "full_valid.out") == {}
    assert os.readlink(out / "model.ckpt.pt") == "model.ckpt-4.pt"
    assert main([*args, "-o", str(out), "--restart", str(out / "model.ckpt.pt")]) == 0
    assert _full_valid(out / "full_valid.out") == whole
    assert (out / "lcurve.out").read_text() == (tmp_path / "whole" / "lcurve.out").read_text()


def _restart_on_a_full_disk(rank: int, world_size: int, raw: dict, base: str, out: str) -> None:
    if rank == 0:  # rank 0 writes the logs: its writes fail past 64 bytes
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (64, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    train(parse_config(raw, base_dir=base), output=out, num_workers=0, options=SMALL,
          restart=f"{out}/model.ckpt-4.pt")


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_restart_on_a_full_disk_names_the_log_and_the_phase(tmp_path: Path) -> None:
    """It was labelled "checking every box against the model cutoff", the last label set."""
    out = _checkpoints(tmp_path)
    raw = _raw(tmp_path)
    outcomes = run_ranks(_restart_on_a_full_disk, 2, raw, str(tmp_path), str(out), timeout=150)
    failed = errors(outcomes)
    assert [e.rank for e in failed] == [0, 1], outcomes
    assert failed[0].message.splitlines()[0] == (
        f"rank 0 failed (opening the logs in {out}): WriteError: cannot write {out}/lcurve.out: "
        f"File too large; the old {out}/lcurve.out is kept unchanged"), failed
    # without torchrun the store lived in rank 0's process: rank 1 says that rank 0 left
    assert failed[1].message.startswith(f"rank 1 failed (opening the logs in {out}): "), failed
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]


@pytest.mark.timeout(300)
def test_ctrl_c_with_workers_alive_ends_the_run(tmp_path: Path) -> None:
    """Ctrl-C mid-training (SIGINT to the whole process group, workers included, as a terminal
    sends it): the job ends within seconds with ``interrupted`` (130), its workers with it. The
    job starts with Ctrl-C at its default, as in a terminal (a test run in the background of a
    shell ignores it, and so would the job)."""
    import subprocess
    import sys
    import time

    path = _input(tmp_path, _raw(tmp_path, steps=100000))
    job = subprocess.Popen([sys.executable, "-m", "mdloader", "train", path, "--rcut", "2.5",
                            "--num-workers", "2", "-o", str(tmp_path / "out")],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    curve, started = tmp_path / "out" / "lcurve.out", time.monotonic()
    while not (curve.exists() and len(curve.read_text().splitlines()) > 3):
        assert job.poll() is None, job.stdout.read()[-4000:]  # type: ignore[union-attr]
        assert time.monotonic() - started < 200, "training never started"
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGINT)
    try:
        out, _ = job.communicate(timeout=60)  # a hang guard: it ends in about a second here
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail("Ctrl-C did not end the job")
    assert job.returncode == 130 and "mdloader: interrupted" in out, out[-4000:]
    deadline = time.monotonic() + 10  # a hang guard: nothing of the session is left at once
    while time.monotonic() < deadline:
        try:
            os.killpg(job.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("a DataLoader worker outlived its job")
