"""Recording a timeline of device work while it is queued.

The recorder is an observer (:mod:`course_helper.runtime.observe`) of the runtime: it
sees every operation queued while it is active (``with tracing() as trace:``
or ``solve(..., trace=True)``) and asks the runtime to time it *on its own
stream* (:meth:`~course_helper.runtime.base.Runtime.trace_start`):

* GPU backend: a CUDA event is recorded just before and just after the
  operation on its stream, read against one reference event after the run
  (see :mod:`course_helper.runtime.gpu`);
* GPU backend with CUPTI (``cupti-python`` installed, the default where it
  works): no events at all; the driver's activity records time each operation
  (:mod:`course_helper.timelines.cupti_trace`, itself an observer of the queued operations);
* CPU backend: the modelled GPU knows when each operation started and ended,
  in modelled time.

``trace.meta["timing"]`` says which of these timed a trace ("CUPTI", "CUDA
events" or "modelled H200").

Host waits are timed with the runtime's host clock. Host and device lanes share
one origin, taken once (:meth:`~course_helper.runtime.base.Runtime.trace_begin`,
when the device is idle): event marks are timed from an event recorded at that
moment, the model's times are on the modelled host clock already, and CUPTI's
records are mapped onto the host clock through readings of both clocks taken
together (:func:`course_helper.timelines.cupti_trace.read_clocks_together`). A host
wait that ends when a kernel ends is drawn ending where the kernel does.

A recording belongs to the thread that opened it: work queued by other threads
never lands in it.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

from . import cupti_trace
from ..runtime import observe
from .. import runtime
from ..streams import synchronize
from .timeline import Trace, TraceEvent

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ..runtime.observe import Op
    from ..streams import Stream

_local = threading.local()


def current() -> Recorder | None:
    """The calling thread's active recorder, or None when it is not tracing."""
    return getattr(_local, "recorder", None)


class Recorder:
    """Collects the operations of one run; :meth:`finish` turns them into a Trace."""

    def __init__(self, meta: dict | None = None):
        self.runtime = runtime.get()
        self.backend = self.runtime.name
        self.meta = dict(meta or {})
        self.items = []
        self.hosts = []
        self.intervals = []      # host-clock work on extra lanes (add_interval), e.g. disk writes
        self.tracks = []
        synchronize()
        self.cupti = None
        if self.runtime.clock_label:
            self.timing = self.runtime.clock_label           # "modelled H200": its own clock times it
        elif cupti_trace.wanted():
            self.timing = "CUPTI"
        else:
            self.timing = "CUDA events"
        # Who times the operations: CUPTI's records, or marks the runtime places around each one
        # (CUDA events on a GPU, the model's own clock on the CPU). Each is an observer of its own,
        # so a CUPTI recording pays nothing per operation for the marks it does not use.
        self.marks = None
        if self.timing == "CUPTI":
            # CUPTI's set-up comes before the origin; its records are mapped
            # onto the host clock (CuptiTimer.events), so they share the origin with host waits.
            self.cupti = cupti_trace.CuptiTimer().start()
        try:
            self._origin = self.runtime.trace_begin()    # the one origin of host and device lanes
        except BaseException:
            if self.cupti is not None:
                self.cupti.stop()
            raise
        if self.cupti is None:
            self.marks = _MarkTimer(self.runtime, self._origin, self.items, self.tracks)

    def activate(self) -> Recorder:
        """Make this the recorder that the calling thread's operations report to."""
        if current() is not None:
            raise RuntimeError("a trace is already being recorded; nested tracing() blocks are not supported")
        _local.recorder = self
        observe.add(self)
        if self.marks is not None:
            observe.add(self.marks)
        return self

    def deactivate(self) -> None:
        """Stop receiving operations (safe to call more than once)."""
        observe.remove(self)
        if self.marks is not None:
            observe.remove(self.marks)
        if current() is self:
            _local.recorder = None
        if self.cupti is not None and self.cupti.running:
            # Let the queued work finish, so that CUPTI's records are complete, and stop
            # CUPTI (its records are kept for finish()).
            with contextlib.suppress(Exception):   # a device error resurfaces at the caller's next sync
                synchronize()
            self.cupti.stop()

    # -- what the runtime announces -------------------------------------------
    def host_waited(self, name: str, t_start_ms: float, t_end_ms: float) -> None:
        """The host waited (``name``) from ``t_start_ms`` to ``t_end_ms`` of the runtime's host clock."""
        self.hosts.append((name, t_start_ms, t_end_ms))

    def add_interval(self, track: str, kind: str, name: str, t_start: float, t_end: float, nbytes: int = 0,
                     level: int | None = None) -> None:
        """Add work timed on the runtime's host clock (:func:`runtime.host_ms`) on a lane of
        its own, e.g. the disk writes of a streamed run; safe to call from other threads."""
        self.intervals.append((track, kind, name, t_start, t_end, nbytes, level))

    # -- turning marks into times -------------------------------------------
    def finish(self) -> Trace:
        """Wait for the device, read every timestamp, and return a :class:`Trace`."""
        self.deactivate()
        synchronize()
        rt, origin = self.runtime, self._origin
        events = []
        if self.cupti is not None:
            cupti_events, tracks, info = self.cupti.events()
            for e in cupti_events:                # host-clock readings -> ms from the origin
                e.start_ms, e.end_ms = rt.trace_host_ms(origin, e.start_ms), rt.trace_host_ms(origin, e.end_ms)
            events.extend(cupti_events)
            for name in tracks:
                if name not in self.tracks:
                    self.tracks.append(name)
            self.meta.update(info)
        for track, kind, name, start, end, nbytes, level in self.items:
            times = rt.trace_times(origin, start, end)
            if times is not None:                 # None: skipped after a failure
                events.append(TraceEvent(track, kind, name, times[0], times[1], nbytes, level))
        for name, a, b in self.hosts:
            events.append(TraceEvent("host", "host wait", name, rt.trace_host_ms(origin, a),
                                     rt.trace_host_ms(origin, b), 0, None))
        for track, kind, name, a, b, nbytes, level in self.intervals:
            events.append(TraceEvent(track, kind, name, rt.trace_host_ms(origin, a),
                                     rt.trace_host_ms(origin, b), nbytes, level))
        rt.trace_release(origin)
        if events:
            # Time zero is the first recorded operation (a graph, say, is captured long
            # before it is replayed; the capture is not part of the timeline).
            t0 = min(e.start_ms for e in events)
            for e in events:
                e.start_ms -= t0
                e.end_ms -= t0
        tracks = (sorted(self.tracks, key=_track_order) + (["host"] if self.hosts else [])
                  + sorted({it[0] for it in self.intervals}, key=_track_order))
        meta = dict(self.meta, backend=self.backend, device=rt.device_label, timing=self.timing)
        if rt.clock_label:
            meta["clock"] = rt.clock_label          # "modelled H200": these times are modelled
        return Trace(events, tracks, meta)


class _MarkTimer:
    """Times each queued operation with marks the runtime places just before and just after
    it on its stream (:meth:`~course_helper.runtime.base.Runtime.trace_start`); fills the
    recorder's ``items`` and ``tracks``."""

    def __init__(self, rt, origin, items, tracks):
        self.runtime, self.origin, self.items, self.tracks = rt, origin, items, tracks
        self._open = {}
        self._track = {}                  # id(raw stream) -> (the raw stream, its track)

    def track_of(self, stream: Stream) -> str:
        """The track of ``stream``'s work: its name, or, where another stream of the same name came
        first, its name and a number ("stream (2)"): two streams never share a lane."""
        found = self._track.get(id(stream.raw))
        if found is not None and found[0] is stream.raw:
            return found[1]
        taken = set(self.tracks) | {t for _, t in self._track.values()}
        name, n = stream.name, 2
        while name in taken:
            name, n = f"{stream.name} ({n})", n + 1
        self._track[id(stream.raw)] = (stream.raw, name)
        return name

    def op_queued(self, op: Op) -> None:
        if op.stream.runtime is self.runtime:
            self._open[id(op)] = self.runtime.trace_start(op.stream.raw, self.origin)

    def op_issued(self, op: Op) -> None:
        if id(op) not in self._open:      # queued on another runtime's stream
            return
        start = self._open.pop(id(op))
        name = self.track_of(op.stream)
        if name not in self.tracks:
            self.tracks.append(name)
        end = self.runtime.trace_end(op.stream.raw, start, self.origin)
        self.items.append((name, op.kind, op.name, start, end, op.nbytes, op.level))


def _track_order(name):
    """compute/default first, then numbered streams in number order ("io 2" before "io 10")."""
    head, _, tail = name.rpartition(" ")
    if tail.isdigit():
        return (1, head, int(tail))
    return (0 if name in ("compute", "default") else 1, name, -1)


class _TraceHandle:
    """What ``with tracing() as trace`` gives: the Trace, once the block ends."""

    def __init__(self):
        self.trace = None

    def __getattr__(self, attr):
        if self.trace is None:
            raise RuntimeError("the trace is ready only after the `with tracing()` block ends")
        return getattr(self.trace, attr)


@contextlib.contextmanager
def tracing(**meta: object) -> Iterator[_TraceHandle]:
    """Record a timeline of the helper operations queued inside the block.

    Examples
    --------
    >>> with tracing(label="my loop") as t:
    ...     launch_wave2d(...)                       # doctest: +SKIP
    >>> t.plot()                                     # doctest: +SKIP
    """
    if current() is not None:      # checked before Recorder() synchronises the device
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
