"""``StatefulLoader``: a loader over sampler keys that knows how many batches it yielded.

Workers read ahead of what the training loop consumed, so the sampler's own position runs
ahead. Batches arrive in sampler order, so counting what was yielded gives the exact resume
position whatever ``num_workers`` and the prefetch depth are (torchdata's approach).
``torchdata.stateful_dataloader.StatefulDataLoader`` also works: it saves the state of the
sampler's epoch iterator at each delivered batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from mdloader.loading.pool import WorkerPool
from mdloader.sampling.samplers import WeightedSystemSampler
from mdloader.state import check_keys

STATE_VERSION = 1


class StatefulLoader:
    """The batches of ``dataset`` at the keys of ``sampler``, one epoch per ``iter()``, with an
    exact state.

    ``state_dict()`` saves the number of batches delivered; a new ``iter()`` rewinds the sampler
    to it, so keys a previous iterator read ahead but never delivered are read again rather than
    skipped. The batches are read by a :class:`~mdloader.loading.pool.WorkerPool` of
    ``num_workers`` processes (0: in this process), started for each epoch and ended when it
    ends or is left; they cross from the workers as numpy arrays and arrive as the same plain
    dicts. A worker's mdloader error is raised here as the same error, with its system and file,
    and a worker that died is a :class:`~mdloader.errors.WorkerLostError`. ``pin_memory``,
    ``worker_init_fn``, ``prefetch_factor`` and the DataLoader's other options pass through.

    Examples
    --------
    >>> from mdloader import DpLoaderSet, StatefulLoader, get_sampler_from_params
    >>> from mdloader.testing import make_dataset
    >>> ls = DpLoaderSet(make_dataset("data", 2, nframes=4, seed=1), batch_size=2,
    ...                  type_map=["O", "H"], seed=7)
    >>> loader = StatefulLoader(ls, get_sampler_from_params(ls, {}, num_workers=0))
    >>> first = [tuple(b["fid"]) for b in itertools.islice(loader, 2)]
    >>> state = loader.state_dict()              # two batches delivered (of an epoch of 4)
    >>> rest = [tuple(b["fid"]) for b in loader]
    >>> again = StatefulLoader(ls, get_sampler_from_params(ls, {}, num_workers=0))
    >>> again.load_state_dict(state)
    >>> [tuple(b["fid"]) for b in again] == rest
    True
    """

    def __init__(self, dataset: Any, sampler: WeightedSystemSampler, *, num_workers: int = 0,
                 **dataloader_kwargs: Any) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.num_workers = int(num_workers)
        self.options = dataloader_kwargs
        self._consumed = sampler.position

    def __iter__(self) -> Iterator[Any]:
        if self.sampler.position != self._consumed:
            self.sampler.seek(self._consumed)
        epoch = len(self.sampler)
        left = (self._consumed // epoch + 1) * epoch - self._consumed
        pool = WorkerPool([self.dataset], [self.sampler], ["loader"],
                          itertools.repeat(0, left), num_workers=self.num_workers,
                          **self.options)
        try:
            for _ in range(left):
                batch = pool.next_batch(0)
                self._consumed += 1
                yield batch
        finally:  # an error or an iterator left early: its workers end now, not when collected
            pool.close()

    def __len__(self) -> int:
        return len(self.sampler)

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
