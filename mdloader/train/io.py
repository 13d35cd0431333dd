"""What the reference training job writes: ``lcurve.out`` and checkpoints.

``lcurve.out`` keeps DeePMD-kit's columns and number format, so existing plotting scripts work:
``step``, then ``rmse``, ``rmse_e`` (per atom) and ``rmse_f`` as ``_val``/``_trn`` pairs, then
``lr``. ``full_valid.out`` has one line per full validation pass. A restart keeps the lines of
both files up to its checkpoint's step and drops the later ones (a run killed after its last
checkpoint wrote them; DeePMD-kit appends, so they appear twice). Checkpoints are
``<save_ckpt>-<step>.pt`` with a ``<save_ckpt>.pt`` link to the latest (DeePMD-kit's naming); they
hold the model, the optimizer, and the loader state of the whole job
(:mod:`mdloader.loading.feed_state`: every rank's state merged), so that a restart on the same
number of ranks continues every stream exactly and one on another number resumes elastically.
Everything is plain tensors, integers and lists, so that they load with
``torch.load(weights_only=True)``.

A checkpoint carries the SHA-256 of its content (:func:`content_checksum`), verified on load:
torch checks neither the zip's CRCs nor the tensors, and would resume from damaged weights. It
is serialised in memory and written with plain file calls, so that a full disk is an ``OSError``
naming the file; the partial file is removed and the previous checkpoint stays the latest.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import tempfile
from typing import IO, Any

import torch

from mdloader.errors import ConfigError, StateDictError, WriteError
from mdloader.persist import point_link, write_atomic

KEYS = ("rmse", "rmse_e", "rmse_f")
CKPT_FORMAT = "mdloader-train"
CKPT_VERSION = 4
"""3 added the checksum; 4 keeps the loader state as one document (``loader_state``) in place
of 3's ``loader`` and ``valid_loader``. Versions 3 and 2 (unverified) still load."""
MAX_KEEP = 5

log = logging.getLogger(__name__)


def check_output(output: str) -> None:
    """Create the output folder, and make sure this process can write in it: before the build,
    so that a bad ``--output`` fails in a second rather than at the first checkpoint."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConfigError(f"{output} exists and is not a folder", path="--output")
    try:
        os.makedirs(output, exist_ok=True)
        with tempfile.TemporaryFile(dir=output):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write in {output}: {exc.strerror or exc}",
                          path="--output") from None


def keep_steps_up_to(path: str, step: int) -> None:
    """Drop the lines of a per-step log written after ``step`` (comment lines stay).

    The file is replaced atomically, so a crash leaves the old one or the new one.
    """
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    kept = [line for line in lines if not _step_of(line) > step]
    if len(kept) == len(lines):
        return
    _write_atomically(path, "".join(kept).encode(), f"the old {path} is kept unchanged")


def _step_of(line: str) -> int:
    head = line.split(maxsplit=1)[0] if line.strip() else ""
    return int(head) if head.isdigit() else -1


def _open_log(path: str, header: str, after: int | None) -> IO[str]:
    """A log for appending: new (with its header) when ``after`` is None or the file is
    missing, else the existing file with its lines after step ``after`` dropped."""
    if after is not None and os.path.exists(path):
        keep_steps_up_to(path, after)
        mode = "a"
    else:
        mode = "w"
    try:
        fh = open(path, mode, encoding="utf-8")
        if mode == "w":
            fh.write(header)
            fh.flush()
    except OSError as exc:
        raise WriteError(f"cannot write {path}: {exc.strerror or exc}") from None
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

    def missing(self, step: int) -> bool:
        """Whether the file has no line for ``step``."""
        with open(self.path, encoding="utf-8") as fh:
            return all(_step_of(line) != step for line in fh)

    def write(self, step: int, rmse_e: float, rmse_f: float, frames: int, seconds: float) -> str:
        line = f"{step:7d}   {rmse_e:11.4e} {rmse_f:11.4e}   {frames:8d}   {seconds:9.3f}\n"
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
        return line


def checkpoint_path(output: str, prefix: str, step: int) -> str:
    """The file of the checkpoint of ``step``: ``<output>/<prefix>-<step>.pt``."""
    return os.path.join(output, f"{prefix}-{step}.pt")


def content_checksum(value: Any) -> str:
    """SHA-256 of a checkpoint's content: every tensor's dtype, shape and bytes, every other
    value's type and text, and the structure (keys in order) around them."""
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{flat.dtype}{tuple(value.shape)}:".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}:".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}:".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"{type(value).__name__}{value!r};".encode())


def save_checkpoint(output: str, prefix: str, step: int, state: dict[str, Any]) -> str:
    """Write atomically (:mod:`mdloader.persist`) with its checksum, point ``<prefix>.pt`` at
    it, keep the last few; a write error is a :class:`~mdloader.errors.WriteError` saying what
    was kept."""
    path = checkpoint_path(output, prefix, step)
    latest = os.path.join(output, f"{prefix}.pt")
    previous = os.path.join(output, os.readlink(latest)) if os.path.islink(latest) else None
    kept = (f"{previous} is still the latest checkpoint" if previous
            else "no earlier checkpoint exists")
    content = {"format": CKPT_FORMAT, "version": CKPT_VERSION, "step": step, **state}
    content["checksum"] = content_checksum(content)
    buffer = io.BytesIO()
    torch.save(content, buffer)
    _write_atomically(path, buffer.getbuffer(), f"no checkpoint of step {step} was written; "
                      + kept)
    try:
        point_link(latest, os.path.basename(path))
        _write_atomically(os.path.join(output, "checkpoint"),
                          (os.path.basename(path) + "\n").encode(), "")
    except OSError as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        raise WriteError(f"wrote checkpoint {path}, but could not point {latest} at it: "
                         f"{cause.strerror or cause}; restart with --restart {path}") from None
    _prune(output, prefix)
    return path


def _write_atomically(path: str, data: bytes | memoryview, kept: str) -> None:
    """``data`` into ``path`` atomically (:func:`mdloader.persist.write_atomic`); on an error
    nothing partial is left and a :class:`WriteError` names the file and says what was
    ``kept``."""
    try:
        write_atomic(path, data)
    except OSError as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        raise WriteError(f"cannot write {path}: {cause.strerror or cause}"
                    + (f"; {kept}" if kept else "")) from None


def _prune(output: str, prefix: str) -> None:
    steps = []
    for name in os.listdir(output):
        stem = name[len(prefix) + 1:-3] if name.startswith(prefix + "-") and \
            name.endswith(".pt") else ""
        if stem.isdigit():
            steps.append(int(stem))
    for step in sorted(steps)[:-MAX_KEEP]:
        old = checkpoint_path(output, prefix, step)
        try:
            os.remove(old)
        except OSError as exc:  # the new checkpoint is written: an old one left is no failure
            log.warning("could not remove the old checkpoint %s: %s", old, exc)


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read and check a checkpoint written by :func:`save_checkpoint` (on any number of ranks):
    its format, version and checksum."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise StateDictError(f"checkpoint not found: {path}") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        # torch's text advises weights_only=False, which runs the damaged file's pickle: not
        # advice to pass on
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        said = "" if "weights_only" in said else f": {said}"
        raise StateDictError(f"cannot read checkpoint {path}: damaged or not a checkpoint "
                             f"({type(exc).__name__}{said}); {_previous(path)}") from None
    if not isinstance(state, dict) or state.get("format") != CKPT_FORMAT:
        raise StateDictError(f"{path} is not an mdloader training checkpoint")
    version = state.get("version")
    if version == 2:
        log.warning("checkpoint %s has version 2, which carries no checksum: not verified", path)
        return state
    if version not in (3, CKPT_VERSION):
        raise StateDictError(f"checkpoint {path} has version {version}, this "
                             f"mdloader reads versions 2 to {CKPT_VERSION}")
    written = state.pop("checksum", None)
    if written != content_checksum(state):
        raise StateDictError(f"checkpoint {path} is damaged: its content does not match the "
                             f"checksum written with it; {_previous(path)}")
    return state


def _previous(path: str) -> str:
    """Advice after a damaged checkpoint: the newest older one in its folder, if any."""
    real = os.path.realpath(path)
    folder, name = os.path.split(real)
    match = re.fullmatch(r"(.+)-(\d+)\.pt", name)
    if match is None:
        return "restart from an earlier checkpoint"
    prefix, step = match.group(1), int(match.group(2))
    older = []
    for other in os.listdir(folder):
        found = re.fullmatch(re.escape(prefix) + r"-(\d+)\.pt", other)
        if found and int(found.group(1)) < step:
            older.append(int(found.group(1)))
    if not older:
        return f"no earlier checkpoint is kept in {folder}"
    return (f"restart from the previous checkpoint, --restart "
            f"{os.path.join(os.path.dirname(path), f'{prefix}-{max(older)}.pt')}")


def restart_note(path: str, loader_state: dict[str, Any], world_size: int) -> str:
    """The log line of a restart from ``path`` with its loader state; it says when the number of
    ranks changed."""
    note = f"restarted from {path} at step {loader_state['next_step']}"
    saved = int(loader_state["world_size"])
    if saved != world_size:
        training = loader_state["streams"]["training"]
        if "generations" not in training:  # a mix:N stream: one pass, split anew
            return note + (f" on {world_size} rank(s), written by {saved}: elastic resume (the "
                           "rest of the current mix:N pass is split over the new ranks)")
        rows = training["generations"]
        note += (f" on {world_size} rank(s), written by {saved}: elastic resume (the samplers "
                 f"first serve what the {saved} rank(s) left of their current passes; "
                 f"{len(rows)} generation(s) in the state)")
    return note
