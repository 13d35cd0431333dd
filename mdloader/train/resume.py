"""Checkpoint contents of the reference job that let a restart continue on any number of ranks.

Rank 0 gathers every rank's loader state and stores the job state they merge into
(:func:`mdloader.sampling.job_state.merge_rank_states`): on the same number of ranks every rank
continues its own stream exactly; on another number the samplers resume elastically
(:mod:`mdloader.sampling.elastic`). The state is a few integers per rank and generation.
"""

from __future__ import annotations

from typing import Any

from mdloader.distributed.collectives import gather_to_main
from mdloader.sampling.job_state import merge_rank_states
from mdloader.sampling.state import Stateful


def gather_loader_states(loader: Stateful, valid: Stateful | None) -> dict[str, Any] | None:
    """The training and validation loader states of the job, on rank 0 (``None`` elsewhere).

    A collective: every rank calls it.
    """
    train_states = gather_to_main(loader.state_dict(), context="gathering the loader states")
    valid_states = (gather_to_main(valid.state_dict(), context="gathering the loader states")
                    if valid is not None else None)
    if train_states is None:
        return None
    return {"loader": merge_rank_states(train_states),
            "valid_loader": None if valid_states is None else merge_rank_states(valid_states)}


def restart_note(path: str, state: dict[str, Any], world_size: int) -> str:
    """The log line of a restart; it says when the number of ranks changed."""
    note = f"restarted from {path} at step {state['step']}"
    saved = int(state["world_size"])
    if saved != world_size:
        rows = state["loader"]["sampler"]["generations"]
        note += (f" on {world_size} rank(s), written by {saved}: elastic resume (the samplers "
                 f"first serve what the {saved} rank(s) left of their current passes; "
                 f"{len(rows)} generation(s) in the state)")
    return note
