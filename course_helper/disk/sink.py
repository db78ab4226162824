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

Timing. The sink keeps time with one clock, chosen when it is made. On a GPU it is the host's
wall clock: writer ``i`` times each chunk's write on it (lane "disk i" of the timeline). On the
CPU backend the disk is a stage of the modelled machine
(:meth:`course_helper.runtime.base.Runtime.disk_write`): a chunk's modelled write starts
when the copy into its slot has completed and takes latency + bytes / bandwidth from the
profile's ``disk`` section, the writers sharing the disk's bandwidth; the host waits for a slot
until its modelled write has ended. The writer threads still write the files, but nothing they
do moves the model's clocks, so a streamed run's modelled time and timeline are the same on
every run. Each slot's state between its copy and its write (the chunk it holds, its modelled
write, which threads still read it) is one :class:`SlotState`.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import os
import queue
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import checks, files, runtime, streams
from ..memory import HandsOnCopies, TakesCopiesOnDevice, copy_on_device_async, device_empty, pinned_empty
from ..runtime.disk_lanes import DiskWrite
from ..runtime.ops import OpKind
from ..runtime import interrupts, observe
from ..streams import Stream
from ..timelines import recording
from ..timelines.timeline import COMPRESS
from ..timing import host_timer
from ..wave import WaveProblem, saved_levels
from .compression import CompressionFallback, NvcompCompressor, engine_for
from .layout import (DATA, NUMCODECS, SHARDED, StoreWriteError, check_target, create_store, flag_bytes,
                     in_one_line, overwrite)
from .reading import StoredImages, open_store
from .shards import ChunkFile, compress_on_host, inner_chunks, raw_file, shard_file

__all__ = ["DEFAULT_WRITERS", "FLAGS_EVERY_S", "ring_slots", "Slot", "DeviceSlot", "SlotState", "Ring", "DiskSink"]

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


@dataclasses.dataclass(eq=False)
class SlotState:
    """One slot of a store's ring and the chunk it holds, from the loop's taking it until the
    chunk is on the disk. The ring hands it out and frees it (``free``, ``first``, ``pending``);
    the sink's clock keeps the chunk's modelled write in it (``write``), and the sink's threads
    what they have done with the chunk (``readers``, ``written``, ``peaked``)."""
    index: int                       # its place in the ring (and in the compression stage's buffers)
    array: Any                       # its memory: one chunk of levels, on the host or the device
    free: threading.Event = dataclasses.field(default_factory=threading.Event)   # set: it holds no chunk
    first: int | None = None         # the first level index of the chunk it holds
    pending: bool = False            # handed to the loop, and no copy queued into it yet
    write: DiskWrite | None = None   # on the CPU backend: its chunk's write on the modelled disk
    readers: int = 0                 # threads still reading it (its writer, the peaks thread)
    written: bool = False            # its chunk's file is on the disk
    peaked: bool = False             # its chunk's peaks are taken

    def __post_init__(self) -> None:
        self.free.set()

    def take(self, first: int) -> None:
        """The loop takes the slot for the chunk whose levels start at ``first``: it holds that
        chunk until a writer has written it, and waits for the copy into it until :meth:`copy_queued`."""
        self.free.clear()
        self.first = first
        self.pending = True

    def copy_queued(self) -> None:
        """The copy into the slot is queued: the slot now waits for its chunk's write."""
        self.pending = False


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
        if device is not None:          # the slots are on the device (compression there)
            arrays = [device[s] for s in range(nslots)]     # views of one device buffer (nslots, chunk, ...)
        else:
            make = pinned_empty if pinned else (lambda s: np.empty(s, np.float32))
            arrays = [make((chunk, *shape)) for _ in range(nslots)]
        self.on_device = device is not None
        self.states = [SlotState(s, array) for s, array in enumerate(arrays)]   # one per slot
        self.freed = threading.Condition()   # notified whenever a slot becomes free

    @property
    def slots(self) -> list[Any]:
        """The slots' memory, one array of a chunk's levels each (what a sanitizer names "ring slot")."""
        return [s.array for s in self.states]

    @property
    def nbytes(self) -> int:
        return sum(s.array.nbytes for s in self.states)

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
        slot = self.sink.take_slot(first // self.chunk)   # the host waits here if the ring is full
        slot.take(first)                                  # taken until a writer has written it
        j = first % self.chunk
        levels = slot.array[j] if not isinstance(key, slice) else slot.array[j:j + stop - first]
        hand_on = lambda stream: self.sink.copy_queued(slot, first, stop - first, stream)   # noqa: E731
        if self.on_device:                # compression on the device: the copy stays there
            return DeviceSlot(levels, hand_on)
        view = levels.view(Slot)          # once the copy into it is queued, it goes to the sink:
        view.copy_queued = hand_on
        return view

    def taken_for(self, chunk: int) -> SlotState | None:
        """The slot the loop took for chunk number ``chunk`` and queued no copy into yet (a loop
        that takes ``ring[k]`` twice gets the same slot again), or None."""
        return next((s for s in self.states if s.pending and s.first // self.chunk == chunk), None)

    def a_free_slot(self, timeout: float | None = None) -> SlotState | None:
        """A free slot, or None if none became free within ``timeout`` seconds."""
        with self.freed:
            self.freed.wait_for(lambda: any(s.free.is_set() for s in self.states), timeout)
            return next((s for s in self.states if s.free.is_set()), None)

    def held(self) -> list[SlotState]:
        """The slots holding a chunk (taken, and not yet written)."""
        return [s for s in self.states if not s.free.is_set()]

    def release(self, slot: SlotState) -> None:
        """``slot`` is free again (its chunk is on the disk)."""
        with self.freed:
            slot.free.set()
            self.freed.notify_all()

    def never_free(self, slots: list[SlotState]) -> RuntimeError:
        """The error for a loop that asks the ring for a slot while the ``slots`` it would wait
        for were taken by the loop and never copied into (they would never come free)."""
        taken = ", ".join(f"run.images[{s.first}]" for s in slots)
        return RuntimeError(
            f"the loop asked the store's ring for another slot, but it took {taken} and queued no copy "
            f"into {'it' if len(slots) == 1 else 'them'}, so the ring ({len(self.states)} slots) would never "
            "free one: with store=PATH each run.images[k] a loop takes is a slot that its copy "
            "(copy_to_host_async or copy_to_host) hands to the disk. Copy into each run.images[k] the loop "
            "takes, right after taking it; the run stopped here instead of waiting for ever")

    def let_go(self) -> None:
        """The run is over: drop the slots (pinned memory) and their modelled writes, whoever
        still holds the ring or a slot (a modelled write's encoding names its slot)."""
        for slot in self.states:
            slot.array = slot.write = None
        self.states = []


class _WallClock:
    """The disk's clock on a GPU: the host's wall clock.

    A chunk goes to a writer as soon as its copy is queued; the writer waits for the copy, then
    encodes the slot, and times its write on the host clock, on its own timeline lane. The host
    takes whichever slot frees first (the writers' fsyncs finish out of order)."""

    def chunk_file(self, slot: SlotState, first: int, n: int, done: Any, stream: Stream,
                   encode: Callable[[], ChunkFile]) -> Callable[[], ChunkFile]:
        """The function a writer calls for the chunk's file: once the copy into ``slot`` (before
        the event ``done``) has landed, ``encode()``."""
        def after_copy():
            done.synchronize()
            return encode()
        return after_copy

    def free_slot(self, ring: Ring, chunk: int, check: Callable[[], None]) -> SlotState:
        """A free slot for chunk number ``chunk``; while none is, the host waits, calling ``check()``
        (which raises a writer's error) as it does, for as long as a slot can still come free."""
        slot = ring.a_free_slot(timeout=0)
        if slot is None:
            # Every slot's chunk is still on its way to the disk: the host waits here, and the
            # device runs on through the work already queued. Nothing is dropped.
            with streams.host_wait("wait for disk (ring full)"):
                while (slot := ring.a_free_slot(timeout=0.05)) is None:
                    check()                       # a writer failed: stop instead of waiting forever
                    held = ring.held()
                    if held and all(s.pending for s in held):
                        raise ring.never_free(held)
        check()
        return slot

    def timed(self, lane: str, slot: SlotState, write: Callable[[], None]) -> tuple[str, tuple[float, float]]:
        """``write()`` the chunk of ``slot``; returns the timeline lane and its (start, end) on the host clock."""
        with host_timer() as took:              # the GPU runtime's host clock: the wall clock
            write()
        return lane, (took.start, took.end)

    def wait_for_writes(self, slots: list[SlotState]) -> None:
        """Nothing: the writer threads write each chunk as soon as its copy has landed."""

    def cancel_writes(self, slots: list[SlotState]) -> None:
        """Nothing: no write waits for a clock of its own."""

    def compressions(self) -> list:
        """Nothing: on a GPU the nvCOMP stage times the compressions (:class:`.NvcompCompressor`)."""
        return []


class _ModelledClock:
    """The disk's clock on the CPU backend: the modelled machine's
    (:meth:`course_helper.runtime.base.Runtime.disk_write`).

    A chunk's write is queued on the modelled disk when its copy is queued (after its modelled
    compression, where the device compresses), on writer lane k mod ``lanes``; it is encoded when
    it begins in modelled time (its copy has landed by then). The host takes the slots in turn
    (equal writes end in turn) and waits for a slot until its modelled write has ended. The
    writer threads still write the files, but nothing they do moves the model's clocks."""

    def __init__(self, rt: runtime.Runtime, *, lanes: int, chunk: int, level_bytes: int,
                 compresses: bool) -> None:
        self._rt = rt
        self._lanes, self._chunk, self._level_bytes = lanes, chunk, level_bytes
        self._compresses = compresses    # the modelled device compresses each chunk before its copy out
        self._compressed = []            # (first, n, modelled chunk) of each chunk compressed there

    def chunk_file(self, slot: SlotState, first: int, n: int, done: Any, stream: Stream,
                   encode: Callable[[], ChunkFile]) -> Callable[[], ChunkFile]:
        """Queue the chunk's modelled write (after the copy before the event ``done``, or after the
        compressed bytes' copy) and keep it in ``slot``; returns the function a writer calls for the
        chunk's file, which ``encode()`` made when the modelled write (or compression) began, so
        that the modelled disk writes the bytes the file will hold."""
        after, encode = done.raw, streams.placed(encode, stream)
        if self._compresses:
            after = self._rt.compress_chunk("zstd", done.raw, n * self._level_bytes, encode)
            self._compressed.append((first, n, after))
            encode = after.result
        slot.write = self._rt.disk_write(f"disk {(first // self._chunk) % self._lanes}", after, encode)
        return functools.partial(_modelled_file, slot.write, done)

    def free_slot(self, ring: Ring, chunk: int, check: Callable[[], None]) -> SlotState:
        """The slot of chunk number ``chunk`` (equal writes end in turn, so the oldest slot is the
        first free one), once its modelled write has ended (the host clock moves there) and its real
        file is written (in real time only); ``check()`` raises a writer's error meanwhile."""
        slot = ring.states[chunk % len(ring.states)]
        if slot.pending:
            raise ring.never_free([slot])
        if slot.write is not None and not slot.write.done:
            with streams.host_wait("wait for disk (ring full)"):
                self._rt.disk_wait(slot.write)
        while not slot.free.wait(0.05):    # the real file, in real time only: the model's
            check()                        # clocks do not move
        check()
        return slot

    def timed(self, lane: str, slot: SlotState, write: Callable[[], None]) -> tuple[str, Callable[[], tuple]]:
        """``write()`` the chunk of ``slot``; returns the lane of its modelled write and that write's
        (start, end) in modelled ms (a function: the write may not have ended yet in modelled time)."""
        write()
        return slot.write.lane, slot.write.interval

    def wait_for_writes(self, slots: list[SlotState]) -> None:
        """The host waits until the modelled writes of ``slots`` have ended (its clock moves to
        the last one's end); the writer threads waiting for them to begin go on meanwhile."""
        for write in (s.write for s in slots if s.write is not None):
            self._rt.disk_wait(write)

    def cancel_writes(self, slots: list[SlotState]) -> None:
        """The run stopped early, and the model may never begin some writes of ``slots`` (their
        copies never ran, or the host stopped waiting): they are cancelled, so that no writer
        thread waits for them for ever."""
        for write in (s.write for s in slots if s.write is not None):
            write.cancel(RuntimeError("the run stopped before this chunk's copy ran"))

    def compressions(self) -> list:
        """``(first level index, n, (start, end) of the compression, (start, end) of the compressed
        bytes' copy, compressed bytes)`` of each chunk compressed on the modelled device, in modelled ms."""
        return [(first, n, *chunk.intervals(), chunk.nbytes) for first, n, chunk in self._compressed
                if chunk.task.done and chunk.task.error is None]


def _modelled_file(write, done):
    """The file of a modelled write, encoded when the write began: the copy (before the event
    ``done``) has landed by then, so the host is ordered after it (the peaks read the slot)."""
    chunk = write.result()
    observe.notify("host_synced", done)
    return chunk


def _disk_clock(rt, *, lanes, chunk, level_bytes, compresses):
    """The disk's clock for the runtime ``rt``: the modelled machine's on the CPU backend, the
    host's wall clock on a GPU. ``compresses``: the modelled device compresses the chunks."""
    if rt.predicts_times:                 # a model keeps the disk's clock (Runtime.disk_write)
        return _ModelledClock(rt, lanes=lanes, chunk=chunk, level_bytes=level_bytes, compresses=compresses)
    return _WallClock()


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
    ``chunk``: saved levels a chunk file holds, at most the run's saved levels (a larger one is
    capped, with a warning, as ``solve`` caps its ``batch``).
    """

    def __init__(self, path: str | os.PathLike, problem: WaveProblem, every: int, chunk: int, *,
                 compress: str | None = None, writers: int | None = None, pinned: bool = True,
                 checked: bool = False) -> None:
        writers = checks.positive_int("writers", DEFAULT_WRITERS if writers is None else writers)
        self.path = Path(path)
        self.nsaved = len(saved_levels(problem.nt, every))
        if checks.positive_int("chunk", chunk) > self.nsaved:
            # A chunk (a shard, compressed) sized beyond the run would hold levels that never come,
            # and its compression ratio would count them. (solve caps its batch the same way.)
            warnings.warn(f"chunk={chunk} is more than the run's {self.nsaved} saved levels: it is capped at "
                          f"{self.nsaved} (one chunk of the store holds them all)", stacklevel=2)
            chunk = self.nsaved
        if not checked:                # solve() checks the target once, before it allocates anything
            check_target(self.path, self.nsaved * problem.nbytes_level, compress)
        self.every = every
        self.chunk = chunk
        self.writers = writers
        self.level_bytes = problem.nbytes_level
        self.sharded = compress in SHARDED
        self._encode = _encoder(compress, problem.shape, chunk)
        where, why = engine_for(compress)             # where the chunks are compressed: "host", "device", "modelled"
        self.compression = {"codec": compress, "where": where, "why": why}
        self._clock = _disk_clock(runtime.get(), lanes=writers, chunk=chunk, level_bytes=self.level_bytes,
                                  compresses=where == "modelled")
        self._compressor = None        # on a GPU with compression on the device: the nvCOMP stage
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
        self._threads = [threading.Thread(target=self._write_chunks, args=(f"disk {i}",), name=f"disk writer {i}",
                                          daemon=True) for i in range(writers)]
        self._peaker = threading.Thread(target=self._take_peaks, name="disk peaks", daemon=True)
        self._flagger = threading.Thread(target=self._keep_flags, name="disk flags", daemon=True)
        # A Ctrl-C while the pipeline starts is held: it starts whole, then stops whole (its
        # threads joined, the empty store removed) and the Ctrl-C is raised.
        with interrupts.held() as ctrl_c:
            self.group, self._state, self._checksums = create_store(self.path, problem, every, chunk, compress)
            try:
                self.data, self.complete, self.peak = self.group[DATA], self.group["complete"], self.group["peak"]
                device = self._device_ring(problem, chunk, ring_slots(writers)) if where != "host" else None
                self.ring = Ring(self, self.nsaved, chunk, problem.shape, ring_slots(writers), pinned, device)
                for t in (*self._threads, self._peaker, self._flagger):
                    t.start()
                if self._compressor is not None:
                    self._compressor.start()
                if ctrl_c.count:
                    raise KeyboardInterrupt
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
        what = f"the store's ring on the device ({nslots} slots of {chunk} level(s)"
        if self.compression["where"] == "device":
            need += 3 * chunk * problem.nbytes_level    # nvCOMP's two output buffers and the packed one
            what += ", and the compression's three buffers of about a chunk each"
        what += ")"
        free = runtime.get().device_free_bytes()
        if free is not None and need > 0.9 * free:
            raise MemoryError(f"{what} needs {need / 2**20:,.0f} MiB of device memory but only {free / 2**20:,.0f} "
                              "MiB are free; use fewer levels per chunk (batch), or a smaller grid")
        if free is None:
            checks.host_memory(need, what, advice="use fewer levels per chunk (batch), or a smaller grid")
        device = device_empty((nslots, chunk, *problem.shape))
        if self.compression["where"] == "modelled":      # the modelled device's engine: no nvCOMP stage
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
    def copy_queued(self, slot: SlotState, first: int, n: int, stream: Stream) -> None:
        """The copy into ``slot`` (levels ``first`` to ``first + n - 1``) is queued on ``stream``:
        record an event after it and pass the slot to a writer thread (on the CPU backend, with
        the chunk's write queued on the modelled disk)."""
        slot.copy_queued()
        self._handed[first:first + n] = True
        self._recorder = recording.current()      # the disk lanes go into the solving thread's timeline
        done = streams.create_events(1)[0]
        done.record(stream)
        if self._compressor is not None:          # on a GPU: nvCOMP compresses it, then a writer writes it
            self._compressor.put(first, n, slot.index, done)
            return
        fetch = self._clock.chunk_file(slot, first, n, done, stream, lambda: self._encoded(slot, n))
        self._queue.put((first, n, slot, fetch))

    def _deliver(self, first, n, s, fetch):
        """The compression stage hands a chunk to the writers (``fetch()`` gives its file)."""
        self._queue.put((first, n, self.ring.states[s], fetch))

    def take_slot(self, chunk: int) -> SlotState:
        """A free slot for chunk number ``chunk``; the host waits while the ring is full, for as
        long as a slot can still come free: a slot the loop took but never copied into is never
        written, so waiting for it raises at once (:meth:`Ring.never_free`). A slot taken for this
        chunk and not copied into yet is handed out again."""
        slot = self.ring.taken_for(chunk)
        if slot is None:
            slot = self._clock.free_slot(self.ring, chunk, self.raise_error)
        return slot

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
        # A Ctrl-C now is held, and raised once everything has stopped: the threads joined, the
        # flags and the run's state written. Only the wait for the modelled writes stops at one.
        with interrupts.held() as ctrl_c:
            if self._ended:
                return
            self._ended = True
            stopped = None               # an error (a Ctrl-C) while waiting for the modelled writes
            try:                 # first: the writer threads wait for the modelled writes to begin
                with ctrl_c.stoppable():
                    self._clock.wait_for_writes(self.ring.states)
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
            self._clock.cancel_writes(self.ring.states)
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
        return self._clock.compressions()

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
            rec.add_interval("compress", COMPRESS, f"zstd level {level}", a, b, n * self.level_bytes, level)
            rec.add_interval("compress", OpKind.D2H, f"{OpKind.D2H} zstd level {level}", c, d, nbytes, level)

    # -- the writer threads --------------------------------------------------
    def _write_chunks(self, lane):
        """A writer thread: for each slot handed over, wait for its chunk's file (its copy, or its
        compression on the device), write it (timed on timeline lane ``lane``, or the modelled
        disk's) and hand the slot to the peaks thread."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            first, n, slot, fetch = item
            with self._lock:
                slot.readers, slot.written, slot.peaked = 1, False, False
            try:
                chunk = fetch()                   # waits for the copy (or the compression) to land
                with self._lock:
                    slot.readers += 1
                self._peaks_queue.put((first, n, slot, chunk.peaks))   # taken while this thread writes the file
                if self._error is None:
                    lane_used, times = self._clock.timed(lane, slot, functools.partial(self._write_chunk, first, chunk))
                    with self._lock:
                        self._intervals.append((first, lane_used, n * self.level_bytes, times))
                        slot.written = True
            except BaseException as exc:  # noqa: BLE001 - handed to the solving thread
                with self._lock:
                    if self._error is None:
                        self._error = _disk_error(exc, self.path, first, self.every)
            finally:
                self._release(slot, first, n)

    def _take_peaks(self):
        """The peaks thread: take each handed slot's peaks (largest |u| per level) while its writer
        writes it (those read on the device come with the chunk)."""
        while True:
            item = self._peaks_queue.get()
            if item is None:
                return
            first, n, slot, peak = item
            try:
                if peak is None:
                    peak = _peaks(slot.array[:n])
                with self._lock:
                    self._peak[first:first + n] = peak
                    slot.peaked = True
            except BaseException as exc:  # noqa: BLE001 - handed to the solving thread; keep serving
                with self._lock:
                    self._error = self._error or exc
            finally:
                self._release(slot, first, n)

    def _release(self, slot, first, n):
        """A reader of ``slot`` (its writer or the peaks thread) is done. After the last one the
        chunk's levels count as landed if its file was written and its peaks taken, and the slot
        is free again."""
        with self._lock:
            slot.readers -= 1
            if slot.readers:
                return
            if slot.written and slot.peaked:
                self._landed[first:first + n] = True
        self._dirty.set()
        self.ring.release(slot)

    def _encoded(self, slot, n):
        """The file of the chunk in ``slot`` (its first ``n`` levels), a :class:`~.shards.ChunkFile`.
        The array's last chunk may hold fewer levels: an unsharded chunk's file holds a whole
        chunk all the same (Zarr's rule), the levels past the end being the fill value; a shard
        leaves their inner chunks out (they read as the fill value). On the CPU backend's device
        (compression modelled there) the slot is read at the compression's start, with its peaks."""
        block = slot.array[:n]
        if self.ring.on_device:
            block = block.view(np.ndarray)
            parts, tag, nbytes, _ = self._encode(block)
            return ChunkFile(parts, tag, nbytes, _peaks(block))
        if n < self.chunk and not self.sharded:
            block = np.concatenate([block, np.full((self.chunk - n, *block.shape[1:]), np.nan, np.float32)])
        return self._encode(block)

    def _write_chunk(self, first, chunk):
        """The chunk's file, whole or absent: its parts (its bytes and their checksum, as the
        array's ``crc32c`` codec appends it; or a shard), written under a temporary name,
        fsync'ed, renamed. The chunk's record (its tag tied to its place,
        :class:`~.layout.Checksums`) is put in place first, so that every chunk file has one."""
        k = first // self.chunk
        self._checksums.record(k, chunk.tag)
        files.write_atomically(self.path / DATA / self.data.metadata.encode_chunk_key((k, 0, 0)), chunk.parts)

    # -- the flags thread ---------------------------------------------------
    def _keep_flags(self):
        """The flags thread: write ``peak`` and ``complete`` (for the levels whose chunks have
        landed) as soon as chunks have landed, then at most every :data:`FLAGS_EVERY_S`."""
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


def _disk_error(exc, path, first, every, what=None):
    what = what or f"level {first * every}"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return StoreWriteError(errno.ENOSPC, f"the disk holding the store {path} is full (writing {what})",
                               str(path))
    if isinstance(exc, OSError):
        return StoreWriteError(exc.errno, f"writing {what} to the store {path} failed: {exc}", str(path))
    return exc
