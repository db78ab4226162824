"""The checks of the "On your own" cells of notebooks 2, 3, 6 and 9.

Each check fails an answer that misses the exercise's point, not only one that is malformed:

* notebook 2, :func:`check_copy_after_kernels`: the copy must be ordered after the kernels by
  the device, with no host wait;
* notebook 3, :func:`check_speedup`: the speed-up you claim is measured again, at your size;
* notebook 6, :func:`check_ring_depth`: your ring must hide the copies, and one buffer fewer
  must not (the *fewest* buffers);
* notebook 9, :func:`check_race_fix`: no race, the sequential answer, and no host wait beyond
  those the loop needs (as notebook 8 counts them).

Each returns a :class:`~.core.Verdict`: the sentence to print, and whether it passed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import checks, runtime
from ..memory import measure_bandwidth
from ..runtime.base import byte_span
from ..runtime.ops import OpKind
from ..solver import prepare, solve, timing_only
from ..streams import create_streams, synchronize
from ..wave import WaveProblem
from .core import ExerciseError, Verdict, describe_waits, run_checked

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..runtime.observe import Op
    from ..solver import Result

__all__ = ["check_copy_after_kernels", "check_speedup", "SPEEDUP_FACTOR_GPU", "SPEEDUP_RTOL", "SPEEDUP_ROUNDS",
           "check_ring_depth", "RING_GOAL", "check_race_fix", "RACE_FIX_PROBLEM"]


class _NotYet(ExerciseError):
    """Raised inside a check; the check turns it into a failed verdict."""


# --------------------------------------------------------------------------
# Notebook 2: make a copy wait for a kernel
# --------------------------------------------------------------------------
def check_copy_after_kernels(loop: Callable[[Any, Any], None] | None) -> Verdict:
    """Run ``loop(compute, io)`` on two fresh streams and say whether it orders its copy after
    its kernels on the device, without the host waiting."""
    if loop is None:
        return Verdict("Not answered yet: fill in copy_after_kernels, set answer = copy_after_kernels, "
                       "run this cell again.", False)
    (compute,) = create_streams(1, name="compute")
    (io,) = create_streams(1, name="io")
    synchronize()
    try:
        program = run_checked(loop, {"compute": compute, "io": io}, _NotYet, "copy the wrong data",
                              args=(compute, io))
    except _NotYet as err:
        if err.race is None:
            return Verdict(f"Not yet: {err}", False)
        return Verdict(f"Not yet: nothing orders the copy after the kernels ({err.race.first}, then "
                       f"{err.race.second}). Make io wait for an event recorded on compute after them.", False)
    kernels = [q[0] for q in program.queued if q[0].kind == "kernel"]
    copies = [q[0] for q in program.queued if q[0].kind == OpKind.D2H]
    if not kernels or not copies:
        return Verdict("Not yet: copy_after_kernels should still queue the 20 steps and the copy; put them back.",
                       False)
    if program.host_waits:
        return Verdict("Ordered, but the host waited for the kernels: let the io stream wait for an event instead.",
                       False)
    return Verdict("Right: the copy is ordered after the last kernel by the device, and the host never waited.", True)


# --------------------------------------------------------------------------
# Notebook 3: your own speed-up
# --------------------------------------------------------------------------
#: How far a claimed speed-up may be from the check's own measurement at the same size: copies
#: into pageable memory vary from run to run on a GPU (the CPU backend's model never varies).
SPEEDUP_RTOL = 0.25
#: How many times the check measures on a GPU before it says an answer is wrong.
SPEEDUP_ROUNDS = 3
#: On a GPU, how far a claimed speed-up may be from the check's measurement, as a factor either
#: way: the pageable speed moves with the host's state, and on an H100 machine a speed-up of 5.3x
#: measured by the solution was 3.7x in three measurements seconds later (8.3x, then 5.7x, another
#: time). Halving or tripling the answer is still refused.
SPEEDUP_FACTOR_GPU = 1.6


def check_speedup(size_mib: float, speedup: float | None, repeats: int = 3) -> Verdict:
    """Measure pinned and pageable copies at ``size_mib`` again and say whether ``speedup``
    (pinned GB/s over pageable GB/s, as you measured it) is what this measurement finds,
    within :data:`SPEEDUP_RTOL`. On a GPU the check measures up to :data:`SPEEDUP_ROUNDS` times
    and takes an answer within a factor of :data:`SPEEDUP_FACTOR_GPU` of any of them: copies into
    pageable memory are as fast as the host is free. The model measures the same every time, so it
    measures once."""
    if speedup is None:
        return Verdict("Not answered yet: measure at my_size_mib, set my_speedup, run this cell again.", False)
    try:
        claimed = checks.positive_float("my_speedup", speedup)
        size_mib = checks.positive_float("my_size_mib", size_mib)
    except (TypeError, ValueError) as err:
        return Verdict(f"Not yet: {err}.", False)
    modelled = runtime.get().predicts_times
    if modelled:
        tolerance = f"within {SPEEDUP_RTOL:.0%}"

        def agrees(value, measured):
            return abs(value - measured) <= SPEEDUP_RTOL * measured
    else:
        tolerance = f"within a factor of {SPEEDUP_FACTOR_GPU:g}"

        def agrees(value, measured):
            return max(value / measured, measured / value) <= SPEEDUP_FACTOR_GPU
    found = []                                   # (pinned / pageable, the speeds) of each round
    for _ in range(1 if modelled else SPEEDUP_ROUNDS):
        speeds = {r["memory"]: r["gb_per_s"] for r in measure_bandwidth(sizes_mib=(size_mib,), repeats=repeats)}
        measured = speeds["pinned"] / speeds["pageable"]
        found.append((measured, speeds))
        if agrees(claimed, measured):
            verdict = "faster" if measured > 1 else "not faster"
            return Verdict(f"Right: measured again at {size_mib:g} MiB, the speed-up agrees with yours; pinned "
                           f"copies were {verdict}.", True)
    if any(agrees(1 / claimed, measured) for measured, _ in found):
        return Verdict(f"Not yet: {claimed:.2f} is the pageable speed over the pinned one; the speed-up is pinned "
                       "GB/s divided by pageable GB/s.", False)
    measured, speeds = found[-1]
    others = "" if len(found) == 1 else f" (the {len(found)} measurements: " + ", ".join(
        f"{m:.2f}x" for m, _ in found) + ")"
    return Verdict(f"Not yet: measured again at {size_mib:g} MiB, pinned copies ran at {speeds['pinned']:.1f} GB/s "
                   f"and pageable ones at {speeds['pageable']:.1f} GB/s, {measured:.2f}x{others}; your "
                   f"{claimed:.2f}x is not {tolerance} of that. Is it pinned GB/s divided by "
                   "pageable GB/s, measured at my_size_mib?", False)


# --------------------------------------------------------------------------
# Notebook 6: the fewest buffers
# --------------------------------------------------------------------------
#: The share of the copies a ring must hide under kernels (``Trace.overlap().hidden_fraction``).
RING_GOAL = 0.85


def check_ring_depth(nscratch: int | None, problem: WaveProblem, every: int, goal: float = RING_GOAL,
                     baseline: Result | None = None) -> Verdict:
    """Run the streams loop on ``problem`` (saving every ``every``-th level) with ``nscratch``
    buffers, and with one buffer fewer: ``nscratch`` is the answer when it hides at least
    ``goal`` of the copies under kernels and one buffer fewer does not. Runs for times only
    (:func:`~course_helper.solver.timing_only`); ``baseline`` (a result of the same problem,
    e.g. sequential-pinned) is what the time is compared with."""
    if nscratch is None:
        return Verdict(f"not answered yet: set nscratch to the fewest buffers that hide at least {goal:.0%} of "
                       "the copies", False)
    try:
        nscratch = checks.positive_int("nscratch", nscratch, minimum=4,
                                       hint="a ring needs at least four buffers (notebook 6.1)")
    except (TypeError, ValueError) as err:
        return Verdict(f"Not yet: {err}.", False)

    def hidden(depth):
        # The median of a few traced runs: a GPU's hidden share moves from run to run (the host's
        # pace, CUPTI), and the verdict should not; predicted times are the same every run.
        runs = 1 if runtime.get().predicts_times else 3
        return float(np.median([solve(problem, "streams", every=every, nscratch=depth).trace.overlap().hidden_fraction
                                for _ in range(runs)]))

    with timing_only():
        mine = solve(problem, "streams", every=every, nscratch=nscratch, trace=False)
        hid = hidden(nscratch)
        fewer = hidden(nscratch - 1) if nscratch > 4 else None
    memory = f"its ring holds {nscratch * problem.nbytes_level / 2**20:.0f} MiB"
    took = f"It took {mine.elapsed_ms:.2f} ms" + (f" ({mine.time_label})" if mine.time_label else "")
    if baseline is not None:
        took += f", {mine.elapsed_ms / baseline.elapsed_ms:.2f}x the {baseline.strategy} loop"
    if hid < goal:
        return Verdict(f"nscratch={nscratch} does not hide the copies yet: {hid:.0%} of them ran under kernels (the "
                       f"goal: at least {goal:.0%}). {took}; {memory}.", False)
    if fewer is not None and fewer >= goal:
        return Verdict(f"nscratch={nscratch} hides {hid:.0%} of the copies, but one buffer fewer hides {fewer:.0%}: "
                       f"both reach {goal:.0%}, so {nscratch} is not the fewest. Try fewer buffers.", False)
    below = "" if fewer is None else f", and one buffer fewer hides only {fewer:.0%}"
    return Verdict(f"nscratch={nscratch} hides the copies: {hid:.0%} of them ran under kernels (the goal: at least "
                   f"{goal:.0%}){below}. {took}; {memory}.", True)


# --------------------------------------------------------------------------
# Notebook 9: find the race
# --------------------------------------------------------------------------
#: The problem the race fix runs on: small, so the sanitizer and the comparison take a moment.
RACE_FIX_PROBLEM = dict(n0=96, n1=96, nt=120)


def check_race_fix(loop: Callable[[Any], None], nscratch: int = 5) -> Verdict:
    """Run ``loop(run)`` (``run`` as ``ch.prepare(problem, "streams")`` builds it) on a small
    problem under the race sanitizer, compare every saved level with the sequential answer,
    and judge its host waits: each one must wait only for a copy that the very next operation
    needs finished (a kernel about to overwrite the buffer the copy reads). A wait for the whole
    device or for a kernel keeps the host from queueing ahead, and a wait before work that
    does not need it stalls the host for nothing: both over-synchronise the loop."""
    small = WaveProblem(**RACE_FIX_PROBLEM)
    reference = solve(small, "sequential", trace=False)
    run = prepare(small, "streams", nscratch=nscratch)
    names = {"U": run.U, "images": run.images, "io": run.io, "ready": run.ready, "compute": run.compute}
    try:
        program = run_checked(loop, names, _NotYet, "save wrong levels", args=(run,))
    except _NotYet as err:
        if err.race is None:
            return Verdict(f"Not yet: {err}", False)
        return Verdict("Not yet: the sanitizer still reports a race. Run your loop inside `with ch.sanitize():` to "
                       "read which wait is missing.", False)
    finally:
        synchronize()
        run.close()
    if not np.array_equal(run.images, reference.images):
        return Verdict("Not yet: no race, but some saved levels differ from the sequential answer.", False)
    too_much = _over_synchronised(program.judged_waits)
    if too_much:
        return Verdict("Not yet: no race and every saved level is right, but the host waits more than the loop "
                       f"needs: {too_much}. Notebook 6's loop waits once per kernel, for the copy out of the buffer "
                       "that kernel overwrites, just before it.", False)
    return Verdict("Right: the sanitizer finds no race, every saved level equals the sequential answer, and the "
                   "host waits only where a kernel would overwrite a buffer still being copied.", True)


def _touches(a: Op, b: Op) -> bool:
    """Whether ``b`` writes memory ``a`` reads or writes, or reads memory ``a`` writes."""
    def overlap(xs, ys):
        for x in xs:
            for y in ys:
                sx, sy = byte_span(x), byte_span(y)
                if sx and sy and sx[0] == sy[0] and sx[1] < sy[2] and sy[1] < sx[2]:
                    return True
        return False
    return overlap(b.writes, (*a.reads, *a.writes)) or overlap(b.reads, a.writes)


def _over_synchronised(judged: list[tuple[str, Any, Op]]) -> str:
    """The waits beyond those needed, described by the learner's lines ("" when none)."""
    device, kernels, early = [], [], []
    for line, covered, next_op in judged:
        if covered == "device":
            device.append(line)
        elif covered is None:
            continue                             # nothing of the loop's was pending there: it cost nothing
        elif covered.kind == "kernel":
            kernels.append(line)
        elif not _touches(covered, next_op):
            early.append(line)
    found = []
    if device:
        found.append(f"{describe_waits(device)} waits for the whole device, the kernels too, so the host cannot "
                     "queue ahead of them")
    if kernels:
        found.append(f"{describe_waits(kernels)} waits for a kernel, so the host cannot queue ahead of the kernels")
    if early:
        found.append(f"{describe_waits(early)} waits for a copy that the next operation does not touch, so the host "
                     "stalls before work that could have been queued")
    return "; ".join(found)
