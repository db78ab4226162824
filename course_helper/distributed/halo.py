"""Beyond one GPU: the wave problem split across ranks, with the halo exchange overlapped.

The grid is cut along dimension 0 into one slab per rank (one MPI process per
GPU). A rank computes the rows it *owns* and holds two more rows on each inner
side, the *halo*: copies of the neighbour's edge rows, which the 4th-order
stencil reaches into. After every step the neighbours swap those rows.

Each rank runs the very same update as the single-device solve: the
``wave2d_4o`` kernel (or its NumPy twin) launched through
:func:`~course_helper.wave.launch_wave2d` on a *window* of its slab - a few
rows plus two rows of context on each side - described by a sub-problem with
the same time step, spacing and wavelet. So every cell sees the same
arithmetic, and the gathered result is bit for bit the single-device one.

Two strategies:

* ``blocking``: compute the whole slab, exchange the halos, then go on;
* ``overlap``: compute the boundary rows first on a high-priority stream,
  exchange them on a halo stream while the interior computes on the compute
  stream, and join both before the next step.

Either way every saved level of the rank's own rows is streamed to pinned host
memory on IO streams while the next levels compute, and handed to an optional
``on_snapshot(level, rows, data)`` hook once it has landed (the place for a
writer that stores each rank's slab on disk).

Transport: the exchange is one operation on the halo stream (:class:`HaloLink`).
On the GPU backend NCCL (``cupy.cuda.nccl``) sends and receives the halo rows,
device to device; on the CPU backend the modelled device runs the same
operation, its NumPy work moving the rows with MPI (``Isend``/``Irecv``), timed
by the profile's ``peer`` link where the profile has one.

Processes are started with ``mpiexec`` through ``mpi4py``::

    mpiexec -n 2 python -m course_helper halo --n 256 --strategy overlap --check

and from Python (a notebook) with :func:`launch_halo`, which runs that command
as a subprocess and returns the gathered result and the merged timeline.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass

import numpy as np

from .. import checks, runtime, streams
from ..runtime import observe
from ..timelines import recording
from ..runtime.backend import backend_name, cupy_module, gpu_name
from ..memory import copy_to_host_async, device_zeros, measure_bandwidth, pinned_empty, to_device, zero_async
from ..streams import create_events, create_streams, stream_priority_range, synchronize
from ..graphs import capture_graph
from ..timelines.timeline import Trace, TraceEvent
from ..wave import PAD, WaveProblem, launch_wave2d, saved_levels

__all__ = ["HALO", "STRATEGIES", "REGISTRY", "HaloStrategy", "capture_rank_loop", "Slab", "Window", "HaloLink",
           "decompose", "owner_of", "Team", "run_rank", "gather",
           "merge_traces", "chrome_trace", "launch_halo", "HaloResult", "find_mpiexec", "halo_bound",
           "measure_parts", "link_note", "blocking_step", "overlap_step", "ranks_backend", "traces_from_chrome",
           "ranks_env", "world"]

HALO = PAD                  #: halo rows on each inner side: the stencil's reach
NSCRATCH = 5                #: slab buffers per rank (level L lives in U[L % 5], as in solve)
_TAG = 18                   # MPI tag of halo messages: one tag will do, MPI keeps each pair's messages in order


# --------------------------------------------------------------------------
# Decomposition (pure arithmetic: no MPI, no device)
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Slab:
    """The rows of the global grid one rank works on.

    ``first``..``stop`` (one past the end) are the global rows this rank
    computes; it holds ``lo``..``hi``, two more rows on each side: the halo
    from a neighbour on an inner side, the zero wall rows on a global edge.
    """
    rank: int
    ranks: int
    first: int
    stop: int

    @property
    def lo(self):
        return self.first - HALO

    @property
    def hi(self):
        return self.stop + HALO

    @property
    def rows(self):
        """Rows held locally (owned rows plus two on each side)."""
        return self.hi - self.lo

    @property
    def owned(self):
        return self.stop - self.first

    @property
    def up(self):
        """Rank holding the rows above (smaller indices), or None at the global edge."""
        return self.rank - 1 if self.rank > 0 else None

    @property
    def down(self):
        """Rank holding the rows below, or None at the global edge."""
        return self.rank + 1 if self.rank < self.ranks - 1 else None

    def owns(self, row):
        return self.first <= row < self.stop


def decompose(n0, ranks):
    """Split the interior rows ``PAD .. n0-PAD-1`` into ``ranks`` balanced slabs.

    The first ``(n0 - 2 PAD) % ranks`` slabs get one row more. Every slab owns
    at least ``2 HALO`` rows, so that the boundary rows of its two inner sides
    never overlap.

    >>> [(s.first, s.stop) for s in decompose(20, 3)]
    [(2, 8), (8, 13), (13, 18)]
    """
    n0 = checks.positive_int("n0", n0, minimum=2 * PAD + 1)
    ranks = checks.positive_int("ranks", ranks)
    interior = n0 - 2 * PAD
    if interior < 2 * HALO * ranks:
        raise ValueError(f"{ranks} ranks cannot share {interior} interior rows: every rank needs at least "
                         f"{2 * HALO} (its boundary rows on each side); use n0 >= {2 * HALO * ranks + 2 * PAD} "
                         "or fewer ranks")
    base, extra = divmod(interior, ranks)
    slabs, first = [], PAD
    for r in range(ranks):
        stop = first + base + (1 if r < extra else 0)
        slabs.append(Slab(r, ranks, first, stop))
        first = stop
    return slabs


def owner_of(n0, ranks, row):
    """The rank whose slab owns global row ``row`` (e.g. the source's row)."""
    row = checks.positive_int("row", row, minimum=0)
    for s in decompose(n0, ranks):
        if s.owns(row):
            return s.rank
    raise ValueError(f"row {row} is a wall row (outside {PAD}..{n0 - PAD - 1}); no rank computes it")


class Window(WaveProblem):
    """Global rows ``a``..``b`` as a problem of their own: ``b - a`` computed rows plus two rows of
    context on each side, with the global problem's time step, spacing and wavelet.

    The source term is the global one where the window holds the source cell; elsewhere the kernel
    adds ``-0.0``, which leaves every float32 unchanged bit for bit (IEEE 754: x + (-0) == x, also
    for x = -0), so a window without the source computes exactly what the full grid computes there.
    """

    def __init__(self, problem, a, b):
        p0, p1 = problem.source
        self.holds_source = a <= p0 < b
        # Uniform velocity vmax: gives the same dt, fm and td (the kernel reads the slab's own V).
        super().__init__(n0=b - a + 2 * PAD, n1=problem.n1, dx=(problem.dx0, problem.dx1),
                         velocity=problem.vmax, cfl=problem.cfl, nt=problem.nt,
                         source=(p0 - a + PAD, p1) if self.holds_source else (PAD, PAD),
                         points_per_wavelength=problem.points_per_wavelength)
        if (self.dt, self.fm, self.td) != (problem.dt, problem.fm, problem.td):
            raise RuntimeError("a slab window does not reproduce the problem's time step; cannot decompose")
        self.parent = problem

    def source_amplitude(self, n):
        return self.parent.source_amplitude(n) if self.holds_source else np.float32(-0.0)


# --------------------------------------------------------------------------
# The ranks: MPI, devices and the transport of halo rows
# --------------------------------------------------------------------------
def _mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise ImportError("the distributed course needs mpi4py and an MPI: "
                          "python -m pip install -e '.[distributed]'") from None
    return MPI


def world():
    """MPI's world communicator (all the ranks ``mpiexec`` started)."""
    return _mpi().COMM_WORLD


class Team:
    """The ranks of one MPI communicator, ready to exchange halos.

    On the GPU backend each rank takes the GPU ``local rank % device count``
    (call this before anything else touches the GPU) and the team opens an
    NCCL communicator, its unique id broadcast through MPI. On the CPU backend
    the halos travel through MPI itself.
    """

    def __init__(self, comm=None):
        MPI = _mpi()
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.nccl = None
        if os.environ.get("COURSE_HELPER_BACKEND", "auto").strip().lower() != "cpu":
            _pick_gpu(self.comm)
        self.backend = backend_name()
        if self.backend == "gpu":
            cupy = cupy_module()
            self.device = gpu_name()
            if self.size > 1:
                sharing = self.comm.Split_type(_mpi().COMM_TYPE_SHARED).Get_size()
                if sharing > cupy.cuda.runtime.getDeviceCount():
                    raise RuntimeError(f"{sharing} ranks share this node's {cupy.cuda.runtime.getDeviceCount()} "
                                       "GPU(s); NCCL needs one GPU per rank. Start fewer ranks, or run them "
                                       "on the CPU backend (COURSE_HELPER_BACKEND=cpu)")
                from cupy.cuda import nccl
                if not getattr(nccl, "available", True):
                    raise RuntimeError("the GPU backend exchanges halos with NCCL, but this CuPy has no NCCL")
                uid = nccl.get_unique_id() if self.rank == 0 else None
                self.nccl = nccl.NcclCommunicator(self.size, self.comm.bcast(uid, root=0), self.rank)
        else:
            import platform
            self.device = f"CPU ({platform.processor() or platform.machine()})"

    def split(self, ranks):
        """A team of the first ``ranks`` ranks (the others get None), e.g. for a 1-GPU baseline."""
        sub = self.comm.Split(0 if self.rank < ranks else _mpi().UNDEFINED, self.rank)
        return None if sub == _mpi().COMM_NULL else Team(sub)

    def max(self, value):
        return self.comm.allreduce(value, op=_mpi().MAX)


def _pick_gpu(comm):
    """One GPU per rank on a node: the rank's index among the ranks sharing its node."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:   # no CuPy or no device: the backend choice will say why  # noqa: BLE001
        return
    if count > 0:
        local = comm.Split_type(_mpi().COMM_TYPE_SHARED).Get_rank()
        cupy.cuda.Device(local % count).use()


class HaloLink:
    """The halo exchange as device work: one operation on the halo stream that sends this rank's
    edge rows and receives the neighbours' into the halo rows.

    On the GPU backend it is NCCL's send/recv (``cupy.cuda.nccl``), device to device, queued
    like a kernel (and captured into a CUDA graph like one). On the CPU backend the modelled
    device runs it as any operation: when it starts, its NumPy work moves the rows with MPI
    (``Isend``/``Irecv``, then waiting for both), and it takes the profile's ``peer`` link time
    (latency + bytes / bandwidth; none where the profile has no ``peer`` link). Either way the
    streams order it with events, and the sanitizer sees what it reads and writes.
    """

    def __init__(self, team, slab, halo_stream):
        self.comm, self.nccl, self.slab, self.stream = team.comm, team.nccl, slab, halo_stream
        self.done = create_events(1)[0]

    def exchange(self, U, level, after):
        """Queue the swap of ``U``'s edge rows on the halo stream after event ``after``; returns at once."""
        self.stream.wait_event(after)
        sends, recvs = _edges(self.slab, U)
        if sends:
            nbytes = sum(a.nbytes for _, a in sends)
            op = observe.Op("halo", f"halo level {level}", self.stream, level, nbytes,
                            tuple(a for _, a in sends), tuple(b for _, b in recvs))
            runtime.submit(self.stream, op, cuda=lambda raw: self.nccl_swap(sends, recvs),
                           numpy=lambda *rows: self.mpi_swap(sends, recvs, rows), cost={"peer": nbytes})
        self.stream.record(self.done)

    def nccl_swap(self, sends, recvs):
        """GPU: the sends and receives to both neighbours in one group, so that NCCL runs them
        together and two ranks never wait for each other."""
        nccl = cupy_module().cuda.nccl
        ptr = self.stream.raw.ptr
        nccl.groupStart()
        for (peer, a), (_, b) in zip(sends, recvs):
            self.nccl.send(a.data.ptr, a.size, nccl.NCCL_FLOAT32, peer, ptr)
            self.nccl.recv(b.data.ptr, b.size, nccl.NCCL_FLOAT32, peer, ptr)
        nccl.groupEnd()

    def mpi_swap(self, sends, recvs, rows):
        """CPU backend: post every receive (into ``rows``, the halo rows the operation writes
        when it ends) and every send, then wait for all of them."""
        reqs = [self.comm.Irecv(out, source=peer, tag=_TAG) for (peer, _), out in zip(recvs, rows)]
        reqs += [self.comm.Isend(a.view(np.ndarray), dest=peer, tag=_TAG) for peer, a in sends]
        _mpi().Request.Waitall(reqs)

    def join(self, stream):
        """Make ``stream`` wait until the halo rows have arrived (device-side)."""
        stream.wait_event(self.done)


def _edges(slab, U):
    """``([(peer, rows to send)], [(peer, halo rows to fill)])`` of the local array ``U``."""
    sends, recvs = [], []
    if slab.up is not None:
        sends.append((slab.up, U[HALO:2 * HALO]))
        recvs.append((slab.up, U[:HALO]))
    if slab.down is not None:
        sends.append((slab.down, U[-2 * HALO:-HALO]))
        recvs.append((slab.down, U[-HALO:]))
    return sends, recvs


# --------------------------------------------------------------------------
# One rank's run
# --------------------------------------------------------------------------
class _RankRun:
    """Everything one rank's loop needs: its slab, windows, buffers, streams and events."""

    def __init__(self, team, problem, strategy, every, on_snapshot):
        self.problem, self.strategy, self.every = problem, strategy, every
        self.slab = s = decompose(problem.n0, team.size)[team.rank]
        self.m = NSCRATCH
        self.U = [device_zeros((s.rows, problem.n1)) for _ in range(self.m)]
        self.V = to_device(np.ascontiguousarray(problem.velocity[s.lo:s.hi]))
        self.levels = np.asarray(saved_levels(problem.nt, every) if every else range(0))
        self.images = pinned_empty((len(self.levels), s.owned, problem.n1))
        self.images.fill(np.nan)
        # The windows: the whole slab, or its boundary rows (inner sides only) and the rest.
        self.whole = self._window(s.first, s.stop)
        top = s.first + HALO if s.up is not None else s.first
        bottom = s.stop - HALO if s.down is not None else s.stop
        self.edges = [self._window(a, b) for a, b in ((s.first, top), (bottom, s.stop)) if b > a]
        self.inner = self._window(top, bottom) if bottom > top else None
        high = stream_priority_range()[1]
        self.compute = create_streams(1, name="compute")[0]
        self.boundary = create_streams(1, priority=high, name="boundary")[0]
        halo_stream = create_streams(1, priority=high, name="halo")[0]
        self.io = create_streams(self.m, name="io")
        self.ready, self.copied = create_events(self.m), create_events(self.m)
        self.edges_done, self.computed = create_events(2)
        self.link = HaloLink(team, s, halo_stream)
        self.on_snapshot = on_snapshot
        self.unsent = deque()          # (level, k, event) copies not yet handed to on_snapshot
        self._streams = [self.compute, self.boundary, halo_stream, *self.io]

    def _window(self, a, b):
        """(sub-problem, local row slice) of global rows a..b plus two rows of context each side."""
        first = a - PAD - self.slab.lo
        return Window(self.problem, a, b), slice(first, first + b - a + 2 * PAD)

    def launch(self, window, level, stream):
        """Queue the kernel for ``level`` on the rows of ``window``."""
        wp, rows = window
        U, m = self.U, self.m
        launch_wave2d(U[(level - 2) % m][rows], U[(level - 1) % m][rows], U[level % m][rows],
                      self.V[rows], wp, n=level - 2, stream=stream)

    def slot(self, level):
        if self.every and level % self.every == 0:
            return level // self.every
        return None

    def save(self, level, k):
        """Stream the owned rows of ``level`` to the host on its IO stream."""
        b = level % self.m
        self.io[b].wait_event(self.ready[b])
        copy_to_host_async(self.images[k], self.U[b][HALO:-HALO], self.io[b], level=level)
        self.io[b].record(self.copied[b])
        self.unsent.append((level, k, self.copied[b]))

    def hand_over(self, wait=False):
        """Give the landed snapshots, in order, to ``on_snapshot`` (all of them when ``wait``)."""
        if self.on_snapshot is None:
            # Nobody to hand them to: no polling either (a poll that finds a copy done orders the
            # host after it, which would hide a missing wait from the sanitizer in this run).
            self.unsent.clear()
            return
        while self.unsent and (wait or self.unsent[0][2].done):
            level, k, event = self.unsent.popleft()
            event.synchronize()
            self.on_snapshot(level, slice(self.slab.first, self.slab.stop), self.images[k])

    def close(self):
        for s in self._streams:
            close = getattr(s.raw, "close", None)
            if close is not None:
                close()


def blocking_step(run, level):
    """Compute the whole slab, then exchange the halos, then go on: nothing overlaps the exchange."""
    b = level % run.m
    run.compute.wait_event(run.copied[b])            # the IO stream has finished reading U[b]
    run.launch(run.whole, level, run.compute)
    run.compute.record(run.computed)
    run.link.exchange(run.U[b], level, after=run.computed)
    run.link.join(run.compute)                       # the next level needs the neighbours' rows
    run.compute.record(run.ready[b])


def overlap_step(run, level):
    """Boundary rows first on a high-priority stream; their exchange runs on the halo stream
    while the interior computes; both are joined before the next level."""
    b = level % run.m
    prev = run.ready[(level - 1) % run.m]            # the whole previous level, halos included
    run.boundary.wait_event(prev)
    run.boundary.wait_event(run.copied[b])
    for window in run.edges:
        run.launch(window, level, run.boundary)
    run.boundary.record(run.edges_done)
    run.compute.wait_event(run.copied[b])
    if run.inner is not None:
        run.launch(run.inner, level, run.compute)    # the interior, while the halos travel
    run.link.exchange(run.U[b], level, after=run.edges_done)
    run.link.join(run.compute)                       # the halos, and so the edges they were sent after
    run.compute.record(run.ready[b])


@dataclass(frozen=True)
class HaloStrategy:
    """A registered halo strategy: the step every level runs, and whether the whole loop is
    captured once into a CUDA graph and replayed (one launch a run, instead of a dozen calls a
    level: the cure for a loop the host cannot queue fast enough)."""
    step: object
    graph: bool = False


#: The halo strategies by name.
REGISTRY = {"blocking": HaloStrategy(blocking_step), "overlap": HaloStrategy(overlap_step),
            "overlap-graph": HaloStrategy(overlap_step, graph=True)}
STRATEGIES = tuple(REGISTRY)


def _levels(run, hand_over=True):
    step = REGISTRY[run.strategy].step
    for level in range(run.problem.nt):
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


def capture_rank_loop(run):
    """Capture this rank's whole loop - boundary kernels, halo exchanges, interior kernels,
    copies to the host and the events that order them - into a CUDA graph on the compute
    stream, once. Nothing runs during the capture; each replay starts from the buffers as
    they are (``run_rank`` zeroes them first). The copies share one IO stream (one chain of
    copies in the graph, as ``solve``'s graph strategies do)."""
    io = run.io
    run.io = [io[0]] * run.m
    try:
        with capture_graph(run.compute) as cap:
            _levels(run, hand_over=False)            # a capture cannot wait for anything
            for stream in (run.boundary, run.link.stream, *run.io[:1 if len(run.levels) else 0]):
                run.compute.wait_stream(stream)      # every stream the capture forked joins it again
    finally:
        run.io = io
    run.unsent.clear()
    cap.graph.upload()
    return cap.graph


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
    times_ms: list            # every repeat
    trace: Trace | None       # the last repeat's timeline, if recorded


def run_rank(team, problem, strategy="overlap", every=1, trace=False, on_snapshot=None, repeats=1):
    """Run this rank's part of the decomposed solve (call it on every rank of ``team``).

    Parameters
    ----------
    team : Team
    problem : WaveProblem
        The global problem (the same on every rank).
    strategy : {"blocking", "overlap", "overlap-graph"}
        See :data:`REGISTRY`; ``"overlap-graph"`` captures the loop once (after the warm-up,
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
    checks.one_of("strategy", strategy, STRATEGIES)
    repeats = checks.positive_int("repeats", repeats)
    if every:
        every = checks.positive_int("every", every)
        if every >= problem.nt:
            raise ValueError(f"every={every} is not below nt={problem.nt}: only level 0 would be saved")
    decompose(problem.n0, team.size)                 # a clear error before anything is allocated
    run = _RankRun(team, problem, strategy, every, on_snapshot)
    times, timeline, recorder, graph = [], None, None, None
    meta = {"strategy": strategy, "rank": team.rank, "ranks": team.size, "device": team.device,
            "n0": problem.n0, "n1": problem.n1, "nt": problem.nt}
    try:
        _warm_up(run)
        if REGISTRY[strategy].graph:
            if trace:                                # a replay's timeline is read from its capture's nodes
                recorder = recording.Recorder(meta).activate()
            graph = capture_rank_loop(run)           # once; every repeat replays it
        for i in range(repeats):
            for u in run.U:
                zero_async(u, run.compute)
            synchronize()
            if trace and i == repeats - 1 and recorder is None:
                recorder = recording.Recorder(meta).activate()
            with streams.host_wait("start"):
                team.comm.Barrier()                  # all ranks start together (and the time origin)
            t0 = runtime.host_ms()
            if graph is not None:
                _replay(run, graph)
            else:
                _loop(run)
            synchronize()
            times.append(runtime.host_ms() - t0)
        if recorder is not None:
            timeline = recorder.finish()
    finally:
        if recorder is not None and timeline is None:
            recorder.deactivate()
        run.close()
    if timeline is not None:
        timeline = _rank_timeline(timeline, sum(a.nbytes for _, a in _edges(run.slab, run.U[0])[0]))
    return RankResult(run.slab, run.images, run.levels, float(np.median(times)), times, timeline)


def measure_parts(team, problem, every, repeats=3):
    """Each part of a rank's work alone, in ms (slowest rank, median of ``repeats``):
    ``compute_ms`` (the slab's kernels back to back), ``exchange_ms`` (the halo exchanges back to
    back) and ``io_ms`` (the saved bytes at the peak pinned device-to-host bandwidth), with
    ``bound_ms`` = :func:`halo_bound` of the three."""
    run = _RankRun(team, problem, "blocking", every, None)
    steps = range(2, problem.nt)

    def kernels():
        for level in steps:
            run.launch(run.whole, level, run.compute)

    def exchanges():
        after = run.compute.record(run.computed)
        for level in steps:
            run.link.exchange(run.U[level % run.m], level, after=after)
            run.link.join(run.compute)

    def timed(work):
        times = []
        for _ in range(repeats + 1):                 # the first run warms up
            synchronize()
            team.comm.Barrier()
            t0 = runtime.host_ms()
            work()
            synchronize()
            times.append(runtime.host_ms() - t0)
        return team.max(float(np.median(times[1:])))

    try:
        compute_ms, exchange_ms = timed(kernels), timed(exchanges)
        peak = max(r["gb_per_s"] for r in measure_bandwidth((64,), repeats=3) if r["memory"] == "pinned")
    finally:
        run.close()
    io_ms = team.max(run.images.nbytes / (peak * 1e9) * 1e3)
    return {"compute_ms": compute_ms, "exchange_ms": exchange_ms, "io_ms": io_ms, "peak_d2h_gbps": peak,
            "bound_ms": halo_bound(compute_ms, exchange_ms, io_ms)}


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
        if e.name.startswith("halo level"):
            e = TraceEvent("halo", "halo", e.name, e.start_ms, e.end_ms, halo_bytes, int(e.name.split()[-1]))
        e.start_ms -= start.end_ms
        e.end_ms -= start.end_ms
        events.append(e)
    tracks = [t for t in ("boundary", "compute", "halo") if any(e.track == t for e in events)]
    tracks += [t for t in trace.tracks if t not in tracks and any(e.track == t for e in events)]
    return Trace(events, tracks, trace.meta)


# --------------------------------------------------------------------------
# Gathering, checking, timelines
# --------------------------------------------------------------------------
def gather(team, result, problem):
    """Assemble every rank's saved rows on rank 0: (nsaved, n0, n1) there, None elsewhere.

    The wall rows (two on each global edge) are zero, as in the single-device solve.
    """
    if team.rank != 0:
        team.comm.Send(np.ascontiguousarray(result.images), dest=0, tag=7)
        return None
    out = np.zeros((len(result.levels), problem.n0, problem.n1), np.float32)
    for s in decompose(problem.n0, team.size):
        if s.rank == 0:
            part = result.images
        else:
            part = np.empty((len(result.levels), s.owned, problem.n1), np.float32)
            team.comm.Recv(part, source=s.rank, tag=7)
        out[:, s.first:s.stop] = part
    return out


def merge_traces(traces, title=None, one_io_lane=True):
    """One Trace with every rank's lanes, named ``"rank R compute"`` etc., on a shared clock.

    With ``one_io_lane`` a rank's IO streams share one lane ("rank R io"), to keep the picture short.
    """
    def lane(r, track):
        return f"rank {r} io" if one_io_lane and track.startswith("io ") else f"rank {r} {track}"

    events, tracks = [], []
    origin = min((e.start_ms for t in traces for e in t.events), default=0.0)
    for r, t in enumerate(traces):
        tracks += list(dict.fromkeys(lane(r, name) for name in t.tracks))
        events += [TraceEvent(lane(r, e.track), e.kind, e.name, e.start_ms - origin, e.end_ms - origin,
                              e.bytes, e.level) for e in t.events]
    meta = dict(traces[0].meta) if traces else {}
    meta.pop("rank", None)
    if title:
        meta["strategy"] = title
    return Trace(events, tracks, meta)


def chrome_trace(traces):
    """The ranks' timelines as one Chrome trace: one process per rank, its lanes as threads."""
    origin = min((e.start_ms for t in traces for e in t.events), default=0.0)
    doc = {"traceEvents": [], "displayTimeUnit": "ms",
           "otherData": {k: v for k, v in (traces[0].meta if traces else {}).items() if k != "rank"}}
    for r, t in enumerate(traces):
        shifted = Trace([TraceEvent(e.track, e.kind, e.name, e.start_ms - origin, e.end_ms - origin,
                                    e.bytes, e.level) for e in t.events], t.tracks, t.meta)
        part = shifted.to_chrome(pid=r + 1, process_name=f"rank {r} ({t.meta.get('device', '')})")
        doc["traceEvents"] += part["traceEvents"]
    return doc


def link_note():
    """How printed times count the halo exchanges: on the CPU backend, on the profile's ``peer``
    link, or not at all where the profile has none; on a GPU, measured (``""``)."""
    rt = runtime.get()
    if not rt.modelled:
        return ""
    if "peer" in rt.profile["links"]:
        return "halo exchanges on the profile's peer link"
    return "the halo exchanges are not modelled"


def halo_bound(compute_ms, exchange_ms, io_ms):
    """The distributed run's physical limit: with perfect overlap a rank can finish no sooner
    than the busiest of its compute, its halo exchanges and its copies to the host (each alone)."""
    return max(compute_ms, exchange_ms, io_ms)


# --------------------------------------------------------------------------
# Running ranks from Python (a notebook): mpiexec as a subprocess
# --------------------------------------------------------------------------
def find_mpiexec():
    """The ``mpiexec`` to start ranks with: ``$COURSE_HELPER_MPIEXEC``, the one next to this
    Python (the ``mpich`` wheel installs it in the environment's ``bin``), else the one on PATH."""
    env = os.environ.get("COURSE_HELPER_MPIEXEC")
    if env:
        return env
    here = pathlib.Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec found: python -m pip install -e '.[distributed]' installs "
                                "mpi4py and MPICH (its mpiexec lands next to python)")
    return found


def ranks_env(backend):
    """The environment for ranks started from this process: this copy of ``course_helper`` first
    on the path, the chosen backend, and (as root, e.g. in a container) Open MPI's consent to run
    as root, which MPICH ignores."""
    env = dict(os.environ, COURSE_HELPER_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[2]),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


class HaloResult:
    """What :func:`launch_halo` returns.

    Attributes
    ----------
    images : numpy.ndarray
        The gathered saved levels, (nsaved, n0, n1).
    identical : bool or None
        With ``check=True``: whether they equal the single-device solve bit for bit.
    elapsed_ms : float
        The slowest rank's loop time (on the CPU backend: modelled, as ``time_label`` says, the
        halo exchanges on the profile's ``peer`` link where it has one, see :func:`link_note`).
    rank_ms : list of float
    traces : list of Trace
        Each rank's timeline (with ``trace=True``).
    summary : dict
        What the run printed as JSON (sizes, strategy, device, times).
    """

    def __init__(self, folder, summary):
        self.summary = summary
        self.ranks = summary["ranks"]
        self.strategy = summary["strategy"]
        self.elapsed_ms = summary["elapsed_ms"]
        self.rank_ms = summary["rank_ms"]
        self.identical = summary.get("identical")
        self.time_label = summary.get("time_label", "")   # e.g. "modelled H200" on the CPU backend
        path = pathlib.Path(folder)
        self.images = np.load(path / "images.npy") if (path / "images.npy").exists() else None
        trace = path / "trace.json"
        self.traces = traces_from_chrome(json.loads(trace.read_text())) if trace.exists() else []

    @property
    def trace(self):
        """Every rank's lanes in one Trace (for ``.plot()``)."""
        if not self.traces:
            raise ValueError("this run recorded no timeline; use launch_halo(..., trace=True)")
        return merge_traces(self.traces, title=f"{self.strategy}, {self.ranks} ranks")

    def chrome(self):
        """The merged Chrome trace (one process per rank) as a dict."""
        return chrome_trace(self.traces)

    def __repr__(self):
        clock = f" {self.time_label}" if self.time_label else ""
        return (f"<HaloResult {self.strategy!r}, {self.ranks} ranks: {self.elapsed_ms:.1f} ms{clock}, "
                f"identical={self.identical}>")


def traces_from_chrome(doc):
    """Split a Chrome trace dict made by :func:`chrome_trace` back into one Trace per rank."""
    traces = []
    for pid in sorted({e["pid"] for e in doc["traceEvents"]}):
        mine = [e for e in doc["traceEvents"] if e["pid"] == pid]
        names = {e["tid"]: e["args"]["name"] for e in mine if e.get("name") == "thread_name"}
        events = [TraceEvent(names[e["tid"]], e["cat"], e["name"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3,
                             e["args"].get("bytes", 0), e["args"].get("level"))
                  for e in mine if e["ph"] == "X"]
        traces.append(Trace(events, [names[t] for t in sorted(names)], dict(doc.get("otherData", {}), rank=pid - 1)))
    return traces


def ranks_backend(ranks):
    """The backend ``ranks`` ranks on this machine get: the GPU when this process uses the GPU
    backend and there is one GPU per rank, else the CPU."""
    if backend_name() == "gpu" and cupy_module().cuda.runtime.getDeviceCount() >= ranks:
        return "gpu"
    return "cpu"


def launch_halo(ranks=2, n=256, nt=None, strategy="overlap", every=1, check=False, trace=True,
                backend=None, timeout=300, mpiexec_args=()):
    """Run ``mpiexec -n ranks python -m course_helper halo ...`` and return a :class:`HaloResult`.

    The ranks run in their own processes (as they would on several GPUs); this
    process only waits for them and reads back what rank 0 wrote. ``backend``
    defaults to :func:`ranks_backend` (the GPU only with one GPU per rank).
    ``mpiexec_args`` is a list of extra arguments for ``mpiexec`` (e.g.
    ``["-bind-to", "core"]``; split a command-line string with ``shlex.split``).
    Every argument is checked before ``mpiexec`` starts. An interrupt (Ctrl-C,
    a notebook's stop button) or ``timeout`` (seconds) stops every rank before
    this function raises.
    """
    ranks = checks.positive_int("ranks", ranks)
    checks.one_of("strategy", strategy, STRATEGIES)
    problem = WaveProblem(n0=n, n1=n, nt=nt)         # the ranks' checks of n and nt, made here first
    decompose(problem.n0, ranks)
    every = checks.positive_int("every", every)
    if every >= problem.nt:
        raise ValueError(f"every={every} is not below nt={problem.nt}: only level 0 would be saved")
    check, trace = checks.flag("check", check), checks.flag("trace", trace)
    timeout = checks.positive_float("timeout (s)", timeout)
    if isinstance(mpiexec_args, (str, bytes)):
        raise TypeError(f"mpiexec_args must be a list of arguments, e.g. ['-bind-to', 'core'], not the string "
                        f"{mpiexec_args!r}; split a command line with shlex.split")
    mpiexec_args = list(mpiexec_args)
    if not all(isinstance(a, str) for a in mpiexec_args):
        raise TypeError(f"mpiexec_args must hold strings, got {mpiexec_args!r}")
    backend = checks.one_of("backend", backend, ("auto", "gpu", "cpu")) if backend else ranks_backend(ranks)
    with tempfile.TemporaryDirectory(prefix="halo-") as out:
        cmd = [find_mpiexec(), *mpiexec_args, "-n", str(ranks), sys.executable, "-m", "course_helper", "halo",
               "--n", str(n), "--nt", str(problem.nt), "--strategy", strategy, "--every", str(every),
               "--out", out]
        if check:
            cmd.append("--check")
        if trace:
            cmd.append("--trace")
        returncode, stderr = _run_ranks(cmd, timeout, ranks_env(backend))
        summary = pathlib.Path(out) / "summary.json"
        doc = json.loads(summary.read_text()) if summary.exists() else None
        # Exit status 1 with a summary that reports a difference is the check's verdict; any
        # other failure (a rank's error, a crash) is the ranks failing.
        if doc is None or returncode not in (0, 1) or (returncode == 1 and doc.get("identical") is not False):
            raise RuntimeError(f"the ranks failed (exit {returncode}):\n{stderr.strip()[-2000:]}")
        return HaloResult(out, doc)


def _run_ranks(cmd, timeout, env):
    """Run ``mpiexec`` and return its exit status and stderr. On an interrupt or a timeout,
    stop it and every rank before raising: MPICH's mpiexec passes a first Ctrl-C on to the
    ranks (each aborts the job) and force-kills them on a second; killing mpiexec ends its
    proxies, which end the ranks."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)     # a terminal's Ctrl-C reaches this process only
    try:
        _, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stderr
    except BaseException as exc:
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            proc.kill()
            proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise TimeoutError(f"the ranks ran longer than timeout={timeout:g} s and were stopped; "
                               "give a larger timeout, or a smaller n or nt") from None
        raise
