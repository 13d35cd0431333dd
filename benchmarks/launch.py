"""The one launcher: W ranks under ``torchrun --standalone`` with gloo, logs captured, time-boxed.

Every harness starts its jobs here: :func:`torchrun` is the command, :func:`rank_env` the
environment (this checkout first on ``PYTHONPATH``, one OpenMP thread per rank, unbuffered
output), and one of three ways to run it: :func:`run_ranks` (the rank worker, whose ranks each
write a JSON record; :func:`run_build` for its ``build`` suite), :func:`run_job` (a job whose
last output line is its JSON result) and :func:`run_logged` (a training job whose output lines
are time-stamped as they arrive, with each rank's memory and CPU time sampled). A job past its
timeout is stopped, never waited for.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psutil

from benchmarks import REPO

POLL_S = 0.25
TAIL_CHARS = 3000


def torchrun(python: str, world: int, entry: list[str]) -> list[str]:
    """The command running ``entry`` (``-m module args...``) on ``world`` local ranks."""
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            *entry]


def rank_env(**extra: str) -> dict[str, str]:
    """This process's environment for the ranks: this checkout importable, one OpenMP thread."""
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def can_import(python: str, module: str, timeout: float = 300.0) -> bool:
    """Whether ``python`` imports ``module`` (the DeePMD-kit interpreter's check)."""
    try:
        done = subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                              timeout=timeout, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def run_ranks(python: str, worker_args: list[str], world: int, *, timeout: float,
              strace_to: str | None = None,
              env: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], str]:
    """:mod:`benchmarks.worker` on ``world`` ranks (each writes ``<--out>.rank<r>.json``);
    the ranks' records, and the tail of the output when the launch failed."""
    tmp = tempfile.mkdtemp(prefix="mdl-bench-")
    out = os.path.join(tmp, "r")
    cmd = torchrun(python, world, ["-m", "benchmarks.worker", *worker_args, "--out", out])
    if strace_to:
        cmd = ["strace", "-f", "-y", "-ttt", "--seccomp-bpf", "-e", "trace=%file,%process",
               "-o", strace_to] + cmd
    code, stdout, stderr = _run_group(cmd, env=rank_env(**(env or {})), timeout=timeout)
    if code is None:
        tail = (f"timeout after {timeout} s (process group stopped): "
                f"{(stdout + stderr)[-TAIL_CHARS:]}")
    else:
        tail = (stdout + stderr)[-TAIL_CHARS:] if code else ""
    recs = []
    for r in range(world):
        path = f"{out}.rank{r}.json"
        if os.path.isfile(path):
            with open(path) as fh:
                recs.append(json.load(fh))
    shutil.rmtree(tmp, ignore_errors=True)
    return recs, tail


def python_for(impl: str, peer_python: str) -> str | None:
    """The interpreter that runs ``impl``'s ranks; None when DeePMD-kit's cannot import it."""
    if impl == "mdloader":
        return sys.executable
    return peer_python if can_import(peer_python, "deepmd.pt.utils.dataloader", 120) else None


def run_build(python: str, impl: str, root: str, world: int, *, seconds: float, build_only: bool,
           strace_to: str | None, timeout: float, rep: int = 0,
           env: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], str]:
    """One launch of the rank worker's ``build`` suite (``env`` added to this process's);
    returns the ranks' records and the tail of its output."""
    worker_args = ["build", "--impl", impl, "--data", root, "--seconds", str(seconds),
                   "--rep", str(rep)]
    if build_only:
        worker_args.append("--build-only")
    return run_ranks(python, worker_args, world, timeout=timeout, strace_to=strace_to, env=env)


def run_job(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
            what: str = "job") -> str:
    """Run ``cmd`` from the checkout; its standard output (``RuntimeError`` with the tail of its
    errors when it fails)."""
    code, stdout, stderr = _run_group(cmd, env=env or rank_env(), timeout=timeout)
    if code is None:
        raise RuntimeError(f"{what} failed: timeout after {timeout} s (process group stopped):\n"
                           f"{stderr[-TAIL_CHARS:]}")
    if code != 0:
        raise RuntimeError(f"{what} failed:\n{stderr[-TAIL_CHARS:]}")
    return stdout


def _run_group(cmd: list[str], *, env: dict[str, str],
               timeout: float) -> tuple[int | None, str, str]:
    """Run ``cmd`` from the checkout in its own session, output captured; its return code (None
    when it ran past ``timeout``: then its whole process group, ``torchrun``'s ranks included,
    is stopped with :func:`_stop`), standard output and standard error."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process that left the group holds the pipes
            stdout, stderr = "", ""
        return None, stdout or "", stderr or ""
    return proc.returncode, stdout, stderr


def last_json(stdout: str) -> Any:
    """The JSON object on the last line of a job's output."""
    return json.loads(stdout.strip().splitlines()[-1])


class Poller(threading.Thread):
    """Samples, per rank (processes whose environment has ``RANK``), RSS and CPU time."""

    def __init__(self, pid: int, t0: float) -> None:
        super().__init__(daemon=True)
        self.root, self.t0 = psutil.Process(pid), t0
        self.stop = threading.Event()
        self.ranks: dict[int, str] = {}  # pid -> rank
        self.peak_rss: dict[str, int] = {}
        self.peak_tree: dict[str, int] = {}
        self.peak_workers: dict[str, int] = {}  # processes of a rank beside its main one
        self.cpu: dict[str, list[tuple[float, float]]] = {}

    def _rank(self, proc: psutil.Process) -> str | None:
        if proc.pid not in self.ranks:
            try:
                self.ranks[proc.pid] = proc.environ().get("RANK", "")
            except psutil.Error:
                return None
        return self.ranks[proc.pid] or None

    def sample(self) -> None:
        rss: dict[str, int] = {}
        cpu: dict[str, float] = {}
        workers: dict[str, int] = {}
        try:
            procs = self.root.children(recursive=True)
        except psutil.Error:
            return
        for proc in procs:
            rank = self._rank(proc)
            if rank is None:
                continue
            try:
                with proc.oneshot():
                    mem, times = proc.memory_info().rss, proc.cpu_times()
                    main = self._rank(proc.parent()) is None
            except psutil.Error:
                continue
            rss[rank] = rss.get(rank, 0) + mem
            cpu[rank] = cpu.get(rank, 0.0) + times.user + times.system
            if main:
                self.peak_rss[rank] = max(self.peak_rss.get(rank, 0), mem)
            else:
                workers[rank] = workers.get(rank, 0) + 1
        now = time.monotonic() - self.t0
        for rank, total in rss.items():
            self.peak_tree[rank] = max(self.peak_tree.get(rank, 0), total)
            self.cpu.setdefault(rank, []).append((now, cpu[rank]))
            self.peak_workers[rank] = max(self.peak_workers.get(rank, 0),
                                          workers.get(rank, 0))

    def run(self) -> None:
        while not self.stop.wait(POLL_S):
            self.sample()


def run_logged(cmd: list[str], cwd: str, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``cmd`` in ``cwd``; the time-stamped log (also written to ``log.txt``), the status
    (``ok``, ``failed`` or ``stopped`` past ``timeout``) and the poller's samples."""
    log_path = os.path.join(cwd, "log.txt")
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    poller = Poller(proc.pid, t0)
    poller.start()

    stream = proc.stdout

    def read() -> None:
        with open(log_path, "w") as fh:
            for line in stream or ():
                t = time.monotonic() - t0
                lines.append((t, line.rstrip("\n")))
                fh.write(f"{t:.3f} {line}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    status = "ok"
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        status = "stopped"
        _stop(proc)
    wall = time.monotonic() - t0
    poller.stop.set()
    poller.join()
    reader.join(timeout=30)
    if status == "ok" and proc.returncode != 0:
        status = "failed"
    return {"status": status, "wall_s": round(wall, 2), "lines": lines, "poller": poller,
            "returncode": proc.returncode}


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop ``proc``'s process group (SIGTERM, then SIGKILL), then any descendant left: torchrun
    starts each rank in a session of its own and stops them on SIGTERM, but not when killed."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _, alive = psutil.wait_procs(descendants, timeout=5)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
