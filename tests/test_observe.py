"""The observer hook: who hears what, on which thread, and what it costs when nobody listens."""
import threading

import pytest

import course_helper as ch
from course_helper import observe


class Log:
    def __init__(self):
        self.heard = []

    def event_recorded(self, stream, event):
        self.heard.append(("recorded", stream.name))


class Quitter(Log):
    """Removes itself on the first notification it hears."""

    def event_recorded(self, stream, event):
        super().event_recorded(stream, event)
        observe.remove(self)


@pytest.fixture
def stream(backend):
    return ch.create_streams(1, name="s")[0]


def test_an_observer_added_later_hears_what_follows(stream):
    first, second = Log(), Log()
    observe.add(first)
    try:
        stream.record()
        observe.add(second)          # after notify has already looked up the methods once
        stream.record()
    finally:
        observe.remove(first)
        observe.remove(second)
    stream.record()                  # nobody listens any more
    assert first.heard == [("recorded", "s")] * 2
    assert second.heard == [("recorded", "s")]
    assert not observe.watching()


def test_an_observer_may_remove_itself_while_notified(stream):
    quitter, log = Quitter(), Log()
    observe.add(quitter)
    observe.add(log)
    try:
        stream.record()
        stream.record()
    finally:
        observe.remove(log)
    assert quitter.heard == [("recorded", "s")]        # heard the first, not the second
    assert log.heard == [("recorded", "s")] * 2        # the others still hear the first one


def test_observers_of_another_thread_hear_nothing_of_this_one(stream):
    log = Log()
    added, done = threading.Event(), threading.Event()

    def other():
        observe.add(log)
        added.set()
        done.wait(10)
        observe.remove(log)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert added.wait(10)
        assert not observe.watching()   # someone watches in the process, not on this thread
        stream.record()
    finally:
        done.set()
        t.join(10)
    assert log.heard == []
    assert observe.observer_count == 0


def test_nothing_stays_observing_after_a_traced_or_checked_solve(backend):
    """A traced solve (CUPTI or marks) and a sanitised one leave no observer behind: otherwise
    every later untraced call would pay for describing its work."""
    p = ch.WaveProblem(n0=40, n1=40, nt=12)
    for kwargs in ({"trace": True}, {"trace": True, "sanitize": True}, {"trace": False}):
        ch.solve(p, "events", **kwargs)
        assert observe.observer_count == 0, kwargs
        assert not observe.active()
