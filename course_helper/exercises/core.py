"""The checker core every exercise shares.

A checker runs the learner's own loop and says what is wrong with it in the learner's words:

* :func:`run_checked` runs the loop under the race sanitizer (a :class:`LoopProgram`), which
  also remembers each operation's place in the program, and counts the host's waits inside
  the loop (:class:`HostWaits`), each named by the learner's line that waited;
* :meth:`LoopProgram.why_serial` finds what ordered every copy before or after every kernel,
  when nothing could run at the same time;
* :func:`hidden_by_direction` measures, on a timeline, how much of each copy direction ran
  under the kernels.

Messages name streams, events and buffers as the loop's own variables do (``io[0]``,
``baked[1]``, ``feed[2]``): the globals and closure variables its code reads
(:func:`learner_names`), and the locals of the loop while it runs.
"""
from __future__ import annotations

import contextlib
import io
import linecache
import os
import sys
import threading
import tokenize
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import streams
from ..memory import is_device_array
from ..runtime import observe
from ..runtime.ops import OpKind
from ..sanitizer import RaceError, Sanitizer
from ..streams import synchronize
from ..timelines import analysis

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..runtime.observe import Op
    from ..streams import Event, Stream

__all__ = ["ExerciseError", "Verdict", "HostWaits", "LoopProgram", "LoopRaceError", "Serial", "explain_serial",
           "learner_names", "run_checked",
           "caller_line", "Hidden", "hidden_by_direction", "describe_waits"]


class ExerciseError(AssertionError):
    """A learner's loop misses the exercise's point; the message says why and what to try.
    ``race``: the :class:`~course_helper.sanitizer.RaceError` behind it, when it is a race."""

    race: RaceError | None = None


class Verdict(str):
    """What a check says: the sentence to print (the string itself) and whether the answer
    passed (:attr:`passed`). ``print(verdict)`` prints the sentence."""

    passed: bool

    def __new__(cls, message: str, passed: bool) -> Verdict:
        verdict = super().__new__(cls, message)
        verdict.passed = bool(passed)
        return verdict


class LoopRaceError(RaceError):
    """A race in an exercise's loop (:meth:`LoopProgram._race`). ``note``: why the loop's own wait
    just before the second access did not order it, in the loop's words ("`io` waits for `done`,
    but your loop records it on `io`, not on `compute`"); empty when the loop queued no wait there."""

    def __init__(self, message: str, first: str = "", second: str = "", fix: str = "", note: str = ""):
        super().__init__(message, first, second, fix)
        self.note = note


# --------------------------------------------------------------------------
# Host waits
# --------------------------------------------------------------------------
class HostWaits:
    """Observer (of every thread): host waits followed by more queued work happened inside the loop.

    A host wait is anything after which the host knows device work to be finished: a
    synchronize of the device, a stream or an event, a blocking copy, ``ch.to_host()``, a
    ``.done`` polled until it answered True. Each is named by the learner's line that waited.
    :attr:`judged` keeps, for each wait followed by an operation, ``(line, covered, next)``:
    the operation the wait waited for (the last one queued on the stream, or before the
    event's record; ``"device"`` for a wait on the whole device; None when it waited for
    nothing the loop had queued) and the first operation queued after it."""

    def __init__(self):
        self.pending, self.inside = [], []
        self.judged = []
        self.unjudged = []                 # waits whose next operation is not queued yet
        self.last_on = {}                  # id(stream) -> the last operation queued on it
        self.recorded_after = {}           # id(event) -> the operation its latest record follows
        self.lock = threading.Lock()

    def host_synced(self, target: Stream | Event | None) -> None:
        is_stream = isinstance(target, streams.Stream)
        line = caller_line()
        if line is None:
            line = ("ch.synchronize()" if target is None else
                    f"{target.name}.synchronize()" if is_stream else "event.synchronize()")
        with self.lock:
            covered = ("device" if target is None else self.last_on.get(id(target)) if is_stream
                       else self.recorded_after.get(id(target)))
            self.pending.append(line)
            self.unjudged.append((line, covered))

    def _more_work(self):
        self.inside += self.pending
        self.pending = []

    def op_queued(self, op: Op) -> None:
        with self.lock:
            self._more_work()
            self.judged += [(line, covered, op) for line, covered in self.unjudged]
            self.unjudged = []
            self.last_on[id(op.stream)] = op

    def event_recorded(self, stream: Stream, event: Event) -> None:
        with self.lock:
            self._more_work()
            self.recorded_after[id(event)] = self.last_on.get(id(stream))

    def event_waited(self, stream: Stream, event: Event) -> None:
        with self.lock:
            self._more_work()


def describe_waits(lines: list[str]) -> str:
    """"`io[b].synchronize()` x6, `ch.synchronize()` x1": the lines that waited, counted."""
    counts = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return ", ".join(f"{line} x{n}" for line, n in counts.items())


def caller_line() -> str | None:
    """The source line outside this package that made the current call, e.g.
    ``stack[k] = ch.to_host(buf)`` (None when its source cannot be read)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # course_helper/
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back
    if frame is None:
        return None
    line = _without_comment(linecache.getline(frame.f_code.co_filename, frame.f_lineno, frame.f_globals))
    return f"`{line}`" if line else None


def _without_comment(line: str) -> str:
    """A source line without its comment and its surrounding blanks."""
    try:
        comments = [t for t in tokenize.generate_tokens(io.StringIO(line).readline) if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError, SyntaxError):    # part of a longer statement
        return line.strip()
    return (line[:comments[0].start[1]] if comments else line).strip()


# --------------------------------------------------------------------------
# The learner's names
# --------------------------------------------------------------------------
def _nameable(value):
    """Whether a variable holds what messages name: streams, events, device arrays (or lists of
    them) or a host array."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if items and all(isinstance(x, (streams.Stream, streams.Event)) or is_device_array(x) for x in items):
        return True
    return isinstance(value, np.ndarray) and value.ndim >= 1


def learner_names(fn: Callable, depth: int = 0, found: dict | None = None) -> dict[str, Any]:
    """The loop's own names for the streams, events and arrays it uses: the globals and closure
    variables its code reads (and those of the functions it calls, a few deep)."""
    found = {} if found is None else found
    code = getattr(fn, "__code__", None)
    if code is None or depth > 3:
        return found
    names, codes = set(), [code]
    while codes:                     # nested code (a comprehension, an inner function) reads names too
        c = codes.pop()
        names.update(c.co_names)
        codes += [k for k in c.co_consts if hasattr(k, "co_names")]
    values = [(n, fn.__globals__[n]) for n in sorted(names) if n in fn.__globals__]
    for n, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            values.append((n, cell.cell_contents))
        except ValueError:           # a closure variable not bound yet
            pass
    for name, value in values:
        if isinstance(value, types.FunctionType):
            learner_names(value, depth + 1, found)
        elif _nameable(value):
            found.setdefault(name, value)
    return found


def _root(a):
    """The array a view was taken from (the array itself when it is no view)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "shape"):
        a = a.base
    return a


# --------------------------------------------------------------------------
# The program the loop queued
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Serial:
    """Why no copy could run during a kernel (:meth:`LoopProgram.why_serial`).

    ``how`` is one of ``"same stream"`` (the copies ran on the stream of the kernels:
    ``copy``), ``"waits"`` (before ``kernel`` its stream waits for ``event``, recorded after
    the copy ``after``: each kernel waited for a copy) or ``"ordered"`` (every copy is
    ordered before or after every kernel, the waits that did it not found)."""
    how: str
    copy: Op | None = None
    kernel: Op | None = None
    event: Any = None
    after: Op | None = None


class LoopProgram(Sanitizer):
    """The race sanitizer, keeping what a checker needs to say why a loop ran serially: each
    operation with its vector clock (what is ordered before it) and the waits queued before it,
    and after which operation each event was last recorded.

    ``loop``: the learner's function; while it runs, its locals name what it made (streams,
    events and buffers made inside the function are named as the function names them).

    ``check_levels=False``: a copy's ``level=`` is only a label, never compared with the level
    of the operation that last wrote its source (a checker that judges the data by its content
    needs no such claim, and must not refuse a loop for a label)."""

    def __init__(self, names: dict[str, Any], loop: Callable | None = None, *, check_levels: bool = True):
        # host_sync_fixes=False: the exercises' rule is that the host never waits
        super().__init__(names, host_sync_fixes=False, levels=check_levels)
        self.queued = []              # (op, its position on its stream, its clock, the waits before it)
        self.last_op = {}             # stream -> the last operation queued on it
        self.after = {}               # id(event) -> (event, the operation its latest record follows)
        self.pending = {}             # stream -> [(event, operation)] waited since its last operation
        self.host_waits = []
        self.trailing_waits = []
        self.code = getattr(loop, "__code__", None)
        self.frame = None             # the loop's frame while it runs (its locals name things)
        self.known = set()            # ids of what the frame's locals have named

    # -- names from the running loop's locals -----------------------------------------------
    def _learn(self, *objs):
        """Name what the loop's locals hold, when one of ``objs`` has not been met yet."""
        if self.code is None or all(id(o) in self.known for o in objs):
            return
        if self.frame is None:
            frame = sys._getframe(2)
            while frame is not None and frame.f_code is not self.code:
                frame = frame.f_back
            if frame is None:            # queued from elsewhere (another thread): only the globals name it
                return
            self.frame = frame
        for name, value in list(self.frame.f_locals.items()):
            if _nameable(value) and not any(id(x) in self.known for x in self._items(value)):
                self.name(name, value)
                self.known.update(id(x) for x in self._items(value))
        self.known.update(id(o) for o in objs)      # met now: not looked up again

    @staticmethod
    def _items(value):
        return list(value) if isinstance(value, (list, tuple)) else [value]

    # -- the observer calls -------------------------------------------------------------------
    def op_queued(self, op: Op) -> None:
        self._learn(op.stream, *(_root(a) for a in (*op.reads, *op.writes)))
        super().op_queued(op)
        with self.lock:
            if self.failed:
                return
            vc = self.clocks[op.stream]
            self.queued.append((op, vc[op.stream], dict(vc), self.pending.pop(op.stream, [])))
            self.last_op[op.stream] = op

    def event_recorded(self, stream: Stream, event: Event) -> None:
        self._learn(stream, event)
        super().event_recorded(stream, event)
        with self.lock:
            self.after[id(event)] = (event, self.last_op.get(stream))

    def event_waited(self, stream: Stream, event: Event) -> None:
        self._learn(stream, event)
        super().event_waited(stream, event)
        with self.lock:
            known = self.after.get(id(event))
            self.pending.setdefault(stream, []).append((event, known[1] if known and known[0] is event else None))

    def close(self) -> None:
        super().close()
        self.frame = None

    # -- races told in the exercises' words ---------------------------------------------------
    def _race(self, first, second):
        """The sanitizer's race, told for a loop whose host never waits. Where the second access's
        stream waited for one of the loop's events just before it, and that event does not follow
        the first access, the message says so (:attr:`LoopRaceError.note`: recorded on another
        stream, before the first access, or never) and the fix names that event, the one the loop
        meant, rather than "an event" or another event recorded after the first access. A host
        access inside the loop is told to wait until the loop has returned."""
        error = super()._race(first, second)
        s1 = first.thread if isinstance(first.thread, streams.Stream) else None
        if s1 is None or first.op is None or first.op.kind == OpKind.LET_GO or " on `" not in error.first:
            return error
        op1, n1 = error.first[:error.first.index(" on `")], self.stream_name(s1)   # "the D2H copy of level 0"
        if not isinstance(second.thread, streams.Stream):
            if error.second.startswith("the host lets go"):
                return error
            buffer = self.names.of(second.array, second.span)
            fix = (f"read {buffer} only after your loop has returned and the device is done with it (the checker "
                   "waits for that): the host never waits inside the loop, so nothing there orders its access "
                   f"after {op1} on `{n1}`")
            return LoopRaceError(str(error).replace(error.fix, fix), error.first, error.second, fix)
        s2 = second.thread
        waits = [e for e, _ in self.pending.get(s2, [])]
        after = [e for p, e, _ in self.records.get(s1, []) if p >= first.clock]
        waited = self.waited.get(s2, {})
        if not waits or any(id(e) in waited for e in after):
            return error     # no wait of the loop's there, or one for an event recorded after: the sanitizer's words
        event, n2 = waits[-1], self.stream_name(s2)         # the wait queued last before the second access
        name = self._event_name(event)
        it = name if name.startswith("`") else "it"
        last_wait = waited.get(id(event))
        before = last_wait[1] if last_wait is not None and last_wait[0] is event else self.order + 1
        records = [(order, stream) for stream, rs in self.records.items() for _, e, order in rs
                   if e is event and order < before]
        recorded_on = max(records, key=lambda r: r[0])[1] if records else None
        if recorded_on is None:
            note = f"`{n2}` waits for {name}, but your loop never records {it}"
            fix = f"record {name} on `{n1}` after {op1}"
            if after:
                other = self._event_name(after[0])
                note += f" (it records {other} on `{n1}` after {op1})"
                fix += f", or make `{n2}` wait for {other}"
        elif recorded_on is s1:
            note = f"`{n2}` waits for {name}, but your loop records {it} on `{n1}` before {op1}"
            fix = (f"record {name} on `{n1}` after {op1}, not before it, so that the wait for {it} on `{n2}` "
                   f"follows {op1}")
        else:
            where = self.stream_name(recorded_on)
            note = f"`{n2}` waits for {name}, but your loop records {it} on `{where}`, not on `{n1}`"
            fix = (f"record {name} on `{n1}` after {op1}, not on `{where}` (a record orders a wait only after the "
                   "work queued before it on its own stream)")
        if recorded_on is None and not after:
            fix += f" ({note})"
        return LoopRaceError(str(error).replace(error.fix, fix), error.first, error.second, fix, note)

    def _event_name(self, event):
        """"`done`" (an event the loop names; one its running frame holds now is named now: an event
        ``stream.record()`` returned was recorded before the loop's variable held it), else "an event"."""
        if not self.label_of(event) and self.frame is not None:
            for name, value in list(self.frame.f_locals.items()):
                if value is event:
                    self.name(name, value)
        label = self.label_of(event)
        return f"`{label}`" if label else "an event"

    # -- why the kernels and the copies did not overlap ----------------------------------------
    def why_serial(self, is_copy: Callable[[Op], bool]) -> Serial | None:
        """Why no copy (an operation for which ``is_copy`` is true) could run during a kernel:
        a :class:`Serial`, or None when some could (all copies but one, at least, are ordered
        neither before nor after some kernel)."""
        kernels = [q for q in self.queued if q[0].kind == OpKind.KERNEL]
        copies = [q for q in self.queued if is_copy(q[0])]

        def before(a, b):            # a is ordered before b
            return b[2].get(a[0].stream, 0) >= a[1]
        alone = [c for c in copies if all(before(k, c) or before(c, k) for k in kernels)]
        if not copies or not kernels or len(alone) < len(copies) - 1:
            return None
        kernel_streams = {id(k[0].stream) for k in kernels}
        shared = [c for c in alone if id(c[0].stream) in kernel_streams]
        if shared:
            return Serial("same stream", copy=shared[0][0])
        for c in alone:              # the wait that put a later kernel after this copy
            for k in kernels:
                if k[0] is c[0] or not before(c, k):
                    continue
                for event, follows in k[3]:
                    if follows is not None and follows.stream is c[0].stream:
                        return Serial("waits", copy=c[0], kernel=k[0], event=event, after=follows)
                break
        return Serial("ordered")


def explain_serial(program: LoopProgram, serial: Serial, name_op: Callable[[Op], str], *, copies: str,
                   kernels_stream: str, own_stream: str, consequence: str, ordered: str) -> str:
    """A :class:`Serial` finding in the learner's names: ``copies`` (what the copies are called),
    ``kernels_stream`` (what the kernels' stream is to them), ``own_stream`` (the fix when they
    share it), ``consequence`` (what the waits did), ``ordered`` (the sentence when no wait is
    to blame); ``name_op`` names an operation."""
    if serial.how == "same stream":
        return (f"{copies} ran on `{program.stream_name(serial.copy.stream)}`, {kernels_stream}, and a stream runs "
                f"its work one item at a time, in the order queued; {own_stream}")
    if serial.how == "waits":
        label = program.label_of(serial.event)
        event = f"`{label}`" if label else "an event"
        return (f"before {name_op(serial.kernel)} your loop makes `{program.stream_name(serial.kernel.stream)}` wait "
                f"for {event}, recorded after {name_op(serial.after)} on `{program.stream_name(serial.after.stream)}`, "
                f"so {consequence}")
    return ordered


def run_checked(loop: Callable, names: dict[str, Any], error: type[ExerciseError], what: str,
                args: tuple = (), *, check_levels: bool = True,
                program_type: type[LoopProgram] = LoopProgram) -> LoopProgram:
    """Run ``loop(*args)`` under the race sanitizer (a :class:`LoopProgram` naming things with
    ``names`` and the loop's own names; ``program_type``: a subclass of it, for a checker that
    judges more or less) and count the host's waits inside it; returns the program, its
    ``host_waits`` filled in and ``returned`` holding what the loop returned.

    A race raises ``error`` saying it can ``what`` (e.g. "bake a wrong cake") on any run; a loop that still
    raises NotImplementedError is told it is not written yet. Any other error of the loop is
    the learner's: raised as it is. ``check_levels``: as for :class:`LoopProgram`."""
    __tracebackhide__ = True       # a failure shows the learner's cell, not this file
    if not callable(loop):
        raise TypeError(f"loop must be a function that queues the whole run, got {type(loop).__name__}")
    names = {**learner_names(loop), **names}
    program = program_type(names, loop, check_levels=check_levels)
    waits = observe.add(HostWaits(), every_thread=True)   # a loop may queue its body from a thread
    observe.add(program, every_thread=True)
    kept = None                                    # what the loop returns (its device buffers) lives until the
    try:                                           # device is done with it: letting it go earlier is a race
        try:
            kept = loop(*args)
        finally:
            observe.remove(waits)
            program.close()
    except BaseException as exc:
        with contextlib.suppress(Exception):      # drain what was queued; the loop's error is the news
            synchronize()
        if isinstance(exc, RaceError):
            found = error(f"your loop has a race: it can {what} on any run, whatever the timing.\n{exc}")
            found.race = exc
            raise found from None
        if isinstance(exc, NotImplementedError):
            raise error(f"`{getattr(loop, '__name__', 'the loop')}` is not written yet: replace its "
                        "`raise NotImplementedError` with the loop, then run this cell again") from None
        raise
    synchronize()
    program.returned = kept                        # a checker may ask what the loop kept (the device is done)
    del kept
    if program.race is not None:                   # found in work another thread queued
        found = error(f"your loop has a race: it can {what} on any run, whatever the timing.\n"
                      f"{program.race[0]}")
        found.race = program.race[0]
        raise found
    program.host_waits = waits.inside
    program.trailing_waits = waits.pending     # waits after the loop's last queued work
    program.judged_waits = waits.judged
    return program



def time_ms(stream: Stream, queue: Callable[[], None]) -> float:
    """Device time from ``stream`` reaching this point until the work ``queue()`` adds to it is
    done (timing events around it on ``stream``; the host waits for the end)."""
    start, end = streams.create_events(2, timing=True)
    stream.record(start)
    queue()
    stream.record(end)
    synchronize()
    return streams.elapsed_ms(start, end)

# --------------------------------------------------------------------------
# Copies hidden under the kernels, per direction: the rule has one home, shared with the overlap
# doctor (course_helper.timelines.analysis); the checkers reach it here under its old names.
# --------------------------------------------------------------------------
Hidden = analysis.Hidden
hidden_by_direction = analysis.hidden_by_direction
