"""The modelled device's discrete-event engine: tasks on lanes, engines and links, and the
loop that lets modelled time run.

A *lane* is a queue that runs its tasks in order: a stream of the modelled device or a
writer lane of the modelled disk. A *task* is one item of a lane's queue; it starts when it
is at the head of its lane, has been queued (its host time has come), its dependencies are
done and its engine (and its link) has room; it ends after its duration, or, on a link,
once its bytes have moved at the link's bandwidth shared with the other copies on it.
:class:`Scheduler` knows nothing of CUDA: the rules of streams, events and the host are
:class:`course_helper.runtime.model.ModelRuntime`'s (see that module's docstring).
"""
from __future__ import annotations

import itertools
import math
import threading
import time
from typing import Any, Callable

from . import interrupts

__all__ = ["EPS", "Lane", "Scheduler", "Task", "ticks"]

PENDING, RUNNING, DONE = range(3)
EPS = 1e-9           # ms: events closer than a picosecond are simultaneous
TICK = 2.0 ** -20    # ms (about 1 ns): every modelled time is a whole number of ticks


def ticks(ms: float) -> float:
    """``ms`` rounded up to whole ticks. Sums and differences of such times are exact in
    floating point, so a run gives the same times whenever it starts (determinism)."""
    return math.ceil(ms / TICK - 1e-6) * TICK


class Task:
    """One item of a lane's queue: an operation, an event record, a wait, a host function."""

    __slots__ = ("seq", "stream", "name", "engine", "link", "peak", "duration", "remaining",
                 "deps", "queued", "start", "end", "state", "begin", "finish", "error", "skipped", "owner",
                 "upstream")

    def __init__(self, seq: int, stream: Lane, name: str, queued: float, deps: list[Task],
                 begin: Callable | None = None, engine: str | None = None, duration: float = 0.0,
                 link: str | None = None, peak: float | None = None, nbytes: float = 0) -> None:
        self.seq, self.stream, self.name, self.queued = seq, stream, name, queued
        self.deps = deps
        self.begin = begin            # called at the start; returns what to call at the end (or None)
        self.finish = None
        self.engine, self.duration = engine, duration
        self.link, self.peak, self.remaining = link, peak, float(nbytes)
        self.start = self.end = None
        self.state = PENDING
        self.error = None
        self.skipped = False
        self.owner = threading.current_thread()    # the thread that queued it: its failure is that thread's
        self.upstream = None          # the error of work it waits for that had failed when it was queued

    @property
    def done(self) -> bool:
        """Whether the task has ended in modelled time."""
        return self.state == DONE


class Lane:
    """A queue of tasks run in order: a stream of the modelled device, or (``disk``) a writer
    lane of the modelled disk, whose failed writes are each the write's own (the lane goes on)."""

    def __init__(self, scheduler: Scheduler, priority: int, name: str, disk: bool = False) -> None:
        self.priority = priority
        self.name = name
        self.disk = disk
        self.pending = []         # queued, not started (in order)
        self.running = None       # the task being run, if any
        self.last = None          # the most recently queued task
        self.error = None         # exception stored by failed work, raised at the next synchronise
        self.error_owner = None   # the thread that queued the failed work (see ModelRuntime.sync_device)
        self.seq = next(scheduler.lane_numbers)   # creation order


class Scheduler:
    """The engines and links of one modelled device and the tasks queued on them.

    ``engines``: how many tasks of each engine run at once (``{"compute": 1, "copy": 2}``);
    ``links``: each link's bandwidth in bytes per ms; ``per_link``: how many copies a link
    runs at a time (0: any number, sharing its bandwidth)."""

    def __init__(self, engines: dict[str, int], links: dict[str, float], per_link: int) -> None:
        self.t = 0.0                      # device time simulated so far (ms)
        self.inside = None                # the task whose Python code runs now (a host function)
        self.lane_numbers = itertools.count()
        self._seq = itertools.count()
        self._busy = []                   # lanes with queued or running work, in first-use order
        self._running = []
        self._engines = engines
        self._in_use = {name: 0 for name in engines}
        self._links = links
        self._per_link = per_link
        self._on_link = {}

    def add_link(self, name: str, bytes_per_ms: float) -> None:
        """Add (or set the bandwidth of) the link ``name``."""
        self._links[name] = bytes_per_ms

    def device_idle(self) -> bool:
        """Whether no lane but the disk's has work queued or running."""
        return all(s.disk for s in self._busy)

    def add(self, lane: Lane, name: str, queued: float, deps: list[Task], **kw: Any) -> Task:
        """Queue a task at the end of ``lane``, queued at the host time ``queued``, after ``deps``."""
        task = Task(next(self._seq), lane, name, queued, [d for d in deps if not d.done], **kw)
        task.upstream = next((d.error for d in deps if d.done and d.error is not None), None)
        lane.pending.append(task)
        lane.last = task
        if lane not in self._busy:
            self._busy.append(lane)
        return task

    def fail(self, task: Task, exc: BaseException) -> None:
        """``task``'s work raised ``exc``: the lane's later work is skipped, and the lane keeps
        ``exc`` (with the thread that queued the task) for its next synchronise."""
        task.stream.error, task.stream.error_owner = exc, task.owner

    # -- letting time run ---------------------------------------------------------
    def advance(self, until: float) -> None:
        """Simulate up to the host's time ``until`` (no further: the host may still queue work
        that starts before anything later). Nothing while a host function runs."""
        if self.inside is None:
            self._run(until=until)

    def run_until(self, condition: Callable[[], bool], what: str) -> None:
        """Simulate until ``condition()`` holds (the host is waiting for ``what``)."""
        if self.inside is not None:
            raise RuntimeError(f"a host function waits for {what}, which would wait for itself")
        self._run(condition=condition, what=what)

    def _run(self, until=None, condition=None, what=""):
        """The one loop: start what can start, let time run to the next end, complete what is
        due; up to ``until``, or (``condition`` given) until it holds.

        A Ctrl-C waits for the loop's next turn, where every lane is in order (the start of a
        task moves it from its lane's queue to the running ones in several steps, which a
        ``KeyboardInterrupt`` between them would leave half done: the lane stuck, and the next
        wait for it never ending); the learner's host functions alone are stopped at once."""
        with interrupts.deferred():
            while condition is None or not condition():
                interrupts.deliver()
                if self._turn(until, condition, what):
                    return

    def _turn(self, until, condition, what):
        """One turn of :meth:`_run`; True when it is done (``until`` reached)."""
        self._start_ready()
        rates = self._rates()
        nxt = self._next(rates)
        if condition is None and (nxt is None or nxt > until + EPS):
            self._move_to(max(until, self.t), rates)
            return True
        if nxt is None:
            raise RuntimeError(f"the host waits for {what}, but no queued work can ever finish it")
        self._move_to(max(nxt, self.t), rates)
        self._complete_due()
        return False

    def _ready(self, task):
        return task.queued <= self.t + EPS and all(d.done for d in task.deps)

    def _start_ready(self):
        """Start every task that can start at time ``self.t`` (in a deterministic order)."""
        while True:
            heads = [s.pending[0] for s in self._busy if s.pending and s.running is None]
            heads = [h for h in heads if self._ready(h)]
            if not heads:
                return
            heads.sort(key=lambda h: (h.queued, h.stream.priority, h.seq))
            started = False
            for task in heads:
                if task.engine in self._engines and self._in_use[task.engine] >= self._engines[task.engine]:
                    continue
                if self._per_link and task.engine == "copy" and self._on_link.get(task.link, 0) >= self._per_link:
                    continue                           # its link is busy: it waits its turn
                self._start(task)
                started = True
            if not started:
                return

    def _start(self, task):
        s = task.stream
        if s.error is None and not s.disk:
            # Work that waits for failed work fails too (as a CUDA error is sticky): a copy after
            # a failed kernel must not ship the stale data that kernel would have replaced.
            upstream = task.upstream or next((d.error for d in task.deps if d.error is not None), None)
            if upstream is not None:
                self.fail(task, upstream)
        skip = s.error is not None                    # work after a failure is skipped
        if not skip and task.begin is not None and task.engine != "host":
            # The NumPy work reads its inputs now, before anything changes. A KeyboardInterrupt it
            # raises itself leaves the task pending, to start again later (a Ctrl-C waits for
            # the loop's next turn: see _run).
            try:
                task.finish = task.begin()
            except Exception as exc:  # noqa: BLE001 - stored, raised at the next synchronise
                if s.disk:
                    task.error = exc      # a disk write's own: its writer raises it (the lane goes on)
                else:
                    self.fail(task, exc)
            task.begin = None
        s.pending.pop(0)
        s.running = task
        task.start = self.t
        task.state = RUNNING
        if task.engine in self._engines:
            self._in_use[task.engine] += 1
        self._running.append(task)
        if task.engine == "copy" and not skip:
            self._on_link[task.link] = self._on_link.get(task.link, 0) + 1
        if skip:
            task.skipped = True
            task.duration, task.link, task.remaining = 0.0, None, 0.0
        elif task.begin is not None:                  # a host function: the learner's Python runs now
            self._run_host_function(task)
        task.begin = None

    def _run_host_function(self, task):
        wall = time.perf_counter()
        self.inside = task
        try:
            with interrupts.at_once():            # the learner's Python may never return: a Ctrl-C stops it
                task.begin()
        except Exception as exc:  # noqa: BLE001 - stored, raised at the next synchronise
            self.fail(task, exc)
        except BaseException as exc:
            # A Ctrl-C is the host's: raised now. The function did not finish, so its
            # stream has failed (it is not run again, which could repeat what it did).
            self.fail(task, RuntimeError(f"the host function {task.name!r} was interrupted "
                                         f"({type(exc).__name__}) before it returned"))
            raise
        finally:
            self.inside = None
            task.duration = ticks((time.perf_counter() - wall) * 1e3)   # a host function takes its own time

    def _rates(self):
        """Bytes per ms of every copy moving data now: a link's bandwidth shared equally
        among its copies, each at most at its own peak (pageable copies are slower)."""
        moving = [t for t in self._running if t.link is not None]
        count = {}
        for t in moving:
            count[t.link] = count.get(t.link, 0) + 1
        return {t: min(t.peak, self._links[t.link] / count[t.link]) for t in moving}

    def _next(self, rates):
        """When the next thing happens (a task ends or a phase changes), or None."""
        times = []
        for t in self._running:
            if t.link is not None:
                times.append(self.t + ticks(t.remaining / rates[t]))
            else:
                times.append(t.start + t.duration)
        return min(times) if times else None

    def _move_to(self, target, rates):
        """Let time run to ``target``, moving the bytes of the copies in flight."""
        dt = target - self.t
        if dt > 0:
            for t, r in rates.items():
                t.remaining -= r * dt
            self.t = target

    def _complete_due(self):
        for t in list(self._running):
            if t.link is not None:
                if t.remaining <= 1e-3:
                    self._complete(t)
            elif t.start + t.duration <= self.t + EPS:
                self._complete(t)

    def _complete(self, task):
        s = task.stream
        if task.finish is not None and s.error is None:
            try:
                # Writes its outputs now. A KeyboardInterrupt it raises leaves the task running:
                # its next completion writes them again, whole.
                task.finish()
            except Exception as exc:  # noqa: BLE001 - stored, raised at the next synchronise
                self.fail(task, exc)
        task.finish = None
        task.deps = ()
        task.end = self.t
        task.state = DONE
        task.error = task.error or s.error
        self._running.remove(task)
        if task.engine in self._engines:
            self._in_use[task.engine] -= 1
        if task.engine == "copy" and task.link is not None:
            self._on_link[task.link] -= 1
        s.running = None
        if not s.pending:
            self._busy.remove(s)
