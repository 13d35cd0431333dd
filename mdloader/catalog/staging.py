"""Node-local copies of a job's data: where a copy lives, whether it is still true, the copy.

A job that stages (``$MDLOADER_STAGE_DIR``) reads every system from a copy on the node instead of
the shared tree, so the shared file system serves each file once per node, not once per pass.
What is copied is each system's container, the path of its address before ``#``: an npy system's
folder, an HDF5 file, an LMDB database. A copy lives in ``<stage>/<key>/<name>`` (``key``: a
digest of the source's absolute path, ``name``: its last component) beside its manifest
``<stage>/<key>/manifest.mdlstage``, which records the :class:`~mdloader.persist.FileStamp` of every
source file at the moment it was copied and of every copied file.

* **Never stale**: a copy is used only while every source file still has the stamp recorded
  (one ``stat`` per file at the job's start, none afterwards) and the set of files is the same;
  otherwise the source is copied again. A file that changes while it is copied fails the copy.
* **Atomic**: a copy is made in a temporary folder and published by a rename
  (:func:`mdloader.persist.publish_folder`), then its manifest is written
  (:func:`mdloader.persist.write_atomic`); a copy without a manifest is never used, so a stager
  killed at any moment leaves nothing that a later job trusts.
* **Bounded**: before copying, the bytes still to copy must fit the free space of the stage
  folder, and every copy's bytes (other jobs' included) ``$MDLOADER_STAGE_BYTES`` when set;
  otherwise :class:`~mdloader.errors.StagingError` names the folder and both figures. Nothing
  is evicted automatically: another job may be reading a copy (``mdloader cache prune``).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mdloader.catalog.table import SystemTable
from mdloader.data.formats.base import SetMeta
from mdloader.errors import StagingError
from mdloader.persist import (
    FileStamp,
    discard,
    is_temporary,
    mark_used,
    publish_folder,
    remove_entry,
    remove_leftovers,
    temporary_path,
    usage,
    write_atomic,
)

MANIFEST = "manifest.mdlstage"
MANIFEST_VERSION = 1
COPY_THREADS = 4
"""Sources copied at once: a copy waits on the shared file system, and threads overlap the
waits."""
_CHUNK = 1 << 24


def stage_key(source: str) -> str:
    """The name of ``source``'s copy in a stage folder: a digest of its absolute path."""
    return hashlib.sha256(os.path.abspath(source).encode()).hexdigest()[:24]


def home_of(stage_dir: str, source: str) -> str:
    """The folder of ``source``'s copy and manifest in ``stage_dir``."""
    return os.path.join(stage_dir, stage_key(source))


def copy_path(stage_dir: str, source: str) -> str:
    """Where the copy of ``source`` (a folder or a file) lives in ``stage_dir``."""
    source = os.path.abspath(source)
    return os.path.join(home_of(stage_dir, source), os.path.basename(source) or "root")


def manifest_path(stage_dir: str, source: str) -> str:
    """The manifest of ``source``'s copy in ``stage_dir``."""
    return os.path.join(home_of(stage_dir, source), MANIFEST)


def sources_of(tables: Iterable[SystemTable]) -> list[str]:
    """The distinct containers of the systems of ``tables`` (address before ``#``), in order."""
    found: dict[str, None] = {}
    for table in tables:
        for address in table.addresses():
            found.setdefault(address.partition("#")[0], None)
    return list(found)


def relocate(table: SystemTable, stage_dir: str) -> SystemTable:
    """``table`` with every system read from its copy in ``stage_dir``.

    A description that carries a source file's stamp (an LMDB group, whose every read checks
    its ``data.mdb``) carries the copy's instead: the manifests say which copy each stamp was
    copied to, and a stamp no manifest records is left as it is (the read then refuses it).
    """
    copies: dict[tuple[int, ...], tuple[int, ...]] = {}
    for source in sources_of([table]):
        manifest = Manifest.read(manifest_path(stage_dir, source))
        if manifest is not None:
            copies.update((tuple(a), tuple(b)) for a, b in manifest.files.values())

    def restate(entry: SetMeta) -> SetMeta:
        stamp = getattr(entry, "stamp", None)
        if stamp is None or tuple(stamp) not in copies:
            return entry
        return dataclasses.replace(entry, stamp=copies[tuple(stamp)])

    return table.relocated(lambda path: copy_path(stage_dir, path), restate if copies else None)


@dataclass(frozen=True)
class Manifest:
    """What a copy was made from: the source, and per file (relative path, ``""`` for a source
    that is one file) the source's stamp when copied and the copy's stamp."""

    source: str
    files: dict[str, tuple[FileStamp, FileStamp]]
    made: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(source.size for source, _ in self.files.values())

    def to_json(self) -> bytes:
        return json.dumps({"version": MANIFEST_VERSION, "source": self.source, "made": self.made,
                           "files": {rel: [list(a), list(b)] for rel, (a, b)
                                     in sorted(self.files.items())}}).encode()

    @classmethod
    def read(cls, path: str, *, use: bool = False) -> Manifest | None:
        """The manifest at ``path``; ``None`` when it is missing or unreadable (not trusted).
        ``use``: the copy is about to be read, which marks it used (``mdloader cache``)."""
        try:
            with open(path, "rb") as fh:
                raw = json.loads(fh.read())
                if use:
                    mark_used(path, fh)
            if raw.get("version") != MANIFEST_VERSION:
                return None
            files = {rel: (FileStamp(*a), FileStamp(*b)) for rel, (a, b) in raw["files"].items()}
            return cls(str(raw["source"]), files, float(raw.get("made", 0.0)))
        except (OSError, ValueError, TypeError, KeyError):
            return None


def survey(source: str) -> dict[str, FileStamp]:
    """Every file of ``source`` (a file, or a folder walked through) and its stamp now."""
    try:
        top = os.stat(source)
    except OSError as exc:
        raise StagingError(f"cannot stage {source}: {exc.strerror or exc}") from exc
    if not os.path.isdir(source):
        return {"": FileStamp.of(top)}
    found: dict[str, FileStamp] = {}
    pending = [""]
    while pending:
        rel = pending.pop()
        with os.scandir(os.path.join(source, rel)) as entries:
            for entry in entries:
                name = os.path.join(rel, entry.name)
                if entry.is_dir():
                    pending.append(name)
                elif entry.is_file():
                    found[name] = FileStamp.of(entry.stat())
    return found


def _copy_intact(copy: str, manifest: Manifest) -> bool:
    """Whether every copied file is still there, as it was written (local ``stat`` s)."""
    for rel, (_, written) in manifest.files.items():
        try:
            if FileStamp.of(os.stat(os.path.join(copy, rel) if rel else copy)) != written:
                return False
        except OSError:
            return False
    return True


def is_fresh(stage_dir: str, source: str, now: dict[str, FileStamp]) -> bool:
    """Whether the copy of ``source`` in ``stage_dir`` may be read: its manifest records these
    files with these stamps (``now``: :func:`survey`'s), and the copy is intact."""
    manifest = Manifest.read(manifest_path(stage_dir, source), use=True)
    if manifest is None or manifest.source != os.path.abspath(source):
        return False
    if {rel: s for rel, (s, _) in manifest.files.items()} != now:
        return False
    return _copy_intact(copy_path(stage_dir, source), manifest)


@dataclass
class StageReport:
    """What a stager did: sources copied and reused, bytes copied (read from the shared tree)
    and held by this job's copies, seconds taken."""

    stage_dir: str
    copied: int = 0
    reused: int = 0
    bytes_copied: int = 0
    bytes_held: int = 0
    seconds: float = 0.0
    copied_sources: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rate = self.bytes_copied / self.seconds / 2**20 if self.seconds > 0 else 0.0
        return (f"staged {self.copied + self.reused} sources in {self.stage_dir}: "
                f"{self.copied} copied ({self.bytes_copied} bytes, {rate:.0f} MiB/s), "
                f"{self.reused} reused, {self.bytes_held} bytes held, {self.seconds:.2f} s")


def stage(sources: Sequence[str], stage_dir: str, *, limit_bytes: int = 0,
          threads: int = COPY_THREADS) -> StageReport:
    """Make ``stage_dir`` hold a fresh copy of every one of ``sources``; what was done.

    Copies still fresh are reused; the others are copied again once the bytes are known to
    fit (see the module docstring).

    Raises
    ------
    StagingError
        The copies do not fit (the folder, the bytes needed and available), or a source could
        not be read or changed while it was copied (naming it).
    """
    start = time.monotonic()
    stage_dir = os.path.abspath(stage_dir)
    try:
        os.makedirs(stage_dir, exist_ok=True)
    except OSError as exc:
        raise StagingError(f"cannot make the stage folder {stage_dir}: "
                           f"{exc.strerror or exc}") from exc
    report = StageReport(stage_dir)
    stale: list[tuple[str, dict[str, FileStamp]]] = []
    for source in sources:
        now = survey(source)
        report.bytes_held += sum(s.size for s in now.values())
        if is_fresh(stage_dir, source, now):
            report.reused += 1
        else:
            stale.append((source, now))
    needed = sum(s.size for _, now in stale for s in now.values())
    _check_room(stage_dir, needed, {os.path.abspath(s) for s, _ in stale}, limit_bytes)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(stale))),
                            thread_name_prefix="mdloader-stage") as pool:
        listed = os.listdir(stage_dir) if stale else []
        copied = list(pool.map(lambda job: _stage_one(job[0], job[1], stage_dir, listed),
                               stale))
    report.bytes_copied = sum(copied)
    report.copied = len(stale)
    report.copied_sources = [source for source, _ in stale]
    report.seconds = time.monotonic() - start
    return report


def _check_room(stage_dir: str, needed: int, replaced: set[str], limit_bytes: int) -> None:
    """Raise unless ``needed`` more bytes fit the free space and the bound (the copies of
    ``replaced`` sources are about to be replaced: they do not count as held)."""
    if needed == 0:
        return
    free = shutil.disk_usage(stage_dir).free
    if needed > free:
        raise StagingError(f"node-local staging needs {needed} bytes in {stage_dir}, "
                           f"{free} available (free space): free the folder (mdloader cache "
                           "prune), or name a larger MDLOADER_STAGE_DIR")
    if limit_bytes:
        held = sum(c.bytes for c in staged_copies(stage_dir) if c.source not in replaced)
        if held + needed > limit_bytes:
            raise StagingError(
                f"node-local staging needs {needed} bytes in {stage_dir}, "
                f"{max(0, limit_bytes - held)} available (MDLOADER_STAGE_BYTES={limit_bytes}, "
                f"{held} held by other copies): raise MDLOADER_STAGE_BYTES or prune the "
                "folder (mdloader cache prune)")


def _stage_one(source: str, now: dict[str, FileStamp], stage_dir: str,
               listed: Sequence[str]) -> int:
    """Copy ``source`` into ``stage_dir`` and publish it with its manifest; bytes copied
    (``listed``: the stage folder's entries, where dead writers' temporaries are found)."""
    source = os.path.abspath(source)
    home = home_of(stage_dir, source)
    remove_entry(manifest_path(stage_dir, source))  # the old copy is not trusted from here on
    remove_leftovers(home, listed)
    temp = temporary_path(home)
    target = os.path.join(temp, os.path.basename(copy_path(stage_dir, source)))
    try:
        os.mkdir(temp)
        if "" not in now:  # a folder: its tree first, then its files
            for rel in sorted({os.path.dirname(r) for r in now} | {""}):
                os.makedirs(os.path.join(target, rel), exist_ok=True)
        stamps = {rel: copy_file(os.path.join(source, rel) if rel else source,
                                 os.path.join(target, rel) if rel else target, stamp)
                  for rel, stamp in now.items()}
        publish_folder(temp, home, durable=False)
    except BaseException:
        discard(temp)
        raise
    record = Manifest(source, stamps, time.time())
    write_atomic(manifest_path(stage_dir, source), record.to_json(), durable=False)
    return record.nbytes


def copy_file(source: str, target: str, expected: FileStamp | None = None
              ) -> tuple[FileStamp, FileStamp]:
    """Copy one file (in the kernel where it can); (the source's stamp, the copy's stamp).

    The source is opened once and its stamp read from the open file after the copy: it must
    be ``expected`` (the stamp seen before, by default the open file's own before the copy),
    so a file rewritten meanwhile is an error, never a copy of two versions.
    """
    try:
        src = os.open(source, os.O_RDONLY)
    except OSError as exc:
        raise StagingError(f"cannot stage {source}: {exc.strerror or exc}") from exc
    try:
        before = expected if expected is not None else FileStamp.of(os.fstat(src))
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            copied = (_copy_small(src, dst, before.size) if before.size <= SMALL_FILE
                      else _copy_fd(src, dst, before.size))
            written = FileStamp.of(os.fstat(dst))
        finally:
            os.close(dst)
        after = FileStamp.of(os.fstat(src))
    except OSError as exc:
        raise StagingError(f"cannot stage {source} to {target}: {exc.strerror or exc}") from exc
    finally:
        os.close(src)
    if after != before or copied != before.size:
        raise StagingError(f"{source} changed while it was staged ({before.describe()}, then "
                           f"{after.describe()}): start the job again once it is written")
    return before, written


SMALL_FILE = 1 << 20
"""Files up to this size are copied with one read and one write: the kernel's copy calls
cost more calls per file than they save on a few KiB (most of an npy system's files)."""


def _copy_small(src: int, dst: int, size: int) -> int:
    """Copy a file of ``size`` bytes through one buffer; the bytes copied (more than ``size``:
    the file grew, fewer: it shrank; either is refused by the caller)."""
    data = os.read(src, size + 1)
    while 0 < len(data) <= size:  # a short read (a network file system may give one)
        more = os.read(src, size + 1 - len(data))
        if not more:
            break
        data += more
    view, done = memoryview(data), 0
    while done < len(data):
        done += os.write(dst, view[done:])
    return done


#: (source device, target device) pairs where ``copy_file_range`` failed: not asked again.
_NO_RANGE: set[tuple[int, int]] = set()


def _copy_fd(src: int, dst: int, size: int) -> int:
    """Copy ``size`` bytes of ``src`` to ``dst``: ``copy_file_range``, else ``sendfile``,
    else reads and writes; the bytes copied (fewer: the file shrank)."""
    devices = (os.fstat(src).st_dev, os.fstat(dst).st_dev) if _NO_RANGE else None
    calls = (_range, _sendfile, _plain) if devices not in _NO_RANGE else (_sendfile, _plain)
    done = 0
    for call in calls:
        try:
            while done < size:
                n = call(src, dst, done, min(_CHUNK, size - done))
                if n == 0:
                    return done
                done += n
            return done
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                                 errno.ENOTSUP) or call is _plain:
                raise
            if call is _range:
                _NO_RANGE.add((os.fstat(src).st_dev, os.fstat(dst).st_dev))
    return done


def _range(src: int, dst: int, offset: int, count: int) -> int:
    return os.copy_file_range(src, dst, count, offset, offset)


def _sendfile(src: int, dst: int, offset: int, count: int) -> int:
    os.lseek(dst, offset, os.SEEK_SET)
    return os.sendfile(dst, src, offset, count)


def _plain(src: int, dst: int, offset: int, count: int) -> int:
    data = os.pread(src, count, offset)
    os.pwrite(dst, data, offset)
    return len(data)


@dataclass(frozen=True)
class StagedCopy:
    """One finished copy in a stage folder: its source, where it is, its bytes, its last use
    (its manifest's modification time), and its manifest."""

    source: str
    path: str
    bytes: int
    last_use: float
    manifest: str


def staged_copies(stage_dir: str) -> list[StagedCopy]:
    """Every copy of ``stage_dir`` that has a manifest (copies in progress are left out)."""
    found = []
    try:
        names = sorted(os.listdir(stage_dir))
    except OSError:
        return found
    for name in names:
        if is_temporary(name):
            continue
        path = os.path.join(stage_dir, name, MANIFEST)
        manifest = Manifest.read(path)
        facts = usage(path)
        if manifest is None or facts is None:
            continue
        found.append(StagedCopy(manifest.source, copy_path(stage_dir, manifest.source),
                                manifest.nbytes, facts[0], path))
    return found


def remove_copy(copy: StagedCopy) -> bool:
    """Remove ``copy``: its manifest first (no job trusts it from then on), then its folder,
    renamed away before it is deleted. ``False`` when it was gone already."""
    if not remove_entry(copy.manifest):
        return False
    remove_entry(os.path.dirname(copy.manifest))
    return True
