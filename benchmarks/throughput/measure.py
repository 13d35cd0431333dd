"""Throughput through the outer DataLoader, and the raw-read limit of the same frames.

The outer loader is made exactly as DeePMD-kit's trainer makes it (``training.py``):
``DataLoader(loader_set, sampler=<weighted sampler>, batch_size=None, num_workers=K,
collate_fn=identity)``, consumed by a cycling iterator that calls ``iter()`` again when an outer
epoch ends. Timing starts after the first batch (worker start-up is reported separately).

The raw-read limit reads the *same* batches (system, frame ids), in the same order, with plain
numpy from the same files: per batch, ``np.load(mmap_mode="r")`` of coord/box/energy/force,
fancy-index the rows, copy. No type sorting, no dtype conversion, no torch: what any loader
must at least do to get those bytes off the files.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

RAW_KEYS = ("coord", "box", "energy", "force")


def _identity(batch: Any) -> Any:
    return batch


def _cycle(loader: Any) -> Iterator[Any]:
    while True:
        yield from iter(loader)


def measure_loader(loader_set: Any, sampler: Any, num_workers: int, seconds: float,
                   max_batches: int) -> tuple[dict[str, Any], list[tuple[int, list[int]]]]:
    """Draw batches for ``seconds`` (after the first) and count batches, frames and atoms."""
    from torch.utils.data import DataLoader

    dl = DataLoader(loader_set, sampler=sampler, batch_size=None, num_workers=num_workers,
                    drop_last=False, collate_fn=_identity)
    t_start = time.monotonic()
    it = _cycle(dl)
    first = next(it)
    t_first = time.monotonic()
    drawn: list[tuple[int, list[int]]] = []
    nb = nf = na = 0
    batch = first
    while True:
        nframes, natoms = batch["coord"].shape[0], batch["coord"].shape[1]
        drawn.append((int(batch["sid"]), [int(f) for f in batch["fid"]]))
        nb, nf, na = nb + 1, nf + nframes, na + nframes * natoms
        if nb >= max_batches or time.monotonic() - t_first >= seconds:
            break
        batch = next(it)
    elapsed = time.monotonic() - t_first
    # first batch is outside the timed window: count rate on the batches after it
    rates = _rates(nb - 1, nf - drawn_frames(drawn[:1]), na - _first_atoms(first), elapsed)
    del it, dl
    return {"first_batch_s": t_first - t_start, "batches": nb, **rates}, drawn


def drawn_frames(drawn: list[tuple[int, list[int]]]) -> int:
    return sum(len(f) for _, f in drawn)


def _first_atoms(batch: Any) -> int:
    return int(batch["coord"].shape[0] * batch["coord"].shape[1])


def _rates(nb: int, nf: int, na: int, elapsed: float) -> dict[str, float]:
    elapsed = max(elapsed, 1e-9)
    return {"elapsed_s": elapsed, "batches_per_s": nb / elapsed,
            "frames_per_s": nf / elapsed, "atoms_per_s": na / elapsed}


def raw_read(paths: list[str], drawn: list[tuple[int, list[int]]],
             min_seconds: float = 1.0) -> dict[str, float]:
    """Read the drawn batches with plain numpy, repeating the list until ``min_seconds``."""
    if not drawn:
        return _rates(0, 0, 0, 1.0)
    nb = nf = na = 0
    t0 = time.monotonic()
    while True:
        for sid, fids in drawn:
            set_dir = os.path.join(paths[sid], "set.000")
            rows = np.asarray(fids)
            for key in RAW_KEYS:
                arr = np.load(os.path.join(set_dir, key + ".npy"), mmap_mode="r")
                out = np.array(arr[rows] if arr.ndim else arr)
            nb, nf, na = nb + 1, nf + len(fids), na + len(fids) * (out.shape[-1] // 3)
        if time.monotonic() - t0 >= min_seconds:
            break
    return _rates(nb, nf, na, time.monotonic() - t0)
