"""What each system is owed after an elastic resume, worked out from the batches served alone.

The definitions of docs/sampling.md#elastic-resume, written the slow and obvious way: rank ``r``
of a generation on ``W`` ranks first serves its share (items ``r, r + W, ...``) of what the
system is owed, in batches, then passes numbered from the system's base pass, sharded as
:func:`mdloader.sampling.order.rank_frames` shards them; a pass a rank left half-served is an
interrupted unit, and the frames it did not serve (the wrap-around padding aside) become owed.
Each call to :meth:`Ledger.generation` checks one generation's batches against this and returns
the facts the tests count on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mdloader.sampling.batching import batches_per_rank
from mdloader.sampling.order import rank_frames


@dataclass
class Ledger:
    """Owed frames and base pass of every system; batches are ``(sid, fids, ...)`` tuples."""

    nframes: Sequence[int]
    batch_sizes: Sequence[int]
    seed: int
    shuffle: bool = True
    owed: dict[int, Counter] = field(default_factory=dict)
    base: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for sid in range(len(self.nframes)):
            self.owed.setdefault(sid, Counter())
            self.base.setdefault(sid, 0)

    def generation(self, batches: list[list[Any]], world: int, *,
                   drained: bool = False) -> dict[str, dict[int, Counter]]:
        """Check one generation (``batches[rank]``); ``drained``: every rank served its whole
        share of what was owed. Returns, per system, the frames the interrupted units had served
        (``prefix``), all their frames (``units``) and what was served from the owed
        (``from_leftover``)."""
        facts: dict[str, dict[int, Counter]] = {"prefix": {}, "units": {}, "from_leftover": {}}
        for sid in range(len(self.nframes)):
            for name, value in self._system(sid, batches, world, drained).items():
                facts[name][sid] = value
        return facts

    def _system(self, sid: int, batches: list[list[Any]], world: int,
                drained: bool) -> dict[str, Counter]:
        size, nframes = int(self.batch_sizes[sid]), int(self.nframes[sid])
        nb = int(batches_per_rank([nframes], [size], world)[0])
        owed_total = sum(self.owed[sid].values())
        from_leftover, prefix, units, rests = Counter(), Counter(), Counter(), Counter()
        started = -1
        for rank, rank_batches in enumerate(batches):
            mine = [tuple(b[1]) for b in rank_batches if b[0] == sid]
            lb = -(-len(range(rank, owed_total, world)) // size)
            if drained:
                assert len(mine) >= lb, "the run was too short to serve the leftover"
            from_leftover.update(f for b in mine[:lb] for f in b)
            fresh = mine[lb:]
            passes = [rank_frames(self.seed, sid, self.base[sid] + q, nframes, rank, world,
                                  self.shuffle) for q in range(len(fresh) // nb + 1)]
            expected = [tuple(p[j * size:(j + 1) * size].tolist()) for p in passes
                        for j in range(nb)]
            assert fresh == expected[:len(fresh)], "fresh passes differ from a W-rank job's"
            p, j = self.base[sid] + len(fresh) // nb, len(fresh) % nb
            if fresh:
                started = max(started, p - (j == 0))
            if j:
                shard = passes[len(fresh) // nb]
                real = (rank + world * np.arange(len(shard))) < nframes   # not the padding
                prefix.update(shard[:j * size].tolist())
                units.update(shard[real].tolist())
                rests.update(shard[j * size:][real[j * size:]].tolist())
        assert not from_leftover - self.owed[sid], "served a leftover frame that was not owed"
        self.owed[sid] = self.owed[sid] - from_leftover + rests
        self.base[sid] = max(self.base[sid], started + 1)
        return {"prefix": prefix, "units": units, "from_leftover": from_leftover}


def by_drawer(batches: list[list[Any]], world: int) -> list[list[Any]]:
    """Keys served by each rank regrouped by the rank whose stream drew them (``key.drawer``),
    taken in (step, serving rank) order: in balanced steps a batch is trained by any rank but
    its frames are its drawer's, so the ledger counts it for the drawer."""
    out: list[list[Any]] = [[] for _ in range(world)]
    for step in range(max((len(b) for b in batches), default=0)):
        for rank_batches in batches:
            if step < len(rank_batches):
                key = rank_batches[step]
                out[key.drawer].append(key)
    return out
