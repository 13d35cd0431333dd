"""The system streams a weighted sampler delegates to: which batch each step of this rank gets.

One interface (:class:`SystemStream`), two strategies: :class:`IndependentStream`, where every
rank trains the batches its own system stream draws, and :class:`BalancedStream`, where the ranks
deal the draws of each window of steps so that every step costs about the same on every rank
(:mod:`mdloader.sampling.balance`). A stream serves one generation of the job under one seed; the
sampler makes a new one when either changes, and picks the strategy once, from its plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from mdloader.errors import StateDictError
from mdloader.sampling.balance import (
    Slots,
    arrange,
    chunk_draws,
    label,
    next_start_counts,
    rank_slots,
    window_draws,
    window_start_counts,
)
from mdloader.sampling.elastic import BALANCE_IDENTITY, Generation
from mdloader.sampling.order import (
    STREAM_CHUNK,
    Continuation,
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
    ``drawer`` is the rank whose system stream drew it (another rank's in balanced steps; -1:
    no stream, a validation key)."""

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


class IndependentStream:
    """Every rank trains the batches its own system stream draws.

    Parameters
    ----------
    plan
        The sampler's plan (its probabilities, sizes and seed).
    order
        This rank's frame order (its share of any leftover of an elastic resume).
    generation
        How many times the job changed its number of ranks.
    full
        The whole job's leftover, unused here: a rank reads only its own share.
    """

    def __init__(self, plan: LoaderPlan, order: FrameOrder, generation: int,
                 full: Continuation | None = None) -> None:
        self.plan, self.order, self.generation = plan, order, generation
        self.step = 0
        self._counts = np.zeros(plan.nsys, dtype=np.int64)
        self._chunk_id = -1
        self._chunk = np.empty(0, dtype=np.int64)

    def _draw(self, step: int) -> int:
        c = step // STREAM_CHUNK
        if c != self._chunk_id:
            self._chunk = stream_chunk(self.order.seed, self.order.rank, c, self.plan.cdf,
                                       self.plan.same_system_across_ranks, self.generation)
            self._chunk_id = c
        return int(self._chunk[step - c * STREAM_CHUNK])

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
        delta = stream_counts(self.order.seed, self.order.rank, lo, hi, self.plan.cdf,
                              self.plan.same_system_across_ranks, self.generation)
        self._counts += delta if step >= self.step else -delta
        self.step = step

    def identity(self) -> dict[str, int]:
        return {}

    def check_identity(self, state: Mapping[str, Any]) -> None:
        _check_balance(state, {})

    def check_generations(self, history: Sequence[Generation]) -> None:
        """Any history: each rank continues its own share."""


class BalancedStream:
    """The ranks deal the batches their streams draw in each window of ``balance_window`` steps
    so that each step's ranks cost about the same; a batch reads the frames of the stream that
    drew it, whichever rank trains it.

    Parameters
    ----------
    plan, order, generation
        As :class:`IndependentStream`'s.
    full
        The whole job's leftover after an elastic resume (None: none): a balanced rank reads
        other ranks' shares of it.
    """

    def __init__(self, plan: LoaderPlan, order: FrameOrder, generation: int,
                 full: Continuation | None = None) -> None:
        self.plan, self.order, self.generation = plan, order, generation
        self.step = 0
        self._full = full
        self._window = -1
        self._window_start: np.ndarray | None = None
        self._window_draws = np.empty((0, 0), dtype=np.int64)
        self._slots: Slots | None = None
        self._drawer_orders: dict[int, FrameOrder] = {}
        self._chunks: dict[int, np.ndarray] = {}

    def _drawer_order(self, drawer: int) -> FrameOrder:
        """The frame order of rank ``drawer``'s stream (its share of any leftover)."""
        if drawer == self.order.rank:
            return self.order
        order = self._drawer_orders.get(drawer)
        if order is None:
            share = None  # interim, until the balanced streams read their own frames
            order = self._drawer_orders[drawer] = self.plan.frame_order(drawer, share)
        return order

    def _enter_window(self, window: int) -> None:
        """Make window ``window``'s plan: the counters at its start, its draws, this rank's
        slots. The next window advances the counters by the draws; any other replays them."""
        seed, k, world = self.plan.seed, self.plan.balance_window, self.plan.world_size
        cdf, generation = self.plan.cdf, self.generation
        if self._window_start is not None and window == self._window + 1:
            next_start_counts(self._window_start, self._window_draws, out=self._window_start)
        else:
            self._window_start = window_start_counts(seed, window, k, world, cdf, generation)
        first, last = window * k // STREAM_CHUNK, ((window + 1) * k - 1) // STREAM_CHUNK
        self._chunks = {c: d for c, d in self._chunks.items() if c >= first}
        for c in range(first, last + 1):
            if c not in self._chunks:
                self._chunks[c] = chunk_draws(seed, c, world, cdf, generation)
        draws = window_draws(seed, window, k, world, cdf, generation, self._chunks)
        src = arrange(draws, self.plan.balance_costs, seed, window, generation)
        self._slots = rank_slots(label(draws, src, self._window_start), self.order.rank)
        self._window, self._window_draws = window, draws

    def next_key(self) -> BatchKey:
        step = self.step
        self.step = step + 1
        window, position = divmod(step, self.plan.balance_window)
        if window != self._window:
            self._enter_window(window)
        slots = self._slots
        drawer, sid = int(slots.drawer[position]), int(slots.sid[position])
        occ = int(slots.occurrence[position])
        return BatchKey(sid, self._drawer_order(drawer).fids(sid, occ), step, drawer)

    def seek(self, step: int) -> None:
        """Move to ``step``; a window's counters are replayed when it is entered."""
        if step // self.plan.balance_window != self._window:
            self._window, self._window_start = -1, None
        self.step = step

    def identity(self) -> dict[str, int]:
        return {"balance_window": self.plan.balance_window,
                "balance_cost_digest": sizes_digest(self.plan.balance_costs)}

    def check_identity(self, state: Mapping[str, Any]) -> None:
        _check_balance(state, self.identity())

    def check_generations(self, history: Sequence[Generation]) -> None:
        """A balanced job changes its number of ranks only where every rank took as many steps
        (the windows are dealt over all ranks)."""
        uneven = [g.steps for g in history if len(set(g.steps)) > 1]
        if uneven:
            raise StateDictError(f"cannot resume the sampler on {self.plan.world_size} rank(s): "
                                 f"a balanced job changes its number of ranks only from a state "
                                 f"where every rank took the same number of steps, got steps "
                                 f"{list(uneven[0])}")


def stream_type(plan: LoaderPlan) -> type[IndependentStream] | type[BalancedStream]:
    """The strategy ``plan`` asks for: balanced steps when it has a balance window."""
    return BalancedStream if plan.balance_window else IndependentStream


__all__ = ["BatchKey", "SystemStream", "IndependentStream", "BalancedStream", "stream_type"]
