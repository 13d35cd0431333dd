"""A DataLoader worker reading through mdloader lives as long as its rank needs it: it dies with
its rank, ignores a launcher's stop signals, and ends when its rank ends it -- so a script, a
user's own loop or a test that ends with workers alive exits in seconds, whichever way it ends
(a normal end, ``SystemExit``, an exception, Ctrl-C)."""

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
    """Reads through the loader set, then reports how the worker process is set up: its death
    signal, which stop signals it blocks (a thread of its own receives them), and whether it
    ignores Ctrl-C."""

    def __init__(self, loader_set: DpLoaderSet) -> None:
        self.loader_set = loader_set

    def __len__(self) -> int:
        return len(self.loader_set)

    def __getitem__(self, key: Any) -> tuple[int, bool, bool, bool]:
        self.loader_set[key]
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return (_death_signal(), signal.SIGTERM in blocked, signal.SIGUSR1 in blocked,
                signal.getsignal(signal.SIGINT) == signal.SIG_IGN)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(120)
def test_a_worker_dies_with_its_rank_and_receives_stop_signals_itself(tmp_path) -> None:
    paths = [make_system(tmp_path, f"sys{i}", natoms=3, nframes=4, seed=i) for i in range(2)]
    ls = DpLoaderSet(paths, 1, ["O", "H"], seed=3)
    sampler = get_weighted_sampler(ls, "prob_sys_size", num_workers=1)
    dl = DataLoader(_Probe(ls), sampler=sampler, batch_size=None, num_workers=1,
                    multiprocessing_context="fork", collate_fn=lambda b: b)
    got = list(dl)
    assert got and all(g == (signal.SIGKILL, True, True, True) for g in got), got
    assert _death_signal() == 0  # the rank itself is left as it was
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


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


# -- every process ends ----------------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import os, sys, time
    from torch.utils.data import DataLoader
    from mdloader import DpLoaderSet, StatefulLoader, get_sampler_from_params
    from mdloader.loading.feed import Feed, Stream
    from mdloader.sampling.loop import TrainingLoop
    from mdloader.sampling.order import AgreedSeed
    from mdloader.world import World
    how, way, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    ls = DpLoaderSet(paths, 1, ["O", "H"], seed=1)
    sampler = get_sampler_from_params(ls, {"auto_prob": "prob_sys_size"}, num_workers=2)
    if how == "dataloader":   # the README's own loop
        it = iter(DataLoader(ls, sampler=sampler, batch_size=None, num_workers=2,
                             collate_fn=lambda batch: batch))
    elif how == "stateful":
        it = iter(StatefulLoader(ls, sampler, num_workers=2))
    else:
        feed = Feed([Stream(None, "training", ls, sampler)], seed=AgreedSeed(1, True),
                    world=World(), num_workers=2)
        feed.start(0, TrainingLoop())
        it = feed.stream(None, "training")
    next(it)
    print("ready", flush=True)
    if way == "exit":
        sys.exit(3)
    if way == "raise":
        raise RuntimeError("the script failed")
    if way == "interrupt":
        time.sleep(120)
""")


WAYS = {"end": 0, "exit": 3, "raise": 1, "interrupt": -signal.SIGINT}


def ctrl_c_as_in_a_terminal() -> None:
    """In the child before it starts: Ctrl-C at its default, as in a terminal (a test run
    started in the background of a shell ignores it, and so would its children)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


CASES = [*(("dataloader", way) for way in WAYS), ("stateful", "raise"), ("feed", "exit")]
Ended = dict[tuple[str, str], tuple[bool, Any, str]]


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> Ended:
    """Every script of :data:`CASES` started at once (each in a session of its own; they wait on
    their imports, not on each other), Ctrl-C sent to the interrupted one once it is ready: for
    each, whether it got ready, its exit code (``None``: it did not exit) and standard error."""
    root = tmp_path_factory.mktemp("scripts")
    paths = [str(make_system(root, f"sys{i}", natoms=3, nframes=4, seed=i)) for i in range(2)]
    procs = {case: subprocess.Popen([sys.executable, "-c", SCRIPT, *case, *paths],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True, preexec_fn=ctrl_c_as_in_a_terminal,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
             for case in CASES}
    ready = {}
    for (how, way), proc in procs.items():
        ready[(how, way)] = proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        if way == "interrupt":
            os.killpg(proc.pid, signal.SIGINT)
    # a hang guard: each script exits 1.5-3 s after it starts when run alone; torch's own worker
    # shutdown waits at most 5 s per worker
    deadline = time.monotonic() + 90
    results = {}
    for case, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[case] = (ready[case], proc.returncode, err)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            results[case] = (ready[case], None, proc.communicate()[1])
    return results


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sigwaitinfo")
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("how", "way"), CASES)
def test_a_script_that_ends_with_live_workers_exits(ended: Ended, how: str, way: str) -> None:
    """Ended with an iterator alive (held by a name, a generator or a traceback), the script
    exits: Python's exit ends its daemonic workers with a SIGTERM from their parent, which a
    worker obeys. It never exited before (the workers ignored that SIGTERM and waited for the
    parent, which waited for them). Ctrl-C goes to the whole process group, as a terminal
    sends it. Every way out with a user's own DataLoader (the README's loop); mdloader's own
    loaders hold their workers the same way."""
    ready, code, err = ended[(how, way)]
    assert ready, err[-2000:]
    assert code is not None, f"the script ({how}, {way}) did not exit: its workers kept it alive"
    assert code == WAYS[way], err[-2000:]
