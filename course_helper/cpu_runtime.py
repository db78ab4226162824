"""A tiny stream-and-event runtime for the CPU backend.

It mirrors the parts of the CUDA runtime the course uses, with the same
semantics, so that code written against ``course_helper`` behaves the same
with or without a GPU:

* a stream is a FIFO of work run in order by its own worker thread, so work on
  two streams really runs at the same time (NumPy releases the GIL for large
  copies and array arithmetic);
* an event completes when the work queued on its stream before the record has
  run; ``wait_event`` makes a stream's worker wait for it;
* the *legacy default stream* waits for all earlier work on blocking streams,
  and blocking streams wait for earlier work on the default stream, exactly as
  CUDA's null stream does; non-blocking streams skip that implicit ordering;
* an exception raised by queued work is stored and raised again, with its
  original traceback, at the next synchronisation on the caller's thread.

The object names follow CuPy (``record``, ``wait_event``, ``synchronize``,
``done``) so that :mod:`course_helper.streams` wraps both in the same way.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref

_STOP = object()
_clock = time.perf_counter


class Token:
    """Completion flag of one queued task: set when the worker has passed it."""

    __slots__ = ("_flag", "time", "error")

    def __init__(self):
        self._flag = threading.Event()
        self.time = None      # worker clock when the task finished (seconds)
        self.error = None     # the stream's stored exception, if it had failed

    def set(self, error=None):
        self.time = _clock()
        self.error = error
        self._flag.set()

    def is_set(self):
        return self._flag.is_set()

    def wait(self, timeout=None):
        return self._flag.wait(timeout)


class _WorkerState:
    """What the worker thread shares with its stream (no reference back to it)."""

    def __init__(self):
        self.error = None
        self.lock = threading.Lock()


def _worker(tasks: queue.SimpleQueue, state: _WorkerState):
    while True:
        item = tasks.get()
        if item is _STOP:
            return
        fn, token = item
        with state.lock:
            failed = state.error
        if fn is not None and failed is None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - stored and re-raised on the caller
                with state.lock:
                    state.error = failed = exc
        token.set(failed)


# Live blocking streams, so the default stream can order itself after them.
_blocking_streams: "weakref.WeakSet[CpuStream]" = weakref.WeakSet()
_registry_lock = threading.Lock()


class CpuStream:
    """An in-order queue of work executed by one daemon worker thread."""

    def __init__(self, non_blocking=True, priority=0, name="stream", legacy_default=False):
        self.non_blocking = bool(non_blocking)
        self.priority = priority
        self.legacy_default = legacy_default
        self._tasks = queue.SimpleQueue()
        self._state = _WorkerState()
        self._last = None            # token of the most recently queued task
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(
            target=_worker, args=(self._tasks, self._state),
            name=f"course_helper-{name}", daemon=True)
        self._thread.start()
        # Stop the worker when the stream is garbage-collected or at exit.
        self._finalizer = weakref.finalize(self, self._tasks.put, _STOP)
        if not self.non_blocking and not legacy_default:
            with _registry_lock:
                _blocking_streams.add(self)

    # -- queueing ---------------------------------------------------------
    def _implicit_waits(self):
        """Tokens this stream must wait for under the legacy default-stream rules."""
        if self.legacy_default:
            with _registry_lock:
                others = list(_blocking_streams)
            return [s._last for s in others if s._last is not None]
        if not self.non_blocking:
            last = default_stream()._last
            return [last] if last is not None else []
        return []

    def submit(self, fn=None):
        """Queue ``fn`` (or a marker when ``fn`` is None); return its token."""
        token = Token()
        with self._submit_lock:
            for waited in self._implicit_waits():
                self._tasks.put((waited.wait, Token()))
            self._tasks.put((fn, token))
            self._last = token
        return token

    # -- the CuPy-like surface ------------------------------------------
    def wait_event(self, event):
        """Later work on this stream waits for ``event``'s most recent record."""
        token = event._token
        if token is not None:           # a never-recorded event is already complete
            self.submit(token.wait)

    def record(self, event=None):
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    @property
    def done(self):
        last = self._last
        return last is None or last.is_set()

    def synchronize(self):
        last = self._last
        if last is not None:
            last.wait()
        self.raise_pending()

    def raise_pending(self):
        """Raise (once) the exception a task on this stream stored, if any."""
        with self._state.lock:
            exc, self._state.error = self._state.error, None
        if exc is not None:
            raise exc.with_traceback(exc.__traceback__)

    def close(self):
        """Stop the worker after the work already queued (idempotent)."""
        self._finalizer()

    @property
    def alive(self):
        return self._thread.is_alive()


class CpuEvent:
    """Marks a point in a stream; complete when the work before it has run."""

    def __init__(self, timing=False):
        self.timing = bool(timing)
        self._token = None

    def record(self, stream=None):
        stream = stream if stream is not None else default_stream()
        self._token = stream.submit(None)

    @property
    def done(self):
        return self._token is None or self._token.is_set()

    def synchronize(self):
        if self._token is None:
            return
        self._token.wait()
        if self._token.error is not None:
            err = self._token.error
            raise err.with_traceback(err.__traceback__)

    @property
    def time(self):
        return None if self._token is None else self._token.time


def get_elapsed_time(start: CpuEvent, end: CpuEvent) -> float:
    """Milliseconds between two completed timing events (worker clock)."""
    return (end.time - start.time) * 1e3


_default = None
_default_lock = threading.Lock()


def default_stream() -> CpuStream:
    """The CPU backend's legacy default stream (created on first use)."""
    global _default
    with _default_lock:
        if _default is None or not _default.alive:
            _default = CpuStream(non_blocking=False, name="default", legacy_default=True)
        return _default
