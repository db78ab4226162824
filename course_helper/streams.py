"""Streams and events: the two primitives of concurrency on a GPU.

A **stream** is an in-order queue of device work (kernels, copies). Work on
one stream runs in the order it was queued; work on different streams may run
at the same time. An **event** marks a point in a stream; it completes when
everything queued before it on that stream has finished. Streams wait on
events (device-side ordering, the host keeps going); the host can wait on an
event or on a whole stream.

On the GPU backend these wrap ``cupy.cuda.Stream`` and ``cupy.cuda.Event``
(reach them through ``.raw``); on the CPU backend they wrap the streams and
events of the modelled GPU in :mod:`course_helper.runtime.model`, which has the same
semantics. Both go through :mod:`course_helper.runtime`.
"""
from __future__ import annotations

import collections
import functools
import threading
from typing import TYPE_CHECKING

from . import checks, runtime
from .runtime import observe
from .runtime.backend import backend_name
from .runtime.base import UncapturedDependency, refuse_host_wait_in_capture

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .runtime.base import Runtime

__all__ = ["Stream", "Event", "create_streams", "create_events", "default_stream",
           "current_stream", "elapsed_ms", "elapsed_times", "stream_priority_range", "synchronize", "placed"]

_local = threading.local()


class host_wait:
    """``with host_wait(name): ...`` times a host wait of the caller's own (an MPI barrier, a full
    ring of disk slots) for the timelines: the observers hear ``host_waited(name, start, end)``
    on the runtime's host clock. (A class rather than a generator: a traced loop waits on every
    level, and this costs a third as much.)"""

    __slots__ = ("name", "runtime", "t0")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.runtime = runtime.get()
        self.t0 = self.runtime.host_ms()
        return self

    def __exit__(self, *exc):
        observe.notify("host_waited", self.name, self.t0, self.runtime.host_ms())
        return False


def _host_wait(rt, name, target, sync, raw):
    """Make the host wait (``sync(raw)``: ``rt``'s sync_stream or sync_event), then tell the
    observers how long it took (``host_waited``) and for what (``host_synced``)."""
    if rt.capturing():               # both backends refuse it alike (CUDA's default capture mode)
        refuse_host_wait_in_capture(f"synchronising stream {target.name!r}" if isinstance(target, Stream)
                                    else "synchronising an event")
    if not (observe.hears("host_waited") or observe.hears("host_synced")):
        sync(raw)                    # nobody to tell: no clock readings
        return
    t0 = rt.host_ms()                # as host_wait does, without a context manager (every level)
    try:
        sync(raw)
    finally:
        observe.notify("host_waited", name, t0, rt.host_ms())
    if observe.hears("host_synced"):
        observe.notify("host_synced", target)


def synchronize() -> None:
    """Block the host until all work on the active backend's device has finished.

    An exception raised by queued work (on the CPU backend) is raised here. Work
    queued by another thread is covered too: its error is raised here as well, and
    stays with its stream until the thread that queued the work has been told (by
    a synchronise of its own), so that thread never misses it.
    """
    rt = runtime.get()
    if rt.capturing():
        refuse_host_wait_in_capture("synchronising the device")
    rt.sync_device()
    observe.notify("host_synced", None)


class Stream:
    """An in-order queue of device work. Make them with :func:`create_streams`.

    Attributes
    ----------
    name : str
        The label shown on timelines ("compute", "io 0", ...).
    blocking : bool
        True when the stream implicitly synchronises with the legacy default
        stream (a *blocking* stream); False for a non-blocking stream.
    priority : int
        The stream's priority (lower numbers are higher priority).
    raw : object
        The underlying ``cupy.cuda.Stream`` on the GPU backend (use it with raw
        CuPy, e.g. ``with s.raw: ...``), or the modelled GPU's stream.
    """

    def __init__(self, raw: Any, name: str, blocking: bool, priority: int, rt: Runtime, is_default: bool = False):
        self.raw = raw
        self.name = name
        self.blocking = blocking
        self.priority = priority
        self.runtime = rt
        self.backend = rt.name
        self.is_default = is_default

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has finished.

        On the CPU backend, an exception raised by the stream's work is raised
        here, with its original traceback.
        """
        if not (observe.hears("host_waited") or observe.hears("host_synced")):
            if self.runtime.capturing():
                refuse_host_wait_in_capture(f"synchronising stream {self.name!r}")
            self.runtime.sync_stream(self.raw)    # nobody times the wait: no label, no clock readings
            return
        self.wait_for_host(f"wait for {self.name}")

    def wait_for_host(self, name: str) -> None:
        """:meth:`synchronize`, labelled ``name`` on timelines (e.g. "blocking copy")."""
        _host_wait(self.runtime, name, self, self.runtime.sync_stream, self.raw)

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait until ``event`` completes (the host does not wait)."""
        # Exact type and same runtime, the usual case, cost two identity tests; else the full checks.
        if type(event) is not Event or event.runtime is not self.runtime:
            checks.instance("event", event, Event, "an Event from create_events()")
            _same_backend(self, event)
        if event.recorded:  # as in CUDA, a never-recorded event counts as complete: nothing to wait for
            if not event.recorded_in_capture and self.runtime.stream_capturing(self.raw):
                beside = event.recorded_beside_capture
                if beside is not None:
                    raise UncapturedDependency(
                        f"stream {self.name!r} waits, during a graph capture, on an event recorded on stream "
                        f"{beside!r}, which is not part of the capture: the capture began on another stream and "
                        f"{beside!r} never waited for an event recorded on a captured stream (a fork), so its work "
                        f"ran at once instead of being captured. Fork {beside!r} into the capture before its first "
                        "work in the block (make it wait for an event recorded on the capture stream), or capture "
                        "on the stream the loop queues its first work on")
                raise UncapturedDependency(
                    f"stream {self.name!r} waits, during a graph capture, on an event recorded before the "
                    "capture began: a graph can only wait on work it captured itself. Use events recorded "
                    "inside the capture block (fresh ones, or ones the loop records before it waits)")
            self.runtime.wait_event(self.raw, event.raw)
        if observe.hears("event_waited"):   # heard even so: a wait queued before the record it meant
            observe.notify("event_waited", self, event)

    def wait_stream(self, other: Stream) -> None:
        """Make later work on this stream wait for the work queued so far on ``other``."""
        checks.instance("other", other, Stream, "a Stream")
        self.wait_event(other.record())

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) at this point of the stream and return it."""
        if event is None:
            event = create_events(1)[0]
        elif type(event) is not Event:      # the exact type needs no further check
            checks.instance("event", event, Event, "an Event from create_events()")
        event.record(self)
        return event

    def launch_host_func(self, fn: Callable[[], object]) -> None:
        """Queue a Python function to run (on a driver/worker thread) when the
        stream reaches this point, like ``cudaLaunchHostFunc``.

        Handy to simulate slow work or to log when a stream gets somewhere.
        The function must not queue or wait for device work itself (on the CPU
        backend doing so raises). On the CPU backend an exception it raises
        comes back at the next synchronisation, and the function runs when the
        host next calls into the helper past its place (a synchronisation, a
        ``done`` query): wait for it that way, not with a ``threading.Event``
        of your own, which the model cannot see (docs/cpu-backend.md).
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self.runtime.host_func(self.raw, placed(fn, self))

    @property
    def done(self) -> bool:
        """True when all work queued on this stream has finished (never blocks), like CuPy's
        ``Stream.done`` and CUDA's ``cudaStreamQuery``.

        Polling until it is True (``while not s.done: ...``) is a host wait: a True answer
        orders the host after all that work, as :meth:`synchronize` does (the race sanitizer
        and the layer-cake checker count it so)."""
        return _polled(self, self.runtime.stream_done(self.raw))

    def __enter__(self):
        stack = _stack()
        stack.append(self)
        self.runtime.enter_stream(self.raw)
        return self

    def __exit__(self, *exc):
        stack = _stack()
        if stack and stack[-1] is self:
            stack.pop()
        self.runtime.exit_stream(self.raw, exc)
        return False

    def __repr__(self):
        kind = "default" if self.is_default else ("blocking" if self.blocking else "non-blocking")
        return f"<Stream {self.name!r} {kind} priority={self.priority} on {self.backend}>"


class Event:
    """A marker in a stream. Make them with :func:`create_events`.

    ``timing=True`` events also carry a timestamp for :func:`elapsed_ms`.
    """

    def __init__(self, raw: Any, timing: bool, rt: Runtime):
        self.raw = raw
        self.timing = timing
        self.runtime = rt
        self.backend = rt.name
        self.recorded = False
        self.recorded_in_capture = False   # its latest record was captured into a graph, not run
        # The stream of its latest record when that record ran during a capture on a stream outside
        # it (never forked into it): a captured wait for it is told so (None otherwise).
        self.recorded_beside_capture: str | None = None

    def record(self, stream: Stream | None = None) -> Event:
        """Mark the current end of ``stream`` (the current stream if None); returns the event."""
        stream = current_stream() if stream is None else stream
        # Exact type and same runtime, the usual case, cost two identity tests; else the full checks.
        if type(stream) is not Stream or stream.runtime is not self.runtime:
            checks.instance("stream", stream, Stream, "a Stream from create_streams()")
            _same_backend(stream, self)
        self.runtime.record(self.raw, stream.raw)
        self.recorded = True
        self.recorded_in_capture = self.runtime.stream_capturing(stream.raw)
        self.recorded_beside_capture = (stream.name if not self.recorded_in_capture and self.runtime.capturing()
                                        else None)
        if observe.hears("event_recorded"):
            observe.notify("event_recorded", stream, self)
        return self

    def synchronize(self) -> None:
        """Block the host until the work before the event's latest record has finished."""
        _host_wait(self.runtime, "wait for event", self, self.runtime.sync_event, self.raw)

    @property
    def done(self) -> bool:
        """True when the event has completed (or was never recorded); never blocks. Like CuPy's
        ``Event.done`` and CUDA's ``cudaEventQuery``.

        Polling until it is True (``while not ev.done: ...``) is a host wait: a True answer
        orders the host after the work before the event's latest record, as :meth:`synchronize`
        does."""
        return _polled(self, self.runtime.event_done(self.raw))

    def __repr__(self):
        # What the helper knows, no query: looking at an event (a debugger, a message) must not
        # cost the host a device query, which a modelled run would count in its time.
        state = "recorded" if self.recorded else "never recorded"
        return f"<Event timing={self.timing} {state} on {self.backend}>"


def placed(fn: Callable[[], object], stream: Stream) -> Callable[[], object]:
    """``fn``, to be run later as a host function queued on ``stream`` now would be: after the
    work queued there so far. Where an observer watches, the observers hear that place, and
    when ``fn`` starts and ends (what it touches meanwhile belongs to that place, not to the
    host's); otherwise ``fn`` itself. :meth:`Stream.launch_host_func` queues every host
    function so; the disk's writers place the encoding of a chunk after its copy so."""
    if not observe.hears("host_func_queued"):
        return fn

    @functools.wraps(fn)
    def run():
        observe.notify("host_func_started", run)
        try:
            return fn()
        finally:
            observe.notify("host_func_ended", run)
    observe.notify("host_func_queued", stream, run)
    return run


def _polled(target, done):
    """A query of ``target`` answered ``done``: a True answer is the host learning that the
    work is finished, so the observers hear ``host_synced(target)``."""
    if done and observe.hears("host_synced"):
        observe.notify("host_synced", target)
    return done


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _same_backend(a, b):
    if a.runtime is not b.runtime:
        raise ValueError(f"cannot mix a {a.backend} {type(a).__name__} with a {b.backend} "
                         f"{type(b).__name__} of another backend or device profile; make both after "
                         "choosing the backend")


def stream_priority_range() -> tuple[int, int]:
    """``(lowest, highest)`` stream priority on this device; lower numbers are higher priority.

    The CPU backend mirrors CUDA's convention (0 is the lowest priority, more
    negative numbers are higher); it accepts and reports priorities but does
    not schedule by them.
    """
    return runtime.get().priority_range()


def create_streams(n: int, blocking: bool = False, priority: int | None = None, name: str = "stream") -> list[Stream]:
    """Create ``n`` streams.

    Parameters
    ----------
    n : int
        How many streams (at least 1).
    blocking : bool
        False (default) gives *non-blocking* streams that never implicitly
        wait for the default stream - the usual choice for overlap. True gives
        *blocking* streams, which synchronise with the legacy default stream.
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
    (The helper's first call in a process also prints one line naming the active backend.)

    >>> compute, = create_streams(1, name="compute")
    >>> io = create_streams(2, name="io")
    >>> [s.name for s in io]
    ['io 0', 'io 1']
    """
    n = checks.positive_int("n (the number of streams)", n)
    blocking = checks.flag("blocking", blocking)
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    lo, hi = stream_priority_range()
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if not hi <= priority <= lo:
            raise ValueError(f"priority {priority} is outside this device's range {hi}..{lo} "
                             f"({lo} is the lowest priority, {hi} the highest)")
    rt = runtime.get()
    names = [name] if n == 1 else [f"{name} {i}" for i in range(n)]
    return [Stream(rt.new_stream(not blocking, priority, label), label, blocking,
                   lo if priority is None else priority, rt) for label in names]


def create_events(n: int, timing: bool = False) -> list[Event]:
    """Create ``n`` events; ``timing=True`` lets :func:`elapsed_ms` time between them.

    On the CPU backend the times are modelled (see :mod:`course_helper.runtime.model`).
    """
    n = checks.positive_int("n (the number of events)", n)
    timing = checks.flag("timing", timing)
    rt = runtime.get()
    return [Event(rt.new_event(bool(timing)), bool(timing), rt) for _ in range(n)]


def elapsed_ms(start: Event, end: Event) -> float:
    """Milliseconds of device time between two completed timing events (modelled on the CPU backend)."""
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
    ms = start.runtime.elapsed_ms(start.raw, end.raw)
    _elapsed_returned.append(ms)
    return ms


#: The latest times :func:`elapsed_ms` returned in this process (bounded: an exercise checks a
#: time measured moments before, not one from hours of solves ago).
_elapsed_returned: collections.deque[float] = collections.deque(maxlen=4096)


def elapsed_times() -> tuple[float, ...]:
    """The times :func:`elapsed_ms` returned in this process, oldest first (the latest 4096): an
    exercise check takes a time the learner measured (one of these, or one divided by a whole
    number of steps) and refuses a typed-in number, as notebook 3's check takes only rows
    :func:`~course_helper.memory.measure_bandwidth` returned."""
    return tuple(_elapsed_returned)


_default_cache = {}


def default_stream() -> Stream:
    """The default (legacy "null") stream of the active backend."""
    rt = runtime.get()
    cached = _default_cache.get(id(rt))
    if cached is None or cached.runtime is not rt:
        cached = _default_cache[id(rt)] = Stream(rt.default_stream(), "default", True, 0, rt, is_default=True)
    return cached


def current_stream() -> Stream:
    """The innermost stream of a ``with stream:`` block, else the default stream."""
    stack = _stack()
    if stack and stack[-1].runtime is runtime.get():
        return stack[-1]
    return default_stream()


def resolve(stream: Stream | None) -> Stream:
    """``stream`` checked, or the current stream when None."""
    if stream is None:
        return current_stream()
    if type(stream) is not Stream:          # the exact type needs no further check
        checks.instance("stream", stream, Stream, "a Stream from create_streams() (or None)")
    if stream.runtime is not runtime.get():
        raise ValueError(f"this stream belongs to the {stream.backend} backend (or another device "
                         f"profile) but the {backend_name()} backend is active; create a new stream")
    return stream
