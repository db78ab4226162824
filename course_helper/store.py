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
the library Zarr's codecs wrap): going through the Zarr array for every chunk
cost about 3 ms of Python per chunk on the H200 machine, a third of a 4 MiB
chunk's write. The ``complete`` flags are written only after their chunks have
landed, so a level flagged complete is never torn (a kill before the next
flags write leaves complete levels that are not flagged: the flags err on the
safe side).

Timing. On a GPU, writer ``i`` times each chunk's write on the host clock
(lane "disk i" of the timeline). On the CPU backend the disk is a stage of
the modelled machine (:meth:`course_helper.model.ModelRuntime.disk_write`):
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
import math
import os
import queue
import shutil
import threading
import time
import uuid
import warnings
from pathlib import Path

import numpy as np

from . import checks, observe, recording, runtime, streams
from .memory import pinned_empty

__all__ = ["Ring", "DiskSink", "open_store", "StoredRun", "check_target", "free_bytes",
           "measure_disk_bandwidth", "codec_speed", "CODECS", "DEFAULT_WRITERS", "ring_slots", "FLAGS_EVERY_S"]

DATA = "u"                      # the wavefield array inside the store
DEFAULT_WRITERS = 4             # enough chunks in flight that one writer's own work leaves the disk busy
FLAGS_EVERY_S = 0.1             # the flags thread writes ``complete`` and ``peak`` at most this often
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
    """Write ``data`` to ``path`` through a temporary name: write, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())   # the bytes are on the disk before the name says so
        os.replace(tmp, path)           # atomic: readers see the old state or the whole chunk
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _durable_store(root, read_only=False):
    """A Zarr LocalStore whose files appear whole (temporary name, then rename), the
    wavefield's chunks fsync'ed first. The small flags are not fsync'ed: if a power cut
    loses one, its level merely reads as incomplete."""
    from zarr.storage import LocalStore

    def put(root, key, value):
        _put_durable(root / key, value.as_buffer_like(), fsync=key.startswith(f"{DATA}/c"))

    class DurableStore(LocalStore):
        async def set(self, key, value):
            if not self._is_open:
                await self._open()
            self._check_writable()
            await asyncio.to_thread(put, self.root, key, value)

        def set_sync(self, key, value):
            self._ensure_open_sync()
            self._check_writable()
            put(self.root, key, value)

    return DurableStore(root, read_only=read_only)


def _problem_attrs(problem, every):
    return {"n0": problem.n0, "n1": problem.n1, "dx0_m": problem.dx0, "dx1_m": problem.dx1,
            "dt_s": problem.dt, "nt": problem.nt, "every": every, "cfl": problem.cfl,
            "vmax_m_per_s": problem.vmax, "fm_hz": problem.fm, "td_s": problem.td,
            "source": list(problem.source), "units": "u: pressure amplitude; time: s; x0, x1: m"}


def create_store(path, problem, every, chunk, compress=None):
    """Create the (empty) store: ``u`` (time, x0, x1) full of NaN, its coordinates, the
    ``complete`` and ``peak`` arrays (one entry per level), the problem as attributes."""
    zarr = _zarr()
    levels = np.arange(0, problem.nt, every)
    nsaved = len(levels)
    group = zarr.open_group(store=_durable_store(path), mode="w-", zarr_format=3)
    group.attrs.update(_problem_attrs(problem, every))
    group.create_array(DATA, shape=(nsaved, *problem.shape), chunks=(chunk, *problem.shape),
                       dtype="float32", fill_value=np.nan, dimension_names=("time", "x0", "x1"),
                       compressors=CODECS[compress](), config={"write_empty_chunks": True},
                       chunk_key_encoding={"name": "default", "separator": "."},   # u/c.K.0.0: one folder
                       attributes={"long_name": "wavefield", "coordinates": "level"})
    for name, values in (("time", levels * problem.dt), ("level", levels),
                         ("x0", np.arange(problem.n0) * problem.dx0),
                         ("x1", np.arange(problem.n1) * problem.dx1)):
        dim = "time" if name in ("time", "level") else name
        a = group.create_array(name, shape=values.shape, dtype=values.dtype, dimension_names=(dim,),
                               attributes={"units": {"time": "s", "level": "1"}.get(name, "m")})
        a[:] = values
    # The flags are one chunk each (one small file, rewritten whole by the flags thread).
    group.create_array("complete", shape=(nsaved,), chunks=(nsaved,), dtype="bool", fill_value=False,
                       dimension_names=("time",), compressors=None)
    group.create_array("peak", shape=(nsaved,), chunks=(nsaved,), dtype="float32", fill_value=np.nan,
                       dimension_names=("time",), compressors=None,
                       attributes={"long_name": "largest |u| of the level (for colour scales)"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # "consolidated metadata is not in the v3 spec"
        zarr.consolidate_metadata(group.store)     # one read opens the whole store (xarray)
    return group


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
        self.nsaved = len(range(0, problem.nt, every))
        check_target(self.path, self.nsaved * problem.nbytes_level, compress)
        self.group = create_store(self.path, problem, every, chunk, compress)
        self.data, self.complete, self.peak = self.group[DATA], self.group["complete"], self.group["peak"]
        self.ring = Ring(self, self.nsaved, chunk, problem.shape, ring_slots(writers), pinned)
        self.every = every
        self.writers = writers
        self._encode = _encoder(compress)
        rt = runtime.get()
        self._model = rt if rt.modelled else None     # the CPU backend: the disk is modelled
        self._error = None
        self._recorder = None          # the solving thread's recorder (the disk lanes go into it)
        self._intervals = []           # (first level index, lane, nbytes, times) of each chunk written
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._landed = np.zeros(self.nsaved, bool)                 # what the flags thread writes
        self._peak = np.full(self.nsaved, np.nan, np.float32)
        self._dirty, self._stop = threading.Event(), threading.Event()
        self._readers = [0] * len(self.ring.slots)     # threads still reading each slot (writer, peaks)
        self._written = [False] * len(self.ring.slots)  # whether each slot's chunk reached its file
        self._peaked = [False] * len(self.ring.slots)   # and whether its peaks were taken
        self._peaks_queue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self.writer, args=(f"disk {i}",), name=f"disk writer {i}",
                                          daemon=True) for i in range(writers)]
        self._peaker = threading.Thread(target=self.peaker, name="disk peaks", daemon=True)
        self._flagger = threading.Thread(target=self.flagger, name="disk flags", daemon=True)
        for t in (*self._threads, self._peaker, self._flagger):
            t.start()

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

    def finish(self):
        """Wait until every handed-over chunk is on the disk (on the CPU backend: the host clock
        moves to the end of the last modelled write), write the flags, put the disk lanes on the
        timeline, and raise a writer's error."""
        if self._model is not None:        # first: the writer threads wait for the modelled writes to begin
            for write in (w for w in self.ring.modelled if w is not None):
                self._model.disk_wait(write)
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._peaks_queue.put(None)
        self._peaker.join()
        self._stop.set()
        self._dirty.set()
        self._flagger.join()
        self._write_flags()
        self._add_lanes()
        self.raise_error()

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
        """The chunk's file, whole or absent: written under a temporary name, fsync'ed, renamed."""
        key = self.data.metadata.encode_chunk_key((first // self.ring.chunk, 0, 0))
        _put_durable(self.path / DATA / key, payload)

    # -- the flags thread ---------------------------------------------------
    def flagger(self):
        """Write ``peak`` and ``complete`` (for the levels whose chunks have landed) whenever
        chunks have landed since the last write, at most every :data:`FLAGS_EVERY_S`."""
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.wait(FLAGS_EVERY_S):
                return                                   # finish() writes the last flags
            self._dirty.clear()
            if not self._write_flags():
                return

    def _write_flags(self):
        """Write the flags of the chunks landed so far; False (the error kept for the solving
        thread) if that failed."""
        with self._lock:
            landed, peak = self._landed.copy(), self._peak.copy()
        try:
            self.peak[:] = peak
            self.complete[:] = landed      # after the chunks and their peaks: never ahead of the data
        except OSError as exc:
            with self._lock:
                self._error = self._error or _disk_error(exc, self.path, 0, self.every, "its flags")
            return False
        return True

    def open_result(self):
        """The finished store's wavefield array, opened for reading (lazy)."""
        return open_store(self.path).images


def _disk_error(exc, path, first, every, what=None):
    what = what or f"level {first * every}"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return OSError(errno.ENOSPC, f"the disk holding the store {path} is full (writing {what}); "
                       "earlier levels are complete and flagged in 'complete'", str(path))
    if isinstance(exc, OSError):
        return OSError(exc.errno, f"writing {what} to the store {path} failed: {exc}", str(path))
    return exc


# --------------------------------------------------------------------------
# Reading a store back
# --------------------------------------------------------------------------
class StoredRun:
    """A store opened lazily: nothing is read until a slice is indexed.

    Attributes
    ----------
    images : zarr.Array
        (nsaved, n0, n1); ``images[k]`` reads one level (NaN where it was never written).
    levels, times_ms : numpy.ndarray
        Time level and simulated time of each slice.
    complete : numpy.ndarray of bool
        Which levels were written completely.
    attrs : dict
        The problem's parameters.
    """

    def __init__(self, path):
        zarr = _zarr()
        path = Path(path)
        if not (path / "zarr.json").is_file():
            raise FileNotFoundError(f"{path} is not a course store (no zarr.json inside)")
        self.path = path
        self.group = zarr.open_group(store=_durable_store(path, read_only=True), mode="r")
        self.images = self.group[DATA]
        self.levels = self.group["level"][:]
        self.times_ms = self.group["time"][:] * 1e3
        self.complete = self.group["complete"][:]
        self.attrs = dict(self.group.attrs)

    def peak_amplitude(self):
        """The largest |u| of all complete levels (read from the small ``peak`` array)."""
        peak = self.group["peak"][:]
        peak = peak[np.isfinite(peak)]
        return float(peak.max()) if peak.size else 0.0

    def stored_nbytes(self):
        """Bytes the wavefield's chunk files take on disk (compare with ``images.nbytes``)."""
        return sum(f.stat().st_size for f in (self.path / DATA).glob("c.*") if f.is_file())

    def __repr__(self):
        return (f"<StoredRun {str(self.path)!r}: {int(self.complete.sum())}/{len(self.complete)} levels "
                f"complete, {self.images.shape[1]}x{self.images.shape[2]}>")


def open_store(path):
    """Open a store written by ``solve(..., store=path)`` lazily (see :class:`StoredRun`)."""
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

    threads = [threading.Thread(target=writer) for _ in range(writers)]
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
