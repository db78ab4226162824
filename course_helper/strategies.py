"""The IO strategies - the heart of the lesson.

Each strategy is one short loop over time levels. Level ``L`` of the
wavefield lives in scratch buffer ``U[L % nscratch]``; the kernel for level L
reads levels L-2 and L-1 and writes level L. Every saved level must reach the
host output ``out.images`` exactly once. The notebooks show these functions
with ``inspect.getsource``, so what you read there is what runs.

* :func:`sequential` - one stream, a blocking copy after every kernel.
* :func:`sequential_pinned` - the same into pinned memory: faster copies, still no overlap.
* :func:`with_streams` - a compute stream and IO streams; the host waits on
  an IO stream before its buffer is overwritten.
* :func:`with_events` - the same dependencies as events; the host never waits.
* :func:`staged` - copy each saved level device-to-device into a staging ring
  on the compute stream, then to the host from there; compute only waits when
  every staging buffer is still being copied.
* ``"graph"`` / ``"graph-staged"`` - the event loop / the staged loop captured
  once into a CUDA graph by :func:`capture_loop` (``solve`` then replays it).

A loop takes the :class:`Run` that ``prepare`` builds; its type is
written ``"Run"``, in quotes, so that a loop copied into a notebook cell runs as it is.

Each strategy declares what its loop needs in one :class:`Strategy` entry of
:data:`STRATEGIES`, at the end of this module; argument checks, defaults,
``solve``, the command line, the benchmark and the tests all read it. A new
strategy is one loop plus one entry.

How deep a ring must be for its copies to run under compute is
:func:`ring_depth`; :func:`level_times` gives it the times of one level on the
active backend.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, TypeVar

import numpy as np

from . import checks, runtime
from .graphs import capture_with_one_io_stream, graphs_supported
from .memory import (copy_on_device_async, copy_to_host, copy_to_host_async, device_zeros, pinned_empty,
                     to_device, zero_async)
from .runtime.ops import LinkCost, OpKind
from .streams import Event, Stream, synchronize
from .wave import WaveProblem, kernel_cost, launch_wave2d, saved_levels

if TYPE_CHECKING:
    from .graphs import Graph

__all__ = ["Run", "sequential", "sequential_pinned", "with_streams", "with_events", "staged", "capture_loop",
           "COPY_LAG", "ring_depth", "level_times", "LevelTimes", "Strategy", "STRATEGIES", "register",
           "add_to_registry"]

#: How many turns the ring loops copy a level after computing it. The kernel of turn L reads
#: levels L-2 and L-1 and writes L, so L - COPY_LAG is the newest level no kernel touches any
#: more; the loops run COPY_LAG extra turns to copy the last levels.
COPY_LAG = 3


@dataclass
class Run:
    """Everything a strategy's loop receives; built by :func:`prepare`.

    Level ``L`` of the wavefield lives in ``U[L % nscratch]``; saved level
    ``level_of(k)`` goes to ``images[k]``. The streams and events exist only
    for strategies that use streams: one IO stream per buffer copied from
    (scratch buffers, or staging buffers for a staged strategy).

    A run prepared inside ``timing_only()`` on the CPU backend has ``computes`` False: its
    loop's work is timed, not computed, and ``images`` stays NaN. ``with run:`` runs the
    loop as the run was prepared, inside a ``timing_only()`` block or not.
    """
    problem: WaveProblem
    every: int
    U: list[Any]             # scratch wavefields on the device, level L in U[L % nscratch]
    V: Any                   # velocity model on the device
    images: np.ndarray       # host output, one slice per saved level (NaN until written)
    staging: list[Any] = field(default_factory=list)  # staging ring on the device (staged strategies)
    batch: int = 1                                # saved levels per staging buffer
    compute: Stream | None = None                 # the compute stream
    io: list[Stream] = field(default_factory=list)     # io[b]: the IO stream of buffer b
    ready: list[Event] = field(default_factory=list)   # ready[b]: the level in U[b] is computed (ring)
    copied: list[Event] = field(default_factory=list)  # copied[b]: the copy out of buffer b is done
    filled: list[Event] = field(default_factory=list)  # filled[s]: staging buffer s holds its batch (staged)
    strategy: str = ""                            # the name of the strategy it was prepared for
    nscratch_reason: str = ""                     # why nscratch has its value (see suggest_nscratch)
    computes: bool = True                         # False: prepared inside timing_only(), timed only

    @property
    def nt(self) -> int:
        return self.problem.nt

    @property
    def nscratch(self) -> int:
        """The ring's depth: the scratch wavefields in ``U``."""
        return len(self.U)

    @property
    def nstaging(self) -> int:
        return len(self.staging)

    @property
    def levels(self) -> range:
        """The saved time levels, as a range."""
        return saved_levels(self.problem.nt, self.every)

    @property
    def nsaved(self) -> int:
        return len(self.levels)

    def level_of(self, k: int) -> int:
        """The time level stored at output index ``k``."""
        return k * self.every

    def slot(self, level: int) -> int | None:
        """Index of ``level`` in the output, or None if it is not saved (or out of range)."""
        if 0 <= level < self.problem.nt and level % self.every == 0:
            return level // self.every
        return None

    def close(self) -> None:
        """This run's streams take no more work (on the CPU backend, queueing more raises;
        GPU streams are freed by CuPy). The output ``images`` stays usable."""
        for s in ([self.compute] if self.compute is not None else []) + list(self.io):
            s.runtime.close_stream(s.raw)

    def __enter__(self):
        # The loop computes, or is only timed, as the run was prepared (see timing_only()).
        self._mode = runtime.get().times_only(not self.computes)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            synchronize()                 # the loop's queued work is done, and images complete
        finally:
            try:
                self.close()
            finally:
                self._mode.__exit__(None, None, None)


def sequential(run: "Run") -> None:
    """Everything on the default stream; after each kernel a blocking copy to pageable memory."""
    U, m = run.U, run.nscratch                     # m = 3 scratch wavefields
    for level in range(run.nt):
        if level >= 2:                              # levels 0 and 1 are the zero initial state
            launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[level % m],
                          run.V, run.problem, n=level - 2)
        k = run.slot(level)                         # index in the output, or None if not saved
        if k is not None:
            copy_to_host(run.images[k], U[level % m], level=level)   # the host waits here


def sequential_pinned(run: "Run") -> None:
    """The sequential loop on a compute stream, copying into pinned memory: the copies run at
    the pinned speed, but the host still waits for each, so nothing overlaps."""
    U, m, compute = run.U, run.nscratch, run.compute   # m = 3 scratch wavefields
    for level in range(run.nt):
        if level >= 2:
            launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[level % m],
                          run.V, run.problem, n=level - 2, stream=compute)
        k = run.slot(level)
        if k is not None:                           # run.images is pinned for this strategy
            copy_to_host(run.images[k], U[level % m], compute, level=level)   # the host waits here


def with_streams(run: "Run") -> None:
    """Compute on one stream, copy on IO streams; the host synchronises an IO stream
    before the buffer it reads is overwritten."""
    U, m = run.U, run.nscratch                      # m >= 4 scratch wavefields
    compute, io, ready = run.compute, run.io, run.ready   # io[b] and ready[b] belong to buffer b
    for level in range(run.nt + COPY_LAG):          # COPY_LAG extra turns copy the last levels
        if level < run.nt:
            b = level % m                           # the buffer computed this turn
            if level >= 2:
                io[b].synchronize()                 # host waits: the copy that read U[b] is done
                launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[b],
                              run.V, run.problem, n=level - 2, stream=compute)
            compute.record(ready[b])                # level is complete when compute gets here
        old = level - COPY_LAG                      # newest level no kernel touches any more
        k = run.slot(old)
        if k is not None:
            c = old % m                             # the buffer copied this turn
            io[c].wait_event(ready[c])              # device-side: copy after the kernel that made it
            copy_to_host_async(run.images[k], U[c], io[c], level=old)


def with_events(run: "Run") -> None:
    """The same dependencies expressed with events: the compute stream waits on the
    copy of the buffer it overwrites; the host never blocks."""
    U, m = run.U, run.nscratch
    compute, io, ready, copied = run.compute, run.io, run.ready, run.copied
    for level in range(run.nt + COPY_LAG):
        if level < run.nt:
            b = level % m                           # the buffer computed this turn
            if level >= 2:
                compute.wait_event(copied[b])       # device-side: the copy that read U[b] is done
                launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[b],
                              run.V, run.problem, n=level - 2, stream=compute)
            compute.record(ready[b])
        old = level - COPY_LAG
        k = run.slot(old)
        if k is not None:
            c = old % m                             # the buffer copied this turn
            io[c].wait_event(ready[c])
            copy_to_host_async(run.images[k], U[c], io[c], level=old)
            io[c].record(copied[c])                 # U[c] may be overwritten after this point


def staged(run: "Run") -> None:
    """Stage each saved level with a fast device-to-device copy on the compute stream, then
    copy whole staging buffers (``batch`` levels each) to the host on the IO streams."""
    U, m = run.U, run.nscratch                      # 3 scratch wavefields: only compute touches them
    S, ns, batch = run.staging, len(run.staging), run.batch   # ns staging buffers of `batch` levels
    compute, io, filled, copied = run.compute, run.io, run.filled, run.copied   # per staging buffer
    for level in range(run.nt):
        if level >= 2:
            launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[level % m],
                          run.V, run.problem, n=level - 2, stream=compute)
        k = run.slot(level)
        if k is None:
            continue
        s, j = (k // batch) % ns, k % batch         # staging buffer, and the slot in it
        if j == 0:
            compute.wait_event(copied[s])           # buffer s is free (waits only if the ring is full)
        copy_on_device_async(S[s][j], U[level % m], compute, level=level)
        if j == batch - 1 or k == run.nsaved - 1:   # buffer full (or last level): ship it
            first = k - j
            compute.record(filled[s])
            io[s].wait_event(filled[s])
            copy_to_host_async(run.images[first:k + 1], S[s][:j + 1], io[s], level=run.level_of(first))
            io[s].record(copied[s])


def capture_loop(loop: Callable[["Run"], None], run: "Run") -> "Graph":
    """Capture ``loop(run)`` into a CUDA graph that starts from the zero initial state every replay.

    Nothing runs during the capture; ``graph.launch()`` replays the whole loop. ``solve``
    captures the graph strategies this way (untimed, like compiling) and times one replay.

    All copies are captured on one IO stream, which joins ``compute`` back if it took part
    (:func:`~course_helper.graphs.capture_with_one_io_stream` says why one)."""
    compute = run.compute

    def queue(io):                                  # io: one IO stream for every buffer
        zero_async(run.U[0], compute)               # levels 0 and 1 are reset on every replay,
        zero_async(run.U[1], compute)               # or a second replay would start from old data
        loop(replace(run, io=io))
        # The IO streams that took part (forked from compute): each is joined back into it
        # (compute.wait_stream), or the capture fails.
        return [s for s, copied in zip(io, run.copied) if copied.recorded]
    return capture_with_one_io_stream(compute, run.io, queue)


# --------------------------------------------------------------------------
# How deep a ring: room for a copy to run under compute
# --------------------------------------------------------------------------
def ring_depth(kernel_ms: float, copy_ms: float) -> int:
    """Scratch buffers a ring loop (:func:`with_events`, :func:`with_streams`) needs so that
    the copy of a saved level never holds up a kernel: ``COPY_LAG + floor(copy_ms / kernel_ms) + 1``.

    ``kernel_ms`` is one level's kernel, ``copy_ms`` one level's copy to pinned host memory
    (measured, e.g. from a trace, or from :func:`level_times`).

    Why, read from the loop of :func:`with_events` with ``m`` buffers: kernel L writes
    ``U[L % m]``, which still holds level L - m, so it waits (``copied``) for the copy of
    level L - m. That copy is queued in turn L - m + COPY_LAG, just after kernel
    L - m + COPY_LAG, and cannot start before kernel L - m has made its level (``ready``).
    When the device keeps pace with the loop, every kernel starts about when it is queued:
    the copy starts with kernel L - m + COPY_LAG and ends ``copy_ms`` later, while kernel L
    starts ``m - COPY_LAG`` kernels after that one. Kernel L does not wait when
    ``(m - COPY_LAG) * kernel_ms > copy_ms``, i.e. ``m > COPY_LAG + copy_ms / kernel_ms``;
    the smallest whole ``m`` is the formula (the ``+ 1`` also covers a whole-number ratio,
    where the copy would end exactly as the kernel wants to start).

    Where the host runs far ahead of the device a copy starts as soon as its kernel ends,
    and ``1 + copy_ms / kernel_ms`` buffers would nearly do; the formula keeps COPY_LAG - 1
    buffers of margin for that. Each buffer short of the depth that suffices lets one kernel
    less run before a saved level's copy ends, so it costs about one kernel's time per saved
    level (notebook 7 sweeps the depth and prints this arithmetic). It assumes the copies do
    not queue behind one another: when a copy takes longer than the kernels between two
    saved levels (``copy_ms > every * kernel_ms``) the link is busy all the time, the copies
    set the pace, and no depth hides them all.
    """
    kernel_ms = checks.positive_float("kernel_ms", kernel_ms)
    copy_ms = checks.positive_float("copy_ms", copy_ms)
    return COPY_LAG + math.floor(copy_ms / kernel_ms) + 1


class LevelTimes(NamedTuple):
    """One level's times on the active backend: see :func:`level_times`."""
    kernel_ms: float
    copy_ms: float
    source: str       # what gave them, e.g. "modelled H200" or "measured on NVIDIA H200"


def level_times(problem: WaveProblem) -> LevelTimes:
    """``(kernel_ms, copy_ms, source)`` of one level of ``problem`` on the active backend: the
    wave kernel and the device-to-host copy of one level into pinned memory, each alone.

    On the CPU backend: the times the modelled GPU gives them (its profile), ``source`` e.g.
    ``"modelled H200"``. On a GPU: measured once per grid shape with CUDA events, each kernel
    and copy queued behind a busy stream so that only device time counts (a few ms, cached);
    ``source`` is ``"measured on <the GPU>"``.
    """
    checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    rt = runtime.get()
    if rt.predicts_times:
        level = problem.nbytes_level
        return LevelTimes(rt.predicted_ms(kernel_cost(level)), rt.predicted_ms(LinkCost(OpKind.D2H, level)),
                          rt.clock_label)
    return LevelTimes(*_measured_level_times(*problem.shape))


@functools.lru_cache(maxsize=None)
def _measured_level_times(n0, n1):
    from .runtime.backend import device_report
    from .timelines.stopwatch import Stopwatch      # imported here: timelines sit above this module
    bench = Stopwatch()
    problem = WaveProblem(n0=n0, n1=n1, nt=3)
    U = [device_zeros(problem.shape) for _ in range(3)]
    V, host = to_device(problem.velocity), pinned_empty(problem.shape)
    kernel = bench.device_ms(lambda: launch_wave2d(U[0], U[1], U[2], V, problem, 0, stream=bench.s))
    copy = bench.device_ms(lambda: copy_to_host_async(host, U[2], bench.s), repeat=10)
    return kernel, copy, f"measured on {device_report().get('device', 'this GPU')}"


# --------------------------------------------------------------------------
# The registry: what each strategy's loop needs
# --------------------------------------------------------------------------
#: Fewest scratch wavefields any loop can use: the kernel reads two levels and writes a third.
KERNEL_LEVELS = 3


@dataclass(frozen=True)
class Strategy:
    """What one strategy's loop needs; :func:`course_helper.prepare` builds it from this.

    Attributes
    ----------
    name : str
        The name ``solve`` takes.
    loop : callable
        The loop, called as ``loop(run)`` with the :class:`Run`
        that ``prepare`` builds (for a graph strategy: the loop that is captured).
    nscratch : int
        Scratch wavefields by default; for a :attr:`ring` strategy, the fewest that
        ``solve``'s default picks (it picks a deeper ring where the copies are long: see
        :func:`course_helper.solver.suggest_nscratch`).
    min_nscratch : int
        Fewest scratch wavefields that give a right answer; fewer (down to
        ``KERNEL_LEVELS``) only with ``unsafe=True``, to watch the race.
    max_nscratch : int or None
        Most scratch wavefields the loop can use (None: any number up to the ring limit).
    streams : bool
        Whether the loop uses a compute stream and IO streams with a pinned output
        (False: the default stream and pageable memory).
    staged : bool
        Whether the loop copies out of a staging ring (``nstaging`` buffers of ``batch`` levels);
        then it has one IO stream per staging buffer, otherwise one per scratch buffer.
    graph : bool
        Whether ``solve`` captures the loop once into a CUDA graph and times a replay.
    help : str
        What the loop does, in a line (``compare --help`` lists it); ``""``: the first sentence
        of the loop's docstring.
    """
    name: str
    loop: Callable[[Run], None]
    nscratch: int = KERNEL_LEVELS
    min_nscratch: int = KERNEL_LEVELS
    max_nscratch: int | None = None
    streams: bool = True
    staged: bool = False
    graph: bool = False
    help: str = ""

    @property
    def ring(self) -> bool:
        """Whether the loop copies straight out of its scratch ring, so that a deeper ring
        gives each copy more kernels to run under (:func:`ring_depth`)."""
        return not self.staged and self.max_nscratch is None

    def available(self) -> tuple[bool, str]:
        """``(True, "")`` when the active backend runs this strategy, else ``(False, reason)``."""
        if self.graph:
            return graphs_supported()
        return True, ""


#: strategy name -> its :class:`Strategy`, in the order the course introduces them
STRATEGIES: dict[str, Strategy] = {}

_Entry = TypeVar("_Entry")


def add_to_registry(registry: dict[str, _Entry], entry: _Entry, kind: type) -> _Entry:
    """Add ``entry`` (a ``kind``, with a ``name``) to ``registry`` under its name, which must be
    new; returns it. The one way a strategy joins a registry: the single-device one here
    (:func:`register`) and the halo one (:func:`course_helper.distributed.loops.register`)."""
    if not isinstance(entry, kind):
        raise TypeError(f"register a {kind.__name__}(...), got {type(entry).__name__}")
    if entry.name in registry:
        raise ValueError(f"a strategy named {entry.name!r} is already registered")
    registry[entry.name] = entry
    return entry


def register(strategy: Strategy) -> Strategy:
    """Add a :class:`Strategy` to :data:`STRATEGIES` (its name must be new); returns it."""
    if isinstance(strategy, Strategy) and strategy.name not in STRATEGIES:
        top = strategy.nscratch if strategy.max_nscratch is None else strategy.max_nscratch
        if not KERNEL_LEVELS <= strategy.min_nscratch <= strategy.nscratch <= top:
            raise ValueError(f"strategy {strategy.name!r}: need {KERNEL_LEVELS} <= min_nscratch <= nscratch "
                             "<= max_nscratch")
    return add_to_registry(STRATEGIES, strategy, Strategy)


register(Strategy("sequential", sequential, max_nscratch=KERNEL_LEVELS, streams=False,
                  help="one stream, a blocking copy after every kernel"))
register(Strategy("sequential-pinned", sequential_pinned, max_nscratch=KERNEL_LEVELS,
                  help="the sequential loop copying into pinned memory: faster copies, the host still "
                       "waits for each"))
register(Strategy("streams", with_streams, nscratch=5, min_nscratch=4,
                  help="compute and IO streams; the host waits on an IO stream before reusing its buffer"))
register(Strategy("events", with_events, nscratch=5, min_nscratch=4,
                  help="the same dependencies as events; the host never waits"))
register(Strategy("staged", staged, staged=True,
                  help="device-to-device copies into a staging ring, batched copies to the host"))
register(Strategy("graph", with_events, nscratch=5, min_nscratch=4, graph=True,
                  help="the events loop captured into a CUDA graph"))
register(Strategy("graph-staged", staged, staged=True, graph=True,
                  help="the staged loop captured into a CUDA graph"))
