"""Who watches the device work: observers of what the runtime queues.

Every operation the helper queues (a kernel, a copy, a fill) and every
ordering step (an event record, a stream waiting on an event, a host wait)
is announced here, *after* it has been checked and *as* it is queued. The
timeline recorder and the race sanitizer are observers: they look at the
program, they never run it.

Observers belong to the thread that added them, so a trace opened in one
thread never sees work queued by another; an observer added with
``every_thread=True`` (the race sanitizer) hears every thread's work instead.

An observer is any object; it receives the notifications of :class:`Observer`, the one list
of them with their signatures, for which it has a method of the same name (all are
optional). Each observer method in the package is written with the signature declared there
(``tests/runtime/test_observe.py`` compares them), and each :func:`notify` names one of them.

The op journal
--------------
A recording timed by CUPTI needs to know no more of each operation than its
kind, label, stream, level and bytes, in the order they were queued: the
driver times the work itself. For it a thread may keep an *op journal*
(:func:`open_journal`), a list to which every operation the helper queues in
that thread appends ``(kind, name, stream, level, nbytes)``, also where no
:class:`Op` is built because no observer reads one. An append costs a
fraction of an observer call, and a traced loop queues a few operations per
time level.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import numpy as np

    from ..graphs import Graph
    from ..streams import Event, Stream
    from .ops import OpKind

__all__ = ["Op", "Observer", "Notification", "add", "remove", "active", "notify", "hears", "watching", "wants_ops",
           "open_journal", "close_journal", "journaling", "note_op", "NOTIFICATIONS"]


class Observer(Protocol):
    """Every notification an observer may hear, with what it is given: the one place they are
    listed. An observer defines the methods it wants, with these signatures, and leaves out the
    rest (the bus calls only what an observer has); the helper announces each with
    :func:`notify`, naming it."""

    def op_queued(self, op: Op) -> None:
        """An :class:`Op` is being queued on ``op.stream`` (announced just before the runtime queues it)."""

    def op_issued(self, op: Op) -> None:
        """The runtime has queued ``op`` (the timeline recorder brackets it with ``op_queued``)."""

    def event_recorded(self, stream: Stream, event: Event) -> None:
        """``event`` was recorded at the current end of ``stream``."""

    def event_waited(self, stream: Stream, event: Event) -> None:
        """Later work on ``stream`` waits for ``event``'s latest record."""

    def host_synced(self, target: Stream | Event | None) -> None:
        """The host waited for ``target``: a Stream, an Event, or None (the whole device)."""

    def host_waited(self, name: str, t_start_ms: float, t_end_ms: float) -> None:
        """A host wait on a stream or an event (``name`` labels it on timelines) lasted from
        ``t_start_ms`` to ``t_end_ms`` of the runtime's host clock (modelled on the CPU backend)."""

    def host_access(self, array: np.ndarray, mode: str, where: str) -> None:
        """The host reads (``mode="r"``) or writes (``"w"``) the host array ``array``: the helper's
        own host code, or (while a race sanitizer watches) any code touching a pinned array
        (:mod:`course_helper.host_watch`); ``where`` names the caller (for messages)."""

    def host_func_queued(self, stream: Stream, token: object) -> None:
        """A host function was queued on ``stream``; ``token`` tells it from other queued ones. What
        it touches belongs to that point of its stream, not to the host's."""

    def host_func_started(self, token: object) -> None:
        """The host function ``token`` began running."""

    def host_func_ended(self, token: object) -> None:
        """The host function ``token`` ended."""

    def device_allocated(self, array: object, stream: Stream) -> None:
        """A new device array, from the memory pool of ``stream`` (the current stream at
        allocation, as in CuPy's pool)."""

    def capture_started(self, stream: Stream) -> None:
        """A CUDA graph capture on ``stream`` began."""

    def capture_ended(self, stream: Stream, graph: Graph | None) -> None:
        """The capture on ``stream`` ended, with its ``graph`` (None when it failed)."""

    def graph_launched(self, graph: Graph, stream: Stream) -> None:
        """A captured ``graph`` was replayed on ``stream``."""


#: Every notification an observer may have a method for: the methods of :class:`Observer`.
NOTIFICATIONS = tuple(name for name in vars(Observer) if not name.startswith("_"))
#: The name of a notification, as :func:`notify` and :func:`hears` take it (a type checker
#: refuses a name that is not one; kept equal to :data:`NOTIFICATIONS` by the tests).
Notification = Literal["op_queued", "op_issued", "event_recorded", "event_waited", "host_synced", "host_waited",
                       "host_access", "host_func_queued", "host_func_started", "host_func_ended",
                       "device_allocated", "capture_started", "capture_ended", "graph_launched"]


@dataclass(eq=False, slots=True)
class Op:
    """One queued operation, as the observers see it.

    ``reads`` and ``writes`` hold the arrays (views included) the operation
    reads and writes, so an observer can tell which operations touch
    overlapping memory.
    """
    kind: OpKind                   # what it is: a kernel, a copy (D2H, H2D, D2D), a fill, a halo exchange
    name: str                      # label on timelines, e.g. "wave2d_4o level 12"
    stream: object                 # the course_helper Stream it was queued on
    level: int | None = None       # time level (or layer) it belongs to, if any
    nbytes: int = 0                # bytes moved (copies, fills)
    reads: tuple = ()
    writes: tuple = ()


class _ThreadState(threading.local):
    """Per-thread state; a class attribute is each new thread's starting value."""
    observers = None     # the thread's observers (a list once one was added)
    methods = None       # notification -> the observers' bound methods; None while there are none
    heard = None         # id(observer) -> the notifications add() counted for it
    journal = None       # the thread's op journal (see open_journal), or None


_local = _ThreadState()
_lock = threading.Lock()
#: Observers of all threads together.
_observer_count = 0
#: notification -> how many observers, of all threads together, have a method for it. Most runs
#: have none at all; then :func:`hears` and :func:`notify` answer from this table without reaching
#: into thread-local state (a GPU loop's host cost is counted in microseconds per level).
_listening = dict.fromkeys(NOTIFICATIONS, 0)
#: notification -> the bound methods of the observers that hear every thread (add(every_thread=True)).
_everywhere = {}
_everywhere_observers = []


def _heard_by(observer):
    return tuple(what for what in NOTIFICATIONS if callable(getattr(observer, what, None)))


def _observers():
    obs = _local.observers
    if obs is None:
        obs = _local.observers = []
    return obs


def _changed(obs):
    """This thread's observers changed: forget the methods :func:`notify` looked up for them."""
    _local.methods = {} if obs else None


def add(observer: object, every_thread: bool = False) -> object:
    """Start sending this thread's runtime notifications to ``observer`` (with ``every_thread``,
    those of every thread, until :func:`remove`)."""
    global _observer_count
    if every_thread:
        return _add_everywhere(observer)
    obs = _observers()
    if observer not in obs:
        heard = _heard_by(observer)
        with _lock:
            obs.append(observer)
            _observer_count += 1
            for what in heard:
                _listening[what] += 1
        _local.heard = {**(_local.heard or {}), id(observer): heard}
        _changed(obs)
    return observer


def _add_everywhere(observer):
    global _observer_count, _everywhere
    with _lock:
        if observer not in _everywhere_observers:
            _everywhere_observers.append(observer)
            _observer_count += 1
            for what in _heard_by(observer):
                _listening[what] += 1
            _everywhere = _methods_of(_everywhere_observers)
    return observer


def _methods_of(observers):
    return {what: tuple(getattr(o, what) for o in observers if what in _heard_by(o)) for what in NOTIFICATIONS}


def remove(observer: object) -> None:
    """Stop sending notifications to ``observer`` (no error if it was not added)."""
    global _observer_count, _everywhere
    with _lock:
        if observer in _everywhere_observers:
            _everywhere_observers.remove(observer)
            _observer_count -= 1
            for what in _heard_by(observer):
                _listening[what] -= 1
            _everywhere = _methods_of(_everywhere_observers)
            return
    obs = _observers()
    if observer in obs:
        heard = _local.heard.pop(id(observer))     # what add() counted, whatever changed since
        with _lock:
            obs.remove(observer)
            _observer_count -= 1
            for what in heard:
                _listening[what] -= 1
        _changed(obs)


def active() -> list:
    """The observers of the calling thread (a copy)."""
    return list(_observers())


def watching() -> bool:
    """True when the calling thread has observers (cheap: the helper asks before describing work)."""
    return _observer_count != 0 and (bool(_local.observers) or bool(_everywhere_observers))


def hears(what: Notification) -> bool:
    """True when some observer, of any thread, has a method for the notification ``what``: the
    helper asks before it reads a clock or builds what only an observer would read."""
    return _listening[what] != 0


def wants_ops() -> bool:
    """True when an observer of the calling thread reads :class:`Op` descriptions (it has
    ``op_queued`` or ``op_issued``); otherwise work is queued without one (and only noted in
    the thread's op journal, where it keeps one)."""
    if not (_listening["op_queued"] or _listening["op_issued"]):
        return False
    return bool(_methods("op_queued") or _methods("op_issued")
                or _everywhere.get("op_queued") or _everywhere.get("op_issued"))


def _methods(what):
    """The bound methods ``what`` of this thread's observers (looked up once while they stay the same)."""
    methods = _local.methods       # notification -> the observers' bound methods
    if methods is None:            # this thread has no observers
        return ()
    called = methods.get(what)
    if called is None:
        called = methods[what] = tuple(m for m in (getattr(o, what, None) for o in _local.observers)
                                       if m is not None)
    return called


def notify(what: Notification, *args: object) -> None:
    """Call ``observer.<what>(*args)`` on every observer of this thread, then on every observer
    of all threads, that has it; ``args`` are those of :class:`Observer`'s method ``what``."""
    if not _listening[what]:       # the common case: no observer anywhere has it, nothing to do
        return
    for method in _methods(what):  # a tuple: an observer may remove itself while being called
        method(*args)
    if _everywhere_observers:
        for method in _everywhere.get(what, ()):
            method(*args)


# --------------------------------------------------------------------------
# The op journal (see the module text)
# --------------------------------------------------------------------------
def open_journal() -> list:
    """Start the calling thread's op journal and return it: an empty list to which each
    operation the helper queues from this thread appends ``(kind, name, stream, level, nbytes)``
    until :func:`close_journal`. A thread keeps one journal at a time."""
    if _local.journal is not None:
        raise RuntimeError("this thread already keeps an op journal (one recording at a time)")
    journal = _local.journal = []
    return journal


def close_journal() -> None:
    """Stop the calling thread's op journal (no error if it keeps none); the list keeps what it holds."""
    _local.journal = None


def journaling() -> bool:
    """True when the calling thread keeps an op journal: callers ask before they build an
    operation's label, which is all a journal needs and nothing else reads."""
    return _local.journal is not None


def note_op(kind: OpKind, name: str, stream: object, level: int | None, nbytes: int) -> None:
    """Append a queued operation to the calling thread's op journal, where it keeps one."""
    journal = _local.journal
    if journal is not None:
        journal.append((kind, name, stream, level, nbytes))
