"""The CPU backend: a deterministic, calibrated model of a GPU that runs the work in NumPy.

Nothing runs in a thread. The model is a discrete-event simulation of one
device with a modelled host in front of it:

* **The host** has a clock. Each call into the runtime costs the host the time
  the same helper call took on the profiled GPU (a kernel launch, an event
  record, ``wait_event``, an async-copy call, a synchronise, a query, a graph
  launch); each kernel also costs the profile's ``loop_turn``, the Python a
  strategy's loop runs per turn between those calls. A host wait moves the host clock to the completion of what it
  waits for; a wait that blocked then costs the host its measured wake-up
  (coming back from the wait, its first calls' extra cost, and the idle
  device taking up the next command).
* **The device** has one compute engine (kernels, fills and device-to-device
  copies run one after another), ``async_engine_count`` copy engines, and
  two links, device-to-host and host-to-device, each with a bandwidth and a
  latency; a link runs the profile's ``copies_per_link`` copies at a time (1 on
  the H200: copies queued together in one direction run one after the other),
  or, where that is 0, any number sharing its bandwidth. A copy from pageable
  host memory is staged: it runs at the pageable bandwidth and the host waits
  for it. A kernel takes the time the profile measured for its shape and size
  (interpolated in the bytes it moves), plus any time it spends by design (the
  layer cake's oven: its cost's ``hold_us``).
* **Ordering** is CUDA's: a stream runs its work in order; ``wait_event``
  waits for the event's record current at call time; a never-recorded event
  counts as done; the legacy default stream waits for the work queued before
  on blocking streams and blocking streams wait for it; non-blocking streams
  skip that.
* **Data follow modelled time**: an operation reads its inputs when it starts
  (its results go to temporaries) and writes its outputs when it ends. A
  missing dependency therefore gives the same wrong answer on every run, and
  the host reading a pinned buffer before synchronising sees what a GPU would
  show it: the old contents.

**The disk** (for runs streamed to a store) is a stage of its own: a chunk's
write is queued on a writer lane when the copy into its host slot is queued,
starts when that copy has completed and the lane's previous write has ended,
and takes latency + bytes / bandwidth (the profile's ``disk`` section): the
writers' latencies overlap, and their bytes share the disk's bandwidth as
copies share a link. The host waits
for a write only where it needs the write's slot, or at the end of the run;
a device synchronise does not wait for the disk.

The device is only ever simulated up to the host's current modelled time (an
operation cannot start before it is queued), so that bandwidth sharing is
exact. Times are deterministic: two runs give identical times and results.

The model leaves out what the course does not need: concurrent kernels, the
launch queue's depth, clock boosts, caches beyond what the calibration of
each kernel shape captures, and host functions' cost (a host function takes
the wall time its Python code takes).
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import math
import threading
import time
import weakref

import numpy as np

from .base import CpuDeviceArray, Runtime

__all__ = ["ModelRuntime", "DiskWrite", "kernel_us", "link_ms"]

_PENDING, _RUNNING, _DONE = range(3)
_EPS = 1e-9      # ms: events closer than a picosecond are simultaneous
_TICK = 2.0 ** -20   # ms (about 1 ns): every modelled time is a whole number of ticks


def _ticks(ms):
    """``ms`` rounded up to whole ticks. Sums and differences of such times are exact in
    floating point, so a run gives the same times whenever it starts (determinism)."""
    return math.ceil(ms / _TICK - 1e-6) * _TICK


def kernel_us(profile, shape, nbytes):
    """Modelled duration (µs) of one kernel of ``shape`` moving ``nbytes``: the
    profile's measured points, interpolated linearly in bytes (extrapolated
    with the slope of the last segment; the first point's time below it)."""
    pts = sorted(profile["kernels"][shape]["points"])
    xs = [p[0] for p in pts]
    i = bisect.bisect_left(xs, nbytes)
    if i == 0:
        return float(pts[0][1])
    if i == len(pts):
        if len(pts) == 1:
            return float(pts[0][1])
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    if x1 == x0:
        return float(y1)
    return float(max(pts[0][1], y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)))


def link_ms(profile, link, nbytes):
    """Modelled time (ms) of one copy of ``nbytes`` alone on ``link``: latency + bytes / bandwidth."""
    spec = profile["links"][link]
    return spec["latency_us"] * 1e-3 + nbytes / (spec["gbps"] * 1e6)


class _Task:
    """One item of a stream's queue: an operation, an event record, a wait, a host function."""

    __slots__ = ("seq", "stream", "name", "engine", "link", "peak", "duration", "remaining",
                 "deps", "queued", "start", "end", "state", "begin", "finish", "error", "skipped", "owner",
                 "upstream")

    def __init__(self, seq, stream, name, queued, deps, begin=None, engine=None, duration=0.0,
                 link=None, peak=None, nbytes=0):
        self.seq, self.stream, self.name, self.queued = seq, stream, name, queued
        self.deps = deps
        self.begin = begin            # called at the start; returns what to call at the end (or None)
        self.finish = None
        self.engine, self.duration = engine, duration
        self.link, self.peak, self.remaining = link, peak, float(nbytes)
        self.start = self.end = None
        self.state = _PENDING
        self.error = None
        self.skipped = False
        self.owner = threading.current_thread()    # the thread that queued it: its failure is that thread's
        self.upstream = None          # the error of work it waits for that had failed when it was queued

    @property
    def done(self):
        return self.state == _DONE


class ModelStream:
    """A stream of the modelled device (the CPU backend's raw stream)."""

    def __init__(self, model, non_blocking, priority, name, legacy_default=False):
        self.non_blocking = bool(non_blocking)
        self.priority = 0 if priority is None else priority    # None: CUDA's default, the lowest (0)
        self.name = name
        self.legacy_default = legacy_default
        self.pending = []         # queued, not started (in order)
        self.running = None       # the task being run, if any
        self.last = None          # the most recently queued task
        self.error = None         # exception stored by failed work, raised at the next synchronise
        self.error_owner = None   # the thread that queued the failed work (see ModelRuntime.sync_device)
        self.closed = False
        self.capture = None       # the graph being captured on this stream, if any
        self.disk = False         # a writer lane of the modelled disk (not device work)
        self.seq = next(model._stream_seq)   # creation order


class ModelEvent:
    """An event of the modelled device: the marker task of its latest record."""

    def __init__(self, timing):
        self.timing = bool(timing)
        self.task = None          # marker task of the latest record (None: never recorded)
        self.graph = None         # the capture its latest record belongs to, if any


class ModelGraph:
    """A captured graph: the calls made on the captured streams, replayed in order.

    As in CUDA, a stream that forked from the capture (it waited on an event recorded
    in it) must be joined back: at the end the capturing stream must come after all
    the work captured on every other stream, or the capture fails."""

    def __init__(self, stream):
        self.origin = stream
        self.nodes = []
        self.streams = [stream]
        # stream -> {captured stream: how many of its work nodes it comes after}, a vector clock
        self.after = {stream: {}}
        self.recorded = {}        # event -> the clock of its stream at its latest record in the capture

    def join(self, stream):
        if stream not in self.streams:
            self.streams.append(stream)
            stream.capture = self
            self.after[stream] = {}

    def note(self, call, args):
        """Follow the ordering of a captured call (see :meth:`unjoined`)."""
        if call in ("enqueue", "host_func"):
            known = self.after[args[0]]
            known[args[0]] = known.get(args[0], 0) + 1
        elif call == "record":
            event, stream = args
            self.recorded[event] = dict(self.after[stream])
        elif call == "wait_event":
            stream, event = args
            known = self.after[stream]
            for s, n in self.recorded.get(event, {}).items():
                known[s] = max(known.get(s, 0), n)

    def unjoined(self):
        """The streams with captured work that the capturing stream does not come after."""
        end = self.after[self.origin]
        return [s for s in self.streams if s is not self.origin and end.get(s, 0) < self.after[s].get(s, 0)]

    def release(self):
        """Every stream of the capture leaves capture mode."""
        for s in self.streams:
            s.capture = None


class _Node:
    """One captured call; ``task`` is its task in the latest replay (what timelines read)."""

    __slots__ = ("call", "args", "task")

    def __init__(self, call, args):
        self.call, self.args, self.task = call, args, None


def _serialised(method):
    """One host thread at a time drives the model (threads share its one modelled host)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return call


class ModelRuntime(Runtime):
    """The modelled GPU of one device profile (see the module's docstring)."""

    name = "cpu"
    modelled = True
    device_array_type = CpuDeviceArray

    def __init__(self, profile):
        self.profile = profile
        self.device_label = f"modelled {profile['device']['short_name']}" \
            if "short_name" in profile["device"] else f"modelled {profile['device']['name']}"
        self.host_t = 0.0                 # modelled host clock (ms)
        self.t = 0.0                      # device time simulated so far (ms)
        self.arithmetic = True            # False: model the times only, skip the NumPy work
        self._seq = itertools.count()
        self._stream_seq = itertools.count()
        self._busy = []                   # streams with queued or running work, in first-use order
        self._running = []
        self._engines = {"compute": 1, "copy": int(profile["device"]["async_engine_count"])}
        # Copies one link (direction) runs at a time: 1 on the H200, where two copies queued
        # together in one direction run one after the other; 0 (or absent): any number, sharing
        # the link's bandwidth.
        self._per_link = int(profile["device"].get("copies_per_link", 0))
        self._on_link = {}
        self._in_use = {"compute": 0, "copy": 0}
        self._links = {k: v["gbps"] * 1e6 for k, v in profile["links"].items()}   # bytes per ms
        self._blocking = weakref.WeakSet()
        self._all = weakref.WeakSet()
        self._default = None
        self._inside = None               # the task whose Python code runs now (a host function)
        self._replaying = None            # the graph being replayed (its calls cost the host nothing)
        self._disk_lanes = {}             # name -> the stream of one writer lane of the modelled disk
        self._lock = threading.RLock()

    @property
    def computes_data(self):
        return self.arithmetic

    @contextlib.contextmanager
    def times_only(self, on=True):
        """Inside the block (when ``on``), predict times only: the NumPy work is skipped, so
        results are left unwritten (a sweep of large grids is predicted in seconds)."""
        before = self.arithmetic
        self.arithmetic = not on and before
        try:
            yield
        finally:
            self.arithmetic = before

    # -- the host clock ---------------------------------------------------------
    def host_ms(self):
        return self.host_t

    def _call(self, what):
        """The host makes the API call ``what``: it costs its profiled time and the
        device catches up with the host."""
        if self._inside is not None:
            raise RuntimeError(f"a host function ({self._inside.name}) called the runtime ({what}); "
                               "a host function must not queue or wait for device work, since it "
                               "would wait for itself")
        if self._replaying is None:
            self.host_t += _ticks(self.profile["host_us"][what] * 1e-3)
        self._advance(self.host_t)

    # -- streams and events --------------------------------------------------
    def priority_range(self):
        return (0, -5)       # CUDA's convention: 0 is the lowest priority; accepted, not scheduled by

    @_serialised
    def new_stream(self, non_blocking, priority, name):
        s = ModelStream(self, non_blocking, priority, name)
        if not non_blocking:
            self._blocking.add(s)
        self._all.add(s)
        return s

    @_serialised
    def default_stream(self):
        if self._default is None:
            self._default = ModelStream(self, False, 0, "default", legacy_default=True)
            self._all.add(self._default)
        return self._default

    def close_stream(self, raw):
        raw.closed = True

    def new_event(self, timing):
        return ModelEvent(timing)

    def _implicit(self, stream):
        """Tasks ``stream`` must wait for under the legacy default-stream rules."""
        if stream.legacy_default:
            return [s.last for s in list(self._blocking) if s.last is not None and not s.last.done]
        if not stream.non_blocking:
            last = self.default_stream().last
            return [last] if last is not None and not last.done else []
        return []

    def _queue(self, stream, name, deps=(), **kw):
        if stream.closed:
            raise RuntimeError(f"stream {stream.name!r} was closed (its run has finished); "
                               "queue work on a stream of your own from create_streams()")
        deps = [*deps, *self._implicit(stream)]
        task = _Task(next(self._seq), stream, name, self.host_t, [d for d in deps if not d.done], **kw)
        task.upstream = next((d.error for d in deps if d.done and d.error is not None), None)
        stream.pending.append(task)
        stream.last = task
        if stream not in self._busy:
            self._busy.append(stream)
        return task

    def _captured(self, stream, call, *args):
        """During a capture, remember the call instead of making it; returns the node or None."""
        graph = stream.capture
        if graph is None or self._replaying is not None:
            return None
        node = _Node(call, args)
        graph.nodes.append(node)
        graph.note(call, args)
        return node

    @_serialised
    def record(self, event, stream):
        if self._captured(stream, "record", event, stream):
            event.graph = stream.capture
            return
        self._call("record")
        event.task = self._queue(stream, "event record")
        event.graph = None
        self._advance(self.host_t)

    @_serialised
    def wait_event(self, stream, event):
        if event.graph is not None and stream.capture is None and self._replaying is None:
            event.graph.join(stream)          # waiting on a captured record forks into the capture
        if self._captured(stream, "wait_event", stream, event):
            return
        self._call("wait_event")
        if event.task is not None and (not event.task.done or event.task.error is not None):
            self._queue(stream, "wait event", deps=[event.task])
            self._advance(self.host_t)

    @_serialised
    def stream_done(self, raw):
        self._call("query")
        return raw.last is None or raw.last.done

    @_serialised
    def event_done(self, raw):
        self._call("query")
        return raw.task is None or raw.task.done

    def _no_wait_in_capture(self, what):
        if any(s.capture is not None for s in self._busy) or self._capturing_streams():
            raise RuntimeError(f"{what} during a graph capture: nothing runs while a graph is "
                               "captured, so the host cannot wait for it; wait after the capture block")

    def _capturing_streams(self):
        return [s for s in list(self._all) if s.capture is not None]

    def _host_wait(self, task, what):
        """The host waits until ``task`` is done."""
        self._call("synchronize")
        if task is not None:
            self._block_until(lambda: task.done, what, lambda: task.end)

    def _block_until(self, condition, what, done_at):
        """After a synchronise call: if ``condition()`` does not hold yet, the host blocks
        until it does (``done_at()``: when that was), then takes its wake-up to get going
        again. A wait whose work is already done costs the call only."""
        if condition():
            return
        self._run_until(condition, what)
        self.host_t = max(self.host_t, done_at()) + _ticks(self.profile["host_us"]["wake"] * 1e-3)
        self._advance(self.host_t)

    @_serialised
    def sync_stream(self, raw):
        if raw.capture is not None:
            self._no_wait_in_capture(f"synchronising stream {raw.name!r}")
        self._host_wait(raw.last, f"stream {raw.name!r}")
        exc = raw.error
        if exc is not None:
            if self._told(raw):
                raw.error = None
            raise exc.with_traceback(exc.__traceback__)

    @_serialised
    def sync_event(self, raw):
        self._host_wait(raw.task, "an event")
        if raw.task is not None and raw.task.error is not None:
            err = raw.task.error
            raise err.with_traceback(err.__traceback__)

    @_serialised
    def sync_device(self):
        if self._capturing_streams():
            self._no_wait_in_capture("synchronising the device")
        self._call("synchronize")
        self._block_until(lambda: all(s.disk for s in self._busy), "the device", lambda: self.t)   # not the disk
        failed = [s for s in [self.default_stream(), *sorted(self._all, key=lambda s: s.seq)] if s.error is not None]
        mine = [s for s in failed if self._told(s)]
        first = (mine or failed)[0].error if failed else None
        for s in mine:
            s.error = None
        if first is not None:
            raise first.with_traceback(first.__traceback__)

    @staticmethod
    def _told(stream):
        """Whether raising ``stream``'s error now tells the thread it belongs to (the thread that
        queued the failed work, or any thread once that one has ended), so that it is dealt with.

        A synchronise that covers a failed stream raises its error in whichever thread calls it,
        as CUDA reports a failed launch to any synchronise that waits for it; but the error stays
        with the stream until its own thread has been told, so that thread's synchronise never
        returns as if nothing had failed because another thread's synchronise took its error."""
        owner = stream.error_owner
        return owner is None or owner is threading.current_thread() or not owner.is_alive()

    def _fail(self, task, exc):
        """``task``'s work raised ``exc``: the stream's later work is skipped, and its next
        synchronise raises ``exc`` (see :meth:`_told`)."""
        task.stream.error, task.stream.error_owner = exc, task.owner

    @_serialised
    def elapsed_ms(self, start, end):
        return end.task.end - start.task.end

    # -- work ----------------------------------------------------------------
    @_serialised
    def enqueue(self, stream, op, cuda, numpy, cost):
        if "kernel" in cost:
            _writable_outputs(op)             # at launch (and capture), not when it would write them
        if self._captured(stream, "enqueue", stream, op, cuda, numpy, cost):
            return
        kw = self._timing(op, cost)
        if "copy" in cost:
            self._call("copy_d2d" if cost["copy"] == "D2D" and "copy_d2d" in self.profile["host_us"]
                       else "copy")
            src, dst = cost["src"], cost["dst"]
            begin = self._begin_copy(dst, src)
        else:
            self._call("launch")
            if "kernel" in cost and self._replaying is None:
                # One kernel per turn of a strategy's loop: the loop's own Python between the
                # helper's calls (slots, indexing) is charged here, once per turn.
                self.host_t += _ticks(self.profile["host_us"].get("loop_turn", 0.0) * 1e-3)
            begin = self._begin_op(op.writes, numpy if "fill" not in cost else _zero)
        task = self._queue(stream, op.name, begin=begin, **kw)
        if cost.get("pageable") and self._replaying is None:
            # Staged through the driver's own pinned buffer: the call returns when the copy is done.
            # No wake-up: the host thread is not asleep but copying the staged chunks itself (and
            # the pageable link is fitted to the sequential loop, which would absorb one).
            self._run_until(lambda: task.done, f"a pageable copy on {stream.name!r}")
            self.host_t = max(self.host_t, task.end)
        self._advance(self.host_t)

    def _timing(self, op, cost):
        """The engine, link and duration of an operation, from the profile.

        A copy's latency is link time: it is turned into the bytes the link
        would have moved meanwhile, so that a copy alone takes latency +
        bytes / bandwidth, and copies sharing a link share all of it."""
        graph = self.profile.get("graph", {}) if self._replaying is not None else {}
        if "copy" in cost:
            kind = cost["copy"]
            spec = self.profile["links"][kind + ("_pageable" if cost.get("pageable") else "")]
            peak = spec["gbps"] * 1e6
            setup_ms = (spec["latency_us"] + graph.get("copy_node_us", 0.0)) * 1e-3
            return dict(engine="compute" if kind == "D2D" else "copy", link=kind, peak=peak,
                        nbytes=op.nbytes + setup_ms * peak)
        if "peer" in cost:
            # A transfer to or from another device (a halo exchange): no engine of this device,
            # the profile's ``peer`` link where it has one (else it takes no modelled time).
            spec = self.profile["links"].get("peer")
            return dict(duration=_ticks(link_ms(self.profile, "peer", cost["peer"])) if spec else 0.0)
        shape = "fill" if "fill" in cost else cost["kernel"]
        nbytes = op.nbytes if "fill" in cost else cost["bytes"]
        # hold_us: time a kernel spends by design on top of its work (the layer cake's oven).
        us = kernel_us(self.profile, shape, nbytes) + cost.get("hold_us", 0.0) + graph.get("kernel_node_us", 0.0)
        return dict(engine="compute", duration=_ticks(us * 1e-3))

    def _begin_op(self, writes, numpy):
        """An operation that reads at its start and writes ``writes`` at its end."""
        if not self.arithmetic:
            return None

        def begin():
            outs = [np.array(w.view(np.ndarray)) for w in writes]
            numpy(*outs)                               # reads its inputs now
            return lambda: [np.copyto(w.view(np.ndarray), o) for w, o in zip(writes, outs)]
        return begin

    def _begin_copy(self, dst, src):
        if not self.arithmetic:
            return None

        def begin():
            data = np.array(src.view(np.ndarray))     # read at the start
            return lambda: np.copyto(dst.view(np.ndarray), data)
        return begin

    @_serialised
    def host_func(self, stream, fn):
        if self._captured(stream, "host_func", stream, fn):
            return
        self._call("host_func")
        self._queue(stream, getattr(fn, "__name__", "host function"), begin=fn, engine="host")
        self._advance(self.host_t)

    # -- the simulation ---------------------------------------------------------
    def _ready(self, task):
        return task.queued <= self.t + _EPS and all(d.done for d in task.deps)

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
                self._fail(task, upstream)
        skip = s.error is not None                    # work after a failure is skipped
        if not skip and task.begin is not None and task.engine != "host":
            # The NumPy work reads its inputs now, before anything changes: a Ctrl-C in it (the
            # host's, raised at once as on a GPU) leaves the task pending, to start again later.
            try:
                task.finish = task.begin()
            except Exception as exc:  # noqa: BLE001 - stored, raised at the next synchronise
                if s.disk:
                    task.error = exc      # a disk write's own: its writer raises it (the lane goes on)
                else:
                    self._fail(task, exc)
            task.begin = None
        s.pending.pop(0)
        s.running = task
        task.start = self.t
        task.state = _RUNNING
        if task.engine in self._engines:
            self._in_use[task.engine] += 1
        self._running.append(task)
        if task.engine == "copy" and not skip:
            self._on_link[task.link] = self._on_link.get(task.link, 0) + 1
        if skip:
            task.skipped = True
            task.duration, task.link, task.remaining = 0.0, None, 0.0
        elif task.begin is not None:                  # a host function: the learner's Python runs now
            wall = time.perf_counter()
            self._inside = task
            try:
                task.begin()
            except Exception as exc:  # noqa: BLE001 - stored, raised at the next synchronise
                self._fail(task, exc)
            except BaseException as exc:
                # A Ctrl-C is the host's: raised now. The function did not finish, so its
                # stream has failed (it is not run again, which could repeat what it did).
                self._fail(task, RuntimeError(f"the host function {task.name!r} was interrupted "
                                              f"({type(exc).__name__}) before it returned"))
                raise
            finally:
                self._inside = None
                task.duration = _ticks((time.perf_counter() - wall) * 1e3)   # a host function takes its own time
        task.begin = None

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
                times.append(self.t + _ticks(t.remaining / rates[t]))
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
            elif t.start + t.duration <= self.t + _EPS:
                self._complete(t)

    def _complete(self, task):
        s = task.stream
        if task.finish is not None and s.error is None:
            try:
                # Writes its outputs now. A Ctrl-C here is raised at once and leaves the task
                # running: its next completion writes them again, whole.
                task.finish()
            except Exception as exc:  # noqa: BLE001 - stored, raised at the next synchronise
                self._fail(task, exc)
        task.finish = None
        task.deps = ()
        task.end = self.t
        task.state = _DONE
        task.error = task.error or s.error
        self._running.remove(task)
        if task.engine in self._engines:
            self._in_use[task.engine] -= 1
        if task.engine == "copy" and task.link is not None:
            self._on_link[task.link] -= 1
        s.running = None
        if not s.pending:
            self._busy.remove(s)

    def _advance(self, until):
        """Simulate the device up to the host's time ``until`` (no further: the host may
        still queue work that starts before anything later)."""
        if self._inside is not None:
            return
        while True:
            self._start_ready()
            rates = self._rates()
            nxt = self._next(rates)
            if nxt is None or nxt > until + _EPS:
                self._move_to(max(until, self.t), rates)
                return
            self._move_to(max(nxt, self.t), rates)
            self._complete_due()

    def _run_until(self, condition, what):
        """Simulate until ``condition()`` holds (the host is waiting)."""
        if self._inside is not None:
            raise RuntimeError(f"a host function waits for {what}, which would wait for itself")
        while not condition():
            self._start_ready()
            rates = self._rates()
            nxt = self._next(rates)
            if nxt is None:
                raise RuntimeError(f"the host waits for {what}, but no queued work can ever finish it")
            self._move_to(max(nxt, self.t), rates)
            self._complete_due()

    # -- the disk ----------------------------------------------------------------
    @_serialised
    def disk_write(self, lane, after, encode):
        """Queue one chunk's write to the modelled disk on the writer lane ``lane`` (a name):
        it starts when the event ``after`` (recorded after the copy into the chunk's slot) has
        completed and the lane's previous write has ended, and takes the profile's disk latency
        (the lane's own: the lanes' latencies overlap) + bytes / bandwidth (shared with the other
        lanes' writes, as copies share a link).

        ``encode()`` is called when the write begins (the copy has landed) and returns the
        bytes to write; a writer thread gets them from the returned :class:`DiskWrite`'s
        ``result()`` and writes the real file. Nothing that thread does
        moves the model's clocks. Queuing costs the host nothing (no GPU API call)."""
        spec = self.profile.get("disk")
        if spec is None:
            raise RuntimeError(f"the profile {self.profile.get('name', '')!r} has no 'disk' section (the "
                               "disk's write bandwidth and latency), so a run streamed to disk cannot be "
                               "modelled; calibrate it again with `python -m course_helper calibrate`")
        bandwidth = spec["gbps"] * 1e6                              # bytes per ms
        self._links["disk"] = bandwidth
        stream = self._disk_lanes.get(lane)
        if stream is None:
            stream = self._disk_lanes[lane] = ModelStream(self, True, 0, lane)
            stream.disk = True
        write = DiskWrite(lane)

        def begin():
            if write._ready.is_set():
                return                                              # cancelled: nobody waits for it
            try:
                if after.task is not None and after.task.error is not None:
                    raise after.task.error                          # the copy failed: nothing to write
                write._result = encode()
                write.task.remaining = float(memoryview(write._result).nbytes)   # the bytes the file holds
            except BaseException as exc:  # noqa: BLE001 - handed to the writer thread
                write._error = exc
            finally:
                write._ready.set()

        deps = [after.task] if after.task is not None else []
        write.first = self._queue(stream, "disk latency", deps=deps, begin=begin,
                                  duration=_ticks(spec["latency_us"] * 1e-3))
        write.task = self._queue(stream, "disk write", link="disk", peak=bandwidth)
        self._advance(self.host_t)
        return write

    @_serialised
    def disk_wait(self, write):
        """The host waits until ``write`` is on the modelled disk: its clock moves to the write's end."""
        self._run_until(lambda: write.task.done, f"a write on {write.lane!r}")
        self.host_t = max(self.host_t, write.task.end)
        self._advance(self.host_t)

    # -- graphs ----------------------------------------------------------------
    def graphs_supported(self):
        return True, ""

    @_serialised
    def begin_capture(self, stream):
        if stream.capture is not None:
            raise RuntimeError(f"stream {stream.name!r} is already being captured")
        stream.capture = ModelGraph(stream)

    @_serialised
    def end_capture(self, stream):
        graph = stream.capture
        graph.release()
        unjoined = graph.unjoined()
        if unjoined:
            names = ", ".join(repr(s.name) for s in unjoined)
            raise RuntimeError(
                f"cudaErrorStreamCaptureUnjoined: the capture on {stream.name!r} forked into {names} "
                f"(a stream that waited on an event recorded in the capture), whose captured work was not "
                f"joined back; before the capture block ends, make {stream.name!r} wait for it "
                f"(wait_stream, or wait_event on an event recorded after that work). The capture has "
                "ended without a graph.")
        return graph

    @_serialised
    def abort_capture(self, stream):
        if stream.capture is not None:
            stream.capture.release()

    @_serialised
    def launch_graph(self, graph, stream):
        """One launch on the host; the captured work follows the work queued before on ``stream``."""
        if any(s.capture is not None for s in graph.streams):
            raise RuntimeError("this graph is still being captured; launch it after the capture block")
        self._call("graph_launch")
        entry = stream.last if stream.last is not None and not stream.last.done else None
        self._replaying = graph
        try:
            for s in graph.streams:
                if s is not stream and entry is not None:
                    self._queue(s, "graph start", deps=[entry])
            for node in graph.nodes:
                getattr(self, node.call)(*node.args)
                node.task = node.args[0].last if node.call != "record" else node.args[0].task
            lasts = [s.last for s in graph.streams if s is not stream and s.last is not None]
            if lasts:
                self._queue(stream, "graph end", deps=lasts)
        finally:
            self._replaying = None
        self._advance(self.host_t)

    # -- memory -----------------------------------------------------------------
    def device_array(self, shape, dtype, zero):
        return (np.zeros if zero else np.empty)(shape, dtype).view(CpuDeviceArray)

    def is_device_array(self, a):
        return isinstance(a, CpuDeviceArray)

    @_serialised
    def to_device(self, host):
        self.sync_stream(self.default_stream())
        out = np.array(host, copy=True).view(CpuDeviceArray)
        self.host_t += _ticks(link_ms(self.profile, "H2D_pageable", out.nbytes))
        self._advance(self.host_t)
        return out

    @_serialised
    def to_host(self, device_array):
        self.sync_device()
        out = np.array(device_array.view(np.ndarray), copy=True)
        self.host_t += _ticks(link_ms(self.profile, "D2H_pageable", out.nbytes))
        self._advance(self.host_t)
        return out

    def pinned_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    # -- timing marks ----------------------------------------------------------
    @_serialised
    def trace_begin(self):
        return {"t0": self.host_t}

    def trace_start(self, stream, origin):
        return None

    @_serialised
    def trace_end(self, stream, start, origin):
        graph = stream.capture
        if graph is not None and self._replaying is None:
            return graph.nodes[-1] if graph.nodes else None
        return stream.last

    @_serialised
    def trace_times(self, origin, start, end):
        task = end.task if isinstance(end, _Node) else end
        if task is None or task.skipped or task.end is None:
            return None
        return task.start - origin["t0"], task.end - origin["t0"]

    def trace_host_ms(self, origin, host_ms):
        return host_ms - origin["t0"]


class DiskWrite:
    """One chunk's write to the modelled disk (see :meth:`ModelRuntime.disk_write`)."""

    def __init__(self, lane):
        self.lane = lane
        self.first = self.task = None     # its latency, then its bytes (tasks of the lane's stream)
        self._result = self._error = None
        self._ready = threading.Event()

    @property
    def done(self):
        """Whether the write has ended, in modelled time (the host's clock has passed its end)."""
        return self.task.done

    def interval(self):
        """The write's (start, end) in modelled ms, on the host clock's axis (once done)."""
        return self.first.start, self.task.end

    def cancel(self, exc):
        """The write will never begin (the run stopped before its copy ran): ``result()``
        raises ``exc`` instead of waiting. Nothing if it has begun."""
        if not self._ready.is_set():
            self._error = exc
            self._ready.set()

    def result(self):
        """What ``encode()`` returned, once the write has begun in modelled time (waits in real
        time, moving no clock; one caller takes it); raises what ``encode`` raised."""
        while not self._ready.wait(0.05):
            if self.first.done and not self._ready.is_set():
                # Its start ended without handing over the bytes (a Ctrl-C came in between).
                raise self.first.error or RuntimeError(f"the write on {self.lane!r} was interrupted")
        if self._error is not None:
            raise self._error
        result, self._result = self._result, None      # handed over: the write keeps no hold on the bytes
        return result


def _zero(out):
    out.fill(0)


def _writable_outputs(op):
    """Refuse a kernel that would write a read-only array: it could only fail when it ends."""
    for a in op.writes:
        if not a.flags.writeable:
            shape = "x".join(str(n) for n in a.shape)
            raise ValueError(f"{op.name} would write a read-only {shape} {a.dtype} device array "
                             "(its flags.writeable is False); pass a writable device array "
                             "(device_empty()/device_zeros(), or one whose flags.writeable is True)")
