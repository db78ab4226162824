"""Streaming the saved levels to disk while the solver runs: a Zarr v3 store.

When the output does not fit in host memory, ``solve(problem, store=PATH)``
sends every saved level through a three-stage pipeline::

    device --(D2H copy on an IO stream)--> ring of pinned host slots --(writer threads)--> files

* The strategy's loop is unchanged: it copies level ``k`` into
  ``run.images[k]`` as always. With a store, ``run.images`` is a
  :class:`Ring`: indexing it hands out a free pinned slot (the host waits
  there only when every slot is still waiting for the disk), and when the copy
  into that slot has been queued, an event is recorded after it and the slot
  is passed to a writer thread.
* A writer thread waits for that event, encodes the slot as one chunk (one
  level, or one staging batch) of the Zarr array ``u`` with the array's codecs
  and writes the chunk's file. Meanwhile a peaks thread reads each level's
  largest amplitude from the same slot (for the viewer's colour scale); the
  slot is free again when both are done. A flags thread then marks those
  levels in the boolean array ``complete`` (and their ``peak``), a few times a
  second: the writers' per-chunk work is the chunk's file alone. (Taking the
  peaks on the writer's own path cost 0.6 ms per 4 MiB chunk on the H200
  machine, during which that writer left the disk idle: about 6% of its time.)
* Host memory is the ring, whatever ``nt`` is: ``nslots`` slots of one chunk.

Ring size. In steady state the pipeline runs at its slowest stage: a slot is
held by a writer for one chunk's write time and by a copy for one copy time.
``writers + 2`` slots (one being filled, one ready, one per writer) keep
every stage busy; more slots only absorb bursts. When the disk is slower than
the compute produces levels (bytes per level / disk bandwidth > compute time
per level), no ring is large enough: it fills after ``nslots`` levels and
from then on the compute waits for the disk, which is the bound
``B = max(compute, bytes / D2H bandwidth, bytes / disk bandwidth)``.

Nothing half-written. Each chunk file is written under a temporary name,
flushed to the disk (``fsync``) and then renamed; a rename is atomic, so a
killed run leaves each chunk either complete or absent (read as NaN, the fill
value). (Zarr's own LocalStore also writes through a temporary name, but does
not fsync, so the disk time would hide in the page cache.) The writers put
the chunk files themselves, with the bytes Zarr's codecs make (the Zarr v3
encoding: raw little-endian bytes, or a zstd or blosc frame through numcodecs,
the library Zarr's codecs wrap, then the 4-byte CRC32C that Zarr's ``crc32c``
codec appends): going through the Zarr array for every chunk cost about 3 ms
of Python per chunk on the H200 machine, a third of a 4 MiB chunk's write.

What the store guarantees
-------------------------
* **complete** (the boolean array ``complete``, one entry per saved level):
  a level is flagged only after its chunk file is on the disk (fsync'ed,
  renamed) and its peak taken, and only if every operation that produced it
  succeeded: the copy into the slot, and the work it waited for. After a fault
  or a Ctrl-C, the device skips the work queued after the failure and the
  copies that wait for it (the CPU backend's model follows CUDA's sticky
  errors); a chunk whose copy failed or was skipped is neither written nor
  flagged. Chunks whose copies had landed are still written and flagged.
* **A full disk cannot stop the flags.** The ``complete`` and ``peak`` files
  are written whole (and fsync'ed) when the store is created, and then
  rewritten in place, which takes no new disk space. The flags only ever go
  from False to True, so even an interrupted rewrite leaves a valid, safe
  state. The error of a failed run says how many levels are flagged.
* **Checksums.** Every chunk of ``u`` ends with its CRC32C (Zarr's ``crc32c``
  codec, declared in the array's metadata), so a damaged chunk (a flipped
  bit, a truncated or overwritten file) is reported with its file and levels
  (:class:`StoreDamaged`), by :func:`open_store`'s images, the slice viewer
  and any Zarr reader (xarray included), instead of being read as data. Bad
  metadata gives a StoreDamaged error naming the file.
* **Interrupted stores.** A store is built under a temporary name and renamed
  when whole, so a store at the path always opens. Its run's state is kept in
  the file ``.run-state``, locked (``flock``) by the writing process until the
  run ends: :attr:`StoredRun.state` is "writing" (a live process holds it),
  "finished", "failed" (the reason kept), or "interrupted" (killed: the lock
  died with its process). Opening a killed store removes the temporary files
  of the chunks that were being written, and reports as complete every level
  whose chunk file is there (a chunk file only appears whole, after its data
  were produced without error), so nothing intact is lost to the flags
  thread's lag; a level whose chunk file was deleted is never reported
  complete (:attr:`StoredRun.missing`). A run that fails before saving any
  level removes its store, so that it does not block a run to the same path.

Timing. On a GPU, writer ``i`` times each chunk's write on the host clock
(lane "disk i" of the timeline). On the CPU backend the disk is a stage of
the modelled machine (:meth:`course_helper.runtime.model.ModelRuntime.disk_write`):
a chunk's modelled write starts when the copy into its slot has completed
and takes latency + bytes / bandwidth from the profile's ``disk`` section,
the writers sharing the disk's bandwidth; the host waits for a slot until
its modelled write has ended. The files are still written by the writer
threads, but nothing they do moves the model's clocks, so a streamed run's
modelled time and timeline are the same on every run.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import math
import os
import queue
import shutil
import signal
import threading
import time
import uuid
import warnings
from pathlib import Path

import google_crc32c
import numpy as np

from .. import checks, runtime, streams
from ..runtime import observe
from ..timelines import recording
from ..memory import pinned_empty
from ..wave import saved_levels

__all__ = ["Ring", "DiskSink", "open_store", "StoredRun", "StoredImages", "StoreDamaged", "StoreWriteError",
           "check_target", "free_bytes", "measure_disk_bandwidth", "codec_speed", "CODECS", "DEFAULT_WRITERS",
           "ring_slots", "FLAGS_EVERY_S"]

DATA = "u"                      # the wavefield array inside the store
DEFAULT_WRITERS = 4             # enough chunks in flight that one writer's own work leaves the disk busy
FLAGS_EVERY_S = 0.1             # the flags thread writes ``complete`` and ``peak`` at most this often
RUN_STATE = ".run-state"        # the run's state inside the store (see _RunState)
PARTIAL = ".partial"            # the ending of files and folders not yet under their name
#: the names of the threads this module starts (each followed by a number, or alone)
THREAD_NAMES = ("disk writer", "disk peaks", "disk flags", "disk bandwidth")
#: compression choices: name -> a function making the Zarr codec list (None: raw bytes)
CODECS = {
    None: lambda: None,
    "zstd": lambda: [_zarr().codecs.ZstdCodec(level=1)],
    "blosc": lambda: [_zarr().codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")],
}
#: the same codecs as numcodecs objects, which encode one chunk's bytes exactly as Zarr's codecs do
_NUMCODECS = {
    "zstd": lambda: _numcodecs().Zstd(level=1),
    "blosc": lambda: _numcodecs().Blosc(cname="lz4", clevel=5, shuffle=_numcodecs().Blosc.SHUFFLE),
}


def _zarr():
    import zarr
    return zarr


def _numcodecs():
    import numcodecs
    return numcodecs


def ring_slots(writers=DEFAULT_WRITERS):
    """Slots in the ring: one per writer, one being filled by a copy, one ready."""
    return writers + 2


# --------------------------------------------------------------------------
# Checks before anything is allocated
# --------------------------------------------------------------------------
def free_bytes(folder):
    """Free bytes on the file system holding ``folder``."""
    return shutil.disk_usage(folder).free


def check_target(path, need_bytes, compress=None):
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


# --------------------------------------------------------------------------
# Files that reach the disk before they get their name
# --------------------------------------------------------------------------
def _put_durable(path, data, fsync=True):
    """Write ``data`` (a buffer, or a tuple of buffers written one after the other) to ``path``
    through a temporary name: write, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{PARTIAL}")
    try:
        with open(tmp, "wb") as f:
            for part in data if isinstance(data, tuple) else (data,):
                f.write(part)
            if fsync:
                f.flush()
                os.fsync(f.fileno())   # the bytes are on the disk before the name says so
        os.replace(tmp, path)           # atomic: readers see the old state or the whole chunk
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _overwrite(path, data):
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


def _checksum(payload):
    """The 4 bytes Zarr's ``crc32c`` codec appends to a chunk: the CRC32C of ``payload``
    (computed by google-crc32c, the library that codec uses), little-endian."""
    view = np.frombuffer(payload, np.uint8)
    view.flags.writeable = False           # google-crc32c takes read-only buffers (no copy made)
    return int(google_crc32c.value(view)).to_bytes(4, "little")


def _durable_store(root, read_only=False):
    """A Zarr LocalStore whose files appear whole (temporary name, then rename), fsync'ed
    (they are written once, when the store is created). It replaces only the store's public
    writes (``set``, ``set_sync``), so it rests on no private part of Zarr."""
    from zarr.storage import LocalStore

    class DurableStore(LocalStore):
        async def set(self, key, value):
            await asyncio.to_thread(self.set_sync, key, value)

        def set_sync(self, key, value):
            if self.read_only:
                raise ValueError(f"the store {self.root} was opened read-only: it cannot be written")
            _put_durable(self.root / key, value.as_buffer_like())

    return DurableStore(root, read_only=read_only)


def _problem_attrs(problem, every):
    return {"n0": problem.n0, "n1": problem.n1, "dx0_m": problem.dx0, "dx1_m": problem.dx1,
            "dt_s": problem.dt, "nt": problem.nt, "every": every, "cfl": problem.cfl,
            "vmax_m_per_s": problem.vmax, "fm_hz": problem.fm, "td_s": problem.td,
            "source": list(problem.source), "units": "u: pressure amplitude; time: s; x0, x1: m"}


# --------------------------------------------------------------------------
# The run's state: writing (its process holds the lock), finished, failed, or killed
# --------------------------------------------------------------------------
class _RunState:
    """The file :data:`RUN_STATE` of a store being written: created first, locked (``flock``) by
    the writing process until the run ends, then overwritten in place with how it ended. The
    kernel drops the lock when the process dies, however it dies: a state still "writing" with
    no lock held means the run was killed."""

    SIZE = 512           # bytes reserved up front: the final state is written in place, even on a full disk

    def __init__(self, folder):
        self.fd = os.open(folder / RUN_STATE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.write("writing")
            os.fsync(self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, text):
        _pwrite_all(self.fd, text.encode()[:self.SIZE].ljust(self.SIZE))

    def end(self, text):
        """Write the final state (OSError is kept: the state then stays "writing", which reads
        as interrupted, a truthful fallback) and release the lock."""
        try:
            self.write(text)
        except OSError:
            pass
        finally:
            os.close(self.fd)           # releases the lock


def _read_state(folder):
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
        text = os.pread(fd, _RunState.SIZE, 0).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if text.startswith("failed"):
        return "failed", text.partition(":")[2].strip()
    if text == "finished":
        return "finished", ""
    return "interrupted", ""


def _remove_partials(folder):
    """Remove the temporary files of chunk writes a killed run left in the store ``folder``."""
    for tmp in folder.rglob(f".*{PARTIAL}"):
        with contextlib.suppress(OSError):
            tmp.unlink() if tmp.is_file() else shutil.rmtree(tmp)


def _remove_stale_creations(path):
    """Remove the folders that runs killed while creating a store at ``path`` left beside it.
    A creation is built under a temporary name holding its process id; it is stale when that
    process has gone and its state file (if it got that far) is not locked."""
    for tmp in path.absolute().parent.glob(f".{path.name}.*{PARTIAL}"):
        pid = tmp.name[len(path.name) + 2:].partition("-")[0]
        if not (tmp.is_dir() and pid.isdigit()) or _alive(int(pid)):
            continue
        if not (tmp / RUN_STATE).is_file() or _read_state(tmp)[0] == "interrupted":
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                       # someone else's process
    return True


def _flag_bytes(landed, peak):
    """The files of the ``complete`` and ``peak`` arrays (one uncompressed chunk each), as Zarr
    encodes them: one byte per bool, little-endian float32."""
    return {"complete": np.asarray(landed, "|b1").tobytes(), "peak": np.asarray(peak, "<f4").tobytes()}


def create_store(path, problem, every, chunk, compress=None):
    """Create the (empty) store: ``u`` (time, x0, x1) full of NaN, its coordinates, the
    ``complete`` and ``peak`` arrays (one entry per level, their files written now so that
    their space is taken before the run), the problem as attributes.

    The store is built under a temporary name beside ``path`` and renamed to ``path`` when
    whole, so that a store at ``path`` always opens. Returns ``(group, state)``: the group
    opened at ``path`` and the locked :class:`_RunState` ("writing") of the run."""
    zarr = _zarr()
    path = Path(path)
    levels = np.asarray(saved_levels(problem.nt, every))
    nsaved = len(levels)
    _remove_stale_creations(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex}{PARTIAL}")
    tmp.mkdir()
    state = None
    try:
        state = _RunState(tmp)
        group = zarr.open_group(store=_durable_store(tmp), mode="a", zarr_format=3)   # a fresh folder
        group.attrs.update(_problem_attrs(problem, every))
        group.create_array(DATA, shape=(nsaved, *problem.shape), chunks=(chunk, *problem.shape),
                           dtype="float32", fill_value=np.nan, dimension_names=("time", "x0", "x1"),
                           compressors=[*(CODECS[compress]() or []), _zarr().codecs.Crc32cCodec()],
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
        for name, data in _flag_bytes(np.zeros(nsaved, bool), np.full(nsaved, np.nan)).items():
            _put_durable(tmp / name / group[name].metadata.encode_chunk_key((0,)), data)
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
        return zarr.open_group(store=_durable_store(path), mode="r+"), state
    except BaseException as exc:
        if state is not None:
            state.end(f"failed: {_why(exc)}")
        shutil.rmtree(tmp, ignore_errors=True)         # (the store, if it was renamed already)
        raise


# --------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------
def _encoder(compress):
    """The function turning one chunk (a C-ordered float32 block) into the bytes of its file,
    as the store's codecs encode it: raw little-endian bytes, or a zstd or blosc frame."""
    if compress is None:
        return lambda block: memoryview(block).cast("B")       # no copy: the slot itself is written
    codec = _NUMCODECS[compress]()
    return codec.encode


def _peaks(block):
    """The largest |u| of each level of ``block`` (for the viewer's colour scale; no temporary copy)."""
    return np.maximum(block.max(axis=(1, 2)), -block.min(axis=(1, 2)))


class Ring:
    """What a loop sees as ``run.images`` when the run streams to disk.

    ``ring[k]`` (or ``ring[first:stop]`` for a staging batch within one chunk)
    is a view of a free slot; the host waits only while no slot is free.

    Which slot: on a GPU, whichever is free first. The writers' fsyncs finish
    out of order, and waiting for one particular slot (the oldest) while
    others were free left about a quarter of a writer idle during the host's
    waits on the H200 machine. In modelled time, equal chunks finish their
    writes in turn, so the chunks take the slots in turn and the timeline is
    the same on every run.
    """

    def __init__(self, sink, nsaved, chunk, shape, nslots, pinned):
        self.sink = sink
        self.chunk = chunk
        self.shape = (nsaved, *shape)
        make = pinned_empty if pinned else (lambda s: np.empty(s, np.float32))
        self.slots = [make((chunk, *shape)) for _ in range(nslots)]
        self.free = [threading.Event() for _ in range(nslots)]
        for f in self.free:
            f.set()
        self.freed = threading.Condition()   # notified whenever a slot becomes free
        self.first = [None] * nslots       # first level index held by each slot
        self.modelled = [None] * nslots    # CPU backend: the modelled disk write of each slot's chunk

    @property
    def nbytes(self):
        return sum(s.nbytes for s in self.slots)

    def __len__(self):
        return self.shape[0]

    def _span(self, key):
        if isinstance(key, slice):
            first, stop, step = key.indices(self.shape[0])
            if step != 1 or stop <= first:
                raise IndexError(f"a streamed output takes one level or a contiguous batch, not {key}")
        else:
            first = int(key)
            if first < 0:
                first += self.shape[0]
            stop = first + 1
        if not (0 <= first < self.shape[0]) or first // self.chunk != (stop - 1) // self.chunk:
            raise IndexError(f"levels {first}..{stop - 1} are not inside one chunk of {self.chunk} levels")
        return first, stop

    def __getitem__(self, key):
        first, stop = self._span(key)
        s = self.sink.take_slot(first // self.chunk)      # the host waits here if the ring is full
        self.free[s].clear()                              # taken until a writer has written it
        self.first[s] = first
        j = first % self.chunk
        return self.slots[s][j] if not isinstance(key, slice) else self.slots[s][j:j + stop - first]

    def let_go(self):
        """The run is over: drop the slots (pinned memory), whoever still holds the ring."""
        self.slots = []
        self.modelled = [None] * len(self.modelled)

    def release(self, s):
        """Slot ``s`` is free again (its chunk is on the disk)."""
        with self.freed:
            self.free[s].set()
            self.freed.notify_all()

    def a_free_slot(self, timeout=None):
        """The index of a free slot, or None if none became free within ``timeout`` seconds."""
        with self.freed:
            self.freed.wait_for(lambda: any(f.is_set() for f in self.free), timeout)
            return next((s for s, f in enumerate(self.free) if f.is_set()), None)

    def slot_of(self, array):
        """Index of the slot ``array`` lies in (None if it is not a slot view)."""
        if not isinstance(array, np.ndarray):
            return None
        p = array.ctypes.data
        for s, slot in enumerate(self.slots):
            lo = slot.ctypes.data
            if lo <= p < lo + slot.nbytes:
                return s
        return None


class DiskSink:
    """The writer side: receives filled slots and writes them as Zarr chunks.

    It observes the solving thread's queued operations (:mod:`observe`): when
    a copy into a slot has been queued, it records an event after it and
    hands the slot to a writer thread (on the CPU backend, it also queues the
    chunk's write on the modelled disk).
    """

    def __init__(self, path, problem, every, chunk, *, compress=None, writers=None, pinned=True):
        writers = checks.positive_int("writers", DEFAULT_WRITERS if writers is None else writers)
        self.path = Path(path)
        self.nsaved = len(saved_levels(problem.nt, every))
        check_target(self.path, self.nsaved * problem.nbytes_level, compress)
        self.every = every
        self.writers = writers
        self._encode = _encoder(compress)
        rt = runtime.get()
        self._model = rt if rt.modelled else None     # the CPU backend: the disk is modelled
        self._error = None             # the first error of a writer, the peaks or the flags thread
        self._ended = False            # finish() has run
        self._recorder = None          # the solving thread's recorder (the disk lanes go into it)
        self._intervals = []           # (first level index, lane, nbytes, times) of each chunk written
        self._queue = queue.SimpleQueue()
        self._peaks_queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._landed = np.zeros(self.nsaved, bool)                 # what the flags thread writes
        self._peak = np.full(self.nsaved, np.nan, np.float32)
        self._dirty, self._stop = threading.Event(), threading.Event()
        self._threads = [threading.Thread(target=self.writer, args=(f"disk {i}",), name=f"disk writer {i}",
                                          daemon=True) for i in range(writers)]
        self._peaker = threading.Thread(target=self.peaker, name="disk peaks", daemon=True)
        self._flagger = threading.Thread(target=self.flagger, name="disk flags", daemon=True)
        self.group, self._state = create_store(self.path, problem, every, chunk, compress)
        try:
            self.data, self.complete, self.peak = self.group[DATA], self.group["complete"], self.group["peak"]
            self.ring = Ring(self, self.nsaved, chunk, problem.shape, ring_slots(writers), pinned)
            self._readers = [0] * len(self.ring.slots)     # threads still reading each slot (writer, peaks)
            self._written = [False] * len(self.ring.slots)  # whether each slot's chunk reached its file
            self._peaked = [False] * len(self.ring.slots)   # and whether its peaks were taken
            for t in (*self._threads, self._peaker, self._flagger):
                t.start()
        except BaseException as exc:
            # (a MemoryError for the ring, a Ctrl-C): the threads started stop, the store goes
            self._stop_threads(cancel=False)
            self._state.end(f"failed: {_why(exc)}")
            shutil.rmtree(self.path, ignore_errors=True)      # it holds nothing: it must not block a re-run
            raise

    # -- the solving thread ------------------------------------------------
    def op_issued(self, op):
        """Observer hook: a copy into a slot is on its stream; pass the slot on after it."""
        if op.kind != "D2H":
            return
        s = self.ring.slot_of(op.writes[0]) if op.writes else None
        if s is None:
            return
        done = streams.create_events(1)[0]
        done.record(op.stream)
        first, n = self.ring.first[s], len(op.writes[0]) if op.writes[0].ndim == 3 else 1
        modelled = None
        if self._model is not None:
            # The write's place on the modelled disk: after the copy, on writer lane k mod writers.
            # The chunk is encoded when that write begins (the copy has landed by then), so the
            # modelled disk writes the bytes the file will hold.
            modelled = self._model.disk_write(f"disk {(first // self.ring.chunk) % self.writers}", done.raw,
                                              lambda: self._encoded(s, n))
            self.ring.modelled[s] = modelled
        self._queue.put((first, n, s, done, modelled))

    def take_slot(self, chunk):
        """A free slot for chunk number ``chunk``; the host waits while the ring is full."""
        ring = self.ring
        if self._model is None:
            s = ring.a_free_slot(timeout=0)
            if s is None:
                # Every slot's chunk is still on its way to the disk: the host waits here, and the
                # device runs on through the work already queued. Nothing is dropped.
                with streams.host_wait("wait for disk (ring full)"):
                    while (s := ring.a_free_slot(timeout=0.05)) is None:
                        self.raise_error()           # a writer failed: stop instead of waiting forever
            self.raise_error()
            return s
        s = chunk % len(ring.slots)           # modelled: equal writes end in turn, so the oldest slot
        modelled = ring.modelled[s]           # is the first free one
        if modelled is not None and not modelled.done:
            # Modelled time: the host clock moves to the end of the slot's modelled write.
            with streams.host_wait("wait for disk (ring full)"):
                self._model.disk_wait(modelled)
        while not ring.free[s].wait(0.05):    # the real file, in real time only: the model's
            self.raise_error()                # clocks do not move
        self.raise_error()
        return s

    def raise_error(self):
        if self._error is not None:
            raise self._error

    @contextlib.contextmanager
    def watching(self):
        """Observe the operations queued by the calling thread inside the block (and hand the
        writer threads that thread's timeline recorder, if it records one)."""
        self._recorder = recording.current()
        observe.add(self)
        try:
            yield self
        finally:
            observe.remove(self)

    def finish(self, error=None):
        """End the run's pipeline, whatever happened; runs once (later calls do nothing).

        Waits until every handed-over chunk is on the disk (on the CPU backend: the host clock
        moves to the end of the last modelled write), stops the threads, writes the flags and
        the run's state, and puts the disk lanes on the timeline. Then raises a writer's error,
        its message saying what is flagged complete.

        ``error``: the exception that stopped the run (it is not raised here). The chunks whose
        copies landed are still written whole; chunks made by failed or skipped work are not
        (their copies failed). The exception gets a note saying what the store keeps, and a
        store that keeps nothing is removed, so that it does not block a run to the same path.
        """
        if self._ended:
            return
        self._ended = True
        with _ctrl_c_held():             # a Ctrl-C now is raised once everything has stopped
            stopped = None               # an error (a second Ctrl-C) while waiting for the modelled writes
            try:
                if self._model is not None:    # first: the writer threads wait for the modelled writes to begin
                    for write in (w for w in self.ring.modelled if w is not None):
                        self._model.disk_wait(write)
            except BaseException as exc:  # noqa: BLE001 - raised below, once everything is stopped
                stopped = exc
            self._stop_threads(cancel=error is not None or stopped is not None)
            flagged = self._write_flags()
            self.ring.let_go()
            self._add_lanes()
            failure = next((e for e in (error, stopped, self._error) if e is not None), None)
            if failure is None:
                self._state.end("finished")
                return
            self._state.end(f"failed: {_why(failure)}")
            what = self._what_is_kept(flagged)
            if isinstance(failure, StoreWriteError):
                failure.strerror = f"{failure.strerror}; {what}"       # the truth, now that the flags are written
            else:
                failure.add_note(what)
            if failure is not error:
                raise failure

    def _stop_threads(self, cancel):
        """Let the writer, peaks and flags threads end. ``cancel``: the run stopped early, and
        the model may never begin some writes (their copies never ran, or the host stopped
        waiting): they are cancelled, so that no writer thread waits for them for ever."""
        if cancel:
            for write in (w for w in self.ring.modelled if w is not None):
                write.cancel(RuntimeError("the run stopped before this chunk's copy ran"))
        started = lambda threads: [t for t in threads if t.ident is not None]   # noqa: E731
        for _ in self._threads:
            self._queue.put(None)
        for t in started(self._threads):
            t.join()
        self._peaks_queue.put(None)            # after the writers, which hand their slots to it
        for t in started([self._peaker]):
            t.join()
        self._stop.set()
        self._dirty.set()
        for t in started([self._flagger]):
            t.join()

    def _what_is_kept(self, flagged):
        """A sentence saying what the store keeps after a failed run (removing it if nothing)."""
        if flagged is not True:
            return (f"the flags of the store {self.path} could not be written ({flagged}); open_store() "
                    "finds its complete levels from their chunk files")
        n = int(self._landed.sum())
        if n == 0 and not any((self.path / DATA).glob("c.*")):
            shutil.rmtree(self.path, ignore_errors=True)
            return f"no level was saved; the store {self.path} was removed"
        return (f"{n} of {self.nsaved} levels are complete and flagged in 'complete' of the store {self.path} "
                "(open_store reads them); remove it, or choose another path, to run again")

    def _add_lanes(self):
        rec = self._recorder
        if rec is None:
            return
        for first, lane, nbytes, times in sorted(self._intervals, key=lambda i: i[0]):
            t0, t1 = times() if callable(times) else times
            rec.add_interval(lane, "disk write", f"write level {first * self.every}", t0, t1, nbytes,
                             first * self.every)

    # -- the writer threads --------------------------------------------------
    def writer(self, lane):
        while True:
            item = self._queue.get()
            if item is None:
                return
            first, n, s, done, modelled = item
            with self._lock:
                self._readers[s], self._written[s], self._peaked[s] = 1, False, False
            try:
                if modelled is None:
                    done.synchronize()            # the copy into the slot has landed
                    payload = self._encoded(s, n)
                else:
                    payload = modelled.result()   # encoded when its modelled write began
                with self._lock:
                    self._readers[s] += 1
                self._peaks_queue.put((first, n, s))   # read while this thread writes the file
                if self._error is None:
                    t0 = runtime.host_ms() if modelled is None else None
                    self._write_chunk(first, payload)
                    times = (t0, runtime.host_ms()) if modelled is None else modelled.interval
                    with self._lock:
                        self._intervals.append((first, lane if modelled is None else modelled.lane,
                                                n * self.ring.slots[s][0].nbytes, times))
                        self._written[s] = True
            except BaseException as exc:  # noqa: BLE001 - handed to the solving thread
                with self._lock:
                    if self._error is None:
                        self._error = _disk_error(exc, self.path, first, self.every)
            finally:
                self._release(s, first, n)

    def peaker(self):
        """Take each handed slot's peaks (largest |u| per level) while its writer writes it."""
        while True:
            item = self._peaks_queue.get()
            if item is None:
                return
            first, n, s = item
            try:
                peak = _peaks(self.ring.slots[s][:n])
                with self._lock:
                    self._peak[first:first + n] = peak
                    self._peaked[s] = True
            except BaseException as exc:  # noqa: BLE001 - handed to the solving thread; keep serving
                with self._lock:
                    self._error = self._error or exc
            finally:
                self._release(s, first, n)

    def _release(self, s, first, n):
        """A reader of slot ``s`` (its writer or the peaks thread) is done. After the last one the
        chunk's levels count as landed if its file was written and its peaks taken, and the slot
        is free again."""
        with self._lock:
            self._readers[s] -= 1
            if self._readers[s]:
                return
            if self._written[s] and self._peaked[s]:
                self._landed[first:first + n] = True
        self._dirty.set()
        self.ring.release(s)

    def _encoded(self, s, n):
        """The file's bytes of the chunk in slot ``s`` (its first ``n`` levels).
        The array's last chunk may hold fewer levels: its file holds a whole chunk all the same
        (Zarr's rule), the levels past the end being the fill value."""
        block = self.ring.slots[s][:n]
        if n < self.ring.chunk:
            block = np.concatenate([block, np.full((self.ring.chunk - n, *block.shape[1:]), np.nan, np.float32)])
        return self._encode(block)

    def _write_chunk(self, first, payload):
        """The chunk's file, whole or absent: its bytes and their checksum (as the array's
        ``crc32c`` codec appends it), written under a temporary name, fsync'ed, renamed."""
        key = self.data.metadata.encode_chunk_key((first // self.ring.chunk, 0, 0))
        _put_durable(self.path / DATA / key, (payload, _checksum(payload)))

    # -- the flags thread ---------------------------------------------------
    def flagger(self):
        """Write ``peak`` and ``complete`` (for the levels whose chunks have landed) as soon as
        chunks have landed, then at most every :data:`FLAGS_EVERY_S`."""
        while True:
            self._dirty.wait()
            if self._stop.is_set():
                return                                   # finish() writes the last flags
            self._dirty.clear()
            if self._write_flags() is not True:
                return
            self._stop.wait(FLAGS_EVERY_S)

    def _write_flags(self):
        """Write the flags of the chunks landed so far, in place (their space was taken when the
        store was created, so a full disk cannot stop them). True, or the OSError (also kept
        for the solving thread)."""
        with self._lock:
            files = _flag_bytes(self._landed, self._peak)
        try:
            for name in ("peak", "complete"):   # complete last: never ahead of the data and peaks
                array = self.peak if name == "peak" else self.complete
                _overwrite(self.path / name / array.metadata.encode_chunk_key((0,)), files[name])
        except OSError as exc:
            with self._lock:
                self._error = self._error or _disk_error(exc, self.path, 0, self.every, "its flags")
            return exc
        return True

    def open_result(self):
        """The finished store's wavefield array, opened for reading (lazy)."""
        return open_store(self.path).images


@contextlib.contextmanager
def _ctrl_c_held():
    """Hold a Ctrl-C (SIGINT) that comes inside the block and raise it at the block's end, so
    that a clean-up runs to its end (threads stopped, flags and state written). A second
    Ctrl-C is not held. Only where Python's own handler is in place (the main thread)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    held = []

    def hold(signum, frame):
        if held:
            raise KeyboardInterrupt          # pressed again: the user insists
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if held:
            raise KeyboardInterrupt


def _why(exc):
    """An exception in one line: its type, and its message if it has one."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class StoreWriteError(OSError):
    """Writing a run's store failed (a full disk, an I/O error); the message names the store
    and the level, and, once the run has stopped, what the store keeps."""


def _disk_error(exc, path, first, every, what=None):
    what = what or f"level {first * every}"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return StoreWriteError(errno.ENOSPC, f"the disk holding the store {path} is full (writing {what})",
                               str(path))
    if isinstance(exc, OSError):
        return StoreWriteError(exc.errno, f"writing {what} to the store {path} failed: {exc}", str(path))
    return exc


# --------------------------------------------------------------------------
# Reading a store back
# --------------------------------------------------------------------------
class StoreDamaged(ValueError):
    """A file of a store is damaged (bad metadata, a chunk failing its checksum): the message
    names the file, and for a chunk its levels."""


def _damaged(path, what, exc):
    """The StoreDamaged error for ``what`` (words) of the store ``path`` that could not be read:
    a metadata file that is not valid JSON is named first, since every read goes through it."""
    for meta in sorted(Path(path).rglob("zarr.json")):
        try:
            json.loads(meta.read_bytes())
        except (ValueError, OSError) as bad:
            return StoreDamaged(f"the metadata file {meta} of the store {path} is damaged ({bad}); the "
                                "store cannot be read")
    if isinstance(exc, KeyError):
        return StoreDamaged(f"the store {path} has no array {exc.args[0]!r}: it was not written by "
                            "solve(..., store=PATH), or it is damaged")
    return StoreDamaged(f"cannot read {what} of the store {path}: {type(exc).__name__}: {exc}")


class StoredImages:
    """A store's wavefield ``(nsaved, n0, n1)``, read lazily: indexing reads only the chunks it
    needs (a Zarr array underneath). A chunk whose bytes fail their checksum (or cannot be
    decoded) raises :class:`StoreDamaged` naming the chunk's file and levels, instead of being
    read as data."""

    def __init__(self, array, path, levels):
        self.array = array                   # the zarr.Array
        self.path = Path(path)
        self.levels = levels

    shape = property(lambda self: self.array.shape)
    dtype = property(lambda self: self.array.dtype)
    ndim = property(lambda self: self.array.ndim)
    chunks = property(lambda self: self.array.chunks)
    nbytes = property(lambda self: self.array.nbytes)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, key):
        try:
            return self.array[key]
        except Exception as exc:  # noqa: BLE001 - told apart below, by reading chunk by chunk
            raise self._damaged(key, exc) from exc

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self[:], dtype)

    def __iter__(self):
        return (self[k] for k in range(len(self)))

    def __repr__(self):
        return f"<StoredImages {str(self.path)!r} {self.shape} float32>"

    def _damaged(self, key, exc):
        """Find which chunk of those ``key`` reads is damaged, and say so."""
        chunk = self.chunks[0]
        try:
            wanted = np.atleast_1d(np.arange(len(self))[key[0] if isinstance(key, tuple) else key])
        except (IndexError, TypeError, ValueError):
            return exc if isinstance(exc, (IndexError, TypeError)) else _damaged(self.path, "the wavefield", exc)
        for k in sorted({int(i) // chunk for i in wanted}):
            first, stop = k * chunk, min((k + 1) * chunk, len(self))
            try:
                self.array[first:stop]
            except Exception as bad:  # noqa: BLE001 - this chunk is the damaged one
                file = self.path / DATA / self.array.metadata.encode_chunk_key((k, 0, 0))
                return StoreDamaged(f"the chunk file {file} (levels {self.levels[first]}..{self.levels[stop - 1]}) "
                                    f"is damaged and is not read as data ({bad}); these levels are lost: run the "
                                    "solve again to get them")
        return _damaged(self.path, "the wavefield", exc)


class StoredRun:
    """A store opened lazily: nothing is read until a slice is indexed.

    Attributes
    ----------
    images : StoredImages
        (nsaved, n0, n1); ``images[k]`` reads one level (NaN where it was never written; a
        damaged chunk raises :class:`StoreDamaged`).
    levels, times_ms : numpy.ndarray
        Time level and simulated time of each slice.
    complete : numpy.ndarray of bool
        Which levels are complete: flagged in the store's ``complete`` array and their chunk
        file is there. For a run that was killed, every level whose chunk file is there (a chunk
        file appears only whole, after its data were produced without error and fsync'ed).
    missing : numpy.ndarray of bool
        Levels flagged complete whose chunk file has gone (deleted after the run).
    state : str
        "finished", "failed" (``reason`` says why), "interrupted" (killed before it ended) or
        "writing" (a live process is writing it now).
    attrs : dict
        The problem's parameters.
    """

    def __init__(self, path):
        zarr = _zarr()
        path = Path(path)
        if not path.exists():
            _remove_stale_creations(path)
            raise FileNotFoundError(f"there is no store at {path}")
        if not (path / "zarr.json").is_file():
            raise FileNotFoundError(f"{path} is not a course store (no zarr.json inside)")
        self.path = path
        self.state, self.reason = _read_state(path)
        if self.state == "interrupted":
            _remove_partials(path)            # temporary files of the chunks being written when killed

        def read(what, get):
            try:
                return get()
            except Exception as exc:  # noqa: BLE001 - reported with the file's name
                raise _damaged(path, what, exc) from exc

        self.group = read("the metadata", lambda: zarr.open_group(store=_durable_store(path, read_only=True),
                                                                   mode="r"))
        self.levels = read("the array 'level'", lambda: self.group["level"][:])
        self.images = StoredImages(read("the array 'u'", lambda: self.group[DATA]), path, self.levels)
        self.times_ms = read("the array 'time'", lambda: self.group["time"][:]) * 1e3
        flagged = read("the array 'complete'", lambda: self.group["complete"][:])
        self.attrs = dict(self.group.attrs)
        present = self._chunk_files_present()
        self.missing = flagged & ~present
        self.complete = present if self.state == "interrupted" else flagged & present

    def _chunk_files_present(self):
        """Per level: whether its chunk file is there."""
        data = self.images.array
        names = set(os.listdir(self.path / DATA)) if (self.path / DATA).is_dir() else set()
        chunk = data.chunks[0]
        present = np.zeros(len(self.levels), bool)
        for k in range(math.ceil(len(present) / chunk)):
            present[k * chunk:(k + 1) * chunk] = data.metadata.encode_chunk_key((k, 0, 0)) in names
        return present

    @property
    def interrupted(self):
        """Whether the run stopped before it ended (killed, or failed)."""
        return self.state in ("interrupted", "failed")

    def peak_amplitude(self):
        """The largest |u| of all complete levels (read from the small ``peak`` array)."""
        peak = self.group["peak"][:]
        peak = peak[np.isfinite(peak)]
        return float(peak.max()) if peak.size else 0.0

    def stored_nbytes(self):
        """Bytes the wavefield's chunk files take on disk (compare with ``images.nbytes``)."""
        return sum(f.stat().st_size for f in (self.path / DATA).glob("c.*") if f.is_file())

    def __repr__(self):
        how = {"finished": "", "writing": ", being written now",
               "interrupted": ", interrupted: the run was killed before it ended",
               "failed": f", interrupted: the run failed ({self.reason})"}[self.state]
        if self.missing.any():
            how += f", {int(self.missing.sum())} flagged levels have lost their chunk files"
        return (f"<StoredRun {str(self.path)!r}: {int(self.complete.sum())}/{len(self.complete)} levels "
                f"complete, {self.images.shape[1]}x{self.images.shape[2]}{how}>")


def open_store(path):
    """Open a store written by ``solve(..., store=path)`` lazily (see :class:`StoredRun`).
    A store opens whatever moment its run was killed at, and says so (``state``)."""
    return StoredRun(path)


# --------------------------------------------------------------------------
# The disk's own speed
# --------------------------------------------------------------------------
def measure_disk_bandwidth(folder, mib=256, chunk_mib=4, writers=DEFAULT_WRITERS, buffers=None):
    """Write ``mib`` MiB of files in ``chunk_mib`` chunks to ``folder`` from ``writers``
    threads, each file fsync'ed (the data really on the disk), and return GB/s.

    File i holds ``buffers[i % len(buffers)]`` (host arrays of one chunk's bytes each; by
    default one chunk of incompressible bytes). The files are removed afterwards. This is the
    disk term of the bound ``B = max(compute, bytes / D2H bandwidth, bytes / disk bandwidth)``.
    """
    folder = Path(folder)
    mib = checks.positive_float("mib", mib)
    chunk = int(checks.positive_float("chunk_mib", chunk_mib) * 2**20)
    writers = checks.positive_int("writers", writers)
    n = max(1, math.ceil(mib * 2**20 / chunk))
    if buffers is not None:
        buffers = [memoryview(np.ascontiguousarray(b)).cast("B") for b in buffers]
        if not buffers or any(len(b) != chunk for b in buffers):
            raise ValueError(f"buffers must be a non-empty list of arrays of one chunk each ({chunk} bytes), "
                             f"got sizes {[len(b) for b in buffers]}")
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot measure the disk: the folder {folder} does not exist")
    check_target(folder / f".disk-bandwidth-{uuid.uuid4().hex}", n * chunk)
    work = folder / f".disk-bandwidth-{uuid.uuid4().hex}"
    work.mkdir()
    if buffers is None:
        buffers = [np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8).tobytes()]   # incompressible
    jobs = queue.SimpleQueue()
    for i in range(n):
        jobs.put(i)
    errors = []

    def writer():
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                _put_durable(work / f"c{i}", buffers[i % len(buffers)])
            except OSError as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=writer, name=f"disk bandwidth {i}") for i in range(writers)]
    t0 = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if errors:
        raise OSError(errors[0].errno, f"measuring the disk under {folder} failed: {errors[0]}")
    return n * chunk / seconds / 1e9


def codec_speed(images, compress, repeats=3):
    """Single-thread compression speed (GB/s of raw input) and ratio of ``compress`` on ``images``
    (a stack of levels), with the same codec settings the store uses."""
    if compress not in _NUMCODECS:
        raise ValueError(f"compress must be one of {tuple(_NUMCODECS)}, got {compress!r}")
    c = _NUMCODECS[compress]()
    levels = [np.ascontiguousarray(level) for level in images]
    best, size = float("inf"), 0
    for _ in range(checks.positive_int("repeats", repeats)):
        t0 = time.perf_counter()
        size = sum(len(c.encode(level)) for level in levels)
        best = min(best, time.perf_counter() - t0)
    raw = sum(level.nbytes for level in levels)
    return {"gb_per_s": raw / best / 1e9, "ratio": raw / max(size, 1)}
