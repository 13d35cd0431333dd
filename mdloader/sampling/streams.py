"""The system streams a weighted sampler delegates to: which batch each step of this rank gets.

One interface (:class:`SystemStream`), two strategies: :class:`IndependentStream`, where every
rank draws its systems independently, and :class:`BalancedStream`, where every rank of a step
draws from the same cost stratum so that the step costs about the same on every rank
(:mod:`mdloader.sampling.balance`). Either way a rank reads its own frames of the systems it
draws, with its own per-system counters. A stream serves one generation of the job under one
seed; the sampler makes a new one when either changes, and picks the strategy once, from its plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from mdloader.sampling.balance import Strata, balanced_chunk, chunk_windows, strata_counts
from mdloader.sampling.elastic import BALANCE_IDENTITY, Generation
from mdloader.sampling.order import (
    STREAM_CHUNK,
    FrameOrder,
    sizes_digest,
    stream_chunk,
    stream_counts,
)
from mdloader.sampling.plan import LoaderPlan
from mdloader.state import check_same

BALANCE_HINT = " (training_data.balance_window, balance_cost)"


class BatchKey(NamedTuple):
    """One batch: frames ``fids`` of system ``sid``; ``step`` is its index in the rank's stream;
    ``drawer`` is the rank whose system stream drew it (the rank itself; -1: no stream, a
    validation key)."""

    sid: int
    fids: tuple[int, ...]
    step: int
    drawer: int = -1


class SystemStream(Protocol):
    """The keys of one rank in one generation of a job, from step 0 on.

    Attributes
    ----------
    order
        Which frames each batch of each system holds on this rank.
    step
        The step of the next key.
    """

    order: FrameOrder
    step: int

    def next_key(self) -> BatchKey:
        """Hand out the key of :attr:`step` and advance."""
        ...

    def seek(self, step: int) -> None:
        """Move to ``step`` (forward or back)."""
        ...

    def identity(self) -> dict[str, int]:
        """The keys this strategy adds to the sampler's state (none for independent streams)."""
        ...

    def check_identity(self, state: Mapping[str, Any]) -> None:
        """Refuse a state saved under another strategy or its settings, quoting both values."""
        ...

    def check_generations(self, history: Sequence[Generation]) -> None:
        """Refuse finished generations this strategy cannot continue from."""
        ...


def _check_balance(state: Mapping[str, Any], mine: Mapping[str, int]) -> None:
    for key, words in BALANCE_IDENTITY.items():
        check_same("sampler", words, state.get(key, 0), mine.get(key, 0), BALANCE_HINT)


class _DrawnStream(ABC):
    """What both strategies share: a rank's step draws one system, from chunks of
    ``chunk_steps`` steps computed on demand (:meth:`_chunk`), and reads that system's next
    frames by its own per-system counter; seeking replays only the counters, from the draws
    between two steps (:meth:`_draws`).
    """

    def __init__(self, plan: LoaderPlan, order: FrameOrder, generation: int,
                 chunk_steps: int) -> None:
        self.plan, self.order, self.generation = plan, order, generation
        self.step = 0
        self._chunk_steps = chunk_steps
        self._counts = np.zeros(plan.nsys, dtype=np.int64)
        self._chunk_id = -1
        self._chunk_sids = np.empty(0, dtype=np.int64)

    @abstractmethod
    def _chunk(self, c: int) -> np.ndarray:
        """The system of each step of chunk ``c`` (steps ``c * chunk_steps`` on)."""

    @abstractmethod
    def _draws(self, lo: int, hi: int) -> np.ndarray:
        """How many times each system is drawn at steps ``lo`` to ``hi - 1``."""

    def _draw(self, step: int) -> int:
        c = step // self._chunk_steps
        if c != self._chunk_id:
            self._chunk_sids = self._chunk(c)
            self._chunk_id = c
        return int(self._chunk_sids[step - c * self._chunk_steps])

    def next_key(self) -> BatchKey:
        step = self.step
        sid = self._draw(step)
        occ = int(self._counts[sid])
        self._counts[sid] = occ + 1
        self.step = step + 1
        return BatchKey(sid, self.order.fids(sid, occ), step, self.order.rank)

    def seek(self, step: int) -> None:
        """Replay only the difference between the two steps (the per-system cursors)."""
        lo, hi = sorted((self.step, step))
        delta = self._draws(lo, hi)
        self._counts += delta if step >= self.step else -delta
        self.step = step


class IndependentStream(_DrawnStream):
    """Every rank trains the batches its own system stream draws.

    Parameters
    ----------
    plan
        The sampler's plan (its probabilities, sizes and seed).
    order
        This rank's frame order (its share of any leftover of an elastic resume).
    generation
        How many times the job changed its number of ranks.
    """

    def __init__(self, plan: LoaderPlan, order: FrameOrder, generation: int) -> None:
        super().__init__(plan, order, generation, STREAM_CHUNK)

    def _chunk(self, c: int) -> np.ndarray:
        return stream_chunk(self.order.seed, self.order.rank, c, self.plan.cdf,
                            self.plan.same_system_across_ranks, self.generation)

    def _draws(self, lo: int, hi: int) -> np.ndarray:
        return stream_counts(self.order.seed, self.order.rank, lo, hi, self.plan.cdf,
                             self.plan.same_system_across_ranks, self.generation)

    def identity(self) -> dict[str, int]:
        return {}

    def check_identity(self, state: Mapping[str, Any]) -> None:
        _check_balance(state, {})

    def check_generations(self, history: Sequence[Generation]) -> None:
        """Any history: each rank continues its own share."""


class BalancedStream(_DrawnStream):
    """Every rank of a step draws from the same cost stratum of each window of
    ``balance_window`` steps, so that the step's ranks cost about the same; a rank reads its own
    frames of what it draws, as :class:`IndependentStream` does.

    Parameters
    ----------
    plan, order, generation
        As :class:`IndependentStream`'s.
    """

    def __init__(self, plan: LoaderPlan, order: FrameOrder, generation: int) -> None:
        super().__init__(plan, order, generation,
                         chunk_windows(plan.balance_window) * plan.balance_window)
        self._strata = Strata.of(plan.cdf, plan.balance_costs)

    def _chunk(self, c: int) -> np.ndarray:
        return balanced_chunk(self.order.seed, self.order.rank, c, self._strata,
                              self.plan.balance_window, self.generation)

    def _draws(self, lo: int, hi: int) -> np.ndarray:
        """Only this rank's draws: the strata are shared, the systems drawn are its own."""
        return strata_counts(self.order.seed, self.order.rank, lo, hi, self._strata,
                             self.plan.balance_window, self.generation)

    def identity(self) -> dict[str, int]:
        return {"balance_window": self.plan.balance_window,
                "balance_cost_digest": sizes_digest(self.plan.balance_costs)}

    def check_identity(self, state: Mapping[str, Any]) -> None:
        _check_balance(state, self.identity())

    def check_generations(self, history: Sequence[Generation]) -> None:
        """Any history: each rank's counters are its own, as in :class:`IndependentStream`."""


def stream_type(plan: LoaderPlan) -> type[IndependentStream] | type[BalancedStream]:
    """The strategy ``plan`` asks for: balanced steps when it has a balance window."""
    return BalancedStream if plan.balance_window else IndependentStream


__all__ = ["BatchKey", "SystemStream", "IndependentStream", "BalancedStream", "stream_type"]
