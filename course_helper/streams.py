"""Streams and events: the two primitives of concurrency on a GPU.

A **stream** is an in-order queue of device work (kernels, copies). Work on
one stream runs in the order it was queued; work on different streams may run
at the same time. An **event** marks a point in a stream; it completes when
everything queued before it on that stream has finished. Streams wait on
events (device-side ordering, the host keeps going); the host can wait on an
event or on a whole stream.

On the GPU backend these wrap ``cupy.cuda.Stream`` and ``cupy.cuda.Event``
(reach them through ``.raw``); on the CPU backend they wrap the worker-thread
runtime in :mod:`course_helper.cpu_runtime`, which has the same semantics.
"""
from __future__ import annotations

import functools
import threading
import weakref

from . import checks, observe, recording
from .backend import backend_name, cupy_module

__all__ = ["Stream", "Event", "create_streams", "create_events", "default_stream",
           "current_stream", "elapsed_ms", "stream_priority_range"]

# The CPU backend's priority range mirrors CUDA's convention: 0 is the lowest
# priority and more negative numbers are higher. It is accepted and reported,
# but threads are not scheduled by it.
_CPU_PRIORITY_RANGE = (0, -5)

_local = threading.local()
_cpu_streams: "weakref.WeakSet[Stream]" = weakref.WeakSet()


class Stream:
    """An in-order queue of device work. Make them with :func:`create_streams`.

    Attributes
    ----------
    name : str
        The label shown on timelines ("compute", "io 0", ...).
    synchronise : bool
        True when the stream implicitly synchronises with the default stream.
    priority : int
        The stream's priority (lower numbers are higher priority).
    raw : object
        The underlying ``cupy.cuda.Stream`` on the GPU backend (use it with raw
        CuPy, e.g. ``with s.raw: ...``), or the CPU runtime's stream.
    """

    def __init__(self, raw, name, synchronise, priority, backend, is_default=False):
        self.raw = raw
        self.name = name
        self.synchronise = synchronise
        self.priority = priority
        self.backend = backend
        self.is_default = is_default

    @property
    def on_gpu(self):
        return self.backend == "gpu"

    def synchronize(self):
        """Block the host until all work queued on this stream has finished.

        On the CPU backend, an exception raised by the stream's work is raised
        here, with its original traceback.
        """
        with recording.host_wait(f"wait for {self.name}"):
            self.raw.synchronize()
        observe.notify("host_synced", self)

    def wait_event(self, event):
        """Make later work on this stream wait until ``event`` completes (the host does not wait)."""
        checks.instance("event", event, Event, "an Event from create_events()")
        _same_backend(self, event)
        if not event.recorded:
            return      # as in CUDA, a never-recorded event counts as complete: nothing to wait for
        self.raw.wait_event(event.raw)
        observe.notify("event_waited", self, event)

    def wait_stream(self, other):
        """Make later work on this stream wait for the work queued so far on ``other``."""
        checks.instance("other", other, Stream, "a Stream")
        self.wait_event(other.record())

    def record(self, event=None):
        """Record ``event`` (a new one if None) at this point of the stream and return it."""
        if event is None:
            event = create_events(1)[0]
        checks.instance("event", event, Event, "an Event from create_events()")
        event.record(self)
        return event

    def launch_host_func(self, fn):
        """Queue a Python function to run (on a driver/worker thread) when the
        stream reaches this point, like ``cudaLaunchHostFunc``.

        Handy to simulate slow work or to log when a stream gets somewhere.
        The function must not queue device work itself. On the CPU backend an
        exception it raises comes back at the next synchronisation.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if self.on_gpu:
            self.raw.launch_host_func(lambda _arg: fn(), None)
        else:
            self.raw.submit(fn)

    def query(self):
        """True when all work queued on this stream has finished (never blocks)."""
        return bool(self.raw.done)

    @property
    def done(self):
        return self.query()

    def __enter__(self):
        stack = _stack()
        stack.append(self)
        if self.on_gpu:
            self.raw.__enter__()
        return self

    def __exit__(self, *exc):
        stack = _stack()
        if stack and stack[-1] is self:
            stack.pop()
        if self.on_gpu:
            self.raw.__exit__(*exc)
        return False

    def __repr__(self):
        kind = "default" if self.is_default else ("blocking" if self.synchronise else "non-blocking")
        return f"<Stream {self.name!r} {kind} priority={self.priority} on {self.backend}>"


class Event:
    """A marker in a stream. Make them with :func:`create_events`.

    ``timing=True`` events also carry a timestamp for :func:`elapsed_ms`.
    """

    def __init__(self, raw, timing, backend):
        self.raw = raw
        self.timing = timing
        self.backend = backend
        self.recorded = False

    def record(self, stream=None):
        """Mark the current end of ``stream`` (the current stream if None); returns the event."""
        stream = current_stream() if stream is None else stream
        checks.instance("stream", stream, Stream, "a Stream from create_streams()")
        _same_backend(stream, self)
        self.raw.record(stream.raw)
        self.recorded = True
        observe.notify("event_recorded", stream, self)
        return self

    def synchronize(self):
        """Block the host until the work before the event's latest record has finished."""
        with recording.host_wait("wait for event"):
            self.raw.synchronize()
        observe.notify("host_synced", self)

    def query(self):
        """True when the event has completed (or was never recorded); never blocks."""
        return bool(self.raw.done)

    @property
    def done(self):
        return self.query()

    def __repr__(self):
        state = "done" if self.done else "pending"
        return f"<Event timing={self.timing} {state} on {self.backend}>"


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _same_backend(a, b):
    if a.backend != b.backend:
        raise ValueError(f"cannot mix a {a.backend} {type(a).__name__} with a {b.backend} "
                         f"{type(b).__name__}; make both after choosing the backend")


def stream_priority_range():
    """``(lowest, highest)`` stream priority on this device; lower numbers are higher priority."""
    if backend_name() == "gpu":
        return _gpu_priority_range()
    return _CPU_PRIORITY_RANGE


@functools.lru_cache(maxsize=None)
def _gpu_priority_range():
    rt = cupy_module().cuda.runtime
    if hasattr(rt, "deviceGetStreamPriorityRange"):
        return tuple(rt.deviceGetStreamPriorityRange())
    # CUDA clamps a requested priority into the device's range, so asking for
    # two extreme priorities and reading them back gives the range.
    cuda = cupy_module().cuda
    lowest = cuda.Stream(non_blocking=True, priority=1 << 20).priority
    highest = cuda.Stream(non_blocking=True, priority=-(1 << 20)).priority
    return (int(lowest), int(highest))


def create_streams(n, synchronise=False, priority=None, name="stream"):
    """Create ``n`` streams.

    Parameters
    ----------
    n : int
        How many streams (at least 1).
    synchronise : bool
        False (default) gives *non-blocking* streams that never implicitly
        wait for the default stream - the usual choice for overlap. True gives
        streams that synchronise with the default stream.
    priority : int, optional
        Stream priority within :func:`stream_priority_range` (lower is higher).
    name : str
        Label for timelines; streams are named ``"{name} {i}"`` (or ``name``
        alone when ``n == 1``).

    Returns
    -------
    list of Stream

    Examples
    --------
    >>> compute, = create_streams(1, name="compute")
    >>> io = create_streams(2, name="io")
    """
    n = checks.positive_int("n (the number of streams)", n)
    synchronise = checks.flag("synchronise", synchronise)
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    lo, hi = stream_priority_range()
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if not hi <= priority <= lo:
            raise ValueError(f"priority {priority} is outside this device's range {hi}..{lo} "
                             f"({lo} is the lowest priority, {hi} the highest)")
    backend = backend_name()
    names = [name] if n == 1 else [f"{name} {i}" for i in range(n)]
    streams = []
    for label in names:
        if backend == "gpu":
            raw = _gpu_stream(non_blocking=not synchronise, priority=priority)
        else:
            from .cpu_runtime import CpuStream
            raw = CpuStream(non_blocking=not synchronise,
                            priority=lo if priority is None else priority, name=label)
        s = Stream(raw, label, bool(synchronise), lo if priority is None else priority, backend)
        if backend == "cpu":
            _cpu_streams.add(s)
        streams.append(s)
    return streams


def _gpu_stream(non_blocking, priority):
    cupy = cupy_module()
    if priority is None:
        return cupy.cuda.Stream(non_blocking=non_blocking)
    return cupy.cuda.Stream(non_blocking=non_blocking, priority=priority)


def create_events(n, timing=False):
    """Create ``n`` events; ``timing=True`` lets :func:`elapsed_ms` time between them."""
    n = checks.positive_int("n (the number of events)", n)
    timing = checks.flag("timing", timing)
    backend = backend_name()
    events = []
    for _ in range(n):
        if backend == "gpu":
            raw = cupy_module().cuda.Event(disable_timing=not timing)
        else:
            from .cpu_runtime import CpuEvent
            raw = CpuEvent(timing=timing)
        events.append(Event(raw, bool(timing), backend))
    return events


def elapsed_ms(start, end):
    """Milliseconds of device time between two completed timing events."""
    for label, ev in (("start", start), ("end", end)):
        checks.instance(label, ev, Event, "an Event")
        if not ev.timing:
            raise ValueError(f"the {label} event was created without timing; "
                             "use create_events(n, timing=True)")
        if not ev.recorded:
            raise ValueError(f"the {label} event was never recorded; call stream.record(event) first")
        if not ev.done:
            raise RuntimeError(f"the {label} event has not completed yet; call "
                               f"{label}.synchronize() (or the stream's) before reading the time")
    _same_backend(start, end)
    if start.backend == "gpu":
        return float(cupy_module().cuda.get_elapsed_time(start.raw, end.raw))
    from .cpu_runtime import get_elapsed_time
    return get_elapsed_time(start.raw, end.raw)


_default_cache = {}


def default_stream():
    """The default (legacy "null") stream of the active backend."""
    backend = backend_name()
    if backend == "gpu":
        if "gpu" not in _default_cache:
            _default_cache["gpu"] = Stream(cupy_module().cuda.Stream.null, "default", True, 0,
                                           "gpu", is_default=True)
        return _default_cache["gpu"]
    from .cpu_runtime import default_stream as cpu_default
    raw = cpu_default()
    cached = _default_cache.get("cpu")
    if cached is None or cached.raw is not raw:
        cached = _default_cache["cpu"] = Stream(raw, "default", True, 0, "cpu", is_default=True)
    return cached


def current_stream():
    """The innermost stream of a ``with stream:`` block, else the default stream."""
    stack = _stack()
    if stack and stack[-1].backend == backend_name():
        return stack[-1]
    return default_stream()


def resolve(stream):
    """``stream`` checked, or the current stream when None."""
    if stream is None:
        return current_stream()
    checks.instance("stream", stream, Stream, "a Stream from create_streams() (or None)")
    if stream.backend != backend_name():
        raise ValueError(f"this stream belongs to the {stream.backend} backend but the "
                         f"{backend_name()} backend is active; create a new stream")
    return stream


def _synchronize_all_cpu():
    """Wait for every live CPU stream and raise the first stored exception."""
    first = None
    for s in [default_stream(), *list(_cpu_streams)]:
        try:
            s.raw.synchronize()
            s.raw.raise_pending()
        except BaseException as exc:  # noqa: BLE001 - keep draining the others
            first = first or exc
    if first is not None:
        raise first.with_traceback(first.__traceback__)
