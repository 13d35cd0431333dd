"""Topology as a value: who am I among how many.

Pure code takes a :class:`World` argument instead of asking ``torch.distributed``, so that
"rank 3 of 8" is a one-process unit test. :func:`mdloader.distributed.group.current_world`
builds one from an initialised process group; :meth:`World.from_env` from the variables
``torchrun`` sets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mdloader.errors import ConfigError


@dataclass(frozen=True)
class World:
    """Rank and size of the job (``local_*`` describe this node, ``node`` is its number)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that touches the data tree during the build."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> World:
        """Read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` and the node's
        number ``GROUP_RANK`` (set by torchrun for each of its agents; without it, the node
        is counted from the rank: ``RANK // LOCAL_WORLD_SIZE``)."""
        env = os.environ if environ is None else environ
        try:
            rank = int(env.get("RANK", 0))
            local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))
            node = env.get("GROUP_RANK")
            return cls(
                rank=rank,
                world_size=int(env.get("WORLD_SIZE", 1)),
                local_rank=int(env.get("LOCAL_RANK", 0)),
                local_world_size=local_world_size,
                node=int(node) if node else rank // max(local_world_size, 1),
            )
        except ValueError as exc:
            raise ConfigError(f"malformed rank variables in the environment: {exc}") from exc
