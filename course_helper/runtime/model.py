"""The CPU backend: a deterministic, calibrated model of a GPU that runs the work in NumPy.

Nothing runs in a thread. The model is a discrete-event simulation of one
device with a modelled host in front of it:

* **The host** has a clock. Each call into the runtime costs the host the time
  the same helper call took on the profiled GPU (a kernel launch, an event
  record, ``wait_event``, an async-copy call, a synchronise, a query, a graph
  launch); each kernel also costs the profile's ``loop_turn``, the Python a
  strategy's loop runs per turn between those calls. A host wait moves the host clock to the completion of what it
  waits for; a wait that blocked then costs the host its measured wake-up
  (coming back from the wait, its first calls' extra cost, and the idle
  device taking up the next command).
* **The device** has one compute engine (kernels, fills and device-to-device
  copies run one after another), ``async_engine_count`` copy engines, and
  two links, device-to-host and host-to-device, each with a bandwidth and a
  latency; a link runs the profile's ``copies_per_link`` copies at a time (1 on
  the H200: copies queued together in one direction run one after the other),
  or, where that is 0, any number sharing its bandwidth. A copy from pageable
  host memory is staged: it runs at the pageable bandwidth and the host waits
  for it. A kernel takes the time the profile measured for its shape and size
  (interpolated in the bytes it moves), plus any time it spends by design (the
  layer cake's oven: its cost's ``hold_us``).
* **Ordering** is CUDA's: a stream runs its work in order; ``wait_event``
  waits for the event's record current at call time; a never-recorded event
  counts as done; the legacy default stream waits for the work queued before
  on blocking streams and blocking streams wait for it; non-blocking streams
  skip that.
* **Data follow modelled time**: an operation reads its inputs when it starts
  (its results go to temporaries) and writes its outputs when it ends. A
  missing dependency therefore gives the same wrong answer on every run, and
  the host reading a pinned buffer before synchronising sees what a GPU would
  show it: the old contents.

**The disk** (for runs streamed to a store) is a stage of its own: a chunk's
write is queued on a writer lane when the copy into its host slot is queued,
starts when that copy has completed and the lane's previous write has ended,
and takes latency + bytes / bandwidth (the profile's ``disk`` section): the
writers' latencies overlap, and their bytes share the disk's bandwidth as
copies share a link. The host waits
for a write only where it needs the write's slot, or at the end of the run;
a device synchronise does not wait for the disk.

**Compression on the device** (``compress="gpu-zstd"``, where the profile has measured it) is a
stage between the copies and the disk: a chunk's compression starts when the copy into its
device slot has completed and the previous chunk's has ended, and takes the profile's
``compress`` latency + bytes / bandwidth on a compression engine of its own (it runs beside the
kernels: the model leaves out that nvCOMP's kernels share the GPU with the wave kernel); then
the compressed bytes cross the D2H link, and the chunk's disk write follows.

The device is only ever simulated up to the host's current modelled time (an
operation cannot start before it is queued), so that bandwidth sharing is
exact. Times are deterministic: two runs give identical times and results.

The model leaves out what the course does not need: concurrent kernels, the
launch queue's depth, clock boosts, caches beyond what the calibration of
each kernel shape captures, and host functions' cost (a host function takes
the wall time its Python code takes).

The model is in parts: :mod:`.scheduler` is the discrete-event engine (tasks on
lanes, engines, links, the loop that lets modelled time run), :mod:`.costs` what
each operation costs, :mod:`.capture` a captured graph, :mod:`.disk_lanes` the
disk's writer lanes and :mod:`.compress_lane` the compression engine; :class:`ModelRuntime`,
here, is the CUDA-like facade the rest of the package calls (streams, events, waits, work, graphs, memory, trace marks).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from . import interrupts
from .base import CpuDeviceArray, Runtime, plain_view, refuse_host_wait_in_capture
from .capture import Call, CapturedCall, ModelGraph
from .compress_lane import CompressedChunk, ModelCompressor, compress_spec
from .costs import alone_ms, kernel_us, link_ms, timing
from .disk_lanes import DiskWrite, ModelDisk
from .host import ModelHost
from .ops import CopyCost, Cost, FillCost, KernelCost, OpKind
from .scheduler import Lane, Scheduler, Task

__all__ = ["ModelRuntime", "DiskWrite", "CompressedChunk", "kernel_us", "link_ms"]


class ModelStream(Lane):
    """A stream of the modelled device (the CPU backend's raw stream): a lane of its
    scheduler with CUDA's stream flags."""

    def __init__(self, scheduler: Scheduler, non_blocking: bool, priority: int | None, name: str,
                 legacy_default: bool = False) -> None:
        super().__init__(scheduler, 0 if priority is None else priority, name)  # None: CUDA's default, the lowest (0)
        self.non_blocking = bool(non_blocking)
        self.legacy_default = legacy_default
        self.closed = False
        self.capture = None       # the graph being captured on this stream, if any


class ModelEvent:
    """An event of the modelled device: the marker task of its latest record."""

    def __init__(self, timing: bool) -> None:
        self.timing = bool(timing)
        self.task = None          # marker task of the latest record (None: never recorded)
        self.graph = None         # the capture its latest record belongs to, if any


def _serialised(method):
    """One host thread at a time drives the model (threads share its one modelled host), and a
    Ctrl-C waits for the model's state to be whole again: the end of the call, or a turn of the
    device's loop inside it (see :mod:`.interrupts`)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock, interrupts.deferred():
            return method(self, *args, **kwargs)
    return call


class ModelRuntime(Runtime):
    """The modelled GPU of one device profile (see the module's docstring): the CUDA-like
    calls, each charged to the modelled host, on a :class:`~.scheduler.Scheduler`."""

    name = "cpu"
    predicts_times = True
    device_array_type = CpuDeviceArray

    def __init__(self, profile: dict) -> None:
        self.profile = profile
        self.device_label = f"modelled {profile['device']['short_name']}" \
            if "short_name" in profile["device"] else f"modelled {profile['device']['name']}"
        self.clock_label = self.device_label
        self.provenance = profile["provenance"]
        # True where the calling context predicts times only (see times_only): a context
        # variable, so that it belongs to the thread (and the block) that set it.
        self._times_only = contextvars.ContextVar(f"times only on {self.device_label}", default=False)
        # Copies one link (direction) runs at a time: 1 on the H200, where two copies queued
        # together in one direction run one after the other; 0 (or absent): any number, sharing
        # the link's bandwidth.
        self.scheduler = Scheduler({"compute": 1, "copy": int(profile["device"]["async_engine_count"]), "compress": 1},
                                   {k: v["gbps"] * 1e6 for k, v in profile["links"].items()},   # bytes per ms
                                   int(profile["device"].get("copies_per_link", 0)))
        self.host = ModelHost(profile["host_us"], self.scheduler)
        self.disk = ModelDisk(self.scheduler)
        self.compressor = ModelCompressor(self.scheduler)
        self._blocking = weakref.WeakSet()
        self._all = weakref.WeakSet()
        self._captures = 0        # captures in progress: the host may not wait (refuse_host_wait_in_capture)
        self._default = None
        self._replaying = None            # the graph being replayed (its calls cost the host nothing)
        self._lock = threading.RLock()

    @property
    def computes_data(self) -> bool:
        """Whether work queued now, from this thread, computes its data (False inside
        :meth:`times_only`)."""
        return not self._times_only.get()

    @contextlib.contextmanager
    def times_only(self, on: bool = True) -> Iterator[None]:
        """Inside the block (when ``on``), predict times only: the NumPy work of what is queued
        is skipped, so results are left unwritten (a sweep of large grids is predicted in
        seconds). ``on=False``: compute inside the block, even within an outer one.

        The block belongs to the thread that entered it (a context variable): work queued by
        other threads computes unless they are inside a block of their own, and leaving the
        block restores what its thread had before, whatever other threads do meanwhile."""
        token = self._times_only.set(bool(on))
        try:
            yield
        finally:
            self._times_only.reset(token)

    def predicted_ms(self, cost: Cost) -> float | None:
        """The time of ``cost`` alone on the modelled device, from its profile (see
        :func:`~.costs.alone_ms`)."""
        return alone_ms(self.profile, cost)

    def compresses_on_device(self, codec: str) -> tuple[bool, str]:
        """``(True, ...)`` where the profile measured ``codec`` on the device (its ``compress``
        figures), which the modelled compression engine then runs; else ``(False, why not)``."""
        if compress_spec(self.profile, codec) is not None:
            return True, f"the {self.device_label}'s compression engine (its profile's 'compress' figures)"
        note = self.profile.get("compress", {}).get("note", "")
        return False, (f"the profile {self.profile.get('name', '')!r} has no measured compression on the device"
                       f"{': ' + note if note else ''}")

    # -- the host clock ---------------------------------------------------------
    def host_ms(self) -> float:
        return self.host.t

    def _call(self, what):
        """The host makes the API call ``what`` (a graph's replay costs it nothing)."""
        self.host.call(what, charged=self._replaying is None)

    # -- streams and events --------------------------------------------------
    def priority_range(self) -> tuple[int, int]:
        return (0, -5)       # CUDA's convention: 0 is the lowest priority; accepted, not scheduled by

    @_serialised
    def new_stream(self, non_blocking: bool, priority: int | None, name: str) -> ModelStream:
        s = ModelStream(self.scheduler, non_blocking, priority, name)
        if not non_blocking:
            self._blocking.add(s)
        self._all.add(s)
        return s

    @_serialised
    def default_stream(self) -> ModelStream:
        if self._default is None:
            self._default = ModelStream(self.scheduler, False, 0, "default", legacy_default=True)
            self._all.add(self._default)
        return self._default

    def close_stream(self, raw: ModelStream) -> None:
        raw.closed = True

    def new_event(self, timing: bool) -> ModelEvent:
        return ModelEvent(timing)

    def _implicit(self, stream):
        """Tasks ``stream`` must wait for under the legacy default-stream rules."""
        if stream.legacy_default:
            return [s.last for s in list(self._blocking) if s.last is not None and not s.last.done]
        if not stream.non_blocking:
            last = self.default_stream().last
            return [last] if last is not None and not last.done else []
        return []

    def _queue(self, stream, name, deps=(), **kw):
        if stream.closed:
            raise RuntimeError(f"stream {stream.name!r} was closed (its run has finished); "
                               "queue work on a stream of your own from create_streams()")
        return self.scheduler.add(stream, name, self.host.t, [*deps, *self._implicit(stream)], **kw)

    def _captured(self, stream, call, *args):
        """During a capture, remember the call instead of making it; returns the node or None."""
        graph = stream.capture
        if graph is None or self._replaying is not None:
            return None
        return graph.add(call, args)

    @_serialised
    def record(self, event: ModelEvent, stream: ModelStream) -> None:
        if self._captured(stream, Call.RECORD, event, stream):
            event.graph = stream.capture
            return
        self._call("record")
        event.task = self._queue(stream, "event record")
        event.graph = None
        self.host.catch_up()

    @_serialised
    def wait_event(self, stream: ModelStream, event: ModelEvent) -> None:
        if event.graph is not None and stream.capture is None and self._replaying is None:
            event.graph.join(stream)          # waiting on a captured record forks into the capture
        if self._captured(stream, Call.WAIT_EVENT, stream, event):
            return
        self._call("wait_event")
        if event.task is not None and (not event.task.done or event.task.error is not None):
            self._queue(stream, "wait event", deps=[event.task])
            self.host.catch_up()

    @_serialised
    def stream_done(self, raw: ModelStream) -> bool:
        self._call("query")
        return raw.last is None or raw.last.done

    @_serialised
    def event_done(self, raw: ModelEvent) -> bool:
        self._call("query")
        return raw.task is None or raw.task.done

    _no_wait_in_capture = staticmethod(refuse_host_wait_in_capture)

    @_serialised
    def sync_stream(self, raw: ModelStream) -> None:
        if raw.capture is not None:
            self._no_wait_in_capture(f"synchronising stream {raw.name!r}")
        self.host.wait(raw.last, f"stream {raw.name!r}")
        exc = raw.error
        if exc is not None:
            if _told(raw):
                raw.error = None
            raise exc.with_traceback(exc.__traceback__)

    @_serialised
    def sync_event(self, raw: ModelEvent) -> None:
        self.host.wait(raw.task, "an event")
        if raw.task is not None and raw.task.error is not None:
            err = raw.task.error
            raise err.with_traceback(err.__traceback__)

    @_serialised
    def sync_device(self) -> None:
        if any(s.capture is not None for s in list(self._all)):
            self._no_wait_in_capture("synchronising the device")
        self.host.call("synchronize")
        sched = self.scheduler
        self.host.block_until(sched.device_idle, "the device", lambda: sched.t)     # not the disk
        first = _take_error([self.default_stream(), *sorted(self._all, key=lambda s: s.seq)])
        if first is not None:
            raise first.with_traceback(first.__traceback__)

    @_serialised
    def elapsed_ms(self, start: ModelEvent, end: ModelEvent) -> float:
        return end.task.end - start.task.end

    # -- work ----------------------------------------------------------------
    @_serialised
    def enqueue(self, stream: ModelStream, op: Any, cuda: Callable | None, numpy: Callable | None,
                cost: Cost) -> None:
        kernel = type(cost) is KernelCost
        if kernel:
            _writable_outputs(op)             # at launch (and capture), not when it would write them
        if self._captured(stream, Call.ENQUEUE, stream, op, cuda, numpy, cost):
            return
        kw = timing(self.profile, op, cost, self._replaying is not None)
        copy = type(cost) is CopyCost
        if copy:
            self._call("copy_d2d" if cost.kind == OpKind.D2D and "copy_d2d" in self.profile["host_us"]
                       else "copy")
            begin = _begin_copy(cost.dst, cost.src) if self.computes_data else None
        else:
            self._call("launch")
            if kernel and self._replaying is None:
                # One kernel per turn of a strategy's loop: the loop's own Python between the
                # helper's calls (slots, indexing) is charged here, once per turn.
                self.host.spend(self.profile["host_us"].get("loop_turn", 0.0) * 1e-3)
            begin = (_begin_op(op.writes, _zero if type(cost) is FillCost else numpy)
                     if self.computes_data else None)
        task = self._queue(stream, op.name, begin=begin, **kw)
        if copy and cost.pageable and self._replaying is None:
            # Staged through the driver's own pinned buffer: the call returns when the copy is done.
            # No wake-up: the host thread is not asleep but copying the staged chunks itself (and
            # the pageable link is fitted to the sequential loop, which would absorb one).
            self.host.busy_until(task, f"a pageable copy on {stream.name!r}")
        self.host.catch_up()

    @_serialised
    def host_func(self, stream: ModelStream, fn: Callable[[], Any]) -> None:
        if self._captured(stream, Call.HOST_FUNC, stream, fn):
            return
        self._call("host_func")
        self._queue(stream, getattr(fn, "__name__", "host function"), begin=fn, engine="host")
        self.host.catch_up()

    # -- the disk ----------------------------------------------------------------
    def predicted_disk_gbps(self) -> float:
        """The modelled disk's write bandwidth, from the profile (its ``disk`` figures)."""
        return self.profile["disk"]["gbps"]

    @_serialised
    def disk_write(self, lane: str, after: ModelEvent | CompressedChunk, encode: Callable[[], Any]) -> DiskWrite:
        """Queue one chunk's write to the modelled disk on the writer lane ``lane``, after the event
        ``after`` (or the copy of a compressed chunk; see :meth:`~.disk_lanes.ModelDisk.write`).
        Queuing costs the host nothing."""
        write = self.disk.write(self.profile, lane, after, encode, self.host.t)
        self.host.catch_up()
        return write

    @_serialised
    def compress_chunk(self, codec: str, after: ModelEvent, nbytes: int, work: Callable[[], Any]) -> CompressedChunk:
        """Queue one chunk's compression with ``codec`` on the modelled compression engine after the
        event ``after``, then the copy of its compressed bytes to the host (see
        :meth:`~.compress_lane.ModelCompressor.compress`). Queuing costs the host nothing."""
        chunk = self.compressor.compress(self.profile, codec, after, nbytes, work, self.host.t)
        self.host.catch_up()
        return chunk

    @_serialised
    def disk_wait(self, write: DiskWrite) -> None:
        """The host waits until ``write`` is on the modelled disk: its clock moves to the write's end."""
        self.host.busy_until(write.task, f"a write on {write.lane!r}")
        self.host.catch_up()

    # -- graphs ----------------------------------------------------------------
    def graphs_supported(self) -> tuple[bool, str]:
        return True, ""

    @_serialised
    def begin_capture(self, stream: ModelStream) -> None:
        if stream.capture is not None:
            raise RuntimeError(f"stream {stream.name!r} is already being captured")
        stream.capture = ModelGraph(stream)
        self._captures += 1

    def capturing(self) -> bool:
        return self._captures > 0

    def stream_capturing(self, stream: ModelStream) -> bool:
        return stream.capture is not None and self._replaying is None

    @_serialised
    def end_capture(self, stream: ModelStream) -> ModelGraph:
        graph = stream.capture
        self._captures -= 1             # over either way: end() raises on an unjoined fork
        graph.end()
        return graph

    @_serialised
    def abort_capture(self, stream: ModelStream) -> None:
        if stream.capture is not None:
            self._captures -= 1
            stream.capture.release()

    @_serialised
    def launch_graph(self, graph: ModelGraph, stream: ModelStream) -> None:
        """One launch on the host; the captured work follows the work queued before on ``stream``."""
        if any(s.capture is not None for s in graph.streams):
            raise RuntimeError("this graph is still being captured; launch it after the capture block")
        self._call("graph_launch")
        entry = stream.last if stream.last is not None and not stream.last.done else None
        self._replaying = graph
        try:
            for s in graph.streams:
                if s is not stream and entry is not None:
                    self._queue(s, "graph start", deps=[entry])
            for node in graph.nodes:
                _REPLAY[node.call](self, *node.args)
                node.task = node.args[0].last if node.call is not Call.RECORD else node.args[0].task
            lasts = [s.last for s in graph.streams if s is not stream and s.last is not None]
            if lasts:
                self._queue(stream, "graph end", deps=lasts)
        finally:
            self._replaying = None
        self.host.catch_up()

    # -- memory -----------------------------------------------------------------
    def device_array(self, shape: Any, dtype: Any, zero: bool) -> CpuDeviceArray:
        return (np.zeros if zero else np.empty)(shape, dtype).view(CpuDeviceArray)

    def is_device_array(self, a: Any) -> bool:
        return isinstance(a, CpuDeviceArray)

    @_serialised
    def to_device(self, host: Any) -> CpuDeviceArray:
        self.sync_stream(self.default_stream())
        out = np.array(host, copy=True).view(CpuDeviceArray)
        self.host.spend(link_ms(self.profile, "H2D_pageable", out.nbytes))
        self.host.catch_up()
        return out

    @_serialised
    def to_host(self, device_array: CpuDeviceArray) -> np.ndarray:
        self.sync_device()
        out = np.array(device_array.view(np.ndarray), copy=True)
        self.host.spend(link_ms(self.profile, "D2H_pageable", out.nbytes))
        self.host.catch_up()
        return out

    def pinned_empty(self, shape: Any, dtype: Any) -> np.ndarray:
        return np.empty(shape, dtype)

    # -- timing marks ----------------------------------------------------------
    @_serialised
    def trace_begin(self) -> dict:
        return {"t0": self.host.t}

    def trace_start(self, stream: ModelStream, origin: dict) -> None:
        return None

    @_serialised
    def trace_end(self, stream: ModelStream, start: None, origin: dict) -> Task | CapturedCall | None:
        graph = stream.capture
        if graph is not None and self._replaying is None:
            return graph.nodes[-1] if graph.nodes else None
        return stream.last

    @_serialised
    def trace_times(self, origin: dict, start: None, end: Task | CapturedCall | None) -> tuple[float, float] | None:
        task = end.task if isinstance(end, CapturedCall) else end
        if task is None or task.skipped or task.end is None:
            return None
        return task.start - origin["t0"], task.end - origin["t0"]

    def trace_host_ms(self, origin: dict, host_ms: float) -> float:
        return host_ms - origin["t0"]


#: What a captured call does again when its graph is replayed.
_REPLAY = {Call.ENQUEUE: ModelRuntime.enqueue, Call.HOST_FUNC: ModelRuntime.host_func,
           Call.RECORD: ModelRuntime.record, Call.WAIT_EVENT: ModelRuntime.wait_event}


def _told(stream):
    """Whether raising ``stream``'s error now tells the thread it belongs to (the thread that
    queued the failed work, or any thread once that one has ended), so that it is dealt with.

    A synchronise that covers a failed stream raises its error in whichever thread calls it,
    as CUDA reports a failed launch to any synchronise that waits for it; but the error stays
    with the stream until its own thread has been told, so that thread's synchronise never
    returns as if nothing had failed because another thread's synchronise took its error."""
    owner = stream.error_owner
    return owner is None or owner is threading.current_thread() or not owner.is_alive()


def _take_error(streams):
    """The error a synchronise covering ``streams`` raises (None if none failed): the first of
    those it tells (see :func:`_told`), else the first; it takes the errors of those it tells."""
    failed = [s for s in streams if s.error is not None]
    mine = [s for s in failed if _told(s)]
    first = (mine or failed)[0].error if failed else None
    for s in mine:
        s.error = None
    return first


def _begin_op(writes, numpy):
    """An operation that reads at its start and writes ``writes`` at its end."""
    def begin():
        outs = [np.array(plain_view(w)) for w in writes]
        numpy(*outs)                               # reads its inputs now
        return lambda: [np.copyto(plain_view(w), o) for w, o in zip(writes, outs)]
    return begin


def _begin_copy(dst, src):
    """A copy that reads ``src`` at its start and writes ``dst`` at its end."""
    def begin():
        data = np.array(plain_view(src))          # read at the start (the copy's read, not the host's)
        return lambda: np.copyto(plain_view(dst), data)
    return begin


def _zero(out):
    out.fill(0)


def _writable_outputs(op):
    """Refuse a kernel that would write a read-only array: it could only fail when it ends."""
    for a in op.writes:
        if not a.flags.writeable:
            shape = "x".join(str(n) for n in a.shape)
            raise ValueError(f"{op.name} would write a read-only {shape} {a.dtype} device array "
                             "(its flags.writeable is False); pass a writable device array "
                             "(device_empty()/device_zeros(), or one whose flags.writeable is True)")
