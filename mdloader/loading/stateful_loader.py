"""``StatefulLoader``: a ``DataLoader`` over sampler keys that knows how many batches it yielded.

A DataLoader with workers pulls keys ahead of what the training loop consumed, so the sampler's
own position runs ahead. DataLoader delivers batches in sampler order, so counting what was
yielded gives the exact resume position whatever ``num_workers`` and ``prefetch_factor`` are
(torchdata's approach). ``torchdata.stateful_dataloader.StatefulDataLoader`` also works: it saves
the state of the sampler's epoch iterator at each delivered batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from mdloader.errors import WorkerLostError
from mdloader.sampling.samplers import WeightedSystemSampler
from mdloader.state import check_keys
from mdloader.transport import CarriedError, CarryErrors, NumpyTransport, identity

STATE_VERSION = 1


class StatefulLoader:
    """``DataLoader(dataset, sampler=sampler, batch_size=None, ...)`` with an exact state.

    ``state_dict()`` saves the number of batches delivered; a new ``iter()`` rewinds the sampler
    to it, so keys a previous iterator prefetched but never delivered are read again rather than
    skipped. With workers, batches cross the process boundary as numpy arrays
    (:class:`~mdloader.transport.NumpyTransport`, ``numpy_transport=True``); the yielded batches
    are the same. A worker's mdloader error is raised in the main process as the same error, with
    its system and file (:class:`~mdloader.transport.CarryErrors`), and a worker that died is a
    :class:`~mdloader.errors.WorkerLostError`.
    """

    def __init__(self, dataset: Any, sampler: WeightedSystemSampler, *, num_workers: int = 0,
                 numpy_transport: bool = True, **dataloader_kwargs: Any) -> None:
        collate_fn = dataloader_kwargs.pop("collate_fn", identity)
        if num_workers > 0 and numpy_transport:
            collate_fn = NumpyTransport(collate_fn)
        dataloader_kwargs["collate_fn"] = collate_fn
        self.sampler = sampler
        self.dataloader = DataLoader(CarryErrors(dataset) if num_workers > 0 else dataset,
                                     sampler=sampler, batch_size=None,
                                     num_workers=num_workers, **dataloader_kwargs)
        self._consumed = sampler.position

    def __iter__(self) -> Iterator[Any]:
        if self.sampler.position != self._consumed:
            self.sampler.seek(self._consumed)
        with torch.device("cpu"):  # torch's DataLoader draws its base seed on the default device
            batches = iter(self.dataloader)
        try:
            for batch in batches:
                if isinstance(batch, CarriedError):
                    raise batch.error
                self._consumed += 1
                yield batch
        except RuntimeError as exc:
            lost = lost_worker(exc)
            if lost is None:
                raise
            raise lost from exc
        finally:  # an error or an iterator left early: its workers end now, not when collected
            end_workers(batches)

    def __len__(self) -> int:
        return len(self.dataloader)

    @property
    def consumed(self) -> int:
        """Batches delivered since the stream start (the resume position)."""
        return self._consumed

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION,
                "sampler": self.sampler.state_dict(consumed=self._consumed)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_keys(state, kind="loader", version=STATE_VERSION, keys=("sampler",))
        self.sampler.load_state_dict(state["sampler"])
        self._consumed = self.sampler.position


def end_workers(batches: Iterator[Any]) -> None:
    """End the workers of a DataLoader iterator now. An iterator referenced by an error's
    traceback lives as long as the error, its workers (and their open files) with it."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # absent without workers
    if shutdown is not None:
        shutdown()


def lost_worker(exc: BaseException | None) -> WorkerLostError | None:
    """Torch's "DataLoader worker (pid N) is killed by signal" (or "exited unexpectedly") as a
    :class:`~mdloader.errors.WorkerLostError` that says what may have happened; else ``None``.

    torch raises it where the main process happens to be when it notices (its SIGCHLD handler),
    so callers outside this loader's iteration may need it too.
    """
    if isinstance(exc, WorkerLostError):
        return exc
    while exc is not None and not (isinstance(exc, RuntimeError)
                                   and str(exc).startswith("DataLoader worker")):
        exc = exc.__cause__  # e.g. a collective that was interrupted by it
    if exc is None:
        return None
    text = str(exc)
    said = text.split("Original Traceback", 1)[0].strip().rstrip(".")
    hint = ("a memory-mapped file may have been truncated while it was read"
            if "Bus error" in text else "killed from outside or out of memory: see the kernel "
            "log (dmesg)")
    return WorkerLostError(f"{said} ({hint})")
