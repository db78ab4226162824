"""The store's layout on disk: a Zarr v3 group, its files, the run's state, checksums, damage.

A store written by ``solve(..., store=PATH)`` is a folder holding the Zarr v3 group:

* ``u`` (time, x0, x1), float32, one chunk file per chunk of levels (``u/c.K.0.0``), each
  ending with the CRC32C that Zarr's ``crc32c`` codec appends (after a zstd or blosc frame
  when compressed); a chunk never written reads as NaN, the fill value;
* ``complete`` (bool) and ``peak`` (float32, the largest |u| of each level), one small file
  each, written whole when the store is created and rewritten in place afterwards (no new
  disk space needed, so a full disk cannot stop them);
* the coordinates ``time``, ``level``, ``x0``, ``x1``, the problem's parameters as
  attributes, and consolidated metadata (one read opens the store);
* ``.run-state``: how the run that wrote it ended (see :class:`RunState`).

Every file appears whole or not at all (:func:`course_helper.files.write_atomically`). A store
is built under a temporary name beside its path and renamed when whole, so a store at the path
always opens. This module creates stores, reads and writes their state and flag files, and
names the errors a store raises; :mod:`.sink` writes the levels, :mod:`.reading` reads them back.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from .. import files
from ..wave import WaveProblem, saved_levels

__all__ = ["DATA", "RUN_STATE", "PARTIAL", "THREAD_NAMES", "CODECS", "NUMCODECS", "StoreDamaged", "StoreWriteError",
           "zarr_module", "free_bytes", "check_target", "put_file", "overwrite", "checksum", "durable_store",
           "RunState", "read_state", "remove_partials", "remove_stale_creations", "flag_bytes", "create_store",
           "in_one_line"]

DATA = "u"                      # the wavefield array inside the store
RUN_STATE = ".run-state"        # the run's state inside the store (see RunState)
PARTIAL = files.PARTIAL         # the ending of files and folders not yet under their name
#: the names of the threads the disk package starts (each followed by a number, or alone)
THREAD_NAMES = ("disk writer", "disk peaks", "disk flags", "disk bandwidth")
#: compression choices: name -> a function making the Zarr codec list (None: raw bytes)
CODECS: dict[str | None, Callable[[], list | None]] = {
    None: lambda: None,
    "zstd": lambda: [zarr_module().codecs.ZstdCodec(level=1)],
    "blosc": lambda: [zarr_module().codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")],
}
#: the same codecs as numcodecs objects, which encode one chunk's bytes exactly as Zarr's codecs do
NUMCODECS: dict[str, Callable[[], Any]] = {
    "zstd": lambda: _numcodecs().Zstd(level=1),
    "blosc": lambda: _numcodecs().Blosc(cname="lz4", clevel=5, shuffle=_numcodecs().Blosc.SHUFFLE),
}


def zarr_module() -> Any:
    """The ``zarr`` module, imported on first use (importing the course does not import Zarr)."""
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


def check_target(path: str | os.PathLike, need_bytes: int, compress: str | None = None) -> None:
    """Raise a clear error naming ``path`` when a store of ``need_bytes`` cannot be written there
    (or ``compress`` is not one of :data:`CODECS`)."""
    if compress not in CODECS:
        raise ValueError(f"compress must be one of {tuple(CODECS)}, got {compress!r}")
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"the store {path} already exists; choose a new path or remove it first "
                              "(a store is never overwritten)")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot create the store {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create the store {path}: the folder {parent} is not writable")
    free = free_bytes(parent)
    if need_bytes > free:
        compressed = (f" (counted uncompressed: how well {compress} will compress is not known before the "
                      "run)") if compress is not None else ""
        raise OSError(errno.ENOSPC,
                      f"the store {path} needs {need_bytes / 2**20:,.0f} MiB{compressed} but only "
                      f"{free / 2**20:,.0f} MiB are free there; save fewer levels (a larger every), use a "
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


def checksum(payload: files.BytesLike) -> bytes:
    """The 4 bytes Zarr's ``crc32c`` codec appends to a chunk: the CRC32C of ``payload``
    (computed by google-crc32c, the library that codec uses), little-endian."""
    view = np.frombuffer(payload, np.uint8)
    view.flags.writeable = False           # google-crc32c takes read-only buffers (no copy made)
    return int(google_crc32c.value(view)).to_bytes(4, "little")


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
        if not (tmp / RUN_STATE).is_file() or read_state(tmp)[0] == "interrupted":
            shutil.rmtree(tmp, ignore_errors=True)


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


def create_store(path: str | os.PathLike, problem: WaveProblem, every: int, chunk: int,
                 compress: str | None = None) -> tuple[Any, RunState]:
    """Create the (empty) store: ``u`` (time, x0, x1) full of NaN, its coordinates, the
    ``complete`` and ``peak`` arrays (one entry per level, their files written now so that
    their space is taken before the run), the problem as attributes.

    The store is built under a temporary name beside ``path`` and renamed to ``path`` when
    whole, so that a store at ``path`` always opens. Returns ``(group, state)``: the group
    opened at ``path`` and the locked :class:`RunState` ("writing") of the run."""
    zarr = zarr_module()
    path = Path(path)
    levels = np.asarray(saved_levels(problem.nt, every))
    nsaved = len(levels)
    remove_stale_creations(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex}{PARTIAL}")
    tmp.mkdir()
    state = None
    try:
        state = RunState(tmp)
        group = zarr.open_group(store=durable_store(tmp), mode="a", zarr_format=3)   # a fresh folder
        group.attrs.update(_problem_attrs(problem, every))
        group.create_array(DATA, shape=(nsaved, *problem.shape), chunks=(chunk, *problem.shape),
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
        try:
            os.rename(tmp, path)                       # atomic: the store appears whole
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise FileExistsError(f"the store {path} was created by someone else while this run created "
                                  "it; choose a new path (a store is never overwritten)") from None
        tmp = path
        return zarr.open_group(store=durable_store(path), mode="r+"), state
    except BaseException as exc:
        if state is not None:
            state.end(f"failed: {in_one_line(exc)}")
        shutil.rmtree(tmp, ignore_errors=True)         # (the store, if it was renamed already)
        raise
