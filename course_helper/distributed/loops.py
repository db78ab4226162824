"""One rank's loop: the halo strategies, each a step run every level, and :func:`run_rank`, which
runs one of them on this rank of a team.

* ``blocking``: compute the whole slab, exchange the halos, then go on;
* ``overlap``: compute the boundary rows first on the high-priority halo stream, which then sends
  them while the interior computes on the compute stream, and join both before the next step;
* ``overlap-graph``: the overlap loop captured once into a CUDA graph and replayed.

Either way every saved level of the rank's own rows is streamed to pinned host memory on IO
streams while the next levels compute, and handed to an optional ``on_snapshot(level, rows,
data)`` hook once it has landed (the place for a writer that stores each rank's slab on disk).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from .. import checks, streams
from ..graphs import Graph, capture_with_one_io_stream
from ..memory import zero_async
from ..runtime import interrupts
from ..runtime.ops import OpKind
from ..strategies import add_to_registry
from ..streams import synchronize
from ..timelines import recording
from ..timelines.timeline import Trace, TraceEvent
from ..timing import host_timer
from ..wave import WaveProblem, save_interval
from .rank import RankRun
from .slabs import Slab, decompose

if TYPE_CHECKING:
    from .link import Team

__all__ = ["STRATEGIES", "register", "HaloStrategy", "RankResult", "blocking_step", "capture_rank_loop",
           "overlap_step", "run_rank"]


def blocking_step(run: "RankRun", level: int) -> None:
    """Compute the whole slab, then exchange the halos, then go on: nothing overlaps the exchange."""
    b = level % run.m
    run.wait_until_copied(b, run.compute)            # the IO stream has finished reading U[b]
    run.launch(run.whole, level, run.compute)
    run.compute.record(run.computed)
    run.link.exchange(run.U[b], level, after=run.computed)
    run.link.join(run.compute)                       # the next level needs the neighbours' rows
    run.compute.record(run.ready[b])


def overlap_step(run: "RankRun", level: int) -> None:
    """Boundary rows first, on the high-priority halo stream, which sends them as soon as they are
    computed while the interior computes on the compute stream; the compute stream joins the halos
    before the next level."""
    b = level % run.m
    halo = run.link.stream
    halo.wait_event(run.ready[(level - 1) % run.m])  # the whole previous level, halos included
    run.wait_until_copied(b, halo, run.compute)
    for window in run.edges:
        run.launch(window, level, halo)
    if run.inner is not None:
        run.launch(run.inner, level, run.compute)    # the interior, while the halos travel
    run.link.exchange(run.U[b], level)               # on the halo stream, right behind the edges
    run.link.join(run.compute)                       # the halos, and so the edges they were sent after
    run.compute.record(run.ready[b])


@dataclass(frozen=True)
class HaloStrategy:
    """A registered halo strategy: its ``name``, the ``step`` every level runs, whether the whole
    loop is captured once into a CUDA graph and replayed (``graph``: one launch a run, instead of
    a dozen calls a level: the cure for a loop the host cannot queue fast enough), and what it
    does in a line (``help``; ``""``: the first sentence of the step's docstring)."""
    name: str
    step: Callable[[RankRun, int], None]
    graph: bool = False
    help: str = ""


#: halo strategy name -> its :class:`HaloStrategy`: the shape of :data:`course_helper.STRATEGIES`.
STRATEGIES: dict[str, HaloStrategy] = {}


def register(strategy: HaloStrategy) -> HaloStrategy:
    """Add a :class:`HaloStrategy` to :data:`STRATEGIES` (its name must be new); returns it."""
    return add_to_registry(STRATEGIES, strategy, HaloStrategy)


register(HaloStrategy("blocking", blocking_step,
                      help="compute, then exchange the halos: nothing overlaps the exchange"))
register(HaloStrategy("overlap", overlap_step,
                      help="boundary rows first, exchanged while the interior computes"))
register(HaloStrategy("overlap-graph", overlap_step, graph=True,
                      help="the overlap loop captured once into a CUDA graph and replayed"))


def _levels(run, hand_over=True):
    step = STRATEGIES[run.strategy].step
    for level in range(run.problem.nt):
        interrupts.deliver()                         # a safe point for a Ctrl-C the rank holds (cli halo)
        if level >= 2:                               # levels 0 and 1 are the zero initial state
            step(run, level)
        else:
            run.compute.record(run.ready[level % run.m])
        k = run.slot(level)
        if k is not None:
            run.save(level, k)
        if hand_over:
            run.hand_over()


def _loop(run):
    _levels(run)
    run.hand_over(wait=True)


def capture_rank_loop(run: "RankRun") -> "Graph":
    """Capture this rank's whole loop - boundary kernels, halo exchanges, interior kernels,
    copies to the host and the events that order them - into a CUDA graph on the compute
    stream, once. Nothing runs during the capture; each replay starts from the buffers as
    they are (``run_rank`` zeroes them first). The copies share one IO stream (one chain of
    copies in the graph, as ``solve``'s graph strategies do)."""
    io = run.io

    def queue(chain):
        run.io = chain                               # one IO stream for every buffer
        _levels(run, hand_over=False)                # a capture cannot wait for anything
        return (run.link.stream, *chain[:1 if len(run.levels) else 0])   # the streams it forked
    try:
        graph = capture_with_one_io_stream(run.compute, io, queue)
    finally:
        run.io = io
    run.unsent.clear()
    graph.upload()
    return graph


def _replay(run, graph):
    graph.launch(run.compute)
    if run.on_snapshot is not None:
        run.compute.synchronize()
        for k, level in enumerate(run.levels):
            run.on_snapshot(int(level), slice(run.slab.first, run.slab.stop), run.images[k])


@dataclass
class RankResult:
    """What :func:`run_rank` returns on every rank."""
    slab: Slab
    images: np.ndarray        # (nsaved, owned rows, n1): this rank's rows of each saved level
    levels: np.ndarray
    elapsed_ms: float         # this rank's loop, device synchronised (the median of the repeats)
    times_ms: list[float]     # every repeat
    trace: Trace | None       # the last repeat's timeline, if recorded
    queued_ms: float = float("nan")   # the host's time to queue the loop (median): close to elapsed_ms
    #                                   when the host, not the device, sets the pace


def run_rank(team: Team, problem: WaveProblem, strategy: str = "overlap", every: int | None = 1, trace: bool = False,
             on_snapshot: Callable[[int, slice, np.ndarray], object] | None = None, repeats: int = 1) -> RankResult:
    """Run this rank's part of the decomposed solve (call it on every rank of ``team``).

    Parameters
    ----------
    team : Team
    problem : WaveProblem
        The global problem (the same on every rank).
    strategy : {"blocking", "overlap", "overlap-graph"}
        See :data:`STRATEGIES`; ``"overlap-graph"`` captures the loop once (after the warm-up,
        untimed) and each repeat replays it.
    every : int or None
        Save every ``every``-th level (None or 0: save nothing).
    trace : bool
        Record this rank's timeline (of the last repeat), aligned with the
        other ranks' at the barrier that starts the loop.
    on_snapshot : callable, optional
        ``on_snapshot(level, rows, data)`` is called on the host for every saved
        level once its copy has landed, in level order: ``rows`` is the slice
        of global rows, ``data`` the (owned rows, n1) host array. This is the
        hook for a writer that stores each rank's slab (e.g. of one Zarr array).
    repeats : int
        Timed runs from the zero initial state (after one untimed warm-up step).
    """
    checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    checks.one_of("strategy", strategy, tuple(STRATEGIES))
    repeats = checks.positive_int("repeats", repeats)
    if every:
        every = save_interval(every, problem.nt)
    decompose(problem.n0, team.size)                 # a clear error before anything is allocated
    run = RankRun(team, problem, strategy, every, on_snapshot)
    times, queued, timeline, recorder, graph = [], [], None, None, None
    meta = {"strategy": strategy, "rank": team.rank, "ranks": team.size, "device": team.device,
            "n0": problem.n0, "n1": problem.n1, "nt": problem.nt}
    try:
        _warm_up(run)
        if STRATEGIES[strategy].graph:
            if trace:                                # a replay's timeline is read from its capture's nodes
                recorder = recording.Recorder(meta).activate()
            graph = capture_rank_loop(run)           # once; every repeat replays it
        for i in range(repeats):
            interrupts.deliver()
            for u in run.U:
                zero_async(u, run.compute)
            synchronize()
            if trace and i == repeats - 1 and recorder is None:
                recorder = recording.Recorder(meta).activate()
            with streams.host_wait("start"):
                team.comm.Barrier()                  # all ranks start together (and the time origin)
            with host_timer() as run_time:
                if graph is not None:
                    _replay(run, graph)
                else:
                    _loop(run)
                queued.append(run_time.ms)           # the host has queued the loop: so far
                synchronize()
            times.append(run_time.ms)
        if recorder is not None:
            timeline = recorder.finish()
    finally:
        if recorder is not None and timeline is None:
            recorder.deactivate()
        run.close()
    if timeline is not None:
        timeline = _rank_timeline(timeline, run.link.sent_bytes(run.U[0]))
    return RankResult(run.slab, run.images, run.levels, float(np.median(times)), times, timeline,
                      float(np.median(queued)))


def _warm_up(run):
    """One untimed step on zero data: loads the kernel and opens the NCCL connections."""
    for window in [run.whole, *run.edges]:
        run.launch(window, 2, run.compute)
    run.compute.record(run.computed)
    run.link.exchange(run.U[2], 2, after=run.computed)
    run.link.join(run.compute)
    zero_async(run.U[2], run.compute)                # the warm-up wrote the source into level 2
    synchronize()


def _rank_timeline(trace, halo_bytes):
    """Put the halo exchange on its own lane and time zero at the end of the start barrier."""
    start = [e for e in trace.events if e.name == "start"][-1]   # the last repeat's (a graph's recording spans all)
    events = []
    for e in trace.events:
        if e is start or e.end_ms < start.end_ms:
            continue
        if e.kind == OpKind.HALO:
            e = TraceEvent("halo", OpKind.HALO, e.name, e.start_ms, e.end_ms, halo_bytes, e.level)
        e.start_ms -= start.end_ms
        e.end_ms -= start.end_ms
        events.append(e)
    tracks = [t for t in ("compute", "halo") if any(e.track == t for e in events)]
    tracks += [t for t in trace.tracks if t not in tracks and any(e.track == t for e in events)]
    return Trace(events, tracks, trace.meta)
