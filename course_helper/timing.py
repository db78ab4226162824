"""Timing queued work with events: one helper, :func:`benchmark`, for every measurement the course makes.

It has the shape of CuPy's ``cupyx.profiler.benchmark``: untimed warm-up calls, then ``n_repeat``
timed runs, each between two events recorded on the stream, the host clock read around the
calls, and a result object. The course's version adds what its measurements need: ``calls`` per
run (many short operations timed together), ``before`` (what puts the device in the state to
time from, untimed: an idle device by default, a busy stream to queue behind, a buffer reset),
``after`` (a check of each run's result, untimed) and an end event on another stream.

On a GPU the events are CUDA events; on the CPU backend they are the modelled device's, and the
host clock is the modelled host's: the same calls give the same modelled times, to the tick.
The benchmark's limit B (:mod:`course_helper.measure.limit`), the calibration
(:mod:`course_helper.measure.calibrate`), :func:`course_helper.memory.measure_bandwidth` and the
GPU stopwatch (:class:`course_helper.timelines.stopwatch.Stopwatch`) all time with it.

Host times - a loop the host ran, calls it made - are read here too, on one clock per backend:
:func:`host_ms`, the active runtime's host clock (the wall clock on a GPU, the modelled host's on
the CPU backend, where the device's times are modelled too). :func:`host_timer` times a block
on it and :func:`host_times` times a call again and again. What really runs on this machine
whatever the backend - files written to its disk, compression on its CPU, how long a command may
take - is timed on :func:`wall_ms`, the machine's own clock (the GPU runtime's host clock too).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import checks, runtime
from .streams import Stream, create_events, elapsed_ms, resolve, synchronize

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["Timing", "benchmark", "host_ms", "HostSpan", "host_timer", "host_times", "wall_ms"]


def host_ms() -> float:
    """The host clock of the active backend, in ms: the wall clock on a GPU, the modelled host's on
    the CPU backend (:meth:`course_helper.runtime.Runtime.host_ms`). Every host time of the
    course's work is read on it, so that it agrees with the device's times."""
    return runtime.host_ms()


def wall_ms() -> float:
    """This machine's own monotonic clock, in ms, on both backends: for what runs here for real
    whatever the backend (a disk's writes, a codec on the CPU, a deadline), which a modelled host
    does not see. On a GPU it is the same clock as :func:`host_ms`."""
    return time.perf_counter() * 1e3


@dataclass
class HostSpan:
    """The start and end of a block timed by :func:`host_timer`, in ms of its ``clock``; ``end``
    is None while the block runs."""
    start: float
    clock: Callable[[], float] = dataclasses.field(default=host_ms, repr=False)
    end: float | None = None

    @property
    def ms(self) -> float:
        """How long the block took (so far, while it runs)."""
        return (self.end if self.end is not None else self.clock()) - self.start


@contextlib.contextmanager
def host_timer(clock: Callable[[], float] = host_ms) -> Iterator[HostSpan]:
    """Time the block on ``clock`` (:func:`host_ms` by default; :func:`wall_ms` for real host work):
    ``with host_timer() as t: ...`` then ``t.ms``. The end is read when the block ends, also by
    an exception (whose time is then of no use, but the span is closed)."""
    span = HostSpan(clock(), clock)
    try:
        yield span
    finally:
        span.end = clock()


def host_times(fn: Callable[[], object], n: int, *, before: Callable[[], object] | None = None,
               after: Callable[[], object] | None = None,
               clock: Callable[[], float] = host_ms) -> list[float]:
    """The host time of each of ``n`` calls of ``fn`` in ms, on ``clock`` (:func:`host_ms` by
    default): ``before()`` runs untimed ahead of each call, ``after()`` runs inside the timed part
    right after it (a synchronisation the time must include)."""
    n = checks.positive_int("n", n)
    times = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = clock()
        fn()
        if after is not None:
            after()
        times.append(clock() - t0)
    return times


@dataclass(frozen=True)
class Timing:
    """The times of one :func:`benchmark`, in ms.

    Attributes
    ----------
    name : str
        What was timed.
    device_ms : tuple of float
        Each timed run's device time: from the start event, recorded on the stream before the
        run's calls, to the end event recorded after them (modelled on the CPU backend).
    host_ms : tuple of float
        Each timed run's host time: the host clock around the run's calls alone (modelled on
        the CPU backend).
    calls : int
        Calls of the timed function per run.
    warmup : int
        Untimed calls made before the first run.
    clock : str
        Whose times these are: ``"CUDA events"`` on a GPU, e.g. ``"modelled H200"`` on the CPU backend.
    """

    name: str
    device_ms: tuple[float, ...]
    host_ms: tuple[float, ...]
    calls: int = 1
    warmup: int = 0
    clock: str = "CUDA events"

    @property
    def median_ms(self) -> float:
        """The median of the runs' device times."""
        return float(np.median(self.device_ms))

    @property
    def min_ms(self) -> float:
        """The shortest run's device time."""
        return float(min(self.device_ms))

    @property
    def max_ms(self) -> float:
        """The longest run's device time."""
        return float(max(self.device_ms))

    @property
    def per_call_ms(self) -> float:
        """The median run's device time per call: ``median_ms / calls``."""
        return self.median_ms / self.calls

    @property
    def host_median_ms(self) -> float:
        """The median of the runs' host times."""
        return float(np.median(self.host_ms))

    def as_dict(self) -> dict:
        """The fields and the statistics as plain data (lists, floats), e.g. for a JSON file."""
        d = dataclasses.asdict(self)
        d.update(device_ms=list(self.device_ms), host_ms=list(self.host_ms), median_ms=self.median_ms,
                 min_ms=self.min_ms, max_ms=self.max_ms, per_call_ms=self.per_call_ms,
                 host_median_ms=self.host_median_ms)
        return d


def benchmark(fn: Callable[[], object], stream: Stream | None = None, *, n_repeat: int = 5, n_warmup: int = 0,
              calls: int = 1, before: Callable[[], object] | None = synchronize,
              after: Callable[[], object] | None = None, end_stream: Stream | None = None,
              name: str | None = None) -> Timing:
    """Time ``fn``, which queues work on ``stream``, with events recorded on the stream around it.

    First ``n_warmup`` untimed calls (kernel loading, pool allocations), then ``n_repeat``
    runs, each: ``before()`` (untimed), the start event recorded on ``stream``, ``calls``
    calls of ``fn`` with the host clock read around them, the end event recorded on
    ``end_stream``, the host waiting for it, then ``after()`` (untimed).

    Parameters
    ----------
    fn : callable
        Called with no arguments; queues the work to time.
    stream : Stream, optional
        Where the start event is recorded (the current stream if None).
    n_repeat : int
        Timed runs (at least 1).
    n_warmup : int
        Untimed calls before the first run (0 or more).
    calls : int
        Calls of ``fn`` per run, timed together (at least 1): for work too short to time alone.
    before : callable or None
        Called before each run, untimed: what the run starts from. The default,
        :func:`course_helper.synchronize`, starts each run on an idle device; queue a busy
        kernel there to time the device alone, not the host's queueing.
    after : callable or None
        Called after each run has finished, untimed (e.g. to check its result).
    end_stream : Stream, optional
        Where the end event is recorded (``stream`` if None): for work that ends on another stream.
    name : str, optional
        What was timed (``fn``'s name if None).

    Returns
    -------
    Timing
        Each run's device and host times, with their median and ``as_dict()``.

    Examples
    --------
    >>> import course_helper as ch
    >>> from course_helper.timing import benchmark
    >>> s, = ch.create_streams(1)
    >>> a, host = ch.device_zeros(2**20), ch.pinned_empty(2**20)
    >>> t = benchmark(lambda: ch.copy_to_host_async(host, a, s), s, n_repeat=3, n_warmup=1)
    >>> len(t.device_ms), t.median_ms > 0
    (3, True)
    """
    if not callable(fn):
        raise TypeError(f"fn must be a function that queues the work to time, got {type(fn).__name__}")
    n_repeat = checks.positive_int("n_repeat", n_repeat)
    n_warmup = checks.positive_int("n_warmup", n_warmup, minimum=0)
    calls = checks.positive_int("calls", calls)
    for label, hook in (("before", before), ("after", after)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{label} must be a function (or None), got {type(hook).__name__}")
    stream = resolve(stream)
    end_stream = stream if end_stream is None else resolve(end_stream)
    name = getattr(fn, "__name__", type(fn).__name__) if name is None else str(name)
    rt = runtime.get()
    start, end = create_events(2, timing=True)
    for _ in range(n_warmup):
        fn()
    device, host = [], []
    for _ in range(n_repeat):
        if before is not None:
            before()
        start.record(stream)
        t0 = rt.host_ms()                   # the runtime's own clock (host_ms), without a call between
        for _ in range(calls):
            fn()
        t1 = rt.host_ms()
        end.record(end_stream)
        end.synchronize()
        device.append(elapsed_ms(start, end))
        host.append(t1 - t0)
        if after is not None:
            after()
    return Timing(name, tuple(device), tuple(host), calls, n_warmup, runtime.time_label() or "CUDA events")
