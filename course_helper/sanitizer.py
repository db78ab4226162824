"""A race sanitizer: happens-before analysis of the work the helper queues.

The sanitizer is an observer of :mod:`course_helper.runtime.observe`. It never runs or
delays anything; it reasons about the *program*: which operation reads or
writes which memory, and which ordering the streams, events and host waits
establish between them. Two accesses to overlapping memory, at least one of
them a write, that nothing orders are a **race**, whether or not the timing
of this run happened to make the answer right. So it reports the same thing
on the GPU and on the CPU backend, on every run.

Ordering is tracked with *vector clocks*, one per stream and one for the
host: a clock maps every stream (and the host) to the last of its operations
known to be finished before the clock's owner goes on. The rules:

* work on one stream runs in the order it was queued;
* queuing happens after everything the host knew to be finished;
* ``stream.wait_event(e)`` orders later work on ``stream`` after the record of
  ``e`` that is current at the call (a never-recorded event counts as done);
* a host synchronise of a stream, an event or the device orders the host
  after that work;
* the legacy default stream waits for earlier work on blocking streams, and
  blocking streams wait for earlier default-stream work (non-blocking
  streams skip this);
* work captured into a CUDA graph is ordered as inside the capture; a replay
  comes after what precedes the launch on its stream, and later work on that
  stream comes after the whole replay.

One more check needs no clocks: a copy labelled with a time level must find
that level in its source. A source last written by the operation of another
level was overwritten before the copy ran (too few buffers in a ring): the
copy is ordered, but it saves the wrong level.

Polling counts as a host wait: an event's or a stream's ``.done`` that is True
orders the host after the work it polled, and ``ch.to_host()`` synchronises
the device before it copies.

**The host's own accesses.** While a sanitizer is on, the host's reads and
writes of pinned arrays (indexing, NumPy functions, ``np.asarray``, a plot:
see :mod:`course_helper.host_watch`) are accesses of the host like the
helper's own: reading a copy's destination, or writing an H2D copy's source,
before a synchronise (of the stream, an event after the copy, or the device)
or a ``.done`` poll answered True is a race. What a host function queued
with ``stream.launch_host_func`` touches belongs to its place on that stream,
after the work queued before it there. A view of a pinned array is watched too,
``a.view(np.ndarray)`` and ``a.flat`` included. What the sanitizer cannot hear
(listed exactly in :mod:`course_helper.host_watch`): the buffer protocol and raw
addresses (``memoryview(a)``, ``a.data``, ``a.ctypes``, ``a.__array_interface__``,
``np.frombuffer(a)``) and compiled code using them (``f.readinto(a)``,
``rng.random(out=a)``); a pinned array assigned into a plain one (``x[...] = a``; use
``np.copyto(x, a)``); ``a.base`` and the methods of ``np.ndarray`` called on the class
itself (``np.ndarray.view(a, np.ndarray)``); a view as another ndarray subclass
(``a.view(np.recarray)``) and ``np.nditer(a)`` (NumPy functions that read through it, or assign
``a`` into a plain array, inside: ``np.lib.format.write_array``, ``np.rec.fromarrays``); what is
done with a plain array made
over the memory, ``np.asarray(a)`` or ``np.lib.stride_tricks.as_strided(a)`` (taking
either is a read); a plain view or ``a.flat`` taken before the sanitizer started;
memory pinned another way than ``ch.pinned_empty``.

**Memory let go.** When the last reference to an array goes, its memory can
be handed out again: CuPy's pool gives device memory back to the stream that
allocated it (the stream current at allocation), its pinned pool gives host
memory to the next pinned allocation. So dropping an array is a write by that
stream (device memory) or by the host (pinned memory): work of another stream
that still reads or writes it, and is not ordered before that point, races
with it. (On the modelled device queued work holds its arrays until it starts,
so there the drop is seen when that work starts; the race is the same.)

Use it with ``with ch.sanitize(): ...`` or ``ch.solve(..., sanitize=True)``;
it raises :class:`RaceError` when the second access of a race is queued.

**Threads.** A sanitizer watches the work queued by *every* thread while it
is on, as compute-sanitizer watches a whole process: a race queued from a
worker thread is found too. It is raised in the thread that queued the
second access and, if that is not the thread that opened the
``sanitize()`` block, again when the block ends. The host is one: the
sanitizer cannot see how threads order one another (a lock, a queue, a
``join``), so a host wait in any thread orders the work queued after it by
every thread. Work queued on one stream by two threads at the same moment is
taken in the order the sanitizer heard it.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from . import host_watch
from .runtime import observe
from .runtime.base import byte_span
from .runtime.ops import COPY_KINDS, OpKind
from .streams import Event, Stream, default_stream, synchronize

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    from .graphs import Graph
    from .runtime.observe import Op

__all__ = ["RaceError", "Sanitizer", "sanitize"]

_HOST = "host"           # the host's key in a vector clock
_CHUNK = 20              # shadow-memory lookup granularity: 1 MiB
_LET_GO = "letting it go"   # the ``where`` of the host letting go of pinned memory


class RaceError(RuntimeError):
    """Two accesses to overlapping memory, at least one a write, that nothing orders.

    Attributes
    ----------
    first, second : str
        What each access does ("the kernel `wave2d_4o level 7` on `compute` writes U[2]").
    fix : str
        The dependency that would order them.
    """

    def __init__(self, message: str, first: str = "", second: str = "", fix: str = ""):
        super().__init__(message)
        self.first, self.second, self.fix = first, second, fix


class _Names:
    """Names of buffers by address range, for messages ("U[2]", "images[5]")."""

    def __init__(self):
        self.entries = []                    # (space, lo, hi, name, bytes per first-axis slice)

    def add(self, name, array):
        if isinstance(array, (list, tuple)):
            for i, a in enumerate(array):
                self.add(f"{name}[{i}]", a)
            return
        span = byte_span(array)
        if span is None:
            return
        step = int(array.strides[0]) if array.ndim >= 3 and array.flags.c_contiguous else 0
        self.entries.append((*span, name, step))

    def of(self, array, span):
        space, lo, hi = span
        best = None
        for s, a, b, name, step in self.entries:
            if s == space and a <= lo and hi <= b and (best is None or b - a < best[1] - best[0]):
                best = (a, b, name, step)
        if best is None:
            shape = "x".join(str(int(n)) for n in array.shape)
            return f"a {shape} {array.dtype} {space} array"
        a, b, name, step = best
        if not step or (a, b) == (lo, hi):
            return name
        i, j = (lo - a) // step, -(-(hi - a) // step)
        return f"{name}[{i}]" if j - i == 1 else f"{name}[{i}:{j}]"


# --------------------------------------------------------------------------
# Accesses and shadow memory
# --------------------------------------------------------------------------
class _OpInfo(NamedTuple):
    """What messages need of an operation (an Op would keep its arrays, and so their memory, alive)."""
    kind: OpKind
    name: str
    stream: Any
    level: int | None


class _Shape(NamedTuple):
    """What messages need of an array: kept instead of the array, which the sanitizer must not keep alive."""
    shape: tuple
    dtype: Any
    ndim: int


def _info(op):
    return None if op is None else _OpInfo(op.kind, op.name, op.stream, op.level)


class _Access:
    """One read or write of one memory range by one operation (or by the host)."""

    __slots__ = ("thread", "clock", "op", "where", "array", "span", "write", "replay")

    def __init__(self, thread, clock, op, where, array, span, write, replay=None):
        self.thread, self.clock, self.op, self.where = thread, clock, op, where
        self.array, self.span, self.write, self.replay = array, span, write, replay   # array: a _Shape


class _Shadow:
    """Per memory range: the last write and the reads since it (one per thread).

    A write that is ordered after everything recorded for a range it covers
    replaces those records: anything that races with them races with the new
    write too (or is ordered after both), so the first race is still found.
    """

    def __init__(self):
        self.ranges = {}                     # (space, lo, hi) -> [last write, {thread: read}]
        self.chunks = {}                     # (space, chunk) -> set of range keys

    def overlapping(self, span):
        space, lo, hi = span
        first, last = lo >> _CHUNK, (hi - 1) >> _CHUNK
        if first == last:                    # the common case: one chunk, no merging needed
            found = self.chunks.get((space, first))
            return [k for k in found if k[1] < hi and k[2] > lo] if found else []
        keys = set()
        for c in range(first, last + 1):
            found = self.chunks.get((space, c))
            if found:
                keys.update(found)
        return [k for k in keys if k[1] < hi and k[2] > lo]

    def _entry(self, key):
        entry = self.ranges.get(key)
        if entry is None:
            entry = self.ranges[key] = [None, {}]
            space, lo, hi = key
            for c in range(lo >> _CHUNK, ((hi - 1) >> _CHUNK) + 1):
                self.chunks.setdefault((space, c), set()).add(key)
        return entry

    def _drop(self, key):
        del self.ranges[key]
        space, lo, hi = key
        for c in range(lo >> _CHUNK, ((hi - 1) >> _CHUNK) + 1):
            self.chunks[(space, c)].discard(key)

    def record(self, acc, overlapping):
        key = acc.span
        if acc.write:
            for k in overlapping:
                if k != key and key[1] <= k[1] and k[2] <= key[2]:
                    self._drop(k)            # covered by the new write, which is ordered after it
            entry = self._entry(key)
            entry[0], entry[1] = acc, {}
        else:
            reads = self._entry(key)[1]
            known = reads.get(acc.thread)
            if known is None or known.clock <= acc.clock:    # a host function may be heard late
                reads[acc.thread] = acc

    def forget(self, span):
        """The memory of ``span`` was let go: what was recorded there belongs to no array any more."""
        for key in self.overlapping(span):
            if span[1] <= key[1] and key[2] <= span[2]:
                self._drop(key)


# --------------------------------------------------------------------------
# The observer
# --------------------------------------------------------------------------
def _join(into, other):
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _serialised(method):
    """One notification at a time: threads queueing work at once share the sanitizer's state.
    Memory let go since the last notification is taken into account first (see :meth:`Sanitizer.settle`)."""
    @functools.wraps(method)
    def call(self, *args):
        with self.lock:
            if self.let_go:
                self.settle()
            return method(self, *args)
    return call


def _owner(a):
    """The array that owns ``a``'s memory (``a`` itself, or the base its views lead to): the memory
    is let go when that object goes."""
    kind = np.ndarray if isinstance(a, np.ndarray) else type(a)       # NumPy's arrays, or CuPy's
    while isinstance(getattr(a, "base", None), kind):
        a = a.base
    return a


def _let_go(sanitizer, *memory):
    """The finalizer of an array whose memory ``sanitizer`` (a weak reference) watches."""
    san = sanitizer()
    if san is not None:
        san._let_go(*memory)


def _blocking(stream):
    """True for a stream that takes part in the legacy default stream's implicit ordering."""
    return bool(stream.blocking)


class Sanitizer:
    """Happens-before race detector; an observer of :mod:`course_helper.runtime.observe`.

    Use :func:`sanitize` (or ``solve(..., sanitize=True)``) rather than this
    class directly. ``names`` maps a name to an array, a stream or an event,
    or a list of them (named ``name[i]``); stacks of three or more dimensions
    are named per slice (``images[5]``). ``host_sync_fixes=False`` never
    suggests a host synchronise as a fix (for a loop whose rules forbid it).
    ``levels=False`` takes a copy's ``level=`` as a label only: no copy is
    reported for reading a buffer that holds another level than its label.
    """

    def __init__(self, names: dict[str, Any] | None = None, host_sync_fixes: bool = True, levels: bool = True):
        self.names = _Names()
        self.labels = {}                     # id(stream or event) -> (it, its name in messages)
        self.host_sync_fixes = host_sync_fixes
        self.levels = levels
        for name, arrays in (names or {}).items():
            self.name(name, arrays)
        self.host = {}                       # the host's vector clock
        self.host_version = 0                # bumped whenever the host's clock changes
        self.joined = {}                     # stream -> host_version last joined into its clock
        self.clocks = {}                     # stream -> its vector clock
        self.roles = {}                      # stream -> its part in the default stream's ordering
        self.spans = {}                      # id(array) -> (array, its memory range)
        self.events = {}                     # id(event) -> (event, clock at its latest record)
        self.records = {}                    # stream -> [(position, event, order)] of its records
        self.waited = {}                     # stream -> {id(event): (event, order)}: its latest wait on each
        self.order = 0                       # counts records and waits, in the order they were queued
        self.shadow = _Shadow()
        self.capture = None                  # saved state while a graph is being captured
        self.graphs = {}                     # id(graph) -> (graph, captured accesses)
        self.owners = {}                     # id(array owning memory) -> finalizer telling us it went
        self.allocated = {}                  # id(owner of device memory) -> (weak ref to it, its pool's stream)
        self.functions = {}                  # id(host function) -> (its stream, its position there, its clock)
        self.running = threading.local()     # .function: the host function this thread runs now, if any
        self.failed = False
        self.race = None                     # (the RaceError, the thread it was raised in)
        self.let_go = []                     # memory let go since the last notification (see settle)
        self.lock = threading.RLock()         # held by each notification (a subclass's too)
        host_watch.watch()                   # the host's own accesses of pinned arrays are heard too
        self._unwatch = weakref.finalize(self, host_watch.unwatch)   # once, at close() or when dropped

    def close(self) -> None:
        """Stop watching and let go of the buffers it remembers (device memory can be freed)."""
        observe.remove(self)
        self._unwatch()
        with self.lock:
            for finalizer in self.owners.values():
                finalizer.detach()
            self.shadow, self.spans, self.graphs, self.capture = _Shadow(), {}, {}, None
            self.owners, self.allocated, self.functions = {}, {}, {}

    def name(self, name: str, arrays: Any) -> None:
        """Name an array, a stream or an event (or a list of them) in race messages."""
        if isinstance(arrays, (Stream, Event)):
            self.labels[id(arrays)] = (arrays, name)
        elif isinstance(arrays, (list, tuple)) and arrays and all(isinstance(x, (Stream, Event)) for x in arrays):
            for i, x in enumerate(arrays):
                self.labels[id(x)] = (x, f"{name}[{i}]")
        else:
            self.names.add(name, arrays)

    def label_of(self, obj: Stream | Event) -> str | None:
        """The name given to a stream or an event, or None."""
        known = self.labels.get(id(obj))
        return known[1] if known is not None and known[0] is obj else None

    def stream_name(self, stream: Stream) -> str:
        """A stream's name in messages: the name given to it, else its own."""
        return self.label_of(stream) or stream.name

    # -- clocks -------------------------------------------------------------
    def _clock(self, stream):
        vc = self.clocks.get(stream)
        if vc is None:
            vc = self.clocks[stream] = {}
        return vc

    def _enqueue(self, stream):
        """The clock of ``stream`` as a new piece of work is queued on it."""
        vc = self._clock(stream)
        if self.joined.get(stream) != self.host_version:     # the host learnt something since
            _join(vc, self.host)
            self.joined[stream] = self.host_version
        role = self._role(stream)
        if role:                             # legacy default-stream ordering
            for other, c in self.clocks.items():
                if other is not stream and self._role(other) == -role:
                    _join(vc, c)
        return vc

    def _role(self, stream):
        """1 for the legacy default stream, -1 for a blocking stream, 0 for a non-blocking one."""
        role = self.roles.get(stream)
        if role is None:
            role = self.roles[stream] = (1 if stream.is_default
                                         else -1 if _blocking(stream) else 0)
        return role

    def _span(self, a):
        """``byte_span(a)``, remembered for arrays met before (the same buffers come back every level).
        Only weakly: the sanitizer must not keep memory alive, or it would hide a buffer let go
        too early. An array met for the first time has the owner of its memory watched."""
        key = id(a)
        known = self.spans.get(key)
        if known is not None and known[0]() is a:
            return known[1]
        span = byte_span(a)
        try:
            # (the callback holds the dict, not the sanitizer: no reference cycle keeps a sanitizer alive)
            ref = weakref.ref(a, lambda r, key=key, spans=self.spans: spans.get(key, (None,))[0] is r
                              and spans.pop(key))
        except TypeError:                  # an array type without weak references: not remembered
            return span
        self.spans[key] = (ref, span)
        if span is not None:
            self._watch_owner(a, span[0])
        return span

    def _watch_owner(self, a, space):
        """Be told when the memory of ``a`` (in ``space``) is let go, that is when the array owning
        it goes: see :meth:`Sanitizer._let_go`."""
        owner = _owner(a)
        known = self.owners.get(id(owner))
        if known is not None and known.alive:
            return
        span = byte_span(owner)
        if span is None:
            return
        span = (space, *span[1:])          # the owner of a CPU backend's device array is a plain array
        allocated = self.allocated.get(id(owner))
        pool = allocated[1] if allocated is not None and allocated[0]() is owner else None
        try:
            # (the finalizer holds the sanitizer weakly: an array outliving it does not keep it)
            self.owners[id(owner)] = weakref.finalize(owner, _let_go, weakref.ref(self), id(owner), span,
                                                      _Shape(owner.shape, owner.dtype, owner.ndim), pool)
        except TypeError:                  # not weakly referenceable: its end is not seen
            pass

    # -- observer calls ------------------------------------------------------
    @_serialised
    def op_queued(self, op: Op) -> None:
        if self.failed:
            return
        vc = self._enqueue(op.stream)
        clock = vc[op.stream] = vc.get(op.stream, 0) + 1
        info = None
        for arrays, write in ((op.reads, False), (op.writes, True)):
            for a in arrays:
                span = self._span(a)
                if span is not None:
                    info = info or _info(op)
                    self._access(_Access(op.stream, clock, info, None, _Shape(a.shape, a.dtype, a.ndim),
                                         span, write), vc)

    @_serialised
    def event_recorded(self, stream: Stream, event: Event) -> None:
        if self.failed:
            return
        vc = self._enqueue(stream)
        self.events[id(event)] = (event, dict(vc))
        self.order += 1
        self.records.setdefault(stream, []).append((vc.get(stream, 0), event, self.order))

    @_serialised
    def event_waited(self, stream: Stream, event: Event) -> None:
        if self.failed:
            return
        known = self.events.get(id(event))
        vc = self._enqueue(stream)
        self.order += 1
        self.waited.setdefault(stream, {})[id(event)] = (event, self.order)
        if known is not None and known[0] is event:
            _join(vc, known[1])

    @_serialised
    def host_synced(self, target: Stream | Event | None) -> None:
        if self.failed:
            return
        self.host_version += 1
        if target is None:
            for vc in self.clocks.values():
                _join(self.host, vc)
        elif isinstance(target, Stream):
            _join(self.host, self._clock(target))
        else:                                        # an Event
            known = self.events.get(id(target))
            if known is not None and known[0] is target:
                _join(self.host, known[1])

    @_serialised
    def host_access(self, array: np.ndarray, mode: str, where: str) -> None:
        if self.failed:
            return
        span = self._span(array)
        shape = _Shape(array.shape, array.dtype, array.ndim)
        function = getattr(self.running, "function", None)
        if function is not None:           # inside a host function: at its place on its stream
            stream, clock, vc, info = function
            if span is not None:
                self._access(_Access(stream, clock, info, where, shape, span, "w" in mode), vc)
            return
        self.host_version += 1
        clock = self.host[_HOST] = self.host.get(_HOST, 0) + 1
        if span is not None:
            self._access(_Access(_HOST, clock, None, where, shape, span, "w" in mode), self.host)

    @_serialised
    def host_func_queued(self, stream: Stream, token: object) -> None:
        if self.failed:
            return
        vc = self._enqueue(stream)
        clock = vc[stream] = vc.get(stream, 0) + 1
        name = getattr(token, "__name__", "host function")
        self.functions[id(token)] = (token, (stream, clock, dict(vc), _OpInfo(OpKind.HOST_FUNC, name, stream, None)))

    def host_func_started(self, token: object) -> None:
        with self.lock:
            known = self.functions.get(id(token))
        self.running.function = known[1] if known is not None and known[0] is token else None

    def host_func_ended(self, token: object) -> None:
        self.running.function = None
        with self.lock:
            known = self.functions.get(id(token))
            if known is not None and known[0] is token:
                del self.functions[id(token)]

    @_serialised
    def device_allocated(self, array: object, stream: Stream) -> None:
        if self.failed:
            return
        owner = _owner(array)                # the memory's owner: what _let_go hears of
        key = id(owner)
        try:
            ref = weakref.ref(owner, lambda r, key=key, known=self.allocated: known.get(key, (None,))[0] is r
                              and known.pop(key))
        except TypeError:
            return
        self.allocated[key] = (ref, stream)

    def _let_go(self, key, span, shape, pool):
        """The array owning the memory ``span`` (device memory: from the pool of the stream ``pool``,
        None if not known) went (a finalizer, run in whichever thread dropped
        it, at any point of that thread's code): noted, and checked at the next notification or
        when the sanitizer stops (:meth:`settle`). Nothing changed the clocks in between."""
        self.let_go.append((key, span, shape, pool))

    def settle(self) -> None:
        """Check the memory let go since the last notification. It may be handed out again: by the
        memory pool of the stream that allocated it (device memory: later work on that stream may
        overwrite it) or to the host's next pinned allocation (pinned memory). Whatever touched it
        must be ordered before that point; then what was recorded there is forgotten."""
        with self.lock:
            while self.let_go:
                key, span, shape, pool = self.let_go.pop(0)
                self.owners.pop(key, None)
                if self.failed:
                    continue
                if span[0] == "device":
                    pool = pool or default_stream()   # allocated before the sanitizer: CuPy's default
                    vc = self._enqueue(pool)
                    gone = _Access(pool, vc.get(pool, 0), _OpInfo(OpKind.LET_GO, "", pool, None), None, shape, span,
                                   True)
                else:
                    vc = self.host
                    gone = _Access(_HOST, self.host.get(_HOST, 0), None, _LET_GO, shape, span, True)
                self._check(gone, vc)
                self.shadow.forget(span)

    @_serialised
    def capture_started(self, stream: Stream) -> None:
        if self.failed:
            return
        saved = ({s: dict(c) for s, c in self.clocks.items()}, dict(self.host), dict(self.events),
                 {s: list(r) for s, r in self.records.items()}, self.shadow,
                 {s: dict(w) for s, w in self.waited.items()})
        self.capture = (saved, [])
        self.host_version += 1               # clocks are swapped in and out around the capture
        self.shadow = _Shadow()              # nothing captured runs now: check it within the capture

    @_serialised
    def capture_ended(self, stream: Stream, graph: Graph | None) -> None:
        """The capture on ``stream`` ended with ``graph`` (None: it failed or was abandoned)."""
        if self.capture is None:
            return
        (self.clocks, self.host, self.events, self.records, self.shadow, self.waited), captured = self.capture
        self.capture = None
        self.host_version += 1
        if graph is not None:
            self.graphs[id(graph)] = (graph, captured)

    @_serialised
    def graph_launched(self, graph: Graph, stream: Stream) -> None:
        if self.failed:
            return
        known = self.graphs.get(id(graph))
        if known is None or known[0] is not graph:
            return                           # captured before the sanitizer started
        vc = self._enqueue(stream)
        clock = vc[stream] = vc.get(stream, 0) + 1
        for acc in known[1]:
            self._access(_Access(stream, clock, acc.op, None, acc.array, acc.span, acc.write, replay=stream), vc)

    # -- the check -----------------------------------------------------------
    def _access(self, acc, vc):
        overlapping = self._check(acc, vc)
        if (self.levels and not acc.write and acc.op is not None and acc.op.kind in COPY_KINDS
                and acc.op.level is not None):
            self._check_version(acc, overlapping)
        self.shadow.record(acc, overlapping)
        if self.capture is not None:
            self.capture[1].append(acc)

    def _check(self, acc, vc):
        """Raise if ``acc`` races with a recorded access (``vc``: what is ordered before it);
        returns the recorded ranges it overlaps."""
        shadow, thread = self.shadow, acc.thread
        overlapping = shadow.overlapping(acc.span)
        for key in overlapping:
            last_write, reads = shadow.ranges[key]
            if (last_write is not None and last_write.thread is not thread
                    and last_write.clock > vc.get(last_write.thread, 0)):
                self._fail(last_write, acc)
            if acc.write:
                for old in reads.values():
                    if old.thread is not thread and old.clock > vc.get(old.thread, 0):
                        self._fail(old, acc)
        return overlapping

    def _fail(self, first, second):
        self._raise(self._race(first, second))

    def _raise(self, error):
        self.failed = True
        self.race = (error, threading.current_thread())
        raise error

    def _check_version(self, acc, overlapping):
        """A copy of level L must find level L in its source: a part of the source last written
        by the operation of another level was overwritten before the copy (ordered, but too late).
        Parts: a kernel writes only the rows inside its padding, and a slab's windows each write
        their own rows of one buffer. A stack of levels (a 3-D source) holds other levels in its
        other slices: it is checked as one whole."""
        if acc.array.ndim >= 3:
            overlapping = [acc.span] if acc.span in self.shadow.ranges else []
        for key in overlapping:
            last = self.shadow.ranges[key][0]
            if last is not None and last.op is not None and last.op.level is not None \
                    and int(last.op.level) != int(acc.op.level):
                break
        else:
            return
        what1, buffer = self._what(last)
        what2, _ = self._what(acc)
        fix = (f"{_describe(acc.op)} must be ordered before {buffer} is overwritten with level "
               f"{int(last.op.level)}: give each level in flight its own buffer (more buffers), and make "
               f"`{self.stream_name(last.op.stream)}` wait for an event recorded after the copy before it "
               f"writes {buffer} again")
        self._raise(_error(f"{_describe(acc.op)} reads {buffer}, which no longer holds level {int(acc.op.level)}",
                           f"{what1} (level {int(last.op.level)})", what2,
                           f"so the copy saves level {int(last.op.level)} as level {int(acc.op.level)}", fix))

    # -- messages ------------------------------------------------------------
    def _what(self, acc):
        buffer = self.names.of(acc.array, acc.span)
        verb = "writes" if acc.write else "reads"
        if acc.op is None and acc.where == _LET_GO:
            return (f"the host lets go of {buffer} (its last reference went: the pinned memory pool "
                    "may give it to the next pinned allocation)"), buffer
        if acc.op is None:
            return f"the host ({acc.where}) {verb} {buffer}", buffer
        if acc.op.kind == OpKind.LET_GO:
            name = self.stream_name(acc.op.stream)
            return (f"{buffer} is let go (its last reference went: the memory pool of `{name}`, the stream it "
                    f"was allocated on, may give it to the next allocation there, and later work on `{name}` "
                    "may overwrite it)"), buffer
        replay = f" (replayed in a graph on `{self.stream_name(acc.replay)}`)" if acc.replay is not None else ""
        return f"{_describe(acc.op)} on `{self.stream_name(acc.op.stream)}`{replay} {verb} {buffer}", buffer

    def _race(self, first, second):
        what1, buffer = self._what(first)
        what2, _ = self._what(second)
        op1 = _describe(first.op) if first.op is not None else "the host's access"
        s1 = self.stream_name(first.thread) if first.thread != _HOST else None
        consequence = "and nothing orders the second after the first"
        headline = f"race on {buffer} ({first.span[0]} memory)"
        if first.thread == _HOST:           # a host function queued before the host's access
            fix = (f"queue {_describe(second.op)} after the host's access ({first.where}): work queued "
                   "before a host access is not ordered after it")
            return _error(headline, what1, what2, consequence, fix)
        if second.thread == _HOST and second.where == _LET_GO:
            fix = (f"keep a reference to {buffer} until `{s1}` is done with it: synchronise `{s1}` (or an "
                   f"event recorded after {op1} on it) before its last reference goes")
            return _error(headline, what1, what2, consequence, fix)
        if second.thread == _HOST:
            fix = (f"synchronise `{s1}` (or an event recorded after {op1} on it) before "
                   f"{second.where} touches {buffer}")
            return _error(headline, what1, what2, consequence, fix)
        s2 = self.stream_name(second.thread)
        if second.op is not None and second.op.kind == OpKind.LET_GO:
            fix = (f"keep a reference to {buffer} until `{s1}` is done with it: make `{s2}` wait for an event "
                   f"recorded after {op1} on `{s1}` (with `record` and `wait_event`), or synchronise `{s1}`, "
                   "before its last reference goes")
            return _error(headline, what1, what2, consequence, fix)
        # The events recorded on the first access's stream after it: waiting for any of them orders the second.
        after = [(e, order) for p, e, order in self.records.get(first.thread, []) if p >= first.clock]
        waited = self.waited.get(second.thread, {})
        early = [e for e, order in after if id(e) in waited and waited[id(e)][0] is e and waited[id(e)][1] < order]
        named = [e for e, _ in after if self.label_of(e)]
        if early:
            event = f"`{self.label_of(early[0])}`" if self.label_of(early[0]) else "the event"
            consequence += (f": `{s2}` waited for {event} before `{s1}` recorded it after {op1}, and "
                            "`wait_event` takes the event's latest record at the moment of the call, so that "
                            "wait was for an earlier record (or for nothing, if it had never been recorded)")
            fix = (f"queue the wait for {event} on `{s2}` after the record of {event} on `{s1}` "
                   f"and before {_describe(second.op)}")
        elif after:
            event = f"`{self.label_of(named[0])}`" if named else "the event"
            fix = f"make `{s2}` wait for {event} recorded after {op1} on `{s1}` (with `wait_event`)"
        else:
            fix = (f"record an event on `{s1}` after {op1} and make `{s2}` wait for it "
                   f"(with `record` and `wait_event`)")
            if self.host_sync_fixes:
                fix += f", or have the host synchronise `{s1}` first"
        return _error(headline, what1, what2, consequence, fix)


def _error(headline, what1, what2, consequence, fix):
    message = f"{headline}:\n  first:  {what1},\n  then:   {what2},\n  {consequence}.\n  Fix: {fix}."
    return RaceError(message, what1, what2, fix)


def _describe(op):
    level = None if op.level is None else int(op.level)
    if op.kind in COPY_KINDS:
        return f"the {op.kind} copy" + (f" of level {level}" if level is not None else "")
    if op.kind == OpKind.KERNEL:
        return f"the kernel `{op.name}`"
    if op.kind == OpKind.MEMSET:
        return "the fill"
    if op.kind == OpKind.HOST_FUNC:
        return f"the host function `{op.name}`"
    return f"the {op.kind} `{op.name}`"


@contextlib.contextmanager
def sanitize(names: dict[str, Any] | None = None, host_sync_fixes: bool = True,
             levels: bool = True) -> Iterator[Sanitizer]:
    """Check every operation queued inside the block for races; raise :class:`RaceError` at the first.

    ``names`` maps names to arrays, streams or events (or lists of them) so
    that messages can say ``U[2]``, ``images[5]``, ``io[0]`` or ``baked[1]``
    instead of "a 256x256 float32 device array", "io 0" or "the event".
    ``host_sync_fixes=False`` keeps a host synchronise out of the fixes it
    suggests (for a loop whose rules forbid host waits).
    Where copies' ``level=`` labels number the levels, a copy that reads a
    buffer a later level has overwritten is reported, ordered or not;
    ``levels=False`` takes the labels as labels only (as the exercise checks
    do, judging the data by its content).
    The check reasons about the program, not about timing: a missing
    dependency fails every time, on either backend. On a race, the work
    already queued is drained before the error leaves the block. Work queued
    by other threads while the block is open is checked too: a race found
    there is raised in that thread and again when the block ends (see the
    module text). The host's own reads and writes of pinned arrays inside the
    block are checked too, and arrays let go inside it (see the module text).

    Examples
    --------
    >>> with ch.sanitize(names={"stack": stack}):          # doctest: +SKIP
    ...     for k in range(nplanes):
    ...         ...
    """
    san = observe.add(Sanitizer(names, host_sync_fixes, levels), every_thread=True)
    try:
        yield san
        san.settle()                              # memory let go since the block's last call
    except BaseException:
        san.close()
        with contextlib.suppress(Exception):      # the original error matters more
            synchronize()
        raise
    finally:
        san.close()
    if san.race is not None and san.race[1] is not threading.current_thread():
        with contextlib.suppress(Exception):      # as above: the race is the news
            synchronize()
        raise san.race[0]                         # found in work another thread queued


def stop(san: Sanitizer | None) -> None:
    """Stop ``san`` (a sanitizer watching every thread); nothing when None."""
    if san is not None:
        san.close()
