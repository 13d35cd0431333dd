"""What the reference training job writes: ``lcurve.out`` and checkpoints.

``lcurve.out`` keeps DeePMD-kit's columns and number format, so existing plotting scripts work:
``step``, then ``rmse``, ``rmse_e`` (per atom) and ``rmse_f`` as ``_val``/``_trn`` pairs, then
``lr``. ``full_valid.out`` has one line per full validation pass. A restart keeps the lines of
both files up to its checkpoint's step and drops the later ones (a run killed after its last
checkpoint wrote them; DeePMD-kit appends, so they appear twice). Checkpoints are
``<save_ckpt>-<step>.pt`` with a ``<save_ckpt>.pt`` link to the latest (DeePMD-kit's naming); they
hold the model, the optimizer, and the loader state of the whole job (every rank's state merged,
:func:`mdloader.sampling.elastic.merge_rank_states`), so that a restart on the same number of
ranks continues every stream exactly and one on another number resumes elastically. Everything is
plain tensors, integers and lists, so that they load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from typing import IO, Any

import torch

from mdloader.distributed.collectives import gather_to_main
from mdloader.errors import StateDictError
from mdloader.sampling.elastic import merge_rank_states
from mdloader.state import Stateful

KEYS = ("rmse", "rmse_e", "rmse_f")
CKPT_FORMAT = "mdloader-train"
CKPT_VERSION = 2
MAX_KEEP = 5


def keep_steps_up_to(path: str, step: int) -> None:
    """Drop the lines of a per-step log written after ``step`` (comment lines stay).

    The file is replaced atomically, so a crash leaves the old one or the new one.
    """
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    kept = [line for line in lines if not _step_of(line) > step]
    if len(kept) == len(lines):
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(kept)
    os.replace(tmp, path)


def _step_of(line: str) -> int:
    head = line.split(maxsplit=1)[0] if line.strip() else ""
    return int(head) if head.isdigit() else -1


def _open_log(path: str, header: str, after: int | None) -> IO[str]:
    """A log for appending: new (with its header) when ``after`` is None or the file is
    missing, else the existing file with its lines after step ``after`` dropped."""
    if after is not None and os.path.exists(path):
        keep_steps_up_to(path, after)
        return open(path, "a", encoding="utf-8")
    fh = open(path, "w", encoding="utf-8")
    fh.write(header)
    fh.flush()
    return fh


class Lcurve:
    """Append-only writer of DeePMD-kit's learning curve (rank 0 only).

    ``after``: ``None`` starts a new file; a restart passes its checkpoint's step to continue the
    existing file from there.
    """

    def __init__(self, path: str, *, with_validation: bool, after: int | None = None) -> None:
        self.path = path
        self.with_validation = with_validation
        self._fh = _open_log(path, self.header(), after)

    def header(self) -> str:
        text = "# {:5s}".format("step")
        for key in KEYS:
            if self.with_validation:
                text += "   {:11s} {:11s}".format(key + "_val", key + "_trn")
            else:
                text += "   {:11s}".format(key + "_trn")
        return text + "   {:8s}\n".format("lr")

    def write(self, step: int, lr: float, train: dict[str, float],
              valid: dict[str, float] | None) -> str:
        line = f"{step:7d}"
        for key in KEYS:
            if self.with_validation and valid is not None:
                line += f"   {valid[key]:11.2e} {train[key]:11.2e}"
            else:
                line += f"   {train[key]:11.2e}"
        line += f"   {lr:8.1e}\n"
        self._fh.write(line)
        self._fh.flush()
        return line

    def close(self) -> None:
        self._fh.close()


class FullValidationLog:
    """Append-only writer of ``full_valid.out``: one line per full validation pass (rank 0);
    ``after`` as for :class:`Lcurve`."""

    HEADER = "# {:>5s}   {:>11s} {:>11s}   {:>8s}   {:>9s}\n".format(
        "step", "rmse_e_val", "rmse_f_val", "frames", "seconds")

    def __init__(self, path: str, *, after: int | None = None) -> None:
        self.path = path
        _open_log(path, self.HEADER, after).close()

    def write(self, step: int, rmse_e: float, rmse_f: float, frames: int, seconds: float) -> str:
        line = f"{step:7d}   {rmse_e:11.4e} {rmse_f:11.4e}   {frames:8d}   {seconds:9.3f}\n"
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
        return line


def checkpoint_path(output: str, prefix: str, step: int) -> str:
    return os.path.join(output, f"{prefix}-{step}.pt")


def save_checkpoint(output: str, prefix: str, step: int, state: dict[str, Any]) -> str:
    """Write atomically (tmp + rename), point ``<prefix>.pt`` at it, keep the last few."""
    path = checkpoint_path(output, prefix, step)
    tmp = path + ".tmp"
    torch.save({"format": CKPT_FORMAT, "version": CKPT_VERSION, "step": step, **state}, tmp)
    os.replace(tmp, path)
    latest = os.path.join(output, f"{prefix}.pt")
    link_tmp = latest + ".tmp"
    if os.path.lexists(link_tmp):
        os.remove(link_tmp)
    os.symlink(os.path.basename(path), link_tmp)
    os.replace(link_tmp, latest)
    with open(os.path.join(output, "checkpoint"), "w", encoding="utf-8") as fh:
        fh.write(os.path.basename(path) + "\n")
    _prune(output, prefix)
    return path


def _prune(output: str, prefix: str) -> None:
    steps = []
    for name in os.listdir(output):
        stem = name[len(prefix) + 1:-3] if name.startswith(prefix + "-") and \
            name.endswith(".pt") else ""
        if stem.isdigit():
            steps.append(int(stem))
    for step in sorted(steps)[:-MAX_KEEP]:
        os.remove(checkpoint_path(output, prefix, step))


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read and check a checkpoint written by :func:`save_checkpoint` (on any number of ranks)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise StateDictError(f"checkpoint not found: {path}") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise StateDictError(f"cannot read checkpoint {path}: {type(exc).__name__}: "
                             f"{exc}") from exc
    if not isinstance(state, dict) or state.get("format") != CKPT_FORMAT:
        raise StateDictError(f"{path} is not an mdloader training checkpoint")
    if state.get("version") != CKPT_VERSION:
        raise StateDictError(f"checkpoint {path} has version {state.get('version')}, this "
                             f"mdloader reads version {CKPT_VERSION}")
    return state


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
