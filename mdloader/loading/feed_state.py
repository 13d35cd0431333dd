"""The loader state of a job, one format for both trainers: what a checkpoint needs to continue
every stream of its feed exactly.

A *document* is plain JSON: the format and its version, the step the job continues at, the
number of ranks that wrote it, the job seed (the task schedule's), and the merged state of every
stream by name (``training``, ``validation.<task>``, ``display.<task>``:
:func:`mdloader.sampling.elastic.merge_rank_states`, which also resumes on another number of
ranks). ``mdloader train`` keeps it inside its checkpoint; under ``mdloader dp`` it is a file
beside DeePMD-kit's checkpoint (``model.ckpt-100.pt`` -> ``model.ckpt-100.pt.mdloader``).

The forms earlier mdloader releases wrote still load (:func:`read`,
:func:`from_training_checkpoint`), so a run upgraded between two of its checkpoints continues
with the batches it would have trained.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from typing import Any

from mdloader.errors import StateDictError
from mdloader.persist import write_atomic
from mdloader.state import check_keys

FORMAT = "mdloader-loader-state"
VERSION = 2
KEYS = ("format", "next_step", "world_size", "seed", "streams")

#: ``mdloader dp``'s file of version 1: ``step`` (the 0-based step just done), ``world_size``,
#: ``streams`` and ``schedule_seed``.
DEEPMD_V1 = "mdloader-deepmd-loader-state"

#: The suffix of the file beside a checkpoint: ``<checkpoint><SUFFIX>``.
SUFFIX = ".mdloader"


def document(streams: Mapping[str, Any], *, next_step: int, world_size: int,
             seed: int | None) -> dict[str, Any]:
    """The loader state of a job that continues at ``next_step`` (the steps done)."""
    return {"format": FORMAT, "version": VERSION, "next_step": int(next_step),
            "world_size": int(world_size), "seed": None if seed is None else int(seed),
            "streams": dict(streams)}


def read(state: Any, where: str = "the loader state") -> dict[str, Any]:
    """A document of this version from ``state``, this version's or an earlier release's;
    ``where`` names it in errors (a file, a checkpoint)."""
    if isinstance(state, Mapping) and state.get("format") == DEEPMD_V1:
        if state.get("version") != 1:
            raise StateDictError(f"{where} has version {state.get('version')} of "
                                 f"{DEEPMD_V1}, this mdloader reads version 1")
        check_keys(state, kind=where, version=1,
                   keys=("format", "step", "world_size", "streams", "schedule_seed"))
        return document(state["streams"], next_step=int(state["step"]) + 1,
                        world_size=state["world_size"], seed=state["schedule_seed"])
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise StateDictError(f"{where} is not an mdloader loader state")
    if state.get("version") != VERSION:
        raise StateDictError(f"{where} has version {state.get('version')}, this mdloader reads "
                             f"version {VERSION} (and {DEEPMD_V1} version 1)")
    check_keys(state, kind=where, version=VERSION, keys=KEYS)
    if not isinstance(state["streams"], Mapping):
        raise StateDictError(f"{where}: its streams must be a dict of stream states")
    return dict(state)


def from_training_checkpoint(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The document of a checkpoint of ``mdloader train`` (its ``loader_state``; before
    version 4, its ``loader`` and ``valid_loader`` states)."""
    if "loader_state" in checkpoint:
        return read(checkpoint["loader_state"], "the checkpoint's loader state")
    streams = {"training": checkpoint["loader"]["sampler"]}
    if checkpoint.get("valid_loader") is not None:
        streams["validation"] = checkpoint["valid_loader"]["sampler"]
    return document(streams, next_step=checkpoint["step"],
                    world_size=checkpoint["world_size"], seed=None)


def path_beside(checkpoint: str | os.PathLike[str]) -> str:
    """The loader-state file of ``checkpoint`` (a link, ``model.ckpt.pt``, is resolved first)."""
    return os.path.realpath(os.fspath(checkpoint)) + SUFFIX


def read_beside(checkpoint: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The document beside ``checkpoint``, ``None`` when there is none."""
    path = path_beside(checkpoint)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:
        raise StateDictError(f"cannot read the loader state {path}: {exc}") from None
    return read(state, path)


def write_beside(checkpoint: str | os.PathLike[str], state: Mapping[str, Any]) -> str:
    """Write ``state`` beside ``checkpoint`` atomically; drop the files whose checkpoint is
    gone (DeePMD-kit's retention removed it). Returns the path written."""
    target = path_beside(checkpoint)
    write_atomic(target, json.dumps(state).encode("utf-8"))
    folder = os.path.dirname(target)
    for path in glob.glob(os.path.join(glob.escape(folder), f"*{SUFFIX}")):
        if not os.path.exists(path[:-len(SUFFIX)]):
            os.remove(path)
    return target


__all__ = ["DEEPMD_V1", "FORMAT", "SUFFIX", "VERSION", "document", "from_training_checkpoint",
           "path_beside", "read", "read_beside", "write_beside"]
