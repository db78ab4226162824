"""``prepare`` and ``solve``: check, allocate, run one IO strategy's loop, time it.

The helper owns the plumbing (argument checks, memory checks, allocation,
streams and events, timing, tracing); the loops in
:mod:`course_helper.strategies` own the lesson. :func:`prepare` builds the
:class:`Run` a loop receives; :func:`solve` is ``prepare``, the loop run and
timed, and a :class:`Result`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import checks, runtime, sanitizer
from .runtime import interrupts, observe
from .timelines import recording
from . import disk
from .runtime.backend import backend_name
from .graphs import GraphsUnsupported
from .memory import device_zeros, pinned_empty, to_device
from .strategies import (COPY_LAG, KERNEL_LEVELS, STRATEGIES, Run, Strategy, capture_loop, level_times,
                         ring_depth)
from .streams import create_events, create_streams, synchronize
from .timing import host_timer
from .wave import WaveProblem, launch_wave2d, save_interval, saved_levels

if TYPE_CHECKING:
    from collections.abc import Iterator

    import zarr
    from numpy.typing import ArrayLike

    from .timelines.timeline import Trace

__all__ = ["plan", "Plan", "UnsafeRing", "prepare", "solve", "timing_only", "Result", "STRATEGIES", "plan_memory",
           "available_strategies", "default_batch", "chunk_levels", "suggest_nscratch", "not_computed"]

#: Most buffers one ring may have: each gets its own IO stream and events (a ring needs
#: COPY_LAG + floor(copy time / kernel time) + 1 buffers: see strategies.ring_depth).
MAX_RING = 32
DEFAULT_NSTAGING = 4


def available_strategies() -> list[str]:
    """Names of the strategies the active backend runs, in the order of :data:`STRATEGIES`."""
    return [name for name, entry in STRATEGIES.items() if entry.available()[0]]


@dataclass(frozen=True, eq=False, repr=False)
class Result:
    """What :func:`solve` returns: the run's :class:`Plan` and what the run measured. Frozen:
    a Result says what happened, and nothing changes it afterwards.

    Attributes
    ----------
    plan : Plan
        The checked settings the run ran with (:func:`plan`); ``problem``, ``strategy``,
        ``every``, ``nscratch``, ``nscratch_reason``, ``nstaging`` and ``batch`` read from it.
    images : numpy.ndarray or StoredImages
        Host array (nsaved, n0, n1): one slice per saved level (with
        ``store``: the store's array, read lazily). A run inside :func:`timing_only` on the
        CPU backend computed no levels: a read-only array of NaN that takes no memory.
    levels : numpy.ndarray
        The time level of each slice.
    elapsed_ms : float
        Host wall time of the loop, device synchronised at the end (for the
        graph strategies: of the replay; the capture is in ``capture_ms``).
        On the CPU backend: the *modelled* time on the profiled GPU
        (``time_label`` says which, e.g. "modelled H200").
    backend : str
        The backend the run ran on.
    timeline : Trace or None
        The recorded timeline (None without ``trace=True``); read it as ``trace``, which says
        how to get one when there is none.
    capture_ms : float or None
        Graph strategies: the one-off capture, not in ``elapsed_ms``.
    store : str or path or None
        Path of the Zarr store the levels were streamed to, if any.
    time_label : str
        "" on a GPU, e.g. "modelled H200" on the CPU backend.
    computed : bool
        False for a run inside :func:`timing_only` on the CPU backend (its images were not computed).
    compression : dict or None
        With ``store``: where its chunks were compressed and how fast
        (:meth:`course_helper.disk.DiskSink.compression_summary`).
    """

    plan: Plan
    images: np.ndarray | zarr.Array
    levels: np.ndarray
    elapsed_ms: float
    backend: str
    timeline: Trace | None = None
    capture_ms: float | None = None
    store: str | os.PathLike | None = None
    time_label: str = ""
    computed: bool = True
    compression: dict | None = None

    @property
    def problem(self) -> WaveProblem:
        """The problem solved (the plan's)."""
        return self.plan.problem

    @property
    def strategy(self) -> str:
        """The strategy's name (the plan's)."""
        return self.plan.strategy

    @property
    def every(self) -> int:
        """Every how many levels one was saved (the plan's)."""
        return self.plan.every

    @property
    def nscratch(self) -> int:
        """Scratch wavefields the run used (the plan's)."""
        return self.plan.nscratch

    @property
    def nscratch_reason(self) -> str:
        """Why ``nscratch`` has its value: given, fixed by the strategy, or the ring depth the
        default chose from one level's kernel and copy times (:func:`suggest_nscratch`)."""
        return self.plan.nscratch_reason

    @property
    def nstaging(self) -> int:
        """Staging buffers of a staged strategy, else 0 (the plan's)."""
        return self.plan.nstaging

    @property
    def batch(self) -> int:
        """Saved levels per staging buffer, 1 for a strategy without one (the plan's)."""
        return self.plan.batch

    @property
    def times_ms(self) -> np.ndarray:
        """Simulated time of each slice in ms."""
        return self.levels * self.problem.dt * 1e3

    @property
    def trace(self) -> Trace:
        """The run's :class:`~course_helper.timelines.timeline.Trace` (only if it was recorded)."""
        if self.timeline is None:
            raise ValueError(f"this {self.strategy!r} run did not record a trace; "
                             "run solve(..., trace=True) to get one")
        return self.timeline

    @property
    def has_trace(self) -> bool:
        """Whether the run recorded a timeline (``trace`` then holds it)."""
        return self.timeline is not None

    def max_difference(self, other: Result | ArrayLike) -> float:
        """Largest absolute difference from another Result (or image stack)."""
        return stack_difference(self.images, other.images if isinstance(other, Result) else other)

    def __repr__(self):
        clock = f" {self.time_label}" if self.time_label else ""
        computed = "" if self.computed else ", timed only (images not computed)"
        return (f"<Result {self.strategy!r} on {self.backend}: {len(self.levels)} levels of "
                f"{self.problem.n0}x{self.problem.n1}, nscratch {self.nscratch}, {self.elapsed_ms:.1f} ms{clock}"
                f"{computed}>")


def not_computed(shape: tuple[int, ...]) -> np.ndarray:
    """The images of a run whose arithmetic was skipped (:func:`timing_only`): NaN everywhere,
    read-only, and no memory (one value seen at every index)."""
    return np.broadcast_to(np.float32(np.nan), shape)


def stack_difference(images: np.ndarray | zarr.Array, other: ArrayLike) -> float:
    """Largest absolute difference between two stacks of saved levels of the same shape."""
    b = np.asarray(other)
    if b.shape != images.shape:
        raise ValueError(f"cannot compare stacks of shapes {images.shape} and {b.shape}")
    # One slice at a time: a float64 copy of a whole large stack would double its memory.
    return max((float(np.max(np.abs(a.astype(np.float64) - c))) for a, c in zip(images, b)), default=0.0)


def default_batch(problem: WaveProblem) -> int:
    """Saved levels per staging buffer: enough for copies of about 4 MiB (at most 16 levels),
    since small device-to-host copies run far below the link's bandwidth."""
    return int(max(1, min(16, (4 * 2**20) // problem.nbytes_level)))


def plan_memory(problem: WaveProblem | None = None, strategy: str = "events", every: int = 1,
                nscratch: int | None = None, *, unsafe: bool = False, nstaging: int | None = None,
                batch: int | None = None) -> dict[str, int]:
    """Bytes a run needs: ``{"device": ..., "host": ...}``, with the same argument checks
    (and defaults) as :func:`solve`.

    Device: scratch wavefields, staging buffers and the velocity model; host:
    the saved output stack. On the CPU backend both live in host memory.
    """
    problem = WaveProblem() if problem is None else problem
    return _validate(problem, strategy, every, nscratch, unsafe, nstaging, batch).need


def suggest_nscratch(problem: WaveProblem | None = None, every: int = 1, strategy: str = "events") -> tuple[int, str]:
    """``(nscratch, reason)``: the scratch wavefields ``solve(problem, strategy, every=every)``
    uses by default, and why (the same sentence as ``result.nscratch_reason``).

    For a ring strategy (``"events"``, ``"streams"``, ``"graph"``) that is the depth at which
    a level's copy no longer holds up the kernels,
    :func:`~course_helper.strategies.ring_depth` of one level's kernel and copy times on
    the active backend (:func:`~course_helper.strategies.level_times`: the modelled GPU's
    on the CPU backend, measured once on a GPU), but at least the strategy's usual depth
    (5), at most :data:`MAX_RING`, and no more than fit in device memory (the check of
    :func:`plan_memory`). The other strategies use a fixed number (3).
    """
    problem = WaveProblem() if problem is None else problem
    plan = _validate(problem, strategy, every, None, False)
    return plan.nscratch, plan.nscratch_reason


def _default_nscratch(problem, every, name, entry, held=True):
    """``(nscratch, reason)`` for ``nscratch=None`` (see :func:`suggest_nscratch`); ``held``:
    the output stack is kept in host memory (not for a run streamed to a store or timed only)."""
    if not entry.ring:
        why = "the staging ring holds the copies" if entry.staged else "the strategy has no ring"
        return entry.nscratch, f"{entry.nscratch}, fixed by the {name!r} strategy ({why})"
    kernel_ms, copy_ms, source = level_times(problem)
    want = ring_depth(kernel_ms, copy_ms)
    n = top = min(max(want, entry.nscratch), MAX_RING)
    while n > entry.nscratch and not _fits(Plan(problem, name, every, n, 0, 1, "", held)):
        n -= 1
    why = (f"{n}, chosen: COPY_LAG {COPY_LAG} + floor(copy {copy_ms:.3g} ms / kernel {kernel_ms:.3g} ms) + 1 "
           f"= {want} ({source})")
    if want < entry.nscratch:
        why += f", raised to the {name!r} strategy's usual {entry.nscratch}"
    elif want > MAX_RING:
        why += f", capped at the ring limit {MAX_RING}"
    if n < top:
        why += f"; only {n} fit in device memory"
    if copy_ms > every * kernel_ms:
        why += (f"; a copy takes longer than the {every} kernel(s) between saved levels, so no depth "
                "hides every copy under kernels")
    return n, why


def _fits(plan):
    """Whether ``plan`` (a ring being sized) passes :func:`_check_memory`, the check ``prepare`` makes."""
    try:
        _check_memory(plan)
    except MemoryError:
        return False
    return True


def chunk_levels(problem: WaveProblem, strategy: str, every: int = 1) -> int:
    """Levels per chunk of a store that ``strategy`` streams to with its default settings:
    one staging batch for the staged strategies (see :func:`default_batch`), else one level.
    Same checks as :func:`solve`."""
    return _validate(problem, strategy, every, None, False).batch


def _bytes_needed(problem, every, nscratch, nstaging, batch):
    """``{"device": ..., "host": ...}``: the bytes of a run's buffers and of its output stack."""
    nsaved = len(saved_levels(problem.nt, every))
    return {"device": (nscratch + nstaging * batch + 1) * problem.nbytes_level,
            "host": nsaved * problem.nbytes_level}


def _fewer_levels(problem, avail):
    """Advice for an output stack too large for ``avail`` bytes: an ``every`` whose stack takes
    half of them, if one below nt does, else a smaller grid or a store."""
    fit = int(0.5 * avail // problem.nbytes_level)       # saved levels that fit
    every = math.ceil(problem.nt / fit) if fit >= 2 else problem.nt
    thinner = f"save fewer levels, e.g. every={every}, " if every < problem.nt else ""
    return f"{thinner}use a smaller grid, or stream the levels to disk with store=PATH"


def _check_memory(plan):
    """Refuse a plan that does not fit, before anything is allocated (without ``plan.held``
    the output stack is not kept in host memory: it is streamed to a store, or not computed)."""
    problem, need = plan.problem, plan.need
    nsaved = len(saved_levels(problem.nt, plan.every))
    if plan.held:
        checks.host_memory(
            need["host"], "the output stack",
            detail=f"{nsaved} levels x {problem.nbytes_level / 2**20:,.1f} MiB",
            advice=lambda avail: _fewer_levels(problem, avail))
    else:
        need = dict(need, host=0)
    free = runtime.get().device_free_bytes()
    if free is not None:
        if need["device"] > 0.9 * free:
            raise MemoryError(
                f"the scratch wavefields need {need['device'] / 2**20:,.0f} MiB of device memory "
                f"but only {free / 2**20:,.0f} MiB are free; use a smaller grid or fewer scratch buffers")
    else:
        checks.host_memory(
            need["host"] + need["device"], "the run",
            detail=f"output {need['host'] / 2**20:,.0f} MiB + scratch, staging and velocity "
                   f"{need['device'] / 2**20:,.0f} MiB, which the CPU backend keeps in host memory",
            advice="use fewer scratch or staging buffers (nscratch, nstaging, batch), save fewer levels, "
                   "or use a smaller grid")


def _ring_size(name, value, minimum, default, hint):
    value = checks.positive_int(name, value, minimum=minimum, hint=hint)
    if value > MAX_RING:
        raise ValueError(f"{name} must be at most {MAX_RING}, got {value}: every buffer of the ring gets its "
                         f"own IO stream; leave it at the default ({default})")
    return value


@dataclass(frozen=True)
class Plan:
    """A run's settings, checked once: what :func:`plan` returns and :func:`solve`,
    :func:`prepare`, the memory checks and the benchmark are given.

    Build one with :func:`plan` (it refuses bad settings, and fills in the defaults, such as
    the ring depth); a Plan is frozen, so what was checked stays what runs.
    """
    problem: WaveProblem   #: the problem to solve
    strategy: str          #: a name in :data:`STRATEGIES`
    every: int             #: save every ``every``-th level (1: all of them)
    nscratch: int          #: scratch wavefields (given, fixed by the strategy, or chosen)
    nstaging: int          #: staging buffers of a staged strategy, else 0
    batch: int             #: saved levels per staging buffer (1 without a staging ring)
    nscratch_reason: str   #: why ``nscratch`` has its value (see :func:`suggest_nscratch`)
    #: the output stack is kept in host memory (False for a run streamed to a store, or one
    #: inside :func:`timing_only` on the CPU backend, which computes no levels)
    held: bool = True

    @property
    def entry(self) -> Strategy:
        """The strategy's entry in :data:`STRATEGIES`."""
        return STRATEGIES[self.strategy]

    @property
    def need(self) -> dict[str, int]:
        """Bytes the run needs: ``{"device": ..., "host": ...}`` (see :func:`plan_memory`)."""
        return _bytes_needed(self.problem, self.every, self.nscratch, self.nstaging, self.batch)


def plan(problem: WaveProblem | None = None, strategy: str = "events", every: int = 1,
         nscratch: int | None = None, *, unsafe: bool = False, nstaging: int | None = None,
         batch: int | None = None, output: bool | None = None) -> Plan:
    """Check a run's settings once and return its :class:`Plan`, to be run by :func:`solve`
    (``solve(plan)``), as often as wanted, without checking them again.

    Takes the arguments of :func:`solve` that say what runs (``problem``, ``strategy``,
    ``every``, ``nscratch``, ``unsafe``, ``nstaging``, ``batch``) and refuses the same
    mistakes, before anything is allocated; the defaults are filled in (``plan.nscratch``
    and ``plan.nscratch_reason`` say which ring depth, and why). ``output``: whether the run
    keeps its output stack in host memory, which the default ring depth must leave room for;
    None (the default): as ``solve`` runs here, yes except inside :func:`timing_only` on the
    CPU backend; ``False`` for a run streamed to a store. ``solve`` runs the plan's settings
    either way, and its memory check counts the output stack as that run keeps it.

    >>> p = plan(WaveProblem(n0=64, n1=64, nt=40), "streams")             # doctest: +SKIP
    >>> solve(p).nscratch == p.nscratch                                    # doctest: +SKIP
    True
    """
    problem = WaveProblem() if problem is None else problem
    held = runtime.get().computes_data if output is None else checks.flag("output", output)
    return _validate(problem, strategy, every, nscratch, unsafe, nstaging, batch, held=held)


def _validate(problem, strategy, every, nscratch, unsafe, nstaging=None, batch=None, held=True):
    """The checked :class:`Plan` of a run; raises before anything is allocated. ``held``: the
    output stack is kept in host memory."""
    checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    checks.one_of("strategy", strategy, tuple(STRATEGIES))
    unsafe = checks.flag("unsafe", unsafe)
    every = save_interval(every, problem.nt)
    ok, why = STRATEGIES[strategy].available()
    if not ok:
        error = GraphsUnsupported if STRATEGIES[strategy].graph else RuntimeError
        raise error(f"strategy {strategy!r} is not available: {why}")
    nstaging, batch = _staging(problem, strategy, nstaging, batch, len(saved_levels(problem.nt, every)))
    nscratch, why = _scratch(problem, strategy, every, nscratch, unsafe, held)
    return Plan(problem, strategy, every, nscratch, nstaging, batch, why, held)


def _staging(problem, strategy, nstaging, batch, nsaved):
    """Checked ``(nstaging, batch)``; ``(0, 1)`` for a strategy without a staging ring. A batch
    is at most the run's ``nsaved`` saved levels: a larger one would only size the staging
    buffers (and a store's chunk, a shard's index) for levels that never come."""
    if STRATEGIES[strategy].staged:
        nstaging = DEFAULT_NSTAGING if nstaging is None else _ring_size(
            "nstaging (staging buffers)", nstaging, 1, DEFAULT_NSTAGING,
            hint="the staging ring needs at least 1 buffer")
        if batch is None:
            batch = min(default_batch(problem), nsaved)
        elif checks.positive_int("batch", batch) > nsaved:
            warnings.warn(f"batch={batch} is more than the run's {nsaved} saved levels: it is capped at {nsaved} "
                          "(one staging batch, one chunk of a store, holds them all)", stacklevel=4)
            batch = nsaved
    elif nstaging is not None or batch is not None:
        staged = tuple(name for name, e in STRATEGIES.items() if e.staged)
        raise ValueError(f"nstaging and batch are only used by the staged strategies {staged}, "
                         f"not {strategy!r}")
    else:
        nstaging, batch = 0, 1
    return nstaging, batch


def _scratch(problem, strategy, every, nscratch, unsafe, held):
    """Checked ``(nscratch, why)``: the scratch wavefields, given or chosen, and the reason."""
    entry = STRATEGIES[strategy]
    if nscratch is None:
        return _default_nscratch(problem, every, strategy, entry, held)
    if entry.max_nscratch == entry.min_nscratch:
        if nscratch != entry.nscratch:
            raise ValueError(f"the {strategy} strategy always uses {entry.nscratch} scratch wavefields; "
                             "leave nscratch=None")
        return entry.nscratch, f"{nscratch}, as given"
    nscratch = _ring_size("nscratch", nscratch, KERNEL_LEVELS, "None: a depth chosen from the kernel and copy times",
                          hint="the kernel reads two levels and writes a third")
    if entry.max_nscratch is not None and nscratch > entry.max_nscratch:
        raise ValueError(f"the {strategy} strategy uses at most {entry.max_nscratch} scratch wavefields, "
                         f"got nscratch={nscratch}")
    if nscratch < entry.min_nscratch and not unsafe:
        raise UnsafeRing(strategy, nscratch, entry.min_nscratch,
                         advice=f"Use nscratch >= {entry.min_nscratch} (or leave nscratch=None: solve picks a ring "
                                "deep enough), or pass unsafe=True to watch the race happen.")
    return nscratch, f"{nscratch}, as given"


class UnsafeRing(ValueError):
    """A ring of scratch wavefields too shallow for its strategy, refused. ``rule`` says why
    it races (the one wording of that rule), ``minimum`` is the least safe depth; the message is
    the rule and ``advice``, the caller's fix (the benchmark, which takes no ``unsafe=True``,
    words its own)."""

    def __init__(self, strategy: str, nscratch: int, minimum: int, advice: str):
        self.strategy, self.nscratch, self.minimum = strategy, nscratch, minimum
        self.rule = (f"nscratch={nscratch} is unsafe for the {strategy!r} strategy: the kernel touches three "
                     f"levels, so with fewer than {minimum} buffers the level being copied shares a buffer "
                     "with the level being computed and the copy reads overwritten data (a race)")
        super().__init__(f"{self.rule}. {advice}")


def prepare(problem: WaveProblem | None = None, strategy: str = "events", every: int = 1,
            nscratch: int | None = None, *, unsafe: bool = False, nstaging: int | None = None,
            batch: int | None = None, output: bool = True) -> Run:
    """Check the arguments and build everything a strategy's loop receives: a :class:`Run`.

    Takes the same arguments as :func:`solve` (less ``trace``) and refuses
    the same mistakes, before allocating anything. The scratch wavefields and
    the velocity model are on the device, the output ``images`` on the host
    (pinned for the strategies that use streams) and filled with NaN, so that a
    level that is never written cannot pass for a quiet wavefield. The device is
    synchronised before it returns. Inside :func:`timing_only` on the CPU backend the run
    is only timed (``run.computes`` is False): its loop computes nothing, and ``images``
    stays NaN.

    Run a loop on it, then close its streams (``with`` does both)::

        with prepare(problem, "events") as run:
            strategies.with_events(run)        # any loop(run)
        run.images                             # the saved levels

    A graph strategy's loop is captured with
    :func:`course_helper.strategies.capture_loop` and the graph replayed.
    ``output=False`` leaves ``run.images`` as None (no host output stack):
    ``solve(..., store=PATH)`` puts its ring of disk-bound slots there.
    """
    problem = WaveProblem() if problem is None else problem
    output = checks.flag("output", output)
    return _build(_validate(problem, strategy, every, nscratch, unsafe, nstaging, batch, held=output))


def _build(plan: Plan) -> Run:
    """Refuse a plan that does not fit, then allocate what its loop receives: the :class:`Run`
    of :func:`prepare` (with no host output stack where ``plan.held`` is False)."""
    problem, entry = plan.problem, plan.entry
    _check_memory(plan)
    # Allocation (outside any timed loop).
    images = None
    if plan.held:
        images = _output_stack(problem, plan.every, entry)
        images.fill(np.nan)
    run = Run(problem, plan.every, U=[device_zeros(problem.shape) for _ in range(plan.nscratch)],
              V=to_device(problem.velocity), images=images,
              staging=[device_zeros((plan.batch, *problem.shape)) for _ in range(plan.nstaging)], batch=plan.batch,
              strategy=plan.strategy, nscratch_reason=plan.nscratch_reason, computes=runtime.get().computes_data)
    if entry.streams:
        nio = plan.nstaging if entry.staged else plan.nscratch   # one IO stream per buffer copied from
        run.compute = create_streams(1, name="compute")[0]
        run.io = create_streams(nio, name="io")
        run.copied = create_events(nio)
        if entry.staged:
            run.filled = create_events(nio)
        else:
            run.ready = create_events(nio)
    _warm_up()
    synchronize()   # the zeroed buffers are ready before any stream touches them
    return run


def _output_stack(problem, every, entry):
    """The host output of a run, uninitialised: pinned for the strategies that use streams."""
    shape = (len(saved_levels(problem.nt, every)), *problem.shape)
    return pinned_empty(shape) if entry.streams else np.empty(shape, np.float32)


def _watch_for_races(run):
    """Start a race sanitizer, of every thread, for one of ``solve``'s runs, its buffers named."""
    buffers = {"U": run.U, "V": run.V, "staging": run.staging}
    if isinstance(run.images, np.ndarray):
        buffers["images"] = run.images
    elif run.images is not None:
        buffers["ring slot"] = run.images.slots        # a run streamed to a store: its ring's slots
    return observe.add(sanitizer.Sanitizer(buffers), every_thread=True)


def solve(problem: WaveProblem | Plan | None = None, strategy: str = "events", every: int = 1,
          nscratch: int | None = None, trace: bool = True, unsafe: bool = False, nstaging: int | None = None,
          batch: int | None = None, sanitize: bool = False, store: str | os.PathLike | None = None,
          compress: str | None = None) -> Result:
    """Solve the wave problem with one IO strategy and return a :class:`Result`.

    ``solve`` is :func:`prepare`, then the strategy's loop run and timed (for a
    graph strategy: captured once, then one replay timed), then a Result.

    Give either the settings (``problem``, ``strategy``, ``every``, ``nscratch``, ``unsafe``,
    ``nstaging``, ``batch``), which ``solve`` checks, or a :class:`Plan` made by :func:`plan`
    in their place: ``solve(plan(problem, "events"), trace=False)`` runs what was checked
    once, however often it is solved.

    Parameters
    ----------
    problem : WaveProblem or Plan, optional
        Default: ``WaveProblem()``, the lesson's 256 x 256 x 640 problem. A :class:`Plan`
        carries the settings below up to ``batch`` (give none of them with it).
    strategy : str
        A name in :data:`STRATEGIES`: ``"sequential"``, ``"sequential-pinned"``, ``"streams"``,
        ``"events"``, ``"staged"``, ``"graph"`` or ``"graph-staged"``. The
        graph strategies need CUDA graphs (the GPU backend).
    every : int
        Save every ``every``-th level from 0 to nt-1 (1: all of them).
    nscratch : int, optional
        Scratch wavefields of the ring strategies (at least 4, at most 32). Default:
        a ring deep enough for the copies to run under the kernels where memory allows,
        at least 5 (:func:`suggest_nscratch`; ``result.nscratch_reason`` says what it chose
        and why). The sequential and staged strategies use 3.
    trace : bool
        Record a timeline of every kernel, copy and host wait (``result.trace``).
    unsafe : bool
        Allow ``nscratch=3`` for a ring strategy, to demonstrate the race.
    nstaging : int, optional
        Staging buffers of the staged strategies (default 4, at least 1, at most 32).
    batch : int, optional
        Saved levels per staging buffer, shipped in one copy (staged
        strategies; default: enough for about 4 MiB, see :func:`default_batch`). At most the
        run's saved levels: a larger one is capped there, with a warning.
    sanitize : bool
        Check the loop for races (:mod:`course_helper.sanitizer`) and raise
        ``RaceError`` at the first; leave it off for timings.
    store : str or path, optional
        Stream every saved level into a new Zarr v3 store at this path while
        computing (see :mod:`course_helper.disk`): host memory is then a small
        ring of slots whatever ``nt`` is, and ``result.images`` reads from the
        store lazily. Not for the graph strategies (their loop is replayed
        without the host, which hands each filled slot to the disk).
    compress : {None, "zstd", "blosc", "gpu-zstd"}
        Compress the chunks of ``store``: on the writer threads (``"zstd"``, ``"blosc"``), or on
        the device before they cross to the host (``"gpu-zstd"``: nvCOMP on a GPU, modelled on
        the CPU backend; each chunk a Zarr shard of small zstd chunks that any Zarr reader opens;
        the staged loop with ``batch`` levels of about 128 MiB per chunk compresses fastest).

    Examples
    --------
    >>> r = solve(WaveProblem(n0=64, n1=64, nt=40), strategy="streams")   # doctest: +SKIP
    >>> r.images.shape                                                     # doctest: +SKIP
    (40, 64, 64)
    """
    trace, sanitize = checks.flag("trace", trace), checks.flag("sanitize", sanitize)
    computes = runtime.get().computes_data
    held = store is None and computes
    if isinstance(problem, Plan):
        _check_planned(problem, strategy, every, nscratch, unsafe, nstaging, batch)
        strategy = problem.strategy
    checks.one_of("strategy", strategy, tuple(STRATEGIES))
    _check_options(strategy, trace, store, compress)
    if isinstance(problem, Plan):
        # The plan's settings run as checked; whether the output stack is held is this run's
        # (a store, timing_only()), and the memory check of prepare counts it so.
        plan = problem if problem.held == held else dataclasses.replace(problem, held=held)
    else:
        plan = _validate(WaveProblem() if problem is None else problem, strategy, every, nscratch, unsafe, nstaging,
                         batch, held=held)
    if store is not None:          # path, free space and codec, before anything is allocated
        disk.check_target(store, plan.need["host"], compress)
    run = _build(plan)
    if store is None and not computes:
        # Timed only: the copies are queued into an output stack of their own (the sanitizer
        # follows them there) but write nothing, so its pages are never touched and take no
        # memory; the Result holds NaN instead (not_computed).
        run.images = _output_stack(plan.problem, plan.every, plan.entry)
    with _Cleanup() as cleanup:                    # on the way out, whatever happened: last in, first out
        cleanup.callback(run.close)
        sink = _open_sink(store, compress, plan, run, cleanup) if store is not None else None
        if sanitize:
            with interrupts.held():                # started, and its stop registered, or neither
                cleanup.callback(sanitizer.stop, _watch_for_races(run))
        cleanup.push(_on_error(_drain))            # a failed run leaves the process usable
        recorder = _start_recording(run, cleanup) if trace else None
        elapsed, capture_ms = _timed_loop(run, plan.entry, sink)
        timeline = recorder.finish() if recorder is not None else None
        if sink is None:
            observe.notify("host_access", run.images, "r", "solve's result")
    if sink is not None:
        images = sink.open_result()
    else:
        images = run.images if computes else not_computed(run.images.shape)   # timing_only(): say so
    return Result(plan, images, np.asarray(run.levels), elapsed, backend_name(), timeline, capture_ms=capture_ms,
                  store=store, time_label=runtime.time_label(), computed=computes,
                  compression=sink.compression_summary() if sink is not None else None)


def _check_planned(plan, strategy, every, nscratch, unsafe, nstaging, batch):
    """Refuse settings given beside a :class:`Plan`: it carries them all."""
    given = [name for name, value, default in (("strategy", strategy, "events"), ("every", every, 1),
                                               ("nscratch", nscratch, None), ("unsafe", unsafe, False),
                                               ("nstaging", nstaging, None), ("batch", batch, None))
             if value != default and not (name == "strategy" and value == plan.strategy)]
    if given:
        raise ValueError(f"solve(plan, ...) runs the plan's settings; leave out {', '.join(given)} "
                         "(or make a new plan with them: ch.plan(problem, strategy, ...))")


def _check_options(strategy, trace, store, compress):
    """Refuse the options of :func:`solve` that cannot go together, before anything is checked
    at length or allocated."""
    if store is not None and not isinstance(store, (str, os.PathLike)):
        raise TypeError(f"store must be the path of a new Zarr store (a str or pathlib.Path), "
                        f"got {store!r} ({type(store).__name__})")
    if trace and recording.current() is not None:
        raise RuntimeError("solve(trace=True) records its own timeline; call it outside the "
                           "`with tracing()` block, or pass trace=False to record into that block's trace")
    if store is None and compress is not None:
        raise ValueError("compress only applies to a run streamed to disk; pass store=PATH too")
    if store is not None and STRATEGIES[strategy].graph:
        raise ValueError(f"strategy {strategy!r} replays a captured loop without the host, which must hand "
                         "each filled slot to the disk; stream with 'events' or 'staged' instead")
    if store is not None and not runtime.get().computes_data:
        raise ValueError("inside timing_only() the modelled GPU computes no data, so a store would hold none; "
                         "stream to a store outside the timing_only() block")


class _Cleanup(contextlib.ExitStack):
    """The clean-up of one of ``solve``'s runs: an ExitStack whose unwinding a Ctrl-C does not
    cut short (a recorder left recording, or a store's writer threads left running, would break
    the next run). A Ctrl-C then is held, and raised once the unwinding is done, unless the run
    is ending with an exception already; only the drain of the queued work stops at one."""

    def __exit__(self, *exc_details):
        with interrupts.held(raise_at_end=exc_details[0] is None):
            return super().__exit__(*exc_details)


def _on_error(action):
    """An exit callback for a :class:`contextlib.ExitStack`: ``action(exc)`` when the block
    raised ``exc``, nothing when it ended well; the exception goes on."""
    def on_exit(exc_type, exc, tb):
        if exc is not None:
            action(exc)
    return on_exit


def _drain(exc):
    """After ``exc``: let the device finish the queued work; ``exc`` matters more than any
    error of the drain."""
    with contextlib.suppress(BaseException), interrupts.stoppable():   # a Ctrl-C stops the drain
        synchronize()


def _open_sink(store, compress, plan, run, cleanup):
    """A small ring of host slots (``run.images``) that writer threads empty into ``store``.
    If the run fails, the sink still ends (``cleanup``): the disk threads stop and the ring is
    let go; chunks whose copies landed are written whole, those made by failed or skipped work
    are not, and the error gets a note saying what the store keeps."""
    with interrupts.held():            # a Ctrl-C here comes once finish() is sure to run
        sink = disk.DiskSink(store, plan.problem, plan.every, chunk=plan.batch, compress=compress,
                             pinned=plan.entry.streams, checked=True)    # the target was checked before allocating
        cleanup.push(_on_error(sink.finish))
    run.images = sink.ring
    return sink


def _start_recording(run, cleanup):
    """Start recording the run's timeline; if the run fails, the recording stops (``cleanup``)
    before the queued work is drained."""
    with interrupts.held():            # activated, and its stop registered, or neither
        recorder = recording.Recorder({"strategy": run.strategy, "n0": run.problem.n0, "n1": run.problem.n1,
                                       "nt": run.nt, "every": run.every, "nscratch": run.nscratch,
                                       "nstaging": run.nstaging, "batch": run.batch}).activate()
        cleanup.push(_on_error(lambda exc: recorder.deactivate()))
    return recorder


def _timed_loop(run, entry, sink):
    """Run the strategy's loop and time it: ``(elapsed_ms, capture_ms)``. A graph strategy's loop
    is captured and set up first (``capture_ms``; None for the others), then one replay is timed.
    The timed part ends when the device is done and, with a ``sink``, every level is on disk."""
    graph, capture_ms = None, None
    if entry.graph:
        with host_timer() as capture:
            graph = capture_loop(entry.loop, run)     # capture: records, runs nothing
            graph.upload()                            # and set up, ready to replay
            synchronize()
        capture_ms = capture.ms
    with host_timer() as timed:
        if graph is not None:
            graph.launch()                            # the timed part: one replay
        else:
            entry.loop(run)                           # with a store, each copy hands its slot to the sink
        synchronize()
        if sink is not None:
            sink.require_every_level(run.strategy)    # a loop that skipped a level leaves no gap unsaid
            sink.finish()                             # the timed part ends when all is on disk
    return timed.ms, capture_ms


@contextlib.contextmanager
def timing_only() -> Iterator[None]:
    """Inside the block, runs are for their times and timelines only.

    On the CPU backend the modelled GPU then skips the NumPy arithmetic: times, timelines and
    overlap figures are exactly those of a full run, but the images are not computed (they read
    NaN and take no memory: ``result.computed`` is False), so a sweep of large grids takes seconds
    instead of minutes. On a GPU the block changes nothing (the device computes anyway, and
    skipping its work would change the times being measured). Use it for sweeps whose images
    you do not look at; :func:`~course_helper.measure.compare.compare_strategies` inside it says
    "not computed" where it would compare images, and a store is refused.

    The block belongs to the thread that entered it: runs in other threads, and runs started
    outside it, compute (a run of :func:`prepare` computes, or not, as where it was prepared,
    when its loop runs inside ``with run:``).

    >>> with timing_only():                                                   # doctest: +SKIP
    ...     r = solve(WaveProblem(n0=3072, n1=3072, nt=320), "events", every=16)
    >>> r.trace.overlap().hidden_fraction                                      # doctest: +SKIP
    1.0
    """
    rt = runtime.get()
    with rt.times_only(rt.predicts_times):     # a device that measures its times computes anyway
        yield

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
