"""What each rank is owed after an elastic resume, worked out from the batches served alone.

The definitions of docs/sampling.md#elastic-resume, written the slow and obvious way: rank ``r``
of generation ``g`` on ``W`` ranks first serves, in batches, every frame it is owed of a system
(what the old ranks it owns, ``d % W == r``, were owed and did not serve), then the passes of
generation ``g`` numbered from 0, sharded as :func:`mdloader.sampling.order.rank_frames` shards
them. A pass shard a rank left half-served is an interrupted unit, and its frames that were not
served (the wrap-around padding aside) become owed by that rank, to be handed to its owner in the
next generation. Each call to :meth:`Ledger.generation` checks one generation's batches against
this and returns the facts the tests count on; it may check only some of the ranks, as long as
every rank it checks owns only old ranks it checked before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mdloader.sampling.batching import batches_per_rank
from mdloader.sampling.order import rank_frames


@dataclass
class Ledger:
    """Owed frames of every (rank, system) of the last generation checked; batches are
    ``(sid, fids, ...)`` tuples."""

    nframes: Sequence[int]
    batch_sizes: Sequence[int]
    seed: int
    shuffle: bool = True
    by_rank: dict[int, dict[int, Counter]] = field(default_factory=dict)
    """Rank of the last generation -> system -> the frames it left owed."""
    world: int | None = None
    """The world size of the last generation checked (None: none yet)."""
    index: int = 0
    """The generation the next call checks."""

    @property
    def owed(self) -> dict[int, Counter]:
        """What the ranks checked last left owed, per system, all of them together."""
        total = {sid: Counter() for sid in range(len(self.nframes))}
        for systems in self.by_rank.values():
            for sid, frames in systems.items():
                total[sid].update(frames)
        return total

    def handed_to(self, rank: int, world: int) -> dict[int, Counter]:
        """What rank ``rank`` of a new generation on ``world`` ranks is owed: the owed frames of
        the old ranks it owns, ``d % world == rank``."""
        handed = {sid: Counter() for sid in range(len(self.nframes))}
        if self.world is None:
            return handed
        for old in range(rank, self.world, world):
            assert old in self.by_rank, f"old rank {old} was not checked: its leftover is unknown"
            for sid, frames in self.by_rank[old].items():
                handed[sid].update(frames)
        return handed

    def generation(self, batches: Sequence[list[Any]] | Mapping[int, list[Any]], world: int, *,
                   drained: bool = False) -> dict[str, dict[int, Counter]]:
        """Check one generation: ``batches[rank]`` (a list of every rank, or a mapping of the
        ranks checked); ``drained``: every rank served its whole leftover. Returns, per system
        and summed over the ranks checked, the frames the interrupted units had served
        (``prefix``), all their frames (``units``) and what was served from the leftover
        (``from_leftover``)."""
        ranks = dict(batches) if isinstance(batches, Mapping) else dict(enumerate(batches))
        nsys = len(self.nframes)
        facts: dict[str, dict[int, Counter]] = {
            name: {sid: Counter() for sid in range(nsys)}
            for name in ("prefix", "units", "from_leftover")}
        by_rank: dict[int, dict[int, Counter]] = {}
        for rank, rank_batches in ranks.items():
            handed = self.handed_to(rank, world)
            by_rank[rank] = {}
            for sid in range(nsys):
                mine = [tuple(b[1]) for b in rank_batches if b[0] == sid]
                got = self._system(sid, mine, rank, world, handed[sid], drained)
                for name in facts:
                    facts[name][sid].update(got[name])
                by_rank[rank][sid] = got["owed"]
        self.by_rank, self.world = by_rank, world
        self.index += 1
        return facts

    def _system(self, sid: int, mine: list[tuple[int, ...]], rank: int, world: int,
                handed: Counter, drained: bool) -> dict[str, Counter]:
        size, nframes = int(self.batch_sizes[sid]), int(self.nframes[sid])
        nb = int(batches_per_rank([nframes], [size], world)[0])
        lb = -(-sum(handed.values()) // size)
        if drained:
            assert len(mine) >= lb, "the run was too short to serve the leftover"
        from_leftover = Counter(f for b in mine[:lb] for f in b)
        assert not from_leftover - handed, "served a leftover frame that was not owed"
        if drained:
            assert from_leftover == handed, "an owed frame was not served"
        fresh = mine[lb:]
        passes = [rank_frames(self.seed, sid, q, nframes, rank, world, self.shuffle, self.index)
                  for q in range(len(fresh) // nb + 1)]
        expected = [tuple(p[j * size:(j + 1) * size].tolist()) for p in passes
                    for j in range(nb)]
        assert fresh == expected[:len(fresh)], "fresh passes differ from a W-rank job's"
        prefix, units, rests = Counter(), Counter(), Counter()
        j = len(fresh) % nb
        if j:
            shard = passes[len(fresh) // nb]
            real = (rank + world * np.arange(len(shard))) < nframes   # not the padding
            prefix.update(shard[:j * size].tolist())
            units.update(shard[real].tolist())
            rests.update(shard[j * size:][real[j * size:]].tolist())
        return {"prefix": prefix, "units": units, "from_leftover": from_leftover,
                "owed": handed - from_leftover + rests}


def by_drawer(batches: list[list[Any]], world: int) -> list[list[Any]]:
    """Keys served by each rank regrouped by the rank whose stream drew them (``key.drawer``),
    taken in (step, serving rank) order: the ledger counts a batch for the rank whose frames it
    holds (its drawer; every rank's own in today's balanced steps)."""
    out: list[list[Any]] = [[] for _ in range(world)]
    for step in range(max((len(b) for b in batches), default=0)):
        for rank_batches in batches:
            if step < len(rank_batches):
                key = rank_batches[step]
                out[key.drawer].append(key)
    return out
