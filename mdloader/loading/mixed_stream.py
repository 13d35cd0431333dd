"""A ``mix:N`` stream of a feed: batches of frames of different atom counts from one LMDB
database, as DeePMD-kit 3.2's trainer receives them.

The stream's key source is a :class:`~mdloader.sampling.mixed.MixedBatchSampler` (a key is the
database indices of one batch); its dataset, :class:`MixedLmdbBatches`, reads those frames
through mdloader's LMDB reader and collates them as DeePMD-kit's ``LmdbDataset`` does: padded
to the widest frame with ``atype = -1`` and zeros, or concatenated with ``n_node`` when ragged
(:func:`~mdloader.loading.lmdb_names.collate_frames`). A ``mix:N`` batch crosses LMDB groups,
so it is read from the database as a whole, not from the loader set's systems; npy and HDF5
systems are refused (a batch there comes from one system).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset, get_worker_info

from mdloader.loading.lmdb_names import LmdbDataReader, to_cpu_tensors
from mdloader.loading.worker_lifetime import bind_to_rank
from mdloader.loading.worker_memory import settle_worker
from mdloader.sampling import lmdb_batches as lb
from mdloader.sampling.mixed import MixedBatchSampler
from mdloader.transport import TransportBatch
from mdloader.world import World


class MixedLmdbBatches(Dataset):
    """The batches of a ``mix:N`` stream: ``batches[key]`` for a key of the stream's sampler
    (the database indices of one batch) is that batch as CPU tensors.

    Parameters
    ----------
    path
        The LMDB database.
    type_map
        The model's type map.
    batch_size
        The section's ``mix:N``.
    ragged
        Concatenate the frames with ``n_node`` instead of padding them.
    """

    def __init__(self, path: str, type_map: Sequence[str] | None, batch_size: str, *,
                 ragged: bool = False) -> None:
        self.reader = LmdbDataReader(path, list(type_map) if type_map else None,  # type: ignore[arg-type]
                                     batch_size)
        self.reader.use_ragged_batches(ragged)
        self.type_map = list(type_map) if type_map else None

    @property
    def rule(self) -> lb.LmdbRule:
        return self.reader.rule

    def __len__(self) -> int:
        return len(self.reader)

    def add_data_requirement(self, data_requirement: Sequence[Any]) -> None:
        """The labels every batch reads (DeePMD-kit's data requirements)."""
        self.reader.add_data_requirement(list(data_requirement))

    def __getitem__(self, key: Sequence[int]) -> Any:
        """The batch of the frames ``key`` (inside a DataLoader worker as numpy transport)."""
        in_worker = get_worker_info() is not None
        if in_worker:
            settle_worker()
            bind_to_rank()
        batch = to_cpu_tensors(self.reader.decode_batch([int(i) for i in key]))
        return TransportBatch(batch) if in_worker else batch

    def sampler(self, *, seed: int, world: World, shuffle: bool = True) -> MixedBatchSampler:
        """The key source of this rank over the database (pass ``e`` drawn from ``seed + e``), its
        groups split by label availability as DeePMD-kit's reader splits them: made once the
        data requirements are added."""
        return MixedBatchSampler(self.reader.frame_nlocs, self.rule, seed=seed,
                                 rank=world.rank, world_size=world.world_size,
                                 ragged=self.reader.ragged_batches, shuffle=shuffle,
                                 groups=self.reader.batch_groups())


__all__ = ["MixedLmdbBatches"]
