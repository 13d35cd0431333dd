"""The batches of one pass over an LMDB database, as DeePMD-kit 3.2's ``LmdbBatchSampler`` cuts
them: pure functions of the per-frame atom counts, the rule, the seed and the pass.

DeePMD-kit's rules (``LmdbDataReader``'s ``batch_size``): an int, ``"auto"``/``"auto:N"``
(``ceil(N / nloc)`` frames), ``"max:N"`` (``max(1, N // nloc)``), ``"filter:N"`` (``max:N``
after dropping the frames of more than N atoms) keep one atom count per batch; ``"mix:N"`` lets
frames of different atom counts share a batch whose atom axis holds at most N entries: the sum
of the atom counts when the frames are concatenated (*ragged*), ``frames * widest`` when they
are padded to the widest frame (*rectangular*, DeePMD-kit's default; shorter frames are padded
with ``atype = -1``). A group (one atom count, or every frame under ``mix:N``) is permuted by the
pass's generator, cut into batches (under rectangular ``mix:N`` after a stable sort by atom
count, cutting where the next frame would exceed the budget; a frame larger than the budget is a
batch of its own), the groups' batches are interleaved round-robin, and the whole list is
permuted by the same generator. With the same generator draws as DeePMD-kit
(``numpy.random.default_rng(seed + epoch)``) the batches are DeePMD-kit's, frame for frame.

On top, what mdloader's samplers guarantee: each pass is a function of ``(seed, epoch)`` alone
(:func:`pass_batches`), a rank's share is a function of ``(rank, world_size)``
(:func:`rank_batches`, DeePMD-kit's padded strided split), and a position inside a pass is one
integer (the global batches consumed), so a resume at another world size continues the same
pass (:func:`resume_batches`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_AUTO = 32
"""DeePMD-kit's bare ``"auto"``: ``"auto:32"``."""

RULE_NAMES = ("auto", "max", "filter", "mix")


@dataclass(frozen=True)
class LmdbRule:
    """A parsed LMDB ``batch_size``: ``name`` is ``"fixed"`` or one of :data:`RULE_NAMES`."""

    name: str
    value: int

    @property
    def mixed(self) -> bool:
        """Whether one batch may hold several atom counts (``mix:N``)."""
        return self.name == "mix"

    @property
    def atom_budget(self) -> int | None:
        """The ``N`` of ``mix:N``; ``None`` under every other rule."""
        return self.value if self.mixed else None

    def __str__(self) -> str:
        return str(self.value) if self.name == "fixed" else f"{self.name}:{self.value}"


def parse_lmdb_rule(batch_size: int | str) -> LmdbRule:
    """Parse an LMDB ``batch_size`` with DeePMD-kit's messages (``ValueError``)."""
    if not isinstance(batch_size, str):
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"Unsupported batch_size {batch_size!r}: an int batch size must "
                             "be a positive integer.")
        return LmdbRule("fixed", int(batch_size))
    if batch_size == "auto":
        return LmdbRule("auto", DEFAULT_AUTO)
    name, sep, raw = batch_size.partition(":")
    if not sep or name not in RULE_NAMES:
        raise ValueError(f"Unsupported batch_size {batch_size!r}. Expected int, 'auto', "
                         "'auto:N', 'max:N', 'filter:N', or 'mix:N'.")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"Unsupported batch_size {batch_size!r}. Expected '{name}:N' with N a "
                         "positive integer.") from None
    if value <= 0:
        raise ValueError(f"Unsupported batch_size {batch_size!r}: N must be a positive "
                         f"integer, got {value}.")
    return LmdbRule(name, value)


def batch_size_for_nloc(rule: LmdbRule, nloc: int) -> int:
    """Frames per batch of atom count ``nloc`` (under ``mix:N``: the statistics' count)."""
    if rule.name == "auto":
        return max(1, -(-rule.value // max(nloc, 1)))
    if rule.name in ("max", "filter", "mix"):
        return max(1, rule.value // max(nloc, 1))
    return rule.value


def kept_frames(rule: LmdbRule, nlocs: np.ndarray) -> np.ndarray:
    """The database indices the rule keeps (``filter:N`` drops frames of more than N atoms)."""
    nlocs = np.asarray(nlocs)
    if rule.name == "filter":
        return np.flatnonzero(nlocs <= rule.value).astype(np.int64)
    return np.arange(len(nlocs), dtype=np.int64)


def chop_same(indices: np.ndarray, size: int) -> list[list[int]]:
    """Cut one group of a single atom count into batches of ``size`` frames (the last short)."""
    listed = np.asarray(indices).tolist()
    return [listed[start:start + size] for start in range(0, len(listed), size)]


def chop_mixed(indices: np.ndarray, nlocs: np.ndarray, budget: int, *,
               ragged: bool) -> list[list[int]]:
    """Cut a group of mixed atom counts into batches whose atom axis fits ``budget``.

    Rectangular: stable-sorted by atom count, the axis is ``frames * widest``; ragged: in the
    given order, the axis is the sum of the atom counts. A batch closes where the next frame
    would exceed the budget; a frame alone is always a batch.
    """
    index_array = np.asarray(indices, dtype=np.int64)
    atoms = np.asarray(nlocs)[index_array]
    if not ragged:
        order = np.argsort(atoms, kind="stable")
        index_array, atoms = index_array[order], atoms[order]
    batches: list[list[int]] = []
    start, real = 0, 0
    for position, nloc in enumerate(atoms.tolist()):
        count = position - start + 1
        axis = real + nloc if ragged else count * nloc
        if count > 1 and axis > budget:
            batches.append(index_array[start:position].tolist())
            start, real = position, 0
        real += nloc
    if len(index_array):
        batches.append(index_array[start:].tolist())
    return batches


def batch_groups(rule: LmdbRule, nlocs: np.ndarray, kept: np.ndarray) -> list[np.ndarray]:
    """The groups one batch may be drawn from, in DeePMD-kit's order: ascending atom count
    (every kept frame in one group under ``mix:N``); indices ascending within a group."""
    kept = np.asarray(kept, dtype=np.int64)
    if rule.mixed:
        return [kept]
    atoms = np.asarray(nlocs)[kept]
    return [kept[atoms == nloc] for nloc in np.unique(atoms).tolist()]


BlockTargets = Sequence[tuple[Sequence[int], int]]
"""``auto_prob`` over a database's systems: per block, (its system ids, frames wanted)."""


def block_targets(auto_prob_style: str, system_nframes: Sequence[int]) -> list[tuple[list[int],
                                                                                     int]]:
    """Frames each ``auto_prob`` block of systems should contribute to one pass.

    A block ``stt:end:w`` of systems has the probability ``w / sum(w)`` (over the blocks that
    hold frames); the pass grows to ``T = ceil(max(frames_b / p_b))`` frames and block b
    contributes ``max(round(T * p_b), frames_b)``. Empty (no block, or every target equal to
    the frames held) when nothing needs repeating.
    """
    parsed = []
    for part in auto_prob_style.split(";")[1:]:
        start, end, weight = part.split(":")
        parsed.append((int(start), int(end), float(weight)))
    frames = [int(sum(system_nframes[start:end])) for start, end, _ in parsed]
    blocks = [(block, n) for block, n in zip(parsed, frames) if n > 0]
    if not blocks:
        return []
    weights = np.asarray([w for (_, _, w), _ in blocks], dtype=np.float64)
    block_probs = weights / np.sum(weights)
    # a block's probability as the sum of its systems' (DeePMD-kit's prob_sys_size_ext), in
    # system order: the same float rounding, so the same ceil and round below
    probs = [sum((np.asarray(system_nframes[start:end], dtype=np.float64) / n) * p)
             for ((start, end, _), n), p in zip(blocks, block_probs)]
    ratios = [n / p if p > 0 else 0.0 for (_, n), p in zip(blocks, probs)]
    total = int(np.ceil(max(ratios)))
    targets = [(list(range(start, end)), max(round(total * p), n))
               for ((start, end, _), n), p in zip(blocks, probs)]
    return targets if any(t > n for (_, t), (_, n) in zip(targets, blocks)) else []


def _block_of(indices: np.ndarray, sids: np.ndarray, blocks: BlockTargets) -> np.ndarray:
    """The block of each frame (-1: in no block)."""
    table = np.full(max((max(ids, default=-1) for ids, _ in blocks), default=-1) + 2, -1)
    for b, (ids, _) in enumerate(blocks):
        table[np.asarray(list(ids), dtype=np.int64)] = b
    own = np.asarray(sids)[np.asarray(indices, dtype=np.int64)]
    return table[np.minimum(own, len(table) - 1)]


def allocate_block_targets(groups: Sequence[np.ndarray], sids: np.ndarray,
                           blocks: BlockTargets) -> list[list[int]]:
    """Each group's share of every block's target: its own frames, plus the block's extra
    frames split in proportion to the group's frames (largest remainders first, ties to the
    earlier group), so a block's total is exact."""
    actual = [np.bincount(_block_of(g, sids, blocks) + 1, minlength=len(blocks) + 1)[1:]
              for g in groups]
    shares = [a.astype(np.int64).tolist() for a in actual]
    for b, (_ids, target) in enumerate(blocks):
        held = int(sum(int(a[b]) for a in actual))
        if target < held or (held == 0 and target):
            raise ValueError(f"auto_prob block {b} wants {target} frames but holds {held}")
        extra = target - held
        if not held or not extra:
            continue
        left = extra
        order = []
        for g, a in enumerate(actual):
            whole, rest = divmod(extra * int(a[b]), held)
            shares[g][b] += whole
            left -= whole
            if a[b]:
                order.append((-rest, g))
        for _rest, g in sorted(order)[:left]:
            shares[g][b] += 1
    return shares


def expand_group(indices: np.ndarray, sids: np.ndarray, blocks: BlockTargets,
                 shares: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """A group's frames repeated to its block shares: frames in no block once, then per block
    its frames as often as the share holds them whole, plus a sample without replacement."""
    indices = np.asarray(indices, dtype=np.int64)
    owner = _block_of(indices, sids, blocks)
    parts = [indices[owner == -1]]
    for b in range(len(blocks)):
        mine = indices[owner == b]
        if not len(mine):
            continue
        copies, rest = divmod(int(shares[b]), len(mine))
        parts.append(np.tile(mine, copies))
        if rest:
            parts.append(rng.choice(mine, size=rest, replace=False))
    return np.concatenate(parts)


def build_batches(rule: LmdbRule, nlocs: np.ndarray, groups: Sequence[np.ndarray], *,
                  shuffle: bool, rng: np.random.Generator | None,
                  ragged: bool = False, blocks: BlockTargets | None = None,
                  sids: np.ndarray | None = None) -> list[list[int]]:
    """One pass's batches over ``groups`` (DeePMD-kit's ``_build_all_batches``).

    ``rng`` must be ``numpy.random.default_rng(seed)`` for DeePMD-kit's draws; it is used in
    DeePMD-kit's order: per group the ``auto_prob`` block samples (with ``blocks`` and the
    frames' system ids ``sids``) and one permutation, then one shuffle of the interleaved list.
    """
    per_group: list[list[list[int]]] = []
    shares = (allocate_block_targets(groups, sids, blocks)
              if blocks and sids is not None else None)
    if shares is not None and rng is None:
        rng = np.random.default_rng()
    for g, indices in enumerate(groups):
        if shares is not None and rng is not None:
            indices = expand_group(indices, sids, blocks, shares[g], rng)  # type: ignore
        if shuffle and rng is not None:
            indices = rng.permutation(indices)
        if not len(indices):
            per_group.append([])
        elif rule.mixed:
            per_group.append(chop_mixed(indices, nlocs, rule.value, ragged=ragged))
        else:
            nloc = int(np.asarray(nlocs)[int(np.asarray(indices)[0])])
            per_group.append(chop_same(indices, batch_size_for_nloc(rule, nloc)))
    batches = interleave(per_group)
    if shuffle and rng is not None:
        rng.shuffle(batches)
    return batches


def interleave(per_group: Sequence[Sequence[list[int]]]) -> list[list[int]]:
    """Round-robin: the first batch of every group, then the second of every group, ..."""
    out: list[list[int]] = []
    longest = max((len(batches) for batches in per_group), default=0)
    for i in range(longest):
        out.extend(batches[i] for batches in per_group if i < len(batches))
    return out


def pass_batches(rule: LmdbRule, nlocs: np.ndarray, groups: Sequence[np.ndarray], *,
                 seed: int | None, epoch: int, shuffle: bool = True, ragged: bool = False,
                 blocks: BlockTargets | None = None,
                 sids: np.ndarray | None = None) -> list[list[int]]:
    """The batches of pass ``epoch``: drawn from ``default_rng(seed + epoch)`` (an unseeded
    generator when ``seed`` is None, as DeePMD-kit does)."""
    rng = np.random.default_rng(None if seed is None else seed + epoch)
    return build_batches(rule, nlocs, groups, shuffle=shuffle, rng=rng, ragged=ragged,
                         blocks=blocks, sids=sids)


def rank_batches(batches: Sequence[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """Rank ``rank``'s share: the list padded by repeating it from its start to a multiple of
    ``world_size``, then every ``world_size``-th batch from ``rank`` (DeePMD-kit's split)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    if not batches:
        return []
    total = -(-len(batches) // world_size) * world_size
    padded = list(batches)
    while len(padded) < total:
        padded.extend(batches[:total - len(padded)])
    return padded[rank::world_size]


def resume_batches(batches: Sequence[list[int]], consumed: int, rank: int,
                   world_size: int) -> list[list[int]]:
    """What rank ``rank`` still reads of a pass whose first ``consumed`` global batches were
    read (at any world size): the rest of the list, split as :func:`rank_batches` splits."""
    if not 0 <= consumed <= len(batches):
        raise ValueError(f"a position of {consumed} batches is outside a pass of "
                         f"{len(batches)} batches")
    return rank_batches(list(batches[consumed:]), rank, world_size)


__all__ = [
    "LmdbRule", "parse_lmdb_rule", "batch_size_for_nloc", "kept_frames", "chop_same",
    "chop_mixed", "batch_groups", "build_batches", "interleave", "pass_batches",
    "rank_batches", "resume_batches", "DEFAULT_AUTO", "block_targets",
    "allocate_block_targets", "expand_group",
]
