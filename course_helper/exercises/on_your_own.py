"""The checks of the "On your own" cells of notebooks 2, 3, 6 and 9.

Each check fails an answer that misses the exercise's point, not only one that is malformed:

* notebook 2, :func:`check_copy_after_kernels`: the copy must run on the io stream, be ordered
  after the kernels by the device, with no host wait, and hold the level the last kernel wrote
  (judged by the data it copied);
* notebook 3, :func:`check_speedup`: the speed-up you claim must be the one your own
  measurement (the rows ``ch.measure_bandwidth`` returned to you) gives, computed from it;
* notebook 6, :func:`check_ring_depth`: your ring must hide the copies, and one buffer fewer
  must not (the *fewest* buffers);
* notebook 9, :func:`check_race_fix`: no race, the sequential answer, no host wait beyond
  those the loop needs (as notebook 8 counts them), and copies that can still run during the
  kernels.

Each returns a :class:`~.core.Verdict`: the sentence to print, and whether it passed.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from .. import checks, runtime
from ..memory import allocated_since, is_device_array, is_pinned, pinned_allocations, to_host, was_measured
from ..runtime.base import byte_span, shares_memory
from ..runtime.ops import OpKind
from ..solver import MAX_RING, prepare, solve, timing_only
from ..streams import create_streams, synchronize
from ..timelines import recording
from ..wave import WaveProblem
from .core import (ExerciseError, LoopRaceError, Verdict, describe_waits, explain_serial, hidden_by_direction,
                   run_checked)

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..runtime.observe import Op
    from ..sanitizer import RaceError
    from ..solver import Result
    from .core import LoopProgram

__all__ = ["check_copy_after_kernels", "check_speedup", "SPEEDUP_EXACT", "SPEEDUP_NEAR",
           "check_ring_depth", "RING_GOAL", "check_race_fix", "RACE_FIX_PROBLEM"]


class _NotYet(ExerciseError):
    """Raised inside a check; the check turns it into a failed verdict."""


# --------------------------------------------------------------------------
# Notebook 2: make a copy wait for a kernel
# --------------------------------------------------------------------------
def check_copy_after_kernels(loop: Callable[[Any, Any], None] | None) -> Verdict:
    """Run ``loop(compute, io)`` on two fresh streams and say whether it copies the level its
    last kernel wrote, on ``io``, ordered after the kernels by the device (an event), without the
    host waiting. The level is judged by the data the copy wrote to the host, not by any
    ``level=`` label."""
    if loop is None:
        return Verdict("Not answered yet: fill in copy_after_kernels, set answer = copy_after_kernels, "
                       "run this cell again.", False)
    (compute,) = create_streams(1, name="compute")
    (io,) = create_streams(1, name="io")
    synchronize()
    made_before = pinned_allocations()      # `last` is one of these; a buffer the loop allocates is not
    try:
        # check_levels=False: a copy's level= only labels it; which level it holds is judged by its data
        program = run_checked(loop, {"compute": compute, "io": io}, _NotYet, "copy the wrong data",
                              args=(compute, io), check_levels=False)
    except _NotYet as err:
        if err.race is None:
            return Verdict(f"Not yet: {err}", False)
        if err.race.second.startswith("the host"):
            # The loop read (or wrote) the host array while the copy into it may still run.
            return Verdict(f"Not yet: {err.race.second} while the copy into it may still run ({err.race.first}). "
                           "copy_after_kernels only queues the work; leave the host array alone until whoever "
                           "reads it has waited for the copy.", False)
        note = err.race.note if isinstance(err.race, LoopRaceError) else ""
        if _copy_then_kernel(err.race):
            # The other direction: the copy is ordered after the kernels, but a kernel queued after it
            # overwrites the buffer it reads. The fix is a wait on compute, not on io.
            return Verdict(f"Not yet: a kernel queued after the copy overwrites the buffer it copies "
                           f"({err.race.first}, then {err.race.second}){': ' + note if note else ''}. Before compute "
                           "overwrites it, make compute wait for an event recorded on io after the copy (or queue no "
                           "step after the copy: the 20 steps come first).", False)
        return Verdict(f"Not yet: nothing orders the copy after the kernels ({err.race.first}, then "
                       f"{err.race.second}){': ' + note if note else ''}. Make io wait for an event recorded on "
                       "compute after them.", False)
    kernels = [q[0] for q in program.queued if q[0].kind == OpKind.KERNEL]
    copies = [q[0] for q in program.queued if q[0].kind == OpKind.D2H]
    if not kernels or not copies:
        return Verdict("Not yet: copy_after_kernels should still queue the 20 steps and the copy; put them back.",
                       False)
    if program.host_waits:
        return Verdict("Ordered, but the host waited for the kernels: let the io stream wait for an event instead.",
                       False)
    if program.trailing_waits:
        # The exercise's point is a host that never waits: a wait after the copy is still one.
        return Verdict(f"Not yet: the host waited after queueing the work ({describe_waits(program.trailing_waits)}). "
                       "copy_after_kernels only queues: the kernels, an event, io waiting for it, the copy; leave "
                       "the waiting to whoever reads the copy.", False)
    elsewhere = [op for op in copies if op.stream is not io]
    if elsewhere:
        where = program.stream_name(elsewhere[0].stream)
        behind = (", behind the kernels: the order is right, but a stream runs one thing at a time, so the next "
                  "kernels queued there would wait for the copy" if elsewhere[0].stream is compute else "")
        return Verdict(f"Not yet: the copy is queued on `{where}`{behind}. Queue it on io, and make io wait for an "
                       "event recorded on compute after the kernels.", False)
    wrong = _copied_level(program, kernels, copies)
    if wrong:
        return Verdict(f"Not yet: the copy is ordered after the kernels on io, but {wrong}. Copy the buffer the "
                       "last step wrote.", False)
    fresh = [op for op in copies if op.writes and is_pinned(op.writes[0])
             and allocated_since(op.writes[0], made_before)]
    if fresh:
        # Ordered and of the right level, but into a buffer nobody outside the function holds: the level is
        # lost when it returns, and the notebook's `last` keeps what it held before.
        return Verdict("Not yet: the copy is ordered after the kernels on io and holds the right level, but it "
                       "copies into a pinned buffer your function allocated itself, which is lost when the function "
                       "returns: `last` never gets the level. Copy into `last`, the pinned buffer the cell made "
                       "before the function.", False)
    return Verdict("Right: the copy is ordered after the last kernel by the device, and the host never waited.", True)


def _copy_then_kernel(race: RaceError) -> bool:
    """Whether a race's first access is the copy and its second a kernel (a write after the copy's
    read), rather than a copy that reads before the kernels wrote."""
    return "copy" in race.first.split(" on `")[0] and race.second.startswith("the kernel")


def _copied_level(program: LoopProgram, kernels: list[Op], copies: list[Op]) -> str:
    """What is wrong with the data the copies wrote to the host ("" when each holds what the last
    kernel wrote): judged by the data, so that a ``level=`` label neither helps nor hurts."""
    def root(a):                 # the buffer a kernel's view of its output rows belongs to
        while getattr(a, "base", None) is not None and is_device_array(a.base):
            a = a.base
        return a

    written = {}                 # id(buffer) -> (buffer, the last kernel that wrote it), in the order written
    for op in kernels:
        for a in op.writes:
            buffer = root(a)
            written.pop(id(buffer), None)
            written[id(buffer)] = (buffer, op)
    contents = [(buffer, op, to_host(buffer)) for buffer, op in written.values()]
    if not contents:             # kernels that write nothing the check can see: nothing to judge by
        return ""
    last_buffer, last_kernel, last_data = contents[-1]

    def name(buffer):
        return program.names.of(buffer, byte_span(buffer))

    for op in copies:
        got = np.asarray(op.writes[0]) if op.writes else None
        if got is not None and got.shape == last_data.shape and np.array_equal(got, last_data):
            continue
        held = next((f"it holds level {kernel.level}, what {name(buffer)} holds" for buffer, kernel, data in contents
                     if got is not None and got.shape == data.shape and np.array_equal(got, data)),
                    "it holds none of the levels the steps wrote")
        return (f"{held}; the last step wrote level {last_kernel.level} into {name(last_buffer)}")
    return ""


# --------------------------------------------------------------------------
# Notebook 3: your own speed-up
# --------------------------------------------------------------------------
#: How close a claimed speed-up must be to the one the learner's rows give, relative: the claim is
#: to be computed from the rows (``pinned / pageable``), not typed in. A typed, rounded number is
#: refused even when it is near: on the CPU backend the modelled speed-up is close to 5 at most
#: sizes, so a guess of 5 would pass any tolerance a rounded answer needs.
SPEEDUP_EXACT = 1e-6
#: A claim within this share of the rows' speed-up is told it is near, only not computed from them.
SPEEDUP_NEAR = 0.05


def check_speedup(rows: Any, speedup: float | None = None) -> Verdict:
    """Say whether ``speedup`` is the speed-up the learner's own measurement gives: ``rows`` is
    what ``ch.measure_bandwidth(sizes_mib=(my_size_mib,))`` returned to them (one size, a pinned
    and a pageable row), and ``speedup`` must be its pinned ``gb_per_s`` divided by its pageable
    one, computed from the rows (within :data:`SPEEDUP_EXACT`). The check does not measure again:
    it judges the learner's measurement, which on a GPU no later measurement repeats exactly.

    The old form ``check_speedup(my_size_mib, my_speedup)`` (a size, not rows) is answered with
    how to call it now."""
    if isinstance(rows, (int, float)) and not isinstance(rows, bool):
        return Verdict(f"Not yet: this check judges your own measurement, and a size ({rows:g} MiB) does not "
                       "hold it. Keep what ch.measure_bandwidth(sizes_mib=(my_size_mib,)) returned in my_rows, "
                       "then call ch.exercises.check_speedup(my_rows, my_speedup).", False)
    if rows is None or speedup is None:
        return Verdict("Not answered yet: measure at my_size_mib into my_rows, compute my_speedup from them, run "
                       "this cell again.", False)
    try:
        speeds, size = _speeds(rows)
        claimed = checks.positive_float("my_speedup", speedup)
    except (TypeError, ValueError) as err:
        return Verdict(f"Not yet: {err}.", False)
    measured = speeds["pinned"] / speeds["pageable"]
    yours = (f"your rows at {size:g} MiB: pinned copies ran at {speeds['pinned']:.1f} GB/s and pageable ones at "
             f"{speeds['pageable']:.1f} GB/s")
    if abs(claimed - measured) <= SPEEDUP_EXACT * measured:
        # No figures here: they are the learner's own (printed by them), and the sentence is the same on
        # every machine.
        verdict = "faster" if measured > 1 else "not faster"
        return Verdict(f"Right: your speed-up is the one your rows at {size:g} MiB give, computed from them; pinned "
                       f"copies were {verdict}.", True)
    if abs(1 / claimed - measured) <= SPEEDUP_NEAR * measured:
        return Verdict(f"Not yet: {claimed:.2f} is the pageable speed over the pinned one; the speed-up is pinned "
                       "GB/s divided by pageable GB/s.", False)
    if abs(claimed - measured) <= SPEEDUP_NEAR * measured:
        return Verdict(f"Not yet: {yours}, {measured:.4f}x, and your {claimed:g} is near it but not it: compute "
                       "my_speedup from my_rows (pinned gb_per_s / pageable gb_per_s), rather than typing a number or "
                       "taking one from another measurement.", False)
    return Verdict(f"Not yet: {yours}, {measured:.2f}x; your {claimed:.2f}x is not that. Compute it from my_rows: "
                   "pinned gb_per_s divided by pageable gb_per_s, both at your size.", False)


def _speeds(rows: Any) -> tuple[dict[str, float], float]:
    """The pinned and pageable GB/s of ``rows`` (``measure_bandwidth``'s rows for one size), and
    the size; TypeError or ValueError saying what is wrong with them."""
    how = "keep what ch.measure_bandwidth(sizes_mib=(my_size_mib,)) returned in my_rows"
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"my_rows must be the list of rows (dicts) ch.measure_bandwidth returned, got "
                        f"{rows!r:.60}: {how}")
    if any(not {"size_mib", "memory", "gb_per_s"} <= r.keys() for r in rows):
        raise ValueError(f"my_rows must be rows of ch.measure_bandwidth (with size_mib, memory and gb_per_s): {how}")
    sizes = sorted({float(r["size_mib"]) for r in rows})
    if len(sizes) != 1:
        raise ValueError(f"my_rows hold {len(sizes)} sizes ({', '.join(f'{s:g}' for s in sizes)} MiB); the exercise "
                         f"is one size of your choice: {how}")
    speeds = {r["memory"]: float(r["gb_per_s"]) for r in rows}
    if sorted(speeds) != ["pageable", "pinned"] or len(rows) != 2:
        raise ValueError(f"my_rows must hold one pinned and one pageable row: {how}")
    if not all(np.isfinite(v) and v > 0 for v in speeds.values()):
        raise ValueError(f"my_rows hold a speed that is not a positive number: {how}")
    if not all(was_measured(r) for r in rows):
        raise ValueError(f"my_rows are not rows ch.measure_bandwidth returned in this session (written by hand, or "
                         f"changed since): the exercise is your own measurement, so {how}")
    return speeds, sizes[0]


# --------------------------------------------------------------------------
# Notebook 6: the fewest buffers
# --------------------------------------------------------------------------
#: The share of the shorter of the kernels' and the copies' busy times that must run under the other
#: (``Trace.overlap().hidden_fraction``) for a ring to hide the copies.
RING_GOAL = 0.85


def check_ring_depth(nscratch: int | None, problem: WaveProblem, every: int, goal: float = RING_GOAL,
                     baseline: Result | None = None) -> Verdict:
    """Run the streams loop on ``problem`` (saving every ``every``-th level) with ``nscratch``
    buffers, and with one buffer fewer: ``nscratch`` is the answer when the kernels and the copies
    run at once for at least ``goal`` of the shorter of their busy times
    (``Trace.overlap().hidden_fraction``) and one buffer fewer does not. Runs for times only
    (:func:`~course_helper.solver.timing_only`); ``baseline`` (a result of the same problem,
    e.g. sequential-pinned) is what the time is compared with."""
    if nscratch is None:
        return Verdict(f"not answered yet: set nscratch to the fewest buffers with which the kernels and the copies "
                       f"run at once for at least {goal:.0%} of the shorter of their busy times", False)
    try:
        nscratch = checks.positive_int("nscratch", nscratch, minimum=4,
                                       hint="a ring needs at least four buffers (notebook 6.1)")
    except (TypeError, ValueError) as err:
        return Verdict(f"Not yet: {err}.", False)
    if nscratch > MAX_RING:
        # solve refuses it (each buffer gets its own IO stream): a verdict, not its traceback
        return Verdict(f"Not yet: nscratch={nscratch} is more buffers than the streams loop takes (at most "
                       f"{MAX_RING}, each with its own IO stream), and the exercise asks for the fewest that hide the "
                       "copies: try far fewer, starting from four.", False)

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
    # hidden_fraction is the share of the *shorter* busy time (kernels' or copies') that ran under the
    # other: at the balanced point the two are close, but the words must not say "of the copies"
    # (copy_fraction is that one), here as in the layer cake's check.
    share = "of the shorter of their busy times"
    if hid < goal:
        return Verdict(f"nscratch={nscratch} is not deep enough yet: the kernels and the copies ran at once for "
                       f"{hid:.0%} {share} (the goal: at least {goal:.0%}). {took}; {memory}.", False)
    if fewer is not None and fewer >= goal:
        return Verdict(f"nscratch={nscratch}: the kernels and the copies ran at once for {hid:.0%} {share}, but with "
                       f"one buffer fewer for {fewer:.0%}: both reach {goal:.0%}, so {nscratch} is not the fewest. Try "
                       "fewer buffers.", False)
    below = "" if fewer is None else f", and with one buffer fewer for only {fewer:.0%}"
    return Verdict(f"nscratch={nscratch} is deep enough: the kernels and the copies ran at once for {hid:.0%} "
                   f"{share} (the goal: at least {goal:.0%}){below}. {took}; {memory}.", True)


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
    does not need it stalls the host for nothing: both over-synchronise the loop. Last, the
    copies must still be free to run during the kernels (the point of the streams loop): a fix
    that orders every copy before or after every kernel (all on the kernels' stream, or waits
    that chain them) is refused, with the share of the copying a traced run hid under kernels
    (:func:`~.core.hidden_by_direction`)."""
    small = WaveProblem(**RACE_FIX_PROBLEM)
    reference = solve(small, "sequential", trace=False)
    run = prepare(small, "streams", nscratch=nscratch)
    names = {"U": run.U, "images": run.images, "io": run.io, "ready": run.ready, "compute": run.compute}
    try:
        # check_levels=False: a copy's level= only labels it; the saved levels are judged by their data below
        program = run_checked(loop, names, _NotYet, "save wrong levels", args=(run,), check_levels=False)
    except _NotYet as err:
        if err.race is None:
            return Verdict(f"Not yet: {err}", False)
        return Verdict(f"Not yet: the sanitizer still reports a race: {_race_in_words(err.race)}", False)
    finally:
        synchronize()
        run.close()
    wrong = [int(level) for level, mine, right in zip(run.levels, run.images, reference.images)
             if not np.array_equal(mine, right)]
    if wrong:
        listed = ", ".join(map(str, wrong[:6])) + (", ..." if len(wrong) > 6 else "")
        return Verdict(f"Not yet: no race, but {len(wrong)} saved level{'s' if len(wrong) > 1 else ''} ({listed}) "
                       "differ from the sequential answer: a copy is ordered after a kernel that had already "
                       "overwritten the buffer it reads, or an index is wrong.", False)
    too_much = _over_synchronised(program.judged_waits)
    if too_much:
        return Verdict("Not yet: no race and every saved level is right, but the host waits more than the loop "
                       f"needs: {too_much}. Notebook 6's loop waits once per kernel, for the copy out of the buffer "
                       "that kernel overwrites, just before it.", False)
    serial = _why_serial(program)
    if serial:
        return Verdict(f"Not yet: no race and every saved level is right, but no copy can run during a kernel: "
                       f"{serial}. {_hidden(loop, small, nscratch)} The streams loop is there to hide the copies: "
                       "order each kernel after the copy out of the buffer it overwrites, and nothing more.", False)
    return Verdict("Right: the sanitizer finds no race, every saved level equals the sequential answer, and the "
                   "host waits only where a kernel would overwrite a buffer still being copied.", True)


def _race_in_words(race: RaceError) -> str:
    """The race's two operations and the wait that is missing between them, as the sanitizer
    names them (the loop's own names), without saying which line would add it."""
    streams = [re.search(r" on `([^`]+)`", what) for what in (race.first, race.second)]
    if race.first and race.second and all(streams):
        first, second = (m.group(1) for m in streams)
        note = race.note if isinstance(race, LoopRaceError) else ""   # the loop's own wait that did not order them
        return (f"{race.first}, then {race.second}, and nothing makes `{second}` wait for that work on `{first}` "
                f"in between{' (' + note + ')' if note else ''}. Find where your loop should make that wait.")
    lines = [line for line in str(race).splitlines() if not line.strip().startswith("Fix:")]
    return "\n".join(lines)


def _why_serial(program: LoopProgram) -> str:
    """Why no copy could run during a kernel, in the loop's names ("" when some could)."""
    def name_op(op):
        if op.kind == OpKind.D2H and op.writes:
            return f"the copy into {program.names.of(op.writes[0], byte_span(op.writes[0]))}"
        return f"the kernel `{op.name}`" if op.kind == OpKind.KERNEL else f"the {op.kind} `{op.name}`"

    serial = program.why_serial(lambda op: op.kind == OpKind.D2H)
    if serial is None:
        return ""
    return explain_serial(program, serial, name_op, copies="the copies", kernels_stream="the stream of the kernels",
                          own_stream="copy on the io streams instead",
                          consequence="each kernel waited for a copy, and each copy for a kernel",
                          ordered="every copy is ordered before or after every kernel, so none could run during one")


def _hidden(loop: Callable[[Any], None], problem: WaveProblem, nscratch: int) -> str:
    """The loop run again, traced: how much of its copying ran under kernels, as a sentence."""
    run = prepare(problem, "streams", nscratch=nscratch)
    try:
        with recording.tracing(strategy="race fix check") as handle:
            loop(run)
            synchronize()
    finally:
        run.close()
    trace = handle.trace
    hidden = hidden_by_direction(trace, (OpKind.D2H,))[str(OpKind.D2H)]
    return (f"Run again and traced (timed by the {trace.clock}), the copies took {hidden.copy_ms:.3f} ms, and "
            f"{hidden.copy_fraction:.0%} of that time ran under a kernel.")


def _touches(a: Op, b: Op) -> bool:
    """Whether ``b`` writes memory ``a`` reads or writes, or reads memory ``a`` writes."""
    def overlap(xs, ys):
        for x in xs:
            for y in ys:
                if shares_memory(x, y):
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
        elif covered.kind == OpKind.KERNEL:
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
