"""Recording a timeline of device work while it is queued.

Every helper operation (kernel launch, copy) goes through :func:`enqueue`, and
every host-side wait through :func:`host_wait`. While a recorder is active
(``with tracing() as trace:`` or ``solve(..., trace=True)``) each operation is
timed *on its own stream*:

* GPU backend without CUPTI: a CUDA event is recorded just before and after the
  operation on the operation's stream; after the run every timestamp is read
  relative to one reference event, so all streams share the device clock. On
  an idle stream the "before" event fires as soon as it is recorded, while the
  host is still preparing the launch, so a start is never placed earlier than
  the moment the host queued the operation (host clock mapped onto the device
  clock through the reference event). Checked against CUPTI in
  ``benchmarks/trace_check.py``;
* GPU backend with CUPTI (``cupti-python`` installed): no events at all; the
  driver's activity records time each operation (:mod:`course_helper.cupti_trace`,
  an observer of the queued operations). This is the default where it works;
* CPU backend: the stream's worker thread reads its clock when it starts and
  finishes the task.

``trace.meta["timing"]`` says which of these timed a trace.

Host waits are timed with the host clock, aligned with the device clock at
the start of the recording (to within a few microseconds).
"""
from __future__ import annotations

import contextlib
import time
from collections import namedtuple

from . import observe
from .backend import backend_name, cupy_module, synchronize

_clock = time.perf_counter
_current = None
#: True while a CUDA graph capture is in progress (set by graphs.capture_graph): marks are
#: then recorded as event-record nodes of the graph.
capturing = False
_gpu_event_pool = []   # raw cudaEvent_t handles, reused between recordings


def _cupti_wanted():
    from .cupti_trace import wanted
    return wanted()


def current():
    """The active recorder, or None when nothing is being traced."""
    return _current


TraceEventArgs = namedtuple("TraceEventArgs", "track kind name start end nbytes level")


class _Pending:
    __slots__ = ("track", "kind", "name", "start", "end", "nbytes", "level", "queued")

    def __init__(self, track, kind, name, start, end, nbytes, level, queued=None):
        self.track, self.kind, self.name = track, kind, name
        self.start, self.end, self.nbytes, self.level = start, end, nbytes, level
        self.queued = queued     # host clock when the operation was queued (None in a graph capture)


class Recorder:
    """Collects the operations of one run; :meth:`finish` turns them into a Trace."""

    def __init__(self, meta=None):
        self.backend = backend_name()
        self.meta = dict(meta or {})
        self.items = []
        self.hosts = []
        self.intervals = []      # host-clock work on extra lanes (add_interval)
        self.tracks = []
        synchronize()
        self.cupti = None
        self.timing = "host clock"
        if self.backend == "gpu" and _cupti_wanted():
            from .cupti_trace import CuptiTimer
            self.cupti = CuptiTimer().start()
            self.timing = "CUPTI"
        elif self.backend == "gpu":
            self.timing = "CUDA events"
            rt = cupy_module().cuda.runtime
            self._rt = rt
            self._used = []
            self._t0 = self._new_event()
            rt.eventRecord(self._t0, 0)
            rt.eventSynchronize(self._t0)
        self._host_t0 = _clock()

    # -- GPU event marks --------------------------------------------------
    def _new_event(self):
        ev = _gpu_event_pool.pop() if _gpu_event_pool else self._rt.eventCreate()
        self._used.append(ev)
        return ev

    def activate(self):
        """Make this the recorder that helper operations report to."""
        global _current
        if _current is not None:
            raise RuntimeError("a trace is already being recorded; nested tracing() blocks are not supported")
        _current = self
        return self

    def deactivate(self):
        """Stop receiving operations (safe to call more than once)."""
        global _current
        if _current is self:
            _current = None
        if self.cupti is not None and self.cupti.running:
            # Let the queued work finish, so that CUPTI's records are complete, and stop
            # CUPTI (its records are kept for finish()).
            with contextlib.suppress(Exception):   # a device error resurfaces at the caller's next sync
                synchronize()
            self.cupti.stop()

    def mark(self, stream):
        ev = self._new_event()
        if capturing:
            from .graphs import record_external
            record_external(ev, stream.raw.ptr)           # a timestamp node of the graph
        else:
            self._rt.eventRecord(ev, stream.raw.ptr)
        return ev

    def _track(self, name):
        if name not in self.tracks:
            self.tracks.append(name)

    def add(self, stream, kind, name, start, end, nbytes, level, queued=None):
        self._track(stream.name)
        item = _Pending(stream.name, kind, name, start, end, nbytes, level, queued)
        self.items.append(item)
        return item

    def add_host(self, name, t_start, t_end):
        self.hosts.append((name, t_start, t_end))

    def add_interval(self, track, kind, name, t_start, t_end, nbytes=0, level=None):
        """Add work timed on the host clock on its own lane (e.g. the "disk" writes of a
        streamed run); safe to call from other threads."""
        self.intervals.append(TraceEventArgs(track, kind, name, t_start, t_end, nbytes, level))

    # -- turning marks into times -------------------------------------------
    def finish(self):
        """Wait for the device, read every timestamp, and return a :class:`Trace`."""
        from .timeline import Trace, TraceEvent
        self.deactivate()
        synchronize()
        events = []
        if self.cupti is not None:
            cupti_events, tracks, info = self.cupti.events()
            events.extend(cupti_events)
            for name in tracks:
                self._track(name)
            self.meta.update(info)
        elif self.backend == "gpu":
            rt, t0 = self._rt, self._t0
            for it in self.items:
                start = rt.eventElapsedTime(t0, it.start)
                if it.queued is not None:
                    # On an idle stream the start event fires as soon as it is recorded, before
                    # the host has even queued the operation; the operation cannot start before
                    # it was queued (host time mapped onto the device clock via the reference).
                    start = max(start, (it.queued - self._host_t0) * 1e3)
                end = rt.eventElapsedTime(t0, it.end)
                events.append(TraceEvent(it.track, it.kind, it.name, min(start, end), end,
                                         it.nbytes, it.level))
            _gpu_event_pool.extend(self._used)
            self._used = []
        else:
            for it in self.items:
                if it.start is None or it.end is None:   # skipped after a failure
                    continue
                events.append(TraceEvent(it.track, it.kind, it.name,
                                         (it.start - self._host_t0) * 1e3,
                                         (it.end - self._host_t0) * 1e3, it.nbytes, it.level))
        for name, a, b in self.hosts:
            events.append(TraceEvent("host", "host wait", name,
                                     (a - self._host_t0) * 1e3, (b - self._host_t0) * 1e3, 0, None))
        for it in self.intervals:
            events.append(TraceEvent(it.track, it.kind, it.name, (it.start - self._host_t0) * 1e3,
                                     (it.end - self._host_t0) * 1e3, it.nbytes, it.level))
        if events:
            # Time zero is the first recorded operation (a graph, say, is captured long
            # before it is replayed; the capture is not part of the timeline).
            origin = min(e.start_ms for e in events)
            for e in events:
                e.start_ms -= origin
                e.end_ms -= origin
        tracks = (sorted(self.tracks, key=_track_order) + (["host"] if self.hosts else [])
                  + sorted({it.track for it in self.intervals}, key=_track_order))
        return Trace(events, tracks, dict(self.meta, backend=self.backend, timing=self.timing))


def _track_order(name):
    """compute/default first, then numbered streams in number order ("io 2" before "io 10")."""
    head, _, tail = name.rpartition(" ")
    if tail.isdigit():
        return (1, head, int(tail))
    return (0 if name in ("compute", "default") else 1, name, -1)


def enqueue(stream, *, kind, name, gpu=None, cpu=None, nbytes=0, level=None, reads=(), writes=()):
    """Queue one operation on ``stream``: call ``gpu()`` on the GPU backend or
    submit ``cpu`` to the stream's worker on the CPU backend; trace it if a
    recorder is active. ``reads``/``writes`` name the arrays it touches (for
    the observers of :mod:`course_helper.observe`)."""
    op = observe.Op(kind, name, stream, level, nbytes, tuple(reads), tuple(writes))
    observe.notify("op_queued", op)
    _submit(stream, kind, name, gpu, cpu, nbytes, level)
    observe.notify("op_submitted", op)


def _submit(stream, kind, name, gpu, cpu, nbytes, level):
    rec = _current
    if stream.on_gpu:
        if rec is None or rec.cupti is not None:    # untraced, or CUPTI times it (an observer)
            gpu()
            return
        start = rec.mark(stream)
        queued = None if capturing else _clock()
        gpu()
        rec.add(stream, kind, name, start, rec.mark(stream), nbytes, level, queued)
        return
    if rec is None:
        stream.raw.submit(cpu)
        return
    item = rec.add(stream, kind, name, None, None, nbytes, level)

    def timed():
        item.start = _clock()
        cpu()
        item.end = _clock()

    stream.raw.submit(timed)


@contextlib.contextmanager
def host_wait(name):
    """Time a host-side wait on the host track (when a recorder is active)."""
    rec = _current
    if rec is None:
        yield
        return
    t = _clock()
    try:
        yield
    finally:
        rec.add_host(name, t, _clock())


class _TraceHandle:
    """What ``with tracing() as trace`` gives: the Trace, once the block ends."""

    def __init__(self):
        self.trace = None

    def __getattr__(self, attr):
        if self.trace is None:
            raise RuntimeError("the trace is ready only after the `with tracing()` block ends")
        return getattr(self.trace, attr)


@contextlib.contextmanager
def tracing(**meta):
    """Record a timeline of the helper operations queued inside the block.

    Examples
    --------
    >>> with tracing(label="my loop") as t:
    ...     launch_wave2d(...)                       # doctest: +SKIP
    >>> t.plot()                                     # doctest: +SKIP
    """
    if _current is not None:       # checked before Recorder() synchronises the device
        raise RuntimeError("a trace is already being recorded; nested tracing() blocks are not supported")
    rec = Recorder(meta).activate()
    handle = _TraceHandle()
    try:
        yield handle
    except BaseException:
        # Keep what was recorded before the error, so it can still be looked at.
        try:
            handle.trace = rec.finish()
        except BaseException:  # noqa: BLE001 - the original error matters more
            pass
        raise
    finally:
        rec.deactivate()
    handle.trace = rec.finish()
