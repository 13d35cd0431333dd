"""A DataLoader worker reading through a loader set dies with its rank and ignores stop signals."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

from mdloader.loading.loader import DpLoaderSet, get_weighted_sampler
from mdloader.testing import make_system

PR_GET_PDEATHSIG = 2


def _death_signal() -> int:
    value = ctypes.c_int(0)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


class _Probe(Dataset):
    """Reads through the loader set, then reports how the worker process is set up."""

    def __init__(self, loader_set: DpLoaderSet) -> None:
        self.loader_set = loader_set

    def __len__(self) -> int:
        return len(self.loader_set)

    def __getitem__(self, key: Any) -> tuple[int, Any, Any]:
        self.loader_set[key]
        return (_death_signal(), signal.getsignal(signal.SIGTERM),
                signal.getsignal(signal.SIGUSR1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(120)
def test_a_worker_dies_with_its_rank_and_ignores_stop_signals(tmp_path) -> None:
    paths = [make_system(tmp_path, f"sys{i}", natoms=3, nframes=4, seed=i) for i in range(2)]
    ls = DpLoaderSet(paths, 1, ["O", "H"], seed=3)
    sampler = get_weighted_sampler(ls, "prob_sys_size", num_workers=1)
    dl = DataLoader(_Probe(ls), sampler=sampler, batch_size=None, num_workers=1,
                    multiprocessing_context="fork", collate_fn=lambda b: b)
    got = list(dl)
    assert got and all(g == (signal.SIGKILL, signal.SIG_IGN, signal.SIG_IGN) for g in got), got
    assert _death_signal() == 0  # the rank itself is left as it was
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN


RANK = textwrap.dedent("""
    import sys, time
    from torch.utils.data import DataLoader
    from mdloader.loading.loader import DpLoaderSet, get_weighted_sampler
    ls = DpLoaderSet(sys.argv[1:], 1, ["O", "H"], seed=3)
    dl = DataLoader(ls, sampler=get_weighted_sampler(ls, "prob_sys_size", num_workers=1),
                    batch_size=None, num_workers=1, multiprocessing_context="fork",
                    collate_fn=lambda b: b)
    it = iter(dl)
    next(it)
    print(it._workers[0].pid, flush=True)
    sys.stdin.readline()
    next(it)
    print("served", flush=True)
    time.sleep(120)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(120)
def test_a_rank_killed_outright_takes_its_workers_with_it(tmp_path) -> None:
    """Its workers held the rank's gloo sockets open until torch's 5 s status poll noticed the
    parent was gone; SIGTERM from the launcher (to the rank's process group) is ignored."""
    paths = [make_system(tmp_path, f"sys{i}", natoms=3, nframes=4, seed=i) for i in range(2)]
    rank = subprocess.Popen([sys.executable, "-c", RANK, *map(str, paths)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    worker = int(rank.stdout.readline())  # type: ignore[union-attr]
    os.kill(worker, signal.SIGTERM)
    time.sleep(0.2)  # not a bound: the signal is delivered meanwhile, and must change nothing
    rank.stdin.write("next\n")  # type: ignore[union-attr]
    rank.stdin.flush()  # type: ignore[union-attr]
    assert rank.stdout.readline().strip() == "served"  # type: ignore[union-attr]
    rank.kill()
    rank.wait(timeout=30)
    deadline = time.monotonic() + 3.0  # a hang guard: the kernel ends it at once
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        state = open(f"/proc/{worker}/stat").read().split(") ")[-1][0]  # noqa: SIM115
        if state == "Z":  # ended, not yet reaped (its parent is gone; init reaps it)
            break
        time.sleep(0.01)
    alive = os.path.exists(f"/proc/{worker}") and \
        open(f"/proc/{worker}/stat").read().split(") ")[-1][0] != "Z"  # noqa: SIM115
    assert not alive, "the worker outlived its rank"
