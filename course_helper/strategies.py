"""The IO strategies - the heart of the lesson.

Each strategy is one short loop over time levels. Level ``L`` of the
wavefield lives in scratch buffer ``U[L % nscratch]``; the kernel for level L
reads levels L-2 and L-1 and writes level L. Every saved level must reach the
host output ``out.images`` exactly once. The notebooks show these functions
with ``inspect.getsource``, so what you read there is what runs.

* :func:`sequential` - one stream, a blocking copy after every kernel.
* :func:`with_streams` - a compute stream and IO streams; the host waits on
  an IO stream before its buffer is overwritten.
* :func:`with_events` - the same dependencies as events; the host never waits.
* :func:`staged` - copy each saved level device-to-device into a staging ring
  on the compute stream, then to the host from there; compute only waits when
  every staging buffer is still being copied.
* ``"graph"`` / ``"graph-staged"`` - the event loop / the staged loop captured
  once into a CUDA graph by :func:`capture_loop` (``solve`` then replays it).

Each strategy declares what its loop needs in one :class:`Strategy` entry of
:data:`STRATEGIES`, at the end of this module; argument checks, defaults,
``solve``, the command line, the benchmark and the tests all read it. A new
strategy is one loop plus one entry.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .graphs import capture_graph, graphs_supported
from .memory import copy_on_device_async, copy_to_host, copy_to_host_async, zero_async
from .wave import launch_wave2d

__all__ = ["sequential", "with_streams", "with_events", "staged", "capture_loop", "COPY_LAG",
           "Strategy", "STRATEGIES", "register"]

#: How many turns the ring loops copy a level after computing it. The kernel of turn L reads
#: levels L-2 and L-1 and writes L, so L - COPY_LAG is the newest level no kernel touches any
#: more; the loops run COPY_LAG extra turns to copy the last levels.
COPY_LAG = 3


def sequential(run):
    """Everything on the default stream; after each kernel a blocking copy to pageable memory."""
    U, m = run.U, run.nscratch                     # m = 3 scratch wavefields
    for level in range(run.nt):
        if level >= 2:                              # levels 0 and 1 are the zero initial state
            launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[level % m],
                          run.V, run.problem, n=level - 2)
        k = run.slot(level)                         # index in the output, or None if not saved
        if k is not None:
            copy_to_host(run.images[k], U[level % m], level=level)   # the host waits here


def with_streams(run):
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


def with_events(run):
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


def staged(run):
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


def capture_loop(loop, run):
    """Capture ``loop(run)`` into a CUDA graph that starts from the zero initial state every replay.

    Nothing runs during the capture; ``graph.launch()`` replays the whole loop. ``solve``
    captures the graph strategies this way (untimed, like compiling) and times one replay.

    All copies are captured on one IO stream. In a graph every captured stream
    becomes a branch, and copies spread over several branches ran about 10%
    slower where the copies set the pace; one chain of copies runs as fast as
    the stream loops (benchmarks/graph_copies.py)."""
    compute = run.compute
    run = replace(run, io=[run.io[0]] * len(run.io))   # one IO stream for every buffer: one chain of copies
    with capture_graph(compute) as cap:
        zero_async(run.U[0], compute)               # levels 0 and 1 are reset on every replay,
        zero_async(run.U[1], compute)               # or a second replay would start from old data
        loop(run)
        for io, copied in zip(run.io, run.copied):
            if copied.recorded:                     # this IO stream took part in the capture:
                compute.wait_stream(io)             # join it back into the capture stream
    return cap.graph


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
        The loop, called as ``loop(run)`` with the :class:`~course_helper.solver.Run`
        that ``prepare`` builds (for a graph strategy: the loop that is captured).
    nscratch : int
        Scratch wavefields by default.
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
    """
    name: str
    loop: Callable
    nscratch: int = KERNEL_LEVELS
    min_nscratch: int = KERNEL_LEVELS
    max_nscratch: int | None = None
    streams: bool = True
    staged: bool = False
    graph: bool = False

    def available(self):
        """``(True, "")`` when the active backend runs this strategy, else ``(False, reason)``."""
        if self.graph:
            return graphs_supported()
        return True, ""


#: strategy name -> its :class:`Strategy`, in the order the course introduces them
STRATEGIES = {}


def register(strategy):
    """Add a :class:`Strategy` to :data:`STRATEGIES` (its name must be new); returns it."""
    if not isinstance(strategy, Strategy):
        raise TypeError(f"register a Strategy(...), got {type(strategy).__name__}")
    if strategy.name in STRATEGIES:
        raise ValueError(f"a strategy named {strategy.name!r} is already registered")
    top = strategy.nscratch if strategy.max_nscratch is None else strategy.max_nscratch
    if not KERNEL_LEVELS <= strategy.min_nscratch <= strategy.nscratch <= top:
        raise ValueError(f"strategy {strategy.name!r}: need {KERNEL_LEVELS} <= min_nscratch <= nscratch "
                         "<= max_nscratch")
    STRATEGIES[strategy.name] = strategy
    return strategy


register(Strategy("sequential", sequential, max_nscratch=KERNEL_LEVELS, streams=False))
register(Strategy("streams", with_streams, nscratch=5, min_nscratch=4))
register(Strategy("events", with_events, nscratch=5, min_nscratch=4))
register(Strategy("staged", staged, staged=True))
register(Strategy("graph", with_events, nscratch=5, min_nscratch=4, graph=True))
register(Strategy("graph-staged", staged, staged=True, graph=True))
