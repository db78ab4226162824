"""The store's layout on disk: a Zarr v3 group, its files, the run's state, checksums, damage.

A store written by ``solve(..., store=PATH)`` is a folder holding the Zarr v3 group:

* ``u`` (time, x0, x1), float32, one chunk file per chunk of levels (``u/c.K.0.0``), each
  ending with the CRC32C that Zarr's ``crc32c`` codec appends (after a zstd or blosc frame
  when compressed), or, with ``compress="gpu-zstd"``, one Zarr shard of small zstd chunks per
  chunk of levels (:mod:`.shards`); a chunk never written reads as NaN, the fill value;
* ``complete`` (bool) and ``peak`` (float32, the largest |u| of each level), one small file
  each, written whole when the store is created and rewritten in place afterwards (no new
  disk space needed, so a full disk cannot stop them);
* the coordinates ``time``, ``level``, ``x0``, ``x1``, the problem's parameters as
  attributes, and consolidated metadata (one read opens the store);
* ``.run-state``: how the run that wrote it ended (see :class:`RunState`);
* ``.checksums``: what the run wrote, to check the store against (see below).

Every file appears whole or not at all (:func:`course_helper.files.write_atomically`). A store
is built under a temporary name beside its path and renamed when whole, so a store at the path
always opens. This module creates stores, reads and writes their state and flag files, and
names the errors a store raises; :mod:`.sink` writes the levels, :mod:`.reading` reads them back.

**Checksums.** Zarr's ``crc32c`` codec proves that a chunk's bytes are the bytes some writer
wrote, not that they belong to this run or to this place in the array, and the metadata,
attributes and coordinates carry no checksum at all. The file ``.checksums`` adds both
(:class:`Checksums`, written when the store is created; any Zarr reader ignores it):

* a header (:data:`CHECKSUMS_MAGIC`, then the length and CRC32C of a JSON document, then the
  document) recording the run's own metadata: the levels per chunk of ``u``, its number of
  chunks, and the CRC32C of every metadata file (each ``zarr.json``, the consolidated one
  included) and every coordinate chunk file, as the run wrote them;
* then one 8-byte record per chunk of ``u``, in chunk order, zero until that chunk's file is
  written: ``2**32 + crc32c(K as 8 little-endian bytes + the chunk's own CRC32C)`` for chunk
  ``K`` (:func:`chunk_record`). A writer puts it in place before the chunk's file appears, so
  every chunk file has its record. Its own CRC32C is the 4 bytes at the end of the chunk's
  file, which Zarr checks against the chunk's bytes on every read; folding the chunk's index
  into the record ties those bytes to their place, so a chunk file moved to another place, or
  copied in from another run, fails its record.

The scheme is per chunk file, keyed by the file's position: a shard's record folds in its
index and the CRC32C of every inner chunk instead (:func:`.shards.shard_tag`), so that it ties
each inner chunk's bytes to the shard's place too. :func:`check_layout` holds a store's arrays, attributes and
coordinates against one another and against the header, and :func:`chunk_verified` checks
a chunk against its record; whatever disagrees raises :class:`StoreDamaged` naming it.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import struct
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from .. import checks, files
from ..runtime import interrupts
from ..wave import WaveProblem, saved_levels
from .shards import checksum, file_tag, inner_rows

__all__ = ["DATA", "RUN_STATE", "CHECKSUMS", "CHECKSUMS_MAGIC", "COORDINATES", "PARTIAL", "THREAD_NAMES", "CODECS",
           "NUMCODECS", "SHARDED", "sharded_inner", "StoreDamaged", "StoreWriteError", "zarr_module", "free_bytes",
           "check_target", "put_file", "overwrite", "checksum", "durable_store", "RunState", "read_state",
           "remove_partials", "remove_stale_creations", "flag_bytes", "create_store", "in_one_line", "Checksums",
           "RunRecord", "chunk_record", "read_record", "chunk_verified", "check_layout"]

DATA = "u"                      # the wavefield array inside the store
RUN_STATE = ".run-state"        # the run's state inside the store (see RunState)
CHECKSUMS = ".checksums"        # what the run wrote, to check the store against (see Checksums)
#: the first bytes of :data:`CHECKSUMS`
CHECKSUMS_MAGIC = b"course store checksums 1\n"
#: the coordinate arrays of a store, written once when it is created
COORDINATES = ("time", "level", "x0", "x1")
PARTIAL = files.PARTIAL         # the ending of files and folders not yet under their name
#: the names of the threads the disk package starts (each followed by a number, or alone)
THREAD_NAMES = ("disk writer", "disk peaks", "disk flags", "disk bandwidth", "disk compressor")
#: compression choices: name -> a function making the Zarr codec list (None: raw bytes). "gpu-zstd"
#: is zstd on the device, each chunk of levels a Zarr shard of small zstd chunks (:mod:`.shards`)
CODECS: dict[str | None, Callable[[], list | None]] = {
    None: lambda: None,
    "zstd": lambda: [zarr_module().codecs.ZstdCodec(level=1)],
    "blosc": lambda: [zarr_module().codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")],
    "gpu-zstd": lambda: [zarr_module().codecs.ZstdCodec(level=1)],
}
#: the choices whose chunks of levels are Zarr shards of small inner chunks
SHARDED = ("gpu-zstd",)
#: the same codecs as numcodecs objects, which encode one chunk's bytes exactly as Zarr's codecs do
NUMCODECS: dict[str, Callable[[], Any]] = {
    "zstd": lambda: _numcodecs().Zstd(level=1),
    "blosc": lambda: _numcodecs().Blosc(cname="lz4", clevel=5, shuffle=_numcodecs().Blosc.SHUFFLE),
    "gpu-zstd": lambda: _numcodecs().Zstd(level=1),
}


def zarr_module() -> Any:
    """The ``zarr`` module, imported on first use (importing the course does not import Zarr).
    A Ctrl-C during that first import waits for its end: an import cut in half can leave a
    module (PyYAML's, below Zarr's configuration) half made, and every later import failing."""
    with interrupts.held():
        import zarr
    return zarr


def _numcodecs():
    import numcodecs
    return numcodecs


class StoreWriteError(OSError):
    """Writing a run's store failed (a full disk, an I/O error); the message names the store
    and the level, and, once the run has stopped, what the store keeps."""


class StoreDamaged(ValueError):
    """A file of a store is damaged (bad metadata, a chunk failing its checksum): the message
    names the file, and for a chunk its levels."""


def in_one_line(exc: BaseException) -> str:
    """An exception in one line: its type, and its message if it has one."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------
# Checks before anything is allocated
# --------------------------------------------------------------------------
def free_bytes(folder: str | os.PathLike) -> int:
    """Free bytes on the file system holding ``folder``."""
    return shutil.disk_usage(folder).free


#: Bytes a store's temporary name adds to its name while it is created (see create_store).
_CREATION_NAME = len(f"..{2**22}-{uuid.uuid4().hex}{PARTIAL}")


def check_target(path: str | os.PathLike, need_bytes: int, compress: str | None = None) -> None:
    """Raise a clear error naming ``path`` when a store of ``need_bytes`` cannot be written there
    (or ``compress`` is not one of :data:`CODECS`)."""
    if compress not in CODECS:
        raise ValueError(f"compress must be one of {tuple(CODECS)}, got {compress!r}")
    if not os.fspath(path):
        raise ValueError("the store's path is empty; give the path of a new store, e.g. store=\"run.zarr\"")
    path = Path(path)
    if path.is_symlink():
        raise FileExistsError(f"the store {path} is a symbolic link (to {os.readlink(path)}); a store is "
                              "created at a new path, never through a link: choose a new path or remove the link")
    if path.exists():
        raise FileExistsError(f"the store {path} already exists; choose a new path or remove it first "
                              "(a store is never overwritten)")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot create the store {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create the store {path}: the folder {parent} is not writable")
    try:
        most = os.pathconf(parent, "PC_NAME_MAX") - _CREATION_NAME
    except (OSError, ValueError):
        most = 255 - _CREATION_NAME
    if len(os.fsencode(path.name)) > most:
        raise OSError(errno.ENAMETOOLONG,
                      f"the store's name {path.name!r} is too long: {len(os.fsencode(path.name))} bytes, where "
                      f"this folder takes names of at most {most} bytes for a store (it is built under a longer "
                      "temporary name first); choose a shorter name", str(path))
    free = free_bytes(parent)
    if need_bytes > free:
        compressed = (f" (counted uncompressed: how well {compress} will compress is not known before the "
                      "run)") if compress is not None else ""
        raise OSError(errno.ENOSPC,
                      f"the store {path} needs {checks.byte_size(need_bytes)}{compressed} but only "
                      f"{checks.byte_size(free)} are free there; save fewer levels (a larger every), use a "
                      "smaller grid, or write to another disk", str(path))
def put_file(path: Path, data: files.BytesLike | tuple[files.BytesLike, ...]) -> None:
    """Write the file ``path`` of a store whole or not at all (its folder made if need be):
    :func:`course_helper.files.write_atomically`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomically(path, data)


def overwrite(path: Path, data: files.BytesLike) -> None:
    """Write ``data`` over the first bytes of the existing file ``path``, in place: no new disk
    space is needed (the flags' space was reserved when the store was created)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        _pwrite_all(fd, data)
    finally:
        os.close(fd)


def _pwrite_all(fd, data):
    """Write all of ``data`` at the start of the open file ``fd`` (pwrite may write less at a time)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)


def durable_store(root: str | os.PathLike, read_only: bool = False) -> Any:
    """A Zarr LocalStore whose files are written by :func:`put_file` (whole or not at all,
    fsync'ed). It replaces only the store's public writes (``set``, ``set_sync``), so it rests
    on no private part of Zarr."""
    from zarr.storage import LocalStore

    class DurableStore(LocalStore):
        async def set(self, key: str, value: Any) -> None:
            await asyncio.to_thread(self.set_sync, key, value)

        def set_sync(self, key: str, value: Any) -> None:
            if self.read_only:
                raise ValueError(f"the store {self.root} was opened read-only: it cannot be written")
            put_file(self.root / key, value.as_buffer_like())

    return DurableStore(root, read_only=read_only)


def _problem_attrs(problem, every):
    return {"n0": problem.n0, "n1": problem.n1, "dx0_m": problem.dx0, "dx1_m": problem.dx1,
            "dt_s": problem.dt, "nt": problem.nt, "every": every, "cfl": problem.cfl,
            "vmax_m_per_s": problem.vmax, "fm_hz": problem.fm, "td_s": problem.td,
            "source": list(problem.source), "units": "u: pressure amplitude; time: s; x0, x1: m"}

# --------------------------------------------------------------------------
# The run's state: writing (its process holds the lock), finished, failed, or killed
# --------------------------------------------------------------------------
class RunState:
    """The file :data:`RUN_STATE` of a store being written: created first, locked (``flock``) by
    the writing process until the run ends, then overwritten in place with how it ended. The
    kernel drops the lock when the process dies, however it dies: a state still "writing" with
    no lock held means the run was killed."""

    SIZE = 512           # bytes reserved up front: the final state is written in place, even on a full disk

    def __init__(self, folder: Path) -> None:
        self.fd = os.open(folder / RUN_STATE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.write("writing")
            os.fsync(self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, text: str) -> None:
        """Write ``text`` over the state (in place, padded to :attr:`SIZE` bytes)."""
        _pwrite_all(self.fd, text.encode()[:self.SIZE].ljust(self.SIZE))

    def end(self, text: str) -> None:
        """Write the final state (OSError is kept: the state then stays "writing", which reads
        as interrupted, a truthful fallback) and release the lock."""
        try:
            self.write(text)
        except OSError:
            pass
        finally:
            os.close(self.fd)           # releases the lock


def read_state(folder: Path) -> tuple[str, str]:
    """``(state, reason)``: state is "writing" (a live process holds the lock), "finished",
    "failed" (reason: why), "interrupted" (killed: no lock, never ended), or "finished" for a
    store without a state file (written before stores had one)."""
    try:
        fd = os.open(folder / RUN_STATE, os.O_RDONLY)
    except FileNotFoundError:
        return "finished", ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreDamaged(f"the run's state {folder / RUN_STATE} of the store {folder} is not a file, so "
                               "how its run ended cannot be read; remove it, and the store opens as a finished one")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "writing", ""
        text = os.pread(fd, RunState.SIZE, 0).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if text.startswith("failed"):
        return "failed", text.partition(":")[2].strip()
    if text == "finished":
        return "finished", ""
    return "interrupted", ""


def remove_partials(folder: Path) -> None:
    """Remove the temporary files of chunk writes a killed run left in the store ``folder``."""
    for tmp in folder.rglob(f".*{PARTIAL}"):
        with contextlib.suppress(OSError):
            tmp.unlink() if tmp.is_file() else shutil.rmtree(tmp)


def remove_stale_creations(path: Path) -> None:
    """Remove the folders that runs killed while creating a store at ``path`` left beside it.
    A creation is built under a temporary name holding its process id; it is stale when that
    process has gone and its state file (if it got that far) is not locked."""
    for tmp in path.absolute().parent.glob(f".{path.name}.*{PARTIAL}"):
        pid = tmp.name[len(path.name) + 2:].partition("-")[0]
        if not (tmp.is_dir() and pid.isdigit()) or _alive(int(pid)):
            continue
        if not (tmp / RUN_STATE).is_file() or _state_or_none(tmp) == "interrupted":
            shutil.rmtree(tmp, ignore_errors=True)


def _state_or_none(folder):
    """:func:`read_state`'s state, or None where it cannot be read."""
    try:
        return read_state(folder)[0]
    except (StoreDamaged, OSError):
        return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                       # someone else's process
    return True


def flag_bytes(landed: np.ndarray, peak: np.ndarray) -> dict[str, bytes]:
    """The files of the ``complete`` and ``peak`` arrays (one uncompressed chunk each), as Zarr
    encodes them: one byte per bool, little-endian float32."""
    return {"complete": np.asarray(landed, "|b1").tobytes(), "peak": np.asarray(peak, "<f4").tobytes()}


# --------------------------------------------------------------------------
# Checksums: the run's own record of what it wrote (see the module's docstring)
# --------------------------------------------------------------------------
_HEADER = struct.Struct("<II")          # the JSON document's length and CRC32C
_RECORD = struct.Struct("<Q")           # one chunk's record
_SET = 2**32                            # a record's flag bit: its chunk's file was written


def chunk_record(k: int, tag: bytes) -> int:
    """The record of chunk ``k`` of ``u`` whose file has the tag ``tag`` (its own CRC32C, the 4
    bytes Zarr's ``crc32c`` codec appends, :func:`checksum`; for a shard,
    :func:`.shards.shard_tag`): the chunk's index folded in, so that the same bytes at another
    place have another record."""
    return _SET + int(google_crc32c.value(int(k).to_bytes(8, "little") + bytes(tag)))


def _run_files(folder):
    """``{file: CRC32C}`` of the files a run writes once, when it creates its store: every
    ``zarr.json`` (the consolidated metadata, the group's attributes, each array's metadata)
    and every chunk file of the coordinates. Paths are relative, with ``/``."""
    found = {}
    for f in sorted(folder.rglob("*")):
        rel = f.relative_to(folder).as_posix()
        if f.is_file() and not f.name.startswith(".") and (f.name == "zarr.json" or rel.split("/")[0] in COORDINATES):
            found[rel] = int(google_crc32c.value(f.read_bytes()))
    return found


class RunRecord:
    """What :data:`CHECKSUMS` says the run wrote: ``chunk_levels`` (levels per chunk of ``u``),
    ``nchunks``, ``files`` (``{file: CRC32C}``, see :func:`_run_files`) and ``records`` (one per
    chunk, 0 where the chunk's file was never written)."""

    def __init__(self, chunk_levels: int, nchunks: int, files: dict[str, int], records: np.ndarray) -> None:
        self.chunk_levels, self.nchunks, self.files, self.records = chunk_levels, nchunks, files, records


class Checksums:
    """The writing side of :data:`CHECKSUMS`: :meth:`create` writes the header and a zero
    record per chunk; :meth:`record` puts one chunk's record in place (in the space taken when
    the store was created, so a full disk cannot stop it); :meth:`close` flushes them."""

    def __init__(self, fd: int, table: int) -> None:
        self.fd, self.table = fd, table      # the open file, and where the records start

    @classmethod
    def create(cls, folder: Path, chunk_levels: int, nchunks: int) -> Checksums:
        """Write the header (the files the run has written so far, see :func:`_run_files`) and
        ``nchunks`` zero records into the new store ``folder``; the file stays open."""
        doc = json.dumps({"chunk_levels": chunk_levels, "nchunks": nchunks, "files": _run_files(folder)},
                         sort_keys=True).encode()
        head = CHECKSUMS_MAGIC + _HEADER.pack(len(doc), google_crc32c.value(doc)) + doc
        fd = os.open(folder / CHECKSUMS, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _pwrite_all(fd, head + bytes(_RECORD.size * nchunks))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, len(head))

    def record(self, k: int, tag: bytes) -> None:
        """Put chunk ``k``'s record in place (call it before the chunk's file appears); ``tag``:
        see :func:`chunk_record`."""
        os.pwrite(self.fd, _RECORD.pack(chunk_record(k, tag)), self.table + _RECORD.size * k)

    def close(self) -> None:
        """Flush the records to the disk and close the file (OSError is kept: a record that did
        not reach the disk makes its chunk read as damaged, never as right)."""
        if self.fd is None:
            return
        try:
            os.fsync(self.fd)
        except OSError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None


def read_record(folder: Path) -> RunRecord:
    """Read the store ``folder``'s :data:`CHECKSUMS`; StoreDamaged if it is missing or damaged."""
    file = folder / CHECKSUMS
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise StoreDamaged(f"the store {folder} has no checksums file {file}: it was not written by "
                           "solve(..., store=PATH), or the file was deleted, so nothing in it can be "
                           "checked; run the solve again") from None
    except OSError as exc:
        raise StoreDamaged(f"cannot read the checksums file {file} of the store {folder}: {exc}") from exc
    start = len(CHECKSUMS_MAGIC) + _HEADER.size
    bad = StoreDamaged(f"the checksums file {file} of the store {folder} is damaged, so nothing in the store "
                       "can be checked; run the solve again")
    if not data.startswith(CHECKSUMS_MAGIC) or len(data) < start:
        raise bad
    size, crc = _HEADER.unpack_from(data, len(CHECKSUMS_MAGIC))
    doc = data[start:start + size]
    if len(doc) != size or google_crc32c.value(doc) != crc:
        raise bad
    try:
        head = json.loads(doc)
        chunk_levels, nchunks, run_files = int(head["chunk_levels"]), int(head["nchunks"]), dict(head["files"])
    except (ValueError, KeyError, TypeError):
        raise bad from None
    table = data[start + size:]
    if len(table) != _RECORD.size * nchunks:
        raise bad
    return RunRecord(chunk_levels, nchunks, run_files, np.frombuffer(table, "<u8"))


def sharded_inner(array: Any) -> int | None:
    """Inner chunks per shard of the Zarr array ``array`` (None: it is not sharded)."""
    if array.shards is None:
        return None
    return int(np.prod([s // c for s, c in zip(array.shards, array.chunks)]))


def chunk_verified(file: Path, k: int, record: RunRecord, inner: int | None = None) -> bool:
    """Whether the chunk file ``file`` is what the run wrote as chunk ``k`` of ``u``: its tag
    (its own CRC32C, the last 4 bytes, which Zarr checks against its bytes when reading it; for
    a shard of ``inner`` inner chunks, its index and the CRC32C of each inner chunk,
    :func:`.shards.file_tag`) gives the record kept for chunk ``k``."""
    if not 0 <= k < record.nchunks or not record.records[k]:
        return False
    tag = file_tag(file, inner)
    return tag is not None and chunk_record(k, tag) == int(record.records[k])


def _disagrees(folder, what):
    return StoreDamaged(f"the store {folder} disagrees with itself: {what}. It was changed after its run wrote "
                        "it, and is not read; run the solve again to get the levels")


def check_layout(group: Any, folder: Path) -> RunRecord:
    """Hold the store ``folder`` (``group``, opened by Zarr) against itself, and return what
    its :data:`CHECKSUMS` says the run wrote: the array ``u``'s data type, byte order, shape
    and chunks against the attributes (n0, n1, nt, every) and that record; the ``level`` and
    ``time`` coordinates against the attributes; ``x0``, ``x1``, ``complete`` and ``peak``
    against the shape; then every metadata and coordinate file against its checksum. The first
    thing that disagrees raises :class:`StoreDamaged` naming it."""
    record = read_record(folder)
    attrs = dict(group.attrs)
    try:
        n0, n1, nt, every, dt = (attrs["n0"], attrs["n1"], attrs["nt"], attrs["every"], attrs["dt_s"])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n0, n1, nt, every)):
            raise ValueError
        levels = np.asarray(saved_levels(nt, every))
    except (KeyError, ValueError, TypeError):
        raise _disagrees(folder, "its attributes n0, n1, nt, every and dt_s are not those of a run "
                                 f"(n0={attrs.get('n0')!r}, n1={attrs.get('n1')!r}, nt={attrs.get('nt')!r}, "
                                 f"every={attrs.get('every')!r}, dt_s={attrs.get('dt_s')!r})") from None
    said = f"the attributes (nt={nt}, every={every}, n0={n0}, n1={n1})"
    u = group[DATA]
    meta = u.metadata.to_dict()
    codecs = meta.get("codecs", ())
    shard = next((c.get("configuration", {}) for c in codecs if c.get("name") == "sharding_indexed"), None)
    inner_codecs = shard.get("codecs", ()) if shard is not None else codecs      # a shard's inner chunks' codecs
    endian = [c.get("configuration", {}).get("endian") for c in inner_codecs if c.get("name") == "bytes"]
    if meta.get("data_type") != "float32" or endian != ["little"]:
        raise _disagrees(folder, f"the array '{DATA}' is stored as {meta.get('data_type')!r} with byte order "
                                 f"{'/'.join(map(str, endian)) or 'unknown'}, but a run writes little-endian float32")
    shape = (len(levels), n0, n1)
    if tuple(u.shape) != shape:
        raise _disagrees(folder, f"the array '{DATA}' has the shape {tuple(u.shape)}, but {said} give {shape}")
    chunks = (record.chunk_levels, n0, n1)
    files_of = tuple(u.shards or u.chunks)           # the levels of one chunk file (a shard, if sharded)
    if files_of != chunks or record.nchunks != -(-len(levels) // record.chunk_levels):
        raise _disagrees(folder, f"the array '{DATA}' has chunks {files_of}, but the run wrote chunks "
                                 f"of {chunks} ({record.nchunks} of them, in {folder / CHECKSUMS})")
    for name, want, source in (("level", levels, said), ("time", levels * dt, f"{said} and dt_s={dt}")):
        got = group[name][:]
        if got.shape != want.shape or not np.array_equal(got, want):
            raise _disagrees(folder, f"the coordinate '{name}' holds {_brief(got)}, but {source} give {_brief(want)}")
    for name, n in (("x0", n0), ("x1", n1), ("complete", len(levels)), ("peak", len(levels))):
        if tuple(group[name].shape) != (n,):
            raise _disagrees(folder, f"the array '{name}' has the shape {tuple(group[name].shape)}, but {said} "
                                     f"give ({n},)")
    now = _run_files(folder)
    for file, crc in record.files.items():
        if file not in now:
            raise _disagrees(folder, f"its file {folder / file} is missing")
        if now[file] != crc:
            raise _disagrees(folder, f"its file {folder / file} is not the one the run wrote (its checksum in "
                                     f"{folder / CHECKSUMS} differs)")
    return record


def _brief(values):
    """A short description of a coordinate's values for a message."""
    values = np.asarray(values)
    if values.size <= 4:
        return f"{values.tolist()}"
    return f"{values.size} values {values[0]:g}, {values[1]:g}, ..., {values[-1]:g}"


def create_store(path: str | os.PathLike, problem: WaveProblem, every: int, chunk: int,
                 compress: str | None = None) -> tuple[Any, RunState, Checksums]:
    """Create the (empty) store: ``u`` (time, x0, x1) full of NaN, its coordinates, the
    ``complete`` and ``peak`` arrays (one entry per level, their files written now so that
    their space is taken before the run), the problem as attributes.

    The store is built under a temporary name beside ``path`` and renamed to ``path`` when
    whole, so that a store at ``path`` always opens. Returns ``(group, state, checksums)``: the
    group opened at ``path``, the locked :class:`RunState` ("writing") of the run, and its open
    :class:`Checksums` (the header written, every chunk's record still zero)."""
    zarr = zarr_module()
    path = Path(path)
    levels = np.asarray(saved_levels(problem.nt, every))
    nsaved = len(levels)
    remove_stale_creations(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex}{PARTIAL}")
    tmp.mkdir()
    state = sums = None
    try:
        state = RunState(tmp)
        group = zarr.open_group(store=durable_store(tmp), mode="a", zarr_format=3)   # a fresh folder
        group.attrs.update(_problem_attrs(problem, every))
        # One file per chunk of levels: the chunk itself, or a shard of inner chunks of whole rows.
        files_of = (chunk, *problem.shape)
        layout = (dict(chunks=(1, inner_rows(*problem.shape), problem.n1), shards=files_of)
                  if compress in SHARDED else dict(chunks=files_of))
        group.create_array(DATA, shape=(nsaved, *problem.shape), **layout,
                           dtype="float32", fill_value=np.nan, dimension_names=("time", "x0", "x1"),
                           compressors=[*(CODECS[compress]() or []), zarr.codecs.Crc32cCodec()],
                           config={"write_empty_chunks": True},
                           chunk_key_encoding={"name": "default", "separator": "."},   # u/c.K.0.0: one folder
                           attributes={"long_name": "wavefield", "coordinates": "level"})
        for name, values in (("time", levels * problem.dt), ("level", levels),
                             ("x0", np.arange(problem.n0) * problem.dx0),
                             ("x1", np.arange(problem.n1) * problem.dx1)):
            dim = "time" if name in ("time", "level") else name
            a = group.create_array(name, shape=values.shape, dtype=values.dtype, dimension_names=(dim,),
                                   attributes={"units": {"time": "s", "level": "1"}.get(name, "m")})
            a[:] = values
        # The flags are one chunk each (one small file, rewritten in place by the flags thread).
        group.create_array("complete", shape=(nsaved,), chunks=(nsaved,), dtype="bool", fill_value=False,
                           dimension_names=("time",), compressors=None)
        group.create_array("peak", shape=(nsaved,), chunks=(nsaved,), dtype="float32", fill_value=np.nan,
                           dimension_names=("time",), compressors=None,
                           attributes={"long_name": "largest |u| of the level (for colour scales)"})
        for name, data in flag_bytes(np.zeros(nsaved, bool), np.full(nsaved, np.nan)).items():
            put_file(tmp / name / group[name].metadata.encode_chunk_key((0,)), data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # "consolidated metadata is not in the v3 spec"
            zarr.consolidate_metadata(group.store)     # one read opens the whole store (xarray)
        sums = Checksums.create(tmp, chunk, -(-nsaved // chunk))      # last: it checksums what is written
        try:
            os.rename(tmp, path)                       # atomic: the store appears whole
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise FileExistsError(f"the store {path} was created by someone else while this run created "
                                  "it; choose a new path (a store is never overwritten)") from None
        tmp = path
        return zarr.open_group(store=durable_store(path), mode="r+"), state, sums
    except BaseException as exc:
        if sums is not None:
            sums.close()
        if state is not None:
            state.end(f"failed: {in_one_line(exc)}")
        shutil.rmtree(tmp, ignore_errors=True)         # (the store, if it was renamed already)
        if isinstance(exc, OSError) and exc.errno is not None:
            # A file system's error, met on the temporary folder: said of the store asked for.
            raise files.cannot_write(path, exc, "create the store") from exc
        raise
