"""Writing a run's store while the solver runs: the ring of host slots, and the sink that
empties it to disk.

When the output does not fit in host memory, ``solve(problem, store=PATH)`` sends every saved
level through a three-stage pipeline::

    device --(D2H copy on an IO stream)--> ring of host slots --(writer threads)--> files

* The strategy's loop is unchanged: it copies level ``k`` into ``run.images[k]`` as always.
  With a store, ``run.images`` is a :class:`Ring`: indexing it hands out a free slot (the
  host waits there only while every slot is still waiting for the disk) as a :class:`Slot`,
  a host array which the copy into it hands back to the sink once the copy is queued
  (:meth:`DiskSink.copy_queued`). The sink then records an event after the copy and passes
  the slot to a writer thread; on the CPU backend it also queues the chunk's write on the
  modelled disk.
* A writer thread waits for that event, encodes the slot as one chunk of the array ``u``
  (one level, or one staging batch) and writes the chunk's file, with its checksum, whole or
  not at all (:func:`course_helper.files.write_atomically`), its record in the store's
  ``.checksums`` put in place first (:class:`~.layout.Checksums`). Beside it, the peaks thread reads
  each level's largest amplitude from the same slot (for the viewer's colour scale); the slot
  is free again when both are done. The flags thread then marks those levels in ``complete``
  (and their ``peak``) in place, at most every :data:`FLAGS_EVERY_S` seconds.
* Host memory is the ring, whatever ``nt`` is: :func:`ring_slots` slots of one chunk.

Compression on the device (``compress="gpu-zstd"``, :mod:`.compression`). The ring's slots are
then on the device: the loop's copy "to the host" lands in a device slot (a :class:`DeviceSlot`,
a device-to-device copy on the loop's own stream), a compression stage compresses the chunk
there on a stream of its own (nvCOMP on a GPU, the modelled compression engine on the CPU
backend), and only the compressed bytes cross to a pinned host slot; the writer writes them as
one Zarr shard (:mod:`.shards`). A slot is free again once its shard is on the disk. Where the
device cannot compress (no nvCOMP, a profile without the figures) the ring stays on the host
and the writer threads compress the same shards.

Ring size. In steady state the pipeline runs at its slowest stage: a slot is held by a writer
for one chunk's write time and by a copy for one copy time. ``writers + 2`` slots (one being
filled, one ready, one per writer) keep every stage busy; more slots only absorb bursts. When
the disk is slower than the compute makes levels, no ring is large enough: it fills, and from
then on the compute waits for the disk, the bound
``B = max(compute, bytes / D2H bandwidth, bytes / disk bandwidth)``.

What a failed run keeps. A level is flagged complete only after its chunk file is on the
disk and its peak taken, and only if every operation that produced it succeeded. After a
fault or a Ctrl-C the device skips the work queued after the failure and the copies that wait
for it (the CPU backend's model follows CUDA's sticky errors); a chunk whose copy failed or
was skipped is neither written nor flagged, while chunks whose copies had landed are written
and flagged. The error says how many levels are flagged; a store that keeps nothing is removed.

Timing. On a GPU, writer ``i`` times each chunk's write on the host clock (lane "disk i" of
the timeline). On the CPU backend the disk is a stage of the modelled machine
(:meth:`course_helper.runtime.model.ModelRuntime.disk_write`): a chunk's modelled write starts
when the copy into its slot has completed and takes latency + bytes / bandwidth from the
profile's ``disk`` section, the writers sharing the disk's bandwidth; the host waits for a slot
until its modelled write has ended. The writer threads still write the files, but nothing they
do moves the model's clocks, so a streamed run's modelled time and timeline are the same on
every run.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import queue
import shutil
import signal
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import checks, files, runtime, streams
from ..memory import HandsOnCopies, TakesCopiesOnDevice, copy_on_device_async, device_empty, pinned_empty
from ..runtime.ops import OpKind
from ..runtime import observe
from ..streams import Stream
from ..timelines import recording
from ..wave import WaveProblem, saved_levels
from .compression import CompressionFallback, NvcompCompressor, engine_for
from .layout import (DATA, NUMCODECS, SHARDED, StoreWriteError, check_target, create_store, flag_bytes,
                     in_one_line, overwrite)
from .reading import StoredImages, open_store
from .shards import ChunkFile, compress_on_host, inner_chunks, raw_file, shard_file

__all__ = ["DEFAULT_WRITERS", "FLAGS_EVERY_S", "ring_slots", "Slot", "DeviceSlot", "Ring", "DiskSink"]

DEFAULT_WRITERS = 4             # enough chunks in flight that one writer's own work leaves the disk busy
FLAGS_EVERY_S = 0.1             # the flags thread writes ``complete`` and ``peak`` at most this often


def ring_slots(writers: int = DEFAULT_WRITERS) -> int:
    """Slots in the ring: one per writer, one being filled by a copy, one ready."""
    return writers + 2


def _encoder(compress, shape, chunk):
    """The function turning one chunk's levels (a C-ordered float32 block) into its file
    (a :class:`~.shards.ChunkFile`), as the store's codecs encode it: raw little-endian bytes,
    a zstd or blosc frame, or a shard of zstd inner chunks."""
    if compress is None:
        return lambda block: raw_file(memoryview(block).cast("B"))     # no copy: the slot itself is written
    codec = NUMCODECS[compress]()
    if compress in SHARDED:
        rows, per_level = inner_chunks(shape)
        return lambda block: shard_file(compress_on_host(block, rows, codec), chunk, per_level)
    return lambda block: raw_file(codec.encode(block))


def _peaks(block):
    """The largest |u| of each level of ``block`` (for the viewer's colour scale; no temporary copy)."""
    return np.maximum(block.max(axis=(1, 2)), -block.min(axis=(1, 2)))


class Slot(np.ndarray, HandsOnCopies):
    """The view of a ring slot that a loop receives from ``ring[k]``: an ordinary host array
    that is also a :class:`~course_helper.memory.HandsOnCopies`. The copy functions of
    :mod:`course_helper.memory` call its :meth:`copy_queued` once the copy into the view is
    queued on ``stream``, handing the slot to the sink. Arrays made from a Slot (slices,
    results) hand nothing on."""

    def copy_queued(self, stream: Stream) -> None:
        """Nothing, on an array made from a slot's view. The view that ``ring[k]`` gives carries
        its own ``copy_queued`` (set by :meth:`Ring.__getitem__`), which hands the slot to the sink."""


class DeviceSlot(TakesCopiesOnDevice):
    """The view of a ring slot on the device that a loop receives from ``ring[k]`` when the store
    compresses on the device. The loop copies into it as into a host array
    (``copy_to_host_async``, ``copy_to_host``): the copy stays on the device, a device-to-device
    copy on the loop's stream (:meth:`take`), and hands the slot to the sink."""

    def __init__(self, array: Any, hand_on: Callable[[Stream], None]) -> None:
        self.array, self.shape, self.dtype = array, array.shape, array.dtype
        self._hand_on = hand_on

    def take(self, src: Any, stream: Stream, level: int | None) -> None:
        """Queue the copy of the device array ``src`` into this slot on ``stream``, then hand the slot on."""
        copy_on_device_async(self.array, src, stream, level=level)
        self._hand_on(stream)


class Ring:
    """What a loop sees as ``run.images`` when the run streams to disk.

    ``ring[k]`` (or ``ring[first:stop]`` for a staging batch within one chunk)
    is a view of a free slot (a :class:`Slot`: the copy into it hands it to the
    sink); the host waits only while no slot is free.

    Which slot: on a GPU, whichever is free first (the writers' fsyncs finish
    out of order). In modelled time, equal chunks finish their writes in turn,
    so the chunks take the slots in turn and the timeline is the same on every
    run.
    """

    def __init__(self, sink: DiskSink, nsaved: int, chunk: int, shape: tuple[int, int], nslots: int,
                 pinned: bool, device: Any = None) -> None:
        self.sink = sink
        self.chunk = chunk
        self.shape = (nsaved, *shape)
        self.on_device = device is not None       # the slots are on the device (compression there)
        if self.on_device:
            self.slots = [device[s] for s in range(nslots)]     # views of one device buffer (nslots, chunk, ...)
        else:
            make = pinned_empty if pinned else (lambda s: np.empty(s, np.float32))
            self.slots = [make((chunk, *shape)) for _ in range(nslots)]
        self.free = [threading.Event() for _ in range(nslots)]
        for f in self.free:
            f.set()
        self.freed = threading.Condition()   # notified whenever a slot becomes free
        self.first = [None] * nslots       # first level index held by each slot
        self.pending = [False] * nslots    # handed to the loop, and no copy queued into it yet
        self.modelled = [None] * nslots    # CPU backend: the modelled disk write of each slot's chunk

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def __len__(self) -> int:
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

    def __getitem__(self, key: int | slice) -> Slot | DeviceSlot:
        first, stop = self._span(key)
        s = self.sink.take_slot(first // self.chunk)      # the host waits here if the ring is full
        self.free[s].clear()                              # taken until a writer has written it
        self.first[s] = first
        j = first % self.chunk
        levels = self.slots[s][j] if not isinstance(key, slice) else self.slots[s][j:j + stop - first]
        hand_on = lambda stream: self.sink.copy_queued(s, first, stop - first, stream)   # noqa: E731
        if self.on_device:                # compression on the device: the copy stays there
            return DeviceSlot(levels, hand_on)
        view = levels.view(Slot)          # once the copy into it is queued, it goes to the sink:
        view.copy_queued = hand_on
        return view

    def let_go(self) -> None:
        """The run is over: drop the slots (pinned memory), whoever still holds the ring."""
        self.slots = []
        self.modelled = [None] * len(self.modelled)

    def release(self, s: int) -> None:
        """Slot ``s`` is free again (its chunk is on the disk)."""
        with self.freed:
            self.free[s].set()
            self.freed.notify_all()

    def a_free_slot(self, timeout: float | None = None) -> int | None:
        """The index of a free slot, or None if none became free within ``timeout`` seconds."""
        with self.freed:
            self.freed.wait_for(lambda: any(f.is_set() for f in self.free), timeout)
            return next((s for s, f in enumerate(self.free) if f.is_set()), None)


class DiskSink:
    """The writer side: creates the store, takes the filled slots of its :attr:`ring` and
    writes them as Zarr chunks.

    When a copy into a slot has been queued, the copy hands the slot to :meth:`copy_queued`,
    which records an event after the copy and passes the slot to a writer thread (on the CPU
    backend it also queues the chunk's write on the modelled disk), or, when the chunks are
    compressed on the device, to the compression stage first. :meth:`finish` ends the run's
    pipeline, whatever happened. ``compression`` says where the chunks were compressed and why
    (see :meth:`compression_summary`). ``checked``: :func:`check_target` has passed for ``path``
    already (``solve`` runs it once, before it allocates anything), so it is not run again.
    """

    def __init__(self, path: str | os.PathLike, problem: WaveProblem, every: int, chunk: int, *,
                 compress: str | None = None, writers: int | None = None, pinned: bool = True,
                 checked: bool = False) -> None:
        writers = checks.positive_int("writers", DEFAULT_WRITERS if writers is None else writers)
        self.path = Path(path)
        self.nsaved = len(saved_levels(problem.nt, every))
        if not checked:                # solve() checks the target once, before it allocates anything
            check_target(self.path, self.nsaved * problem.nbytes_level, compress)
        self.every = every
        self.writers = writers
        self.level_bytes = problem.nbytes_level
        self.sharded = compress in SHARDED
        self._encode = _encoder(compress, problem.shape, chunk)
        rt = runtime.get()
        self._model = rt if rt.modelled else None     # the CPU backend: the disk is modelled
        where, why = engine_for(compress)             # where the chunks are compressed: "host", "device", "modelled"
        self.compression = {"codec": compress, "where": where, "why": why}
        self._compressor = None        # on a GPU with compression on the device: the nvCOMP stage
        self._compressed = []          # CPU backend, compression on the device: (first, n, modelled chunk)
        self._error = None             # the first error of a writer, the peaks or the flags thread
        self._ended = False            # finish() has run
        self._recorder = None          # the solving thread's recorder (the disk lanes go into it)
        self._intervals = []           # (first level index, lane, nbytes, times) of each chunk written
        self._queue = queue.SimpleQueue()
        self._peaks_queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._handed = np.zeros(self.nsaved, bool)                 # levels whose copy the loop queued
        self._landed = np.zeros(self.nsaved, bool)                 # what the flags thread writes
        self._peak = np.full(self.nsaved, np.nan, np.float32)
        self._dirty, self._stop = threading.Event(), threading.Event()
        self._threads = [threading.Thread(target=self.writer, args=(f"disk {i}",), name=f"disk writer {i}",
                                          daemon=True) for i in range(writers)]
        self._peaker = threading.Thread(target=self.peaker, name="disk peaks", daemon=True)
        self._flagger = threading.Thread(target=self.flagger, name="disk flags", daemon=True)
        self.group, self._state, self._checksums = create_store(self.path, problem, every, chunk, compress)
        try:
            self.data, self.complete, self.peak = self.group[DATA], self.group["complete"], self.group["peak"]
            device = self._device_ring(problem, chunk, ring_slots(writers)) if where != "host" else None
            self.ring = Ring(self, self.nsaved, chunk, problem.shape, ring_slots(writers), pinned, device)
            self._readers = [0] * len(self.ring.slots)     # threads still reading each slot (writer, peaks)
            self._written = [False] * len(self.ring.slots)  # whether each slot's chunk reached its file
            self._peaked = [False] * len(self.ring.slots)   # and whether its peaks were taken
            for t in (*self._threads, self._peaker, self._flagger):
                t.start()
            if self._compressor is not None:
                self._compressor.start()
        except BaseException as exc:
            # (a MemoryError for the ring, a Ctrl-C): the threads started stop, the store goes
            self._stop_threads(cancel=False)
            self._checksums.close()
            self._state.end(f"failed: {in_one_line(exc)}")
            shutil.rmtree(self.path, ignore_errors=True)      # it holds nothing: it must not block a re-run
            raise

    def _device_ring(self, problem, chunk, nslots):
        """The ring's slots on the device (one buffer), and on a GPU the nvCOMP stage; None, and
        the host compresses instead (saying why), where nvCOMP cannot start on this GPU."""
        need = nslots * chunk * problem.nbytes_level
        free = runtime.get().device_free_bytes()
        what = f"the store's ring on the device ({nslots} slots of {chunk} level(s))"
        if free is not None and need > 0.9 * free:
            raise MemoryError(f"{what} needs {need / 2**20:,.0f} MiB of device memory but only {free / 2**20:,.0f} "
                              "MiB are free; use fewer levels per chunk (batch), or a smaller grid")
        if free is None:
            checks.host_memory(need, what, advice="use fewer levels per chunk (batch), or a smaller grid")
        device = device_empty((nslots, chunk, *problem.shape))
        if self._model is not None:
            return device
        try:
            self._compressor = NvcompCompressor(device, inner_chunks(problem.shape)[0], self._deliver)
        except Exception as exc:  # noqa: BLE001 - nvCOMP could not start here: the host compresses, and says why
            why = (f"nvCOMP could not start on this GPU ({type(exc).__name__}: {exc}); the writer threads "
                   "compress the chunks on the host instead (the same store)")
            warnings.warn(f"compress='gpu-zstd': {why}", CompressionFallback, stacklevel=4)
            self.compression.update(where="host", why=why)
            return None
        return device

    # -- the solving thread ------------------------------------------------
    def copy_queued(self, s: int, first: int, n: int, stream: Stream) -> None:
        """The copy into slot ``s`` (levels ``first`` to ``first + n - 1``) is queued on
        ``stream``: record an event after it and pass the slot to a writer thread."""
        self.ring.pending[s] = False
        self._handed[first:first + n] = True
        self._recorder = recording.current()      # the disk lanes go into the solving thread's timeline
        done = streams.create_events(1)[0]
        done.record(stream)
        if self._compressor is not None:          # on a GPU: nvCOMP compresses it, then a writer writes it
            self._compressor.put(first, n, s, done)
            return
        modelled = None
        if self._model is not None:
            # The write's place on the modelled disk: after the copy (or, compressed on the modelled
            # device, after the compressed bytes' copy), on writer lane k mod writers. The chunk is
            # encoded when that compression or write begins (the copy has landed by then), so the
            # modelled disk writes the bytes the file will hold.
            after, encode = done.raw, streams.placed(lambda: self._encoded(s, n), stream)
            if self.ring.on_device:
                after = self._model.compress_chunk("zstd", done.raw, n * self.level_bytes, encode)
                self._compressed.append((first, n, after))
                encode = after.result
            modelled = self._model.disk_write(f"disk {(first // self.ring.chunk) % self.writers}", after, encode)
            self.ring.modelled[s] = modelled
            fetch = functools.partial(self._modelled_file, modelled, done)
        else:
            fetch = functools.partial(self._after_copy, done, s, n)
        self._queue.put((first, n, s, fetch, modelled))

    @staticmethod
    def _modelled_file(modelled, done):
        """The file of a modelled write, encoded when the write began: the copy (before the event
        ``done``) has landed by then, so the host is ordered after it (the peaks read the slot)."""
        chunk = modelled.result()
        observe.notify("host_synced", done)
        return chunk

    def _after_copy(self, done, s, n):
        """Slot ``s``'s chunk file, once the copy into it (before the event ``done``) has landed."""
        done.synchronize()
        return self._encoded(s, n)

    def _deliver(self, first, n, s, fetch):
        """The compression stage hands a chunk to the writers (``fetch()`` gives its file)."""
        self._queue.put((first, n, s, fetch, None))

    def take_slot(self, chunk: int) -> int:
        """A free slot for chunk number ``chunk``; the host waits while the ring is full, for as
        long as a slot can still come free: a slot the loop took but never copied into is never
        written, so waiting for it raises at once (:meth:`_never_free`). A slot taken for this
        chunk and not copied into yet is handed out again."""
        ring = self.ring
        s = next((i for i, p in enumerate(ring.pending) if p and ring.first[i] // ring.chunk == chunk), None)
        if s is None:
            s = self._free_slot(chunk)
            ring.pending[s] = True            # until the copy into it is queued (copy_queued)
        return s

    def _free_slot(self, chunk):
        """:meth:`take_slot`'s wait for a free slot."""
        ring = self.ring
        if self._model is None:
            s = ring.a_free_slot(timeout=0)
            if s is None:
                # Every slot's chunk is still on its way to the disk: the host waits here, and the
                # device runs on through the work already queued. Nothing is dropped.
                with streams.host_wait("wait for disk (ring full)"):
                    while (s := ring.a_free_slot(timeout=0.05)) is None:
                        self.raise_error()           # a writer failed: stop instead of waiting forever
                        waiting = [i for i, f in enumerate(ring.free) if not f.is_set()]
                        if all(ring.pending[i] for i in waiting):
                            raise self._never_free(waiting)
            self.raise_error()
            return s
        s = chunk % len(ring.slots)           # modelled: equal writes end in turn, so the oldest slot
        if ring.pending[s]:
            raise self._never_free([s])
        modelled = ring.modelled[s]           # is the first free one
        if modelled is not None and not modelled.done:
            # Modelled time: the host clock moves to the end of the slot's modelled write.
            with streams.host_wait("wait for disk (ring full)"):
                self._model.disk_wait(modelled)
        while not ring.free[s].wait(0.05):    # the real file, in real time only: the model's
            self.raise_error()                # clocks do not move
        self.raise_error()
        return s

    def _never_free(self, slots):
        """The error for a loop that asks the ring for a slot while the slots it would wait for
        were taken by the loop and never copied into (they would never come free)."""
        ring = self.ring
        taken = ", ".join(f"run.images[{ring.first[i]}]" for i in slots)
        return RuntimeError(
            f"the loop asked the store's ring for another slot, but it took {taken} and queued no copy "
            f"into {'it' if len(slots) == 1 else 'them'}, so the ring ({len(ring.slots)} slots) would never "
            "free one: with store=PATH each run.images[k] a loop takes is a slot that its copy "
            "(copy_to_host_async or copy_to_host) hands to the disk. Copy into each run.images[k] the loop "
            "takes, right after taking it; the run stopped here instead of waiting for ever")

    def require_every_level(self, strategy: str) -> None:
        """Raise a RuntimeError if the loop of ``strategy`` did not copy every saved level into
        its slot (called when the loop has returned): the store would end with levels missing
        and no error."""
        missing = np.flatnonzero(~self._handed)
        if missing.size:
            shown = ", ".join(str(k) for k in missing[:5]) + (", ..." if missing.size > 5 else "")
            raise RuntimeError(
                f"the {strategy!r} loop returned having copied {self.nsaved - missing.size} of the {self.nsaved} "
                f"saved levels into run.images (never run.images[k] for k = {shown}): with store=PATH every "
                "saved level must be copied into run.images[k] once (copy_to_host_async or copy_to_host), or "
                "the store would miss it; check the loop's copies")

    def raise_error(self) -> None:
        """Raise the first error of a writer, the peaks or the flags thread, if one failed."""
        if self._error is not None:
            raise self._error

    def finish(self, error: BaseException | None = None) -> None:
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
            self._checksums.close()           # the chunks' records are on the disk before the state says how it ended
            self.ring.let_go()
            if self._compressor is not None:
                self._compressor.let_go()
            self._add_lanes()
            failure = next((e for e in (error, stopped, self._error) if e is not None), None)
            if failure is None:
                self._state.end("finished")
                return
            self._state.end(f"failed: {in_one_line(failure)}")
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
        if self._compressor is not None:
            self._compressor.stop()            # first: it hands its last chunks to the writers
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

    def _compression_times(self):
        """``(first level index, n, (start, end) of the compression, (start, end) of the compressed
        bytes' copy, compressed bytes)`` of each chunk compressed on the device, on the host clock."""
        if self._compressor is not None:
            return [(first, n, (t0, t1), (t1, t2), nbytes)
                    for first, n, t0, t1, t2, nbytes in self._compressor.intervals]
        return [(first, n, *chunk.intervals(), chunk.nbytes) for first, n, chunk in self._compressed
                if chunk.task.done and chunk.task.error is None]

    def compression_summary(self) -> dict:
        """Where the chunks were compressed (``where``: "device", "modelled" or "host"; ``why``),
        and for a compression stage on the device: ``chunks``, ``raw_bytes``, ``compressed_bytes``,
        ``busy_ms`` (time compressing, on the device's clock as the host saw it, or modelled) and
        ``gbps`` (raw bytes / busy_ms)."""
        summary = dict(self.compression)
        times = self._compression_times()
        if times:
            raw = sum(n for _, n, *_ in times) * self.level_bytes
            busy = sum(b - a for _, _, (a, b), _, _ in times)
            summary.update(chunks=len(times), raw_bytes=raw, compressed_bytes=sum(t[-1] for t in times),
                           busy_ms=busy, gbps=raw / busy / 1e6 if busy > 0 else float("inf"))
        return summary

    def _add_lanes(self):
        rec = self._recorder
        if rec is None:
            return
        for first, lane, nbytes, times in sorted(self._intervals, key=lambda i: i[0]):
            t0, t1 = times() if callable(times) else times
            rec.add_interval(lane, "disk write", f"write level {first * self.every}", t0, t1, nbytes,
                             first * self.every)
        for first, n, (a, b), (c, d), nbytes in self._compression_times():
            level = first * self.every        # nvCOMP's kernels, then the compressed bytes' copy
            rec.add_interval("compress", "kernel", f"zstd level {level}", a, b, n * self.level_bytes, level)
            rec.add_interval("compress", OpKind.D2H, f"{OpKind.D2H} zstd level {level}", c, d, nbytes, level)

    # -- the writer threads --------------------------------------------------
    def writer(self, lane: str) -> None:
        """A writer thread: for each slot handed over, wait for its chunk's file (its copy, or its
        compression on the device), write it (timed on timeline lane ``lane``) and hand the slot
        to the peaks thread."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            first, n, s, fetch, modelled = item
            with self._lock:
                self._readers[s], self._written[s], self._peaked[s] = 1, False, False
            try:
                chunk = fetch()                   # waits for the copy (or the compression) to land
                with self._lock:
                    self._readers[s] += 1
                self._peaks_queue.put((first, n, s, chunk.peaks))   # taken while this thread writes the file
                if self._error is None:
                    t0 = runtime.host_ms() if modelled is None else None
                    self._write_chunk(first, chunk)
                    times = (t0, runtime.host_ms()) if modelled is None else modelled.interval
                    with self._lock:
                        self._intervals.append((first, lane if modelled is None else modelled.lane,
                                                n * self.level_bytes, times))
                        self._written[s] = True
            except BaseException as exc:  # noqa: BLE001 - handed to the solving thread
                with self._lock:
                    if self._error is None:
                        self._error = _disk_error(exc, self.path, first, self.every)
            finally:
                self._release(s, first, n)

    def peaker(self) -> None:
        """Take each handed slot's peaks (largest |u| per level) while its writer writes it (those
        read on the device come with the chunk)."""
        while True:
            item = self._peaks_queue.get()
            if item is None:
                return
            first, n, s, peak = item
            try:
                if peak is None:
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
        """The file of the chunk in slot ``s`` (its first ``n`` levels), a :class:`~.shards.ChunkFile`.
        The array's last chunk may hold fewer levels: an unsharded chunk's file holds a whole
        chunk all the same (Zarr's rule), the levels past the end being the fill value; a shard
        leaves their inner chunks out (they read as the fill value). On the CPU backend's device
        (compression modelled there) the slot is read at the compression's start, with its peaks."""
        block = self.ring.slots[s][:n]
        if self.ring.on_device:
            block = block.view(np.ndarray)
            parts, tag, nbytes, _ = self._encode(block)
            return ChunkFile(parts, tag, nbytes, _peaks(block))
        if n < self.ring.chunk and not self.sharded:
            block = np.concatenate([block, np.full((self.ring.chunk - n, *block.shape[1:]), np.nan, np.float32)])
        return self._encode(block)

    def _write_chunk(self, first, chunk):
        """The chunk's file, whole or absent: its parts (its bytes and their checksum, as the
        array's ``crc32c`` codec appends it; or a shard), written under a temporary name,
        fsync'ed, renamed. The chunk's record (its tag tied to its place,
        :class:`~.layout.Checksums`) is put in place first, so that every chunk file has one."""
        k = first // self.ring.chunk
        self._checksums.record(k, chunk.tag)
        files.write_atomically(self.path / DATA / self.data.metadata.encode_chunk_key((k, 0, 0)), chunk.parts)

    # -- the flags thread ---------------------------------------------------
    def flagger(self) -> None:
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
            content = flag_bytes(self._landed, self._peak)
        try:
            for name in ("peak", "complete"):   # complete last: never ahead of the data and peaks
                array = self.peak if name == "peak" else self.complete
                overwrite(self.path / name / array.metadata.encode_chunk_key((0,)), content[name])
        except OSError as exc:
            with self._lock:
                self._error = self._error or _disk_error(exc, self.path, 0, self.every, "its flags")
            return exc
        return True

    def open_result(self) -> StoredImages:
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


def _disk_error(exc, path, first, every, what=None):
    what = what or f"level {first * every}"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return StoreWriteError(errno.ENOSPC, f"the disk holding the store {path} is full (writing {what})",
                               str(path))
    if isinstance(exc, OSError):
        return StoreWriteError(exc.errno, f"writing {what} to the store {path} failed: {exc}", str(path))
    return exc
