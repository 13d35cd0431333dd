"""DeePMD-kit 3.2's LMDB names (``LmdbDataReader``, ``LmdbBatchSampler``,
``DistributedLmdbBatchSampler``, ``LmdbDataset``, ``LmdbBatchDataLoader``) on mdloader's own
LMDB reader, so that a script switches by its import and runs without DeePMD-kit installed.

Frames are decoded by :class:`~mdloader.data.formats.lmdb.reader.LmdbGroupReader` (DeePMD-kit's
``decode_lmdb_frame`` contract), one reader per (system id, atom count) group; batches are cut by
:mod:`mdloader.sampling.lmdb_batches` (DeePMD-kit's batches for the same seed). ``mix:N`` batches
are padded to their widest frame with ``atype = -1`` and zeros (rectangular, DeePMD-kit's
default) or concatenated with ``n_node`` (ragged, :meth:`LmdbDataReader.use_ragged_batches`).
``auto_prob`` block targets repeat a block's frames within a pass as DeePMD-kit does
(:func:`~mdloader.sampling.lmdb_batches.block_targets`). The older names
``SameNlocBatchSampler`` and ``DistributedSameNlocBatchSampler`` are the same classes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from mdloader.data.formats.base import Location
from mdloader.data.formats.lmdb import codec
from mdloader.data.formats.lmdb.address import group_address, is_lmdb
from mdloader.data.formats.lmdb.fields import canonical
from mdloader.data.formats.lmdb.groups import describe_group, read_groups
from mdloader.data.formats.lmdb.reader import LmdbGroupReader
from mdloader.data.schema import DataRequirementItem
from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling import lmdb_batches as lb

log = logging.getLogger(__name__)

#: Fields whose leading axis runs over atoms in every frame (DeePMD-kit's structural and
#: optional per-atom keys), and frame-level fields never taken for per-atom ones.
PER_ATOM = frozenset({"coord", "atype", "aparam", "spin"})
FRAME_LEVEL = frozenset({"box", "energy", "virial", "fparam", "charge_spin", "natoms",
                         "real_natoms_vec", "fid", "sid"})
PHANTOM_ATOM_TYPE = -1
"""The atom type of a padded slot in a ``mix:N`` batch."""
PROBE_FRAMES = 256
"""Frames, spread over the database, whose labels decide whether it needs a full scan."""

_REQUIREMENT_FIELDS = ("ndof", "atomic", "must", "high_prec", "type_sel", "repeat", "default",
                       "dtype", "output_natoms_for_type_sel")


def _requirement(item: Any) -> DataRequirementItem:
    """The :class:`DataRequirementItem` from one of DeePMD-kit's (or mdloader's)."""
    if isinstance(item, DataRequirementItem):
        return item

    def get(name: str, default: Any = None) -> Any:
        try:
            return item[name]
        except (KeyError, TypeError, IndexError):
            return getattr(item, name, default)

    fields = {name: get(name) for name in _REQUIREMENT_FIELDS if get(name) is not None}
    policy = get("source_policy", "tracked")
    return DataRequirementItem(get("key"), source_policy=policy or "tracked", **fields)


class LmdbDataReader:
    """DeePMD-kit 3.2's ``LmdbDataReader(lmdb_path, type_map, batch_size="auto")``.

    Frames as numpy dicts by dataset index (``filter:N`` renumbers the kept frames), the
    batching rule, the per-frame atom counts and system ids, and DeePMD-kit's properties.
    """

    def __init__(self, lmdb_path: str, type_map: list[str],
                 batch_size: int | str = "auto") -> None:
        self.lmdb_path = str(Path(lmdb_path).resolve())
        self._type_map = type_map
        self._rule = lb.parse_lmdb_rule(batch_size)
        found = read_groups(self.lmdb_path)
        meta = found.metadata
        self._metas = [describe_group(Location("lmdb", self.lmdb_path,
                                               group_address("", sid, nloc)[1:]), type_map)
                       for sid, nloc in found.groups]
        orig_nlocs = np.asarray(meta.frame_nlocs, dtype=np.int32)
        self._group_of = np.empty(meta.nframes, dtype=np.int32)
        self._position_of = np.empty(meta.nframes, dtype=np.int64)
        for g, runs in enumerate(found.groups.values()):
            keys = runs.all_keys()
            self._group_of[keys] = g
            self._position_of[keys] = np.arange(len(keys))
        self._retained_keys = lb.kept_frames(self._rule, orig_nlocs)
        dropped = meta.nframes - len(self._retained_keys)
        if dropped:
            log.info("LMDB filter:%d drops %d/%d frames with nloc > %d (%s).", self._rule.value,
                     dropped, meta.nframes, self._rule.value, self.lmdb_path)
        self._frame_nlocs = orig_nlocs[self._retained_keys]
        sids = meta.frame_system_ids
        self._nsystems = 1 if sids is None else int(np.max(sids)) + 1
        self._frame_system_ids = (None if sids is None
                                  else np.asarray(sids, np.int32)[self._retained_keys])
        self.nframes = int(len(self._retained_keys))
        self._natoms = meta.system_natoms
        self._nloc_groups = {int(n): np.flatnonzero(self._frame_nlocs == n)
                             for n in np.unique(self._frame_nlocs).tolist()}
        self.batch_size = self._nominal_batch_size()
        self._requirements: dict[str, DataRequirementItem] = {}
        self._revision = 0
        self._frozen = False
        self._readers: dict[int, LmdbGroupReader] = {}
        self._ragged = False
        self._closed = False
        self._availability: np.ndarray | None = None

    def _nominal_batch_size(self) -> int:
        """The one number DeePMD-kit reports (``batch_size``), from ``system_info``'s atoms
        (0 when absent: ``auto:N`` then reports N + 1, as DeePMD-kit does)."""
        rule, natoms = self._rule, self._natoms
        if rule.name == "mix":
            mean = float(self._frame_nlocs.mean()) if self.nframes else natoms
            return max(1, int(rule.value / max(mean, 1.0)))
        if rule.name == "auto":
            size = rule.value // max(natoms, 1)
            return max(size + (size * natoms < rule.value), 1)
        if rule.name in ("max", "filter"):
            return max(1, rule.value // max(natoms, 1))
        return rule.value

    # -- frames ---------------------------------------------------------------------------------
    def _reader(self, group: int) -> LmdbGroupReader:
        reader = self._readers.get(group)
        if reader is None:
            reader = LmdbGroupReader(self._metas[group], list(self._requirements.values()))
            self._readers[group] = reader
        return reader

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("cannot read from a closed LMDB reader")

    def __len__(self) -> int:
        return self.nframes

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Frame ``index`` (a dataset index) in DeePMD-kit's convention, arrays writable."""
        self._check_open()
        self._frozen = True
        if not 0 <= int(index) < self.nframes:
            raise IndexError(f"dataset index {index} out of range [0, {self.nframes})")
        key = int(self._retained_keys[int(index)])
        group = int(self._group_of[key])
        return self._reader(group).frames([int(self._position_of[key])])[0]

    def original_keys(self, indices: Sequence[int]) -> list[int]:
        """The database frame indices of dataset indices."""
        for index in indices:
            if not 0 <= int(index) < self.nframes:
                raise IndexError(f"dataset index {index} out of range [0, {self.nframes})")
        return [int(self._retained_keys[int(i)]) for i in indices]

    def decode_batch(self, indices: Sequence[int], *, ragged: bool | None = None
                     ) -> dict[str, Any]:
        """One batch of numpy arrays: padded to the widest frame (``atype`` = -1), or
        concatenated with ``n_node`` when ragged."""
        frames = [self[int(i)] for i in indices]
        return collate_frames(frames, self.per_atom_keys(frames[0]),
                              ragged=self._ragged if ragged is None else ragged)

    def per_atom_keys(self, frame: dict[str, Any]) -> frozenset[str]:
        """The fields of ``frame`` whose leading axis runs over atoms (padded in a batch)."""
        nloc = len(frame["coord"])
        keys = set(PER_ATOM) | {k for k, r in self._requirements.items() if r.atomic}
        for key, value in frame.items():
            if (key in keys or key in FRAME_LEVEL or key in self._requirements
                    or key.startswith("find_")):
                continue
            if isinstance(value, np.ndarray) and value.ndim >= 1 and value.shape[0] == nloc:
                keys.add(key)
        return frozenset(keys & frame.keys())

    def batch_pad_nloc(self, indices: Sequence[int]) -> int:
        """The atom count every frame of the batch is padded to: its widest frame's."""
        return int(self._frame_nlocs[np.asarray(indices, dtype=np.int64)].max())

    # -- the batching rule ----------------------------------------------------------------------
    def get_batch_size_for_nloc(self, nloc: int) -> int:
        """Frames per batch of atom count ``nloc`` under the rule (``mix:N``: ``max:N``'s)."""
        return lb.batch_size_for_nloc(self._rule, nloc)

    @property
    def rule(self) -> lb.LmdbRule:
        return self._rule

    @property
    def mixed_nloc(self) -> bool:
        """Whether one batch may span several atom counts (``mix:N``)."""
        return self._rule.mixed

    @property
    def atom_budget(self) -> int | None:
        return self._rule.atom_budget

    @property
    def ragged_batches(self) -> bool:
        return self._ragged

    def use_ragged_batches(self, ragged: bool) -> None:
        """Concatenate (rather than pad) the frames of a ``mix:N`` batch; only ``mix:N``."""
        self._ragged = bool(ragged) and self.mixed_nloc

    def batch_groups(self) -> list[np.ndarray]:
        """The dataset-index groups a batch is drawn from (atom count, label availability)."""
        kept = np.arange(self.nframes, dtype=np.int64)
        groups = lb.batch_groups(self._rule, self._frame_nlocs, kept)
        return [part for group in groups for part in self.availability_groups(group)]

    def availability_groups(self, indices: np.ndarray) -> list[np.ndarray]:
        """``indices`` split by which optional tracked labels each frame holds, as DeePMD-kit
        splits them: one group when no such label is registered or when 256 frames spread
        over the database agree; else one group per label signature, in first-seen order."""
        indices = np.asarray(indices, dtype=np.int64)
        tracked = sorted(k for k, r in self._requirements.items()
                         if not r.must and getattr(r, "source_policy", "tracked") == "tracked")
        if not len(indices):
            return []
        if not tracked:
            return [indices]
        if self._availability is None:
            probe = (np.arange(self.nframes) if self.nframes <= PROBE_FRAMES else
                     (self.nframes * np.arange(PROBE_FRAMES)) // PROBE_FRAMES)
            seen = {self._signature(int(i), tracked) for i in probe.tolist()}
            self._availability = (np.zeros(self.nframes, dtype=np.int64) if len(seen) < 2 else
                                  self._scan_availability(tracked))
        signature = self._availability[indices]
        first = {}
        for value in signature.tolist():
            first.setdefault(value, len(first))
        return [indices[signature == value] for value in first]

    def _signature(self, index: int, tracked: list[str]) -> int:
        """A bit per tracked label frame ``index`` (a dataset index) holds, arrays undecoded."""
        key = int(self._retained_keys[index])
        record = {canonical(k): v for k, v in
                  self._reader(int(self._group_of[key])).unpacked(key).items()}
        bits = 0
        for bit, name in enumerate(tracked):
            flag = record.get("find_" + name)
            held = flag is None or bool(float(np.asarray(
                codec.decode_array(flag) if codec.is_encoded_array(flag) else flag).ravel()[0]))
            if name in record and held:
                bits |= 1 << bit
        return bits

    def _scan_availability(self, tracked: list[str]) -> np.ndarray:
        """Every frame's signature, ids in first-seen order (DeePMD-kit's exact scan)."""
        ids: dict[int, int] = {}
        out = np.empty(self.nframes, dtype=np.int64)
        for index in range(self.nframes):
            out[index] = ids.setdefault(self._signature(index, tracked), len(ids))
        return out

    # -- data requirements ----------------------------------------------------------------------
    def add_data_requirement(self, data_requirement: list[Any]) -> None:
        """Register what the model needs, before the first frame is read."""
        if self._frozen:
            raise RuntimeError("LMDB data requirements must be registered before reading any "
                               "frame")
        for item in data_requirement:
            requirement = _requirement(item)
            self._requirements[requirement.key] = requirement
        self._revision += 1
        self._readers.clear()
        self._availability = None

    @property
    def data_requirements(self) -> list[DataRequirementItem]:
        return list(self._requirements.values())

    def worker_decode_config(self) -> tuple[DataRequirementItem, ...]:
        """Freeze the requirements and return them, for a decoder in another process."""
        self._frozen = True
        return tuple(self._requirements.values())

    @property
    def data_requirements_revision(self) -> int:
        return self._revision

    # -- DeePMD-kit's properties ----------------------------------------------------------------
    @property
    def index(self) -> list[int]:
        return [self.total_batch]

    @property
    def total_batch(self) -> int:
        """Batches in one pass (under ``mix:N`` those of a shuffled pass of seed 0)."""
        return len(LmdbBatchSampler(self, shuffle=True, seed=0))

    @property
    def batch_sizes(self) -> list[int]:
        return [self.batch_size]

    @property
    def mixed_type(self) -> bool:
        return True

    @property
    def type_map(self) -> list[str]:
        return self._type_map

    @property
    def nloc_groups(self) -> dict[int, np.ndarray]:
        """Atom count -> the ascending dataset indices holding it."""
        return self._nloc_groups

    @property
    def frame_nlocs(self) -> np.ndarray:
        return self._frame_nlocs

    @property
    def nsystems(self) -> int:
        return self._nsystems

    @property
    def frame_system_ids(self) -> np.ndarray | None:
        return self._frame_system_ids

    @property
    def system_groups(self) -> dict[int, np.ndarray]:
        if self._frame_system_ids is None:
            return {0: np.arange(self.nframes, dtype=np.int64)}
        return {int(s): np.flatnonzero(self._frame_system_ids == s)
                for s in np.unique(self._frame_system_ids).tolist()}

    @property
    def system_nframes(self) -> list[int]:
        if self._frame_system_ids is None:
            return [self.nframes]
        return np.bincount(self._frame_system_ids, minlength=self._nsystems).tolist()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop serving frames (the shared environment stays open for other readers)."""
        self._closed = True
        self._readers.clear()

    def print_summary(self, name: str, prob: Any) -> None:
        log.info("LMDB %s: %s, %d frames, %d nloc groups, batch_size=%s, mixed_nloc=%s", name,
                 self.lmdb_path, self.nframes, len(self._nloc_groups), self._rule,
                 self.mixed_nloc)

    def set_noise(self, noise_settings: dict[str, Any]) -> None:
        """No-op, as in DeePMD-kit."""


def collate_frames(frames: list[dict[str, Any]], per_atom: frozenset[str], *,
                   ragged: bool = False) -> dict[str, Any]:
    """Stack decoded frames into one numpy batch (DeePMD-kit's ``collate_lmdb_frames``).

    ``find_*`` flags are 1 only when every frame has them; ``fid`` is a list; per-atom fields of
    frames narrower than the widest are padded (``atype`` with -1, others with 0), or
    concatenated along the atom axis with ``n_node`` when ``ragged``.
    """
    if not frames:
        raise ValueError("a batch needs at least one frame")
    nlocs = [len(frame["coord"]) for frame in frames]
    widest = max(nlocs)
    out: dict[str, Any] = {}
    names: dict[str, None] = {}
    for frame in frames:
        names.update(dict.fromkeys(frame))
    for key in names:
        values = [frame.get(key) for frame in frames]
        if key.startswith("find_"):
            every = all(v is not None and float(v) != 0.0 for v in values)
            out[key] = np.float32(1.0 if every else 0.0)
        elif key == "fid":
            out[key] = list(values)
        elif key == "type":
            continue
        elif values[0] is None:
            out[key] = None
        elif any(v is None for v in values):
            continue
        elif key in per_atom and ragged:
            out[key] = np.concatenate(values)
        elif key in per_atom and widest != min(nlocs):
            fill = PHANTOM_ATOM_TYPE if key == "atype" else 0
            out[key] = np.stack([_pad(v, n, widest, fill) for v, n in zip(values, nlocs)])
        else:
            out[key] = np.stack(values)
    if ragged:
        out["n_node"] = np.asarray(nlocs, dtype=np.int64)
    out["sid"] = np.zeros(1, dtype=np.int64)
    return out


def _pad(value: np.ndarray, nloc: int, widest: int, fill: int) -> np.ndarray:
    """Widen a per-atom array from ``nloc`` to ``widest`` atoms (rows of ``stride`` entries)."""
    stride = len(value) // nloc
    if len(value) == widest * stride:
        return value
    tail = np.full(((widest - nloc) * stride, *value.shape[1:]), fill, dtype=value.dtype)
    return np.concatenate([value, tail])


class LmdbBatchSampler:
    """DeePMD-kit 3.2's ``LmdbBatchSampler(reader, shuffle=True, seed=None)``: the batches
    of pass ``epoch`` drawn from ``seed + epoch``; iterating serves the pending pass and moves
    on to the next, :meth:`set_epoch` names a pass."""

    def __init__(self, reader: LmdbDataReader, shuffle: bool = True, seed: int | None = None,
                 block_targets: list[tuple[list[int], int]] | None = None) -> None:
        self._reader, self._shuffle, self._seed = reader, shuffle, seed
        self._block_targets = block_targets
        self._epoch = 0
        self._batches: list[list[int]] | None = None
        self._revision = -1

    def batches(self) -> list[list[int]]:
        """The batch list of the pending pass (built once per pass)."""
        revision = self._reader.data_requirements_revision
        if self._batches is None or revision != self._revision:
            reader = self._reader
            self._batches = lb.pass_batches(reader.rule, reader.frame_nlocs,
                                            reader.batch_groups(), seed=self._seed,
                                            epoch=self._epoch, shuffle=self._shuffle,
                                            ragged=reader.ragged_batches,
                                            blocks=self._block_targets,
                                            sids=reader.frame_system_ids)
            self._revision = revision
        return self._batches

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, None

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches()
        self.set_epoch(self._epoch + 1)
        yield from batches

    def __len__(self) -> int:
        return len(self.batches())

    @property
    def total_batches(self) -> int:
        return len(self)


class DistributedLmdbBatchSampler:
    """DeePMD-kit 3.2's ``DistributedLmdbBatchSampler(reader, rank, world_size, ...)``: every
    rank builds pass ``seed + epoch``'s batches and takes its padded strided share
    (:func:`~mdloader.sampling.lmdb_batches.rank_batches`).

    mdloader adds a resume state (:meth:`state_dict`): the pass and the global batches the
    ranks have read of it, so a job restored at any world size reads exactly the rest.
    """

    STATE_KEYS = ("epoch", "consumed", "seed")

    def __init__(self, reader: LmdbDataReader, rank: int, world_size: int,
                 shuffle: bool = True, seed: int | None = None,
                 block_targets: list[tuple[list[int], int]] | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside a world of {world_size} ranks",
                              path="rank")
        self._reader, self._rank, self._world_size = reader, rank, world_size
        self._shuffle, self._seed = shuffle, 0 if seed is None else seed
        self._block_targets = block_targets
        self._epoch = 0
        self._global: LmdbBatchSampler | None = None
        self._start = 0  # global batches of the pass read before a restore
        self._served = 0  # batches this rank yielded of the pass since then

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._epoch, self._global = epoch, None
            self._start = self._served = 0

    def state_dict(self) -> dict[str, int]:
        """The pass and the global batches read of it (every rank reads one per step)."""
        consumed = min(self._start + self._served * self._world_size,
                       len(self._global_batches()))
        return {"epoch": self._epoch, "consumed": consumed, "seed": self._seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the saved pass: the next iteration yields this rank's share of the rest."""
        if sorted(state) != sorted(self.STATE_KEYS):
            raise StateDictError(f"an LMDB sampler state holds {sorted(state)}, expected "
                                 f"{sorted(self.STATE_KEYS)}")
        if state["seed"] != self._seed:
            raise StateDictError(f"the saved LMDB sampler state is of seed {state['seed']}, "
                                 f"this sampler's seed is {self._seed}")
        self.set_epoch(int(state["epoch"]))
        total = len(self._global_batches())
        if not 0 <= int(state["consumed"]) <= total:
            raise StateDictError(f"the saved position {state['consumed']} is outside the pass "
                                 f"of {total} batches")
        self._start, self._served = int(state["consumed"]), 0

    def _global_batches(self) -> list[list[int]]:
        if self._global is None:
            self._global = LmdbBatchSampler(self._reader, shuffle=self._shuffle,
                                            seed=self._seed + self._epoch,
                                            block_targets=self._block_targets)
        return self._global.batches()

    def _partition_batches(self, all_batches: list[list[int]]) -> list[list[int]]:
        return lb.rank_batches(all_batches, self._rank, self._world_size)

    def __iter__(self) -> Iterator[list[int]]:
        start, self._served = self._start, 0
        for batch in self._partition_batches(self._global_batches()[start:]):
            self._served += 1
            yield batch

    def __len__(self) -> int:
        return -(-(len(self._global_batches()) - self._start) // self._world_size)

    @property
    def total_batches(self) -> int:
        return len(self._global_batches())

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size


SameNlocBatchSampler = LmdbBatchSampler
DistributedSameNlocBatchSampler = DistributedLmdbBatchSampler


def compute_block_targets(auto_prob_style: str, nsystems: int,
                          system_nframes: list[int]) -> list[tuple[list[int], int]]:
    """DeePMD-kit's per-block ``(system ids, frames wanted)`` of an ``auto_prob`` string
    (:func:`~mdloader.sampling.lmdb_batches.block_targets`); ``nsystems`` is DeePMD-kit's
    argument and is implied by ``system_nframes``."""
    empty = [part for part in auto_prob_style.split(";")[1:]
             if not sum(system_nframes[int(part.split(":")[0]):int(part.split(":")[1])])]
    if empty:
        log.info("compute_block_targets: dropping empty blocks (all systems have 0 frames, "
                 "likely after filter:N): %s; the other weights are renormalised", empty)
    return lb.block_targets(auto_prob_style, system_nframes[:nsystems])


def to_cpu_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    """Convert numpy arrays to CPU tensors; flags, ``fid`` and ``None`` as they are."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key.startswith("find_") or key in ("fid", "type") or value is None:
            out[key] = value
        else:
            out[key] = torch.as_tensor(value, device="cpu")
    return out


class _TorchBatchSampler(Sampler):
    """A torch ``Sampler`` over one of the LMDB batch samplers."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._inner

    def __len__(self) -> int:
        return len(self._inner)

    def set_epoch(self, epoch: int) -> None:
        self._inner.set_epoch(epoch)


class LmdbBatchDataLoader:
    """DeePMD-kit 3.2's ``LmdbBatchDataLoader(dataset, sampler, *, pin_memory, num_workers)``:
    one pass of ``sampler``'s batches as CPU tensors, decoded in this process."""

    def __init__(self, dataset: LmdbDataset, sampler: Any, *, pin_memory: bool,
                 num_workers: int | None = None) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.batch_sampler = _TorchBatchSampler(sampler)
        self._pin_memory = pin_memory and torch.cuda.is_available()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        reader = self.dataset.reader
        for indices in self.sampler:
            batch = to_cpu_tensors(reader.decode_batch(indices))
            if self._pin_memory:
                batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v
                         for k, v in batch.items()}
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def close(self) -> None:
        """Nothing to release: batches are decoded in this process."""


class LmdbDataset(Dataset):
    """DeePMD-kit 3.2's ``LmdbDataset(lmdb_path, type_map, batch_size="auto",
    auto_prob_style=None)``: a torch dataset of frames with the trainer's interface
    (``systems``, ``dataloaders``, ``sampler_list``, ``index``, ``total_batch``, ...)."""

    def __init__(self, lmdb_path: str, type_map: list[str], batch_size: int | str = "auto",
                 auto_prob_style: str | None = None) -> None:
        self._reader = LmdbDataReader(lmdb_path, type_map, batch_size)
        self._block_targets = None
        if auto_prob_style is not None and self._reader.frame_system_ids is not None:
            self._block_targets = lb.block_targets(auto_prob_style,
                                                   self._reader.system_nframes) or None
        sampler = LmdbBatchSampler(self._reader, shuffle=True,
                                   block_targets=self._block_targets)
        self._batch_sampler = _TorchBatchSampler(sampler)

    @property
    def reader(self) -> LmdbDataReader:
        return self._reader

    def __len__(self) -> int:
        return len(self._reader)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._reader[index]

    @property
    def lmdb_path(self) -> str:
        return self._reader.lmdb_path

    @property
    def nframes(self) -> int:
        return self._reader.nframes

    @property
    def mixed_nloc(self) -> bool:
        return self._reader.mixed_nloc

    @property
    def mixed_type(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return self._reader.batch_size

    @property
    def type_map(self) -> list[str]:
        return self._reader.type_map

    @property
    def data_requirements(self) -> list[DataRequirementItem]:
        return self._reader.data_requirements

    def add_data_requirement(self, data_requirement: list[Any]) -> None:
        self._reader.add_data_requirement(data_requirement)

    def close(self) -> None:
        self._reader.close()

    def preload_and_modify_all_data_torch(self) -> None:
        """No-op, as in DeePMD-kit: frames are read on demand."""

    def print_summary(self, name: str, prob: Any) -> None:
        self._reader.print_summary(name, prob)

    def set_noise(self, noise_settings: dict[str, Any]) -> None:
        self._reader.set_noise(noise_settings)

    @property
    def index(self) -> list[int]:
        return [self.total_batch]

    @property
    def total_batch(self) -> int:
        return len(self._batch_sampler)

    @property
    def batch_sizes(self) -> list[int]:
        return self._reader.batch_sizes

    @property
    def systems(self) -> list[LmdbDataset]:
        """One entry per statistics loader (:attr:`dataloaders`), as in DeePMD-kit."""
        return [self] * len(self.dataloaders)

    @property
    def dataloaders(self) -> list[LmdbBatchDataLoader]:
        """The statistics loaders: one per group of one atom count and label availability,
        in order, ``get_batch_size_for_nloc`` frames a batch."""
        reader = self._reader
        loaders = []
        for nloc in sorted(reader.nloc_groups):
            for group in reader.availability_groups(reader.nloc_groups[nloc]):
                batches = lb.chop_same(group, reader.get_batch_size_for_nloc(nloc))
                loaders.append(LmdbBatchDataLoader(self, batches, pin_memory=False))
        return loaders

    @property
    def sampler_list(self) -> list[Sampler]:
        return [self._batch_sampler]


__all__ = [
    "LmdbDataReader", "LmdbBatchSampler", "DistributedLmdbBatchSampler", "SameNlocBatchSampler",
    "DistributedSameNlocBatchSampler", "LmdbDataset", "LmdbBatchDataLoader", "collate_frames",
    "compute_block_targets", "is_lmdb", "to_cpu_tensors",
    "PHANTOM_ATOM_TYPE",
]
