"""Where a Ctrl-C may land: the course's code that must not be cut in half holds it.

Python runs a SIGINT's handler (by default: raise ``KeyboardInterrupt``) in the main thread,
between any two bytecodes. Most of the course's code does not mind where that is. Some does: the
modelled device's bookkeeping (a task half moved from a lane's queue to its running slot would
leave that lane stuck, and the next run waiting for work that can never finish), a halo
exchange whose receives are posted into buffers a ``KeyboardInterrupt`` would let go, a store's
writer threads half stopped. Two blocks keep a Ctrl-C out of such code:

* :func:`deferred`: a Ctrl-C inside waits for the next *safe point*, a place where the code
  inside the block calls :func:`deliver` (the modelled device's loop between two tasks, a rank's
  loop between two levels), or for the end of the block, and is raised there;
  inside it, :func:`at_once` marks code that a Ctrl-C may stop anywhere (a learner's host
  function, which may never return).
* :func:`held`: a Ctrl-C inside is raised only at the end of the block, so that a clean-up runs
  to its end (threads stopped, a store's state written); not at all if the block ends with an
  exception already (the one that stopped the run says more). Inside it, :func:`Held.stoppable`
  marks a wait that a Ctrl-C may stop at its safe points.

Each block puts its own SIGINT handler in place and gives the signal, when it raises it, to the
handler that was there before (Python's, or a program's own), so blocks nest. Only the main
thread can set signal handlers, and only there does Python run them: in any other thread, and
where the SIGINT handler is not a Python function (ignored, or the system's default), the blocks
change nothing.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any, Callable

__all__ = ["Held", "at_once", "deferred", "deliver", "held", "stoppable"]


class _Deferral:
    """The state of the outermost :func:`deferred` block (there is at most one: the main thread's)."""

    def __init__(self) -> None:
        self.previous: Callable[..., Any] | None = None   # the handler the block replaced; None: no block
        self.pending: list[tuple[int, Any]] = []          # (signum, frame) of a Ctrl-C not raised yet
        self.at_once = 0                                  # inside at_once(): raise at once

    def handle(self, signum: int, frame: Any) -> None:
        """The block's SIGINT handler: note the Ctrl-C, or pass it on at once inside :func:`at_once`."""
        if self.at_once and self.previous is not None:
            self.previous(signum, frame)
        elif not self.pending:
            self.pending.append((signum, frame))       # one Ctrl-C pending is enough

    def deliver(self) -> None:
        """Give a pending Ctrl-C to the handler the block replaced (which raises, as a rule)."""
        if self.pending and self.previous is not None:
            signum, frame = self.pending.pop()
            self.previous(signum, frame)


_deferral = _Deferral()


def _python_handler() -> Callable[..., Any] | None:
    """The SIGINT handler now in place when this thread may replace it (the main thread, with a
    Python function there), else None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    current = signal.getsignal(signal.SIGINT)
    return current if callable(current) else None


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A Ctrl-C inside the block is raised at the next :func:`deliver` inside it, or at its end.

    Cheap when nested (the outermost block alone swaps the handler) and outside the main
    thread (nothing to do)."""
    if _deferral.previous is not None and threading.current_thread() is threading.main_thread():
        yield                                           # inside an outer block: it delivers
        return
    previous = _python_handler()
    if previous is None:
        yield
        return
    _deferral.previous, _deferral.pending = previous, []
    signal.signal(signal.SIGINT, _deferral.handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _deferral.previous = None
        pending, _deferral.pending = _deferral.pending, []
        if pending:
            previous(*pending[0])                       # raised here, once the block has ended


def deliver() -> None:
    """A safe point: raise a Ctrl-C that came inside the enclosing :func:`deferred` block (nothing
    outside one, or in another thread)."""
    if (_deferral.pending and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) == _deferral.handle):   # (not inside a held() block)
        _deferral.deliver()


@contextlib.contextmanager
def at_once() -> Iterator[None]:
    """Inside a :func:`deferred` block, code that a Ctrl-C may stop anywhere (it is raised at once):
    the learner's own Python, which may never return."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferral.at_once += 1
    try:
        yield
    finally:
        _deferral.at_once -= 1


class Held:
    """What :func:`held` yields: the Ctrl-Cs it holds, and :meth:`stoppable` waits."""

    def __init__(self) -> None:
        self.count = 0                   # Ctrl-Cs that came inside the block
        self.passed = 0                  # of those, the ones a stoppable wait raised
        self.previous: Callable[..., Any] | None = None   # the handler the block replaced
        self._stoppable = 0              # inside stoppable(): a Ctrl-C is passed on

    def handle(self, signum: int, frame: Any) -> None:
        """The block's SIGINT handler: hold the Ctrl-C, or pass it on inside :meth:`stoppable`."""
        self.count += 1
        if self._stoppable and self.previous is not None:
            self.passed += 1
            self.previous(signum, frame)

    @contextlib.contextmanager
    def stoppable(self) -> Iterator[None]:
        """A wait inside the block that a Ctrl-C stops: a Ctrl-C that comes during the wait is
        raised at the wait's next safe point (:func:`deliver`; at once, outside a :func:`deferred`
        block). The caller catches it and goes on with its clean-up."""
        self._stoppable += 1
        try:
            yield
        finally:
            self._stoppable -= 1


_holding: list[Held] = []       # the main thread's held() blocks, innermost last


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """:meth:`Held.stoppable` of the innermost :func:`held` block (nothing outside one)."""
    if _holding and threading.current_thread() is threading.main_thread():
        with _holding[-1].stoppable():
            yield
    else:
        yield


@contextlib.contextmanager
def held(raise_at_end: bool = True) -> Iterator[Held]:
    """Hold every Ctrl-C that comes inside the block, and raise one at its end, unless the block
    ends with an exception (that exception goes on, and says more) or ``raise_at_end`` is False
    (the caller's block is already ending with one). For a clean-up that must run to its end; see
    :meth:`Held.stoppable` for a wait inside it that a Ctrl-C may stop."""
    state = Held()
    previous = _python_handler()
    if previous is None:
        yield state
        return
    state.previous = previous
    signal.signal(signal.SIGINT, state.handle)
    _holding.append(state)
    raised = True
    try:
        yield state
        raised = False
    finally:
        _holding.pop()
        signal.signal(signal.SIGINT, previous)
        if state.count > state.passed and raise_at_end and not raised:
            previous(signal.SIGINT, None)               # the Ctrl-C, now that the clean-up is done
