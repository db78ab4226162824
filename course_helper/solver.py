"""``solve``: allocate, run one IO strategy's loop, time it, and return the result.

The helper owns the plumbing (argument checks, memory checks, allocation,
streams and events, timing, tracing); the loops in
:mod:`course_helper.strategies` own the lesson.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import checks, recording, runtime, strategies
from .backend import backend_name
from .graphs import GraphsUnsupported, graphs_supported
from .memory import device_zeros, host_memory_available, pinned_empty, to_device
from .streams import create_events, create_streams, synchronize
from .wave import WaveProblem, launch_wave2d

__all__ = ["solve", "Result", "STRATEGIES", "Run", "plan_memory"]

#: strategy name -> the loop that runs it
STRATEGIES = {
    "sequential": strategies.sequential,
    "streams": strategies.with_streams,
    "events": strategies.with_events,
    "staged": strategies.staged,
    "graph": strategies.graph,
    "graph-staged": strategies.graph_staged,
}
_RING = ("streams", "events", "graph")              # copy straight out of the scratch ring
_STAGED = ("staged", "graph-staged")                # copy out of a staging ring
_GRAPHS = ("graph", "graph-staged")                 # captured once, then replayed
DEFAULT_NSCRATCH = 5
MIN_SAFE_NSCRATCH = 4
DEFAULT_NSTAGING = 4


@dataclass
class Run:
    """Everything a strategy's loop needs: the problem, buffers, streams and events."""
    problem: WaveProblem
    every: int
    nscratch: int
    U: list                  # scratch wavefields on the device, level L in U[L % nscratch]
    V: object                # velocity model on the device
    images: np.ndarray       # host output, one slice per saved level
    staging: list = field(default_factory=list)  # staging ring on the device (staged strategies)
    batch: int = 1                                # saved levels per staging buffer
    compute: object = None
    io: list = field(default_factory=list)
    ready: list = field(default_factory=list)    # ready[b]: level in U[b] is computed
    copied: list = field(default_factory=list)   # copied[b]: the copy out of U[b] is done

    @property
    def nt(self):
        return self.problem.nt

    @property
    def nsaved(self):
        return len(range(0, self.problem.nt, self.every))

    def level_of(self, k):
        """The time level stored at output index ``k``."""
        return k * self.every

    def slot(self, level):
        """Index of ``level`` in the output, or None if it is not saved (or out of range)."""
        if 0 <= level < self.problem.nt and level % self.every == 0:
            return level // self.every
        return None


class Result:
    """What :func:`solve` returns.

    Attributes
    ----------
    images : numpy.ndarray
        Host array (nsaved, n0, n1): one slice per saved level.
    levels : numpy.ndarray
        The time level of each slice.
    times_ms : numpy.ndarray
        Simulated time of each slice in ms.
    elapsed_ms : float
        Host wall time of the loop, device synchronised at the end (for the
        graph strategies: of the replay; the capture is in ``capture_ms``).
        On the CPU backend: the *modelled* time on the profiled GPU
        (``time_label`` says which, e.g. "modelled H200").
    strategy, backend : str
    every, nscratch : int
    problem : WaveProblem
    """

    def __init__(self, images, levels, elapsed_ms, strategy, problem, every, nscratch, backend, trace,
                 nstaging=0, batch=1, capture_ms=None, time_label=""):
        self.images = images
        self.levels = levels
        self.times_ms = levels * problem.dt * 1e3
        self.elapsed_ms = elapsed_ms
        self.strategy = strategy
        self.problem = problem
        self.every = every
        self.nscratch = nscratch
        self.backend = backend
        self.nstaging = nstaging
        self.batch = batch
        self.capture_ms = capture_ms     # graph strategies: the one-off capture, not in elapsed_ms
        self.time_label = time_label     # "" on a GPU, e.g. "modelled H200" on the CPU backend
        self._trace = trace

    @property
    def trace(self):
        """The run's :class:`~course_helper.timeline.Trace` (only if it was recorded)."""
        if self._trace is None:
            raise ValueError(f"this {self.strategy!r} run did not record a trace; "
                             "run solve(..., trace=True) to get one")
        return self._trace

    @property
    def has_trace(self):
        return self._trace is not None

    def max_difference(self, other):
        """Largest absolute difference from another Result (or image stack)."""
        b = other.images if isinstance(other, Result) else np.asarray(other)
        if b.shape != self.images.shape:
            raise ValueError(f"cannot compare stacks of shapes {self.images.shape} and {b.shape}")
        # One slice at a time: a float64 copy of a whole large stack would double its memory.
        return max((float(np.max(np.abs(a.astype(np.float64) - c))) for a, c in zip(self.images, b)),
                   default=0.0)

    def __repr__(self):
        clock = f" {self.time_label}" if self.time_label else ""
        return (f"<Result {self.strategy!r} on {self.backend}: {len(self.levels)} levels of "
                f"{self.problem.n0}x{self.problem.n1}, {self.elapsed_ms:.1f} ms{clock}>")


def default_batch(problem):
    """Saved levels per staging buffer: enough for copies of about 4 MiB (at most 16 levels),
    since small device-to-host copies run far below the link's bandwidth."""
    return int(max(1, min(16, (4 * 2**20) // problem.nbytes_level)))


def plan_memory(problem, every=1, nscratch=DEFAULT_NSCRATCH, nstaging=0, batch=1):
    """Bytes a run needs: ``{"device": ..., "host": ...}``.

    Device: scratch wavefields, staging buffers and the velocity model; host:
    the saved output stack.
    """
    nsaved = len(range(0, problem.nt, every))
    return {"device": (nscratch + nstaging * batch + 1) * problem.nbytes_level,
            "host": nsaved * problem.nbytes_level}


def _check_memory(problem, every, nscratch, nstaging=0, batch=1):
    need = plan_memory(problem, every, nscratch, nstaging, batch)
    avail = host_memory_available()
    if avail is not None and need["host"] > 0.8 * avail:
        suggest = every * math.ceil(need["host"] / (0.5 * avail))
        raise MemoryError(
            f"the output stack needs {need['host'] / 2**20:,.0f} MiB of host memory "
            f"({len(range(0, problem.nt, every))} levels x {problem.nbytes_level / 2**20:,.1f} MiB) but "
            f"only {avail / 2**20:,.0f} MiB are available; save fewer levels, e.g. every={suggest}, "
            "or use a smaller grid")
    free = runtime.get().device_free_bytes()
    if free is not None:
        if need["device"] > 0.9 * free:
            raise MemoryError(
                f"the scratch wavefields need {need['device'] / 2**20:,.0f} MiB of device memory "
                f"but only {free / 2**20:,.0f} MiB are free; use a smaller grid or fewer scratch buffers")


def _validate(problem, strategy, every, nscratch, unsafe, nstaging=None, batch=None):
    """Checked ``(every, nscratch, nstaging, batch)``; raises before anything is allocated."""
    checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    checks.one_of("strategy", strategy, tuple(STRATEGIES))
    every = checks.positive_int("every", every)
    if every >= problem.nt:
        raise ValueError(f"every={every} is not below nt={problem.nt}: only level 0 (the zero "
                         "initial state) would be saved; choose every < nt")
    if strategy in _GRAPHS:
        ok, why = graphs_supported()
        if not ok:
            raise GraphsUnsupported(f"strategy {strategy!r} is not available: {why}")
    if strategy in _STAGED:
        nstaging = DEFAULT_NSTAGING if nstaging is None else checks.positive_int(
            "nstaging (staging buffers)", nstaging, hint="the staging ring needs at least 1 buffer")
        batch = default_batch(problem) if batch is None else checks.positive_int("batch", batch)
    elif nstaging is not None or batch is not None:
        raise ValueError(f"nstaging and batch are only used by the staged strategies {_STAGED}, "
                         f"not {strategy!r}")
    else:
        nstaging, batch = 0, 1
    if strategy == "sequential" and nscratch not in (None, 3):
        raise ValueError("the sequential strategy always uses 3 scratch wavefields; leave nscratch=None")
    if strategy in ("sequential",) + _STAGED:
        # Only the compute stream touches the scratch ring here: 3 buffers suffice.
        if nscratch is None:
            return every, 3, nstaging, batch
        return every, checks.positive_int("nscratch", nscratch, minimum=3,
                                          hint="the kernel reads two levels and writes a third"), nstaging, batch
    if nscratch is None:
        return every, DEFAULT_NSCRATCH, nstaging, batch
    nscratch = checks.positive_int("nscratch", nscratch, minimum=3,
                                   hint="the kernel itself reads two levels and writes a third")
    if nscratch < MIN_SAFE_NSCRATCH and not unsafe:
        raise ValueError(
            f"nscratch={nscratch} is unsafe for the {strategy!r} strategy: the kernel touches three "
            "levels, so with fewer than 4 buffers the level being copied shares a buffer with the "
            "level being computed and the copy reads overwritten data (a race). Use nscratch >= 4 "
            "(default 5), or pass unsafe=True to watch the race happen.")
    return every, nscratch, nstaging, batch


def solve(problem=None, strategy="events", every=1, nscratch=None, trace=True, unsafe=False,
          nstaging=None, batch=None):
    """Solve the wave problem with one IO strategy and return a :class:`Result`.

    Parameters
    ----------
    problem : WaveProblem, optional
        Default: ``WaveProblem()``, the lesson's 256 x 256 x 640 problem.
    strategy : {"sequential", "streams", "events", "staged", "graph", "graph-staged"}
        Which loop of :mod:`course_helper.strategies` to run. The graph
        strategies need the GPU backend.
    every : int
        Save every ``every``-th level from 0 to nt-1 (1: all of them).
    nscratch : int, optional
        Scratch wavefields of the ring strategies (default 5, at least 4); the
        sequential and staged strategies use 3.
    trace : bool
        Record a timeline of every kernel, copy and host wait (``result.trace``).
    unsafe : bool
        Allow ``nscratch=3`` for a ring strategy, to demonstrate the race.
    nstaging : int, optional
        Staging buffers of the staged strategies (default 4, at least 1).
    batch : int, optional
        Saved levels per staging buffer, shipped in one copy (staged
        strategies; default: enough for about 4 MiB, see :func:`default_batch`).

    Examples
    --------
    >>> r = solve(WaveProblem(n0=64, n1=64, nt=40), strategy="streams")   # doctest: +SKIP
    >>> r.images.shape                                                     # doctest: +SKIP
    (40, 64, 64)
    """
    problem = WaveProblem() if problem is None else problem
    if trace and recording.current() is not None:
        raise RuntimeError("solve(trace=True) records its own timeline; call it outside the "
                           "`with tracing()` block, or pass trace=False to record into that block's trace")
    every, nscratch, nstaging, batch = _validate(problem, strategy, every, nscratch, unsafe, nstaging, batch)
    _check_memory(problem, every, nscratch, nstaging, batch)
    backend = backend_name()
    levels = np.arange(0, problem.nt, every)

    # Allocation (outside the timed loop). The output is poisoned with NaN so
    # that a level that was never written cannot pass for a quiet wavefield.
    concurrent = strategy != "sequential"
    shape = (len(levels), *problem.shape)
    images = pinned_empty(shape) if concurrent else np.empty(shape, np.float32)
    rt = runtime.get()
    if rt.computes_data:          # (a model predicting times only writes no data)
        images.fill(np.nan)
    run = Run(problem, every, nscratch, U=[device_zeros(problem.shape) for _ in range(nscratch)],
              V=to_device(problem.velocity), images=images,
              staging=[device_zeros((batch, *problem.shape)) for _ in range(nstaging)], batch=batch)
    if concurrent:
        nio = nstaging if strategy in _STAGED else nscratch   # one IO stream per buffer copied from
        run.compute = create_streams(1, name="compute")[0]
        run.io = create_streams(nio, name="io")
        run.ready = create_events(nio)
        run.copied = create_events(nio)
    _warm_up()
    synchronize()   # the zeroed buffers are ready before any stream touches them

    recorder = None
    capture_ms = None
    try:
        if trace:
            recorder = recording.Recorder({"strategy": strategy, "n0": problem.n0, "n1": problem.n1,
                                         "nt": problem.nt, "every": every, "nscratch": nscratch,
                                         "nstaging": nstaging, "batch": batch}).activate()
        if strategy in _GRAPHS:
            t0 = rt.host_ms()
            graph = STRATEGIES[strategy](run)             # capture: records, runs nothing
            capture_ms = rt.host_ms() - t0
            t0 = rt.host_ms()
            graph.launch()                                # the timed part: one replay
        else:
            t0 = rt.host_ms()
            STRATEGIES[strategy](run)
        synchronize()
        elapsed = rt.host_ms() - t0
        timeline = recorder.finish() if recorder is not None else None
    except BaseException:
        # Leave the process usable: drain queued work, stop recording, re-raise.
        if recorder is not None:
            recorder.deactivate()
        try:
            synchronize()
        except BaseException:  # noqa: BLE001 - the original error matters more
            pass
        raise
    finally:
        _close_streams(run)
    return Result(images, levels, elapsed, strategy, problem, every, nscratch, backend, timeline,
                  nstaging=nstaging, batch=batch, capture_ms=capture_ms, time_label=runtime.time_label())


_warmed = set()


def _warm_up():
    """Run the kernel once, untimed: the first launch loads its module (CUDA loads
    kernels lazily), which would otherwise land inside the first timed loop."""
    backend = id(runtime.get())
    if backend in _warmed:
        return
    tiny = WaveProblem(n0=8, n1=8, nt=3)
    U = [device_zeros(tiny.shape) for _ in range(3)]
    launch_wave2d(U[0], U[1], U[2], to_device(tiny.velocity), tiny, 0)
    synchronize()
    _warmed.add(backend)


def _close_streams(run):
    """This run's streams take no more work (on the CPU backend queueing more raises)."""
    for s in ([run.compute] if run.compute is not None else []) + list(run.io):
        s.runtime.close_stream(s.raw)
