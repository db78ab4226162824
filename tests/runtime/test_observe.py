"""The observer hook: who hears what, on which thread, and what it costs when nobody listens."""
import ast
import pathlib
import threading
import typing

import numpy as np
import pytest

import course_helper as ch
from course_helper.runtime import observe


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


def heard():
    """The notifications some observer, of any thread, listens for."""
    return {what for what in observe.NOTIFICATIONS if observe.hears(what)}


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
    assert heard() == set()


def test_nothing_stays_observing_after_a_traced_or_checked_solve(backend):
    """A traced solve (CUPTI or marks) and a sanitised one leave no observer behind: otherwise
    every later untraced call would pay for describing its work."""
    p = ch.WaveProblem(n0=40, n1=40, nt=12)
    for kwargs in ({"trace": True}, {"trace": True, "sanitize": True}, {"trace": False}):
        ch.solve(p, "events", **kwargs)
        assert heard() == set(), kwargs
        assert not observe.active()


class OpReader:
    def op_queued(self, op):
        pass


class WaitTimer:
    def host_waited(self, name, t0, t1):
        pass


def test_the_helper_knows_which_notifications_anyone_listens_for(stream):
    """Each notification is counted by the observers that have a method for it, so a call
    nobody listens for is skipped; Ops are wanted only where an observer of this thread reads them."""
    before = heard()
    log, waits, reader = Log(), WaitTimer(), OpReader()
    observe.add(log)
    observe.add(waits)
    try:
        assert heard() == before | {"event_recorded", "host_waited"}
        assert not observe.hears("op_queued")
        assert not observe.wants_ops()          # a trace timed by CUPTI is in this state: no Ops built
        observe.add(reader)
        assert observe.wants_ops()
        seen = []
        t = threading.Thread(target=lambda: seen.append(observe.wants_ops()))
        t.start()
        t.join(10)
        assert seen == [False]                  # another thread's reader does not make this one build Ops
    finally:
        for o in (log, waits, reader):
            observe.remove(o)
    assert heard() == before
    assert not observe.wants_ops()


def test_an_observer_is_uncounted_as_it_was_counted(stream):
    """What remove() uncounts is what add() counted, even if the observer grew a method since."""
    before = heard()
    log = Log()
    observe.add(log)
    log.host_waited = lambda *a: None
    observe.remove(log)
    assert heard() == before


def test_the_op_journal_holds_what_its_thread_queues_in_order(backend, stream):
    """With a journal open, each kernel and copy the helper queues from this thread appends
    (kind, label, stream, level, bytes), on either backend; another thread's work does not."""
    p = ch.WaveProblem(n0=16, n1=16, nt=4)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    host = ch.pinned_empty(p.shape)
    journal = observe.open_journal()
    try:
        with pytest.raises(RuntimeError, match="already keeps an op journal"):
            observe.open_journal()
        ch.launch_wave2d(U[0], U[1], U[2], V, p, 1, stream=stream)
        ch.copy_to_host_async(host, U[2], stream, level=3)
        t = threading.Thread(target=lambda: ch.launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=stream))
        t.start()
        t.join(30)
        stream.record()                     # an ordering step is not an operation
    finally:
        observe.close_journal()
    ch.copy_to_host_async(host, U[2], stream, level=3)   # after the close: not noted
    ch.synchronize()
    observe.close_journal()                 # a second close is harmless
    assert journal == [("kernel", "wave2d_4o level 3", stream, 3, 0), ("D2H", "D2H level 3", stream, 3, host.nbytes)]


# -- the GPU's unobserved path, exercised on the CPU ------------------------------------
class DirectRuntime:
    """Stands in for CuPy's side of the GPU runtime on the modelled one: ``needs_op`` False, and
    ``launch`` / ``copy_async`` (which only a runtime that needs no Op has) do the work at once in
    NumPy, with the arguments the helper passed, so a wrong argument gives a wrong answer."""

    def __init__(self, rt, monkeypatch):
        self.launches, self.copies, self.packs = [], [], []
        monkeypatch.setattr(rt, "needs_op", False)
        monkeypatch.setattr(rt, "launch", self.launch, raising=False)
        monkeypatch.setattr(rt, "pack_launch", self.pack_launch, raising=False)
        monkeypatch.setattr(rt, "copy_async", self.copy_async, raising=False)

    def launch(self, raw, kernel_for, grid, block, args):
        U0, U1, U2, V, n0, n1, dt2, idx0, idx1, p0, p1, amp = args
        assert U2.shape == (n0, n1)
        assert grid[0] * block[0] >= n1 > (grid[0] - 1) * block[0]       # every column, no block more
        assert grid[1] * block[1] >= n0 > (grid[1] - 1) * block[1]       # every row
        self.launches.append(grid)
        ch.wave._numpy_step(*(a.view(np.ndarray) for a in (U0, U1, U2, V)), dt2, idx0, idx1, p0, p1, amp)

    def pack_launch(self, raw, kernel_for, grid, block, args):
        """The GPU's packed launch, as a launch with ``args`` kept and the last one replaced."""
        direct = self

        class Packed:
            def serves(self, stream):
                return stream is raw

            def __call__(self, stream, last):
                direct.launch(stream, kernel_for, grid, block, (*args[:-1], last))
        self.packs.append(grid)
        return Packed()

    def copy_async(self, raw, kind, dst, src, host_ptr=None):
        host = dst if kind == "D2H" else src if kind == "H2D" else None
        assert host_ptr is None or host_ptr == host.ctypes.data
        self.copies.append(kind)
        np.copyto(dst.view(np.ndarray), src.view(np.ndarray))


@pytest.fixture
def direct(cpu, monkeypatch):
    return DirectRuntime(ch.runtime.get(), monkeypatch)


def test_unwatched_work_goes_straight_to_a_runtime_that_needs_no_op(direct):
    """With nobody reading Ops, launch_wave2d and the copies skip the Op and call the runtime's
    launch / copy_async themselves (the GPU's path): a whole loop run that way gives the reference."""
    p = ch.WaveProblem(n0=41, n1=37, nt=14)          # neither a multiple of its block side
    (s,) = ch.create_streams(1)
    assert not ch.runtime.wants_op(s)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    out = ch.pinned_empty((p.nt, *p.shape))
    for n in range(p.nt - 2):
        ch.launch_wave2d(U[n % 3], U[(n + 1) % 3], U[(n + 2) % 3], V, p, n, stream=s)
        ch.copy_to_host_async(out[n + 2], U[(n + 2) % 3], s, level=n + 2)
    out[:2] = 0
    np.testing.assert_array_equal(out, ch.reference_solution(p))
    assert len(direct.launches) == p.nt - 2 and direct.copies == ["D2H"] * (p.nt - 2)
    assert len(direct.packs) == 3                     # one packed launch per buffer set of the ring
    back = ch.device_zeros(p.shape)
    ch.memory.copy_to_device_async(back, out[5], s)
    ch.memory.copy_on_device_async(U[0], back, s)
    np.testing.assert_array_equal(ch.to_host(U[0]), out[5])
    assert direct.copies[-2:] == ["H2D", "D2D"]


def test_unwatched_work_is_noted_in_the_journal_and_an_op_reader_brings_the_ops_back(direct):
    p = ch.WaveProblem(n0=16, n1=16, nt=4)
    (s,) = ch.create_streams(1)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    host = ch.pinned_empty(p.shape)
    journal = observe.open_journal()
    try:
        ch.launch_wave2d(U[0], U[1], U[2], V, p, 1, stream=s)
        ch.copy_to_host_async(host, U[2], s, level=3)
    finally:
        observe.close_journal()
    assert journal == [("kernel", "wave2d_4o level 3", s, 3, 0), ("D2H", "D2H level 3", s, 3, host.nbytes)]
    assert len(direct.launches) == 1 and direct.copies == ["D2H"]
    reader = observe.add(OpReader())
    try:
        assert ch.runtime.wants_op(s)            # someone reads Ops: they are built and enqueued
        ch.launch_wave2d(U[0], U[1], U[2], V, p, 1, stream=s)
        ch.copy_to_host_async(host, U[2], s, level=3)
        s.synchronize()
    finally:
        observe.remove(reader)
    assert len(direct.launches) == 1 and direct.copies == ["D2H"]


@pytest.mark.parametrize("change", ["dt", "source", "fm", "td", "dx0"])
def test_a_prepared_launch_notices_a_problem_changed_after_it_was_prepared(direct, change):
    """The packed launch holds the problem's numbers and the amplitude table its steps: a change to
    the problem after a first loop is noticed at the next call, which prepares again, and the second
    loop gives the changed problem's reference."""
    p = ch.WaveProblem(n0=41, n1=37, nt=14)
    (s,) = ch.create_streams(1)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    prepared = [ch.wave.PreparedLaunch(U[n], U[(n + 1) % 3], U[(n + 2) % 3], V, p, s) for n in range(3)]
    out = ch.pinned_empty((p.nt, *p.shape))

    def loop():
        out[...] = 0
        for u in U:
            ch.memory.zero_async(u, s)
        for n in range(p.nt - 2):
            prepared[n % 3](n)
            ch.copy_to_host_async(out[n + 2], U[(n + 2) % 3], s, level=n + 2)
        s.synchronize()
        return out.copy()
    before = ch.reference_solution(p)
    np.testing.assert_array_equal(loop(), before)
    assert len(direct.packs) == 3
    setattr(p, change, {"dt": p.dt * 0.5, "source": (10, 12), "fm": p.fm * 2, "td": p.td * 0.5,
                        "dx0": p.dx0 * 1.5}[change])
    after = ch.reference_solution(p)
    assert not np.array_equal(after, before)
    np.testing.assert_array_equal(loop(), after)
    # Each position packed again, once; fm and td change only the amplitudes (not packed arguments).
    packs = 3 if change in ("fm", "td") else 6
    assert len(direct.packs) == packs
    np.testing.assert_array_equal(loop(), after)               # and then the packed path again
    assert len(direct.packs) == packs and len(direct.launches) == 3 * (p.nt - 2)


def test_a_prepared_launch_refuses_a_problem_grown_past_its_arrays(direct):
    """A change the prepared arrays no longer fit (the grid's size) is refused at the next call,
    with launch_wave2d's message, before anything is queued."""
    p = ch.WaveProblem(n0=41, n1=37, nt=14)
    (s,) = ch.create_streams(1)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    prepared = ch.wave.PreparedLaunch(U[0], U[1], U[2], ch.to_device(p.velocity), p, s)
    prepared(0)
    prepared(3)
    s.synchronize()
    launched = len(direct.launches) + len(direct.packs)
    p.n0 = 48
    with pytest.raises(ValueError, match=r"must be a C-contiguous float32 array of shape \(48, 37\)"):
        prepared(6)
    assert len(direct.launches) + len(direct.packs) == launched


def test_a_prepared_launch_queues_the_packed_launch_unwatched_and_launch_wave2d_watched(direct):
    """PreparedLaunch checks its arguments when it is made; unwatched, every call after the first
    goes to the packed launch with the amplitude of its own step; watched, each call is
    launch_wave2d's (an Op the model runs), and the loop still gives the reference."""
    p = ch.WaveProblem(n0=41, n1=37, nt=14)
    (s,) = ch.create_streams(1)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    with pytest.raises(ValueError, match="shape"):
        ch.wave.PreparedLaunch(U[0], U[1], U[2], V[1:], p, s)
    assert direct.launches == [] and direct.packs == []       # refused before anything was queued
    prepared = [ch.wave.PreparedLaunch(U[n], U[(n + 1) % 3], U[(n + 2) % 3], V, p, s) for n in range(3)]
    out = ch.pinned_empty((p.nt, *p.shape))
    out[:2] = 0
    reader = None
    for n in range(p.nt - 2):
        if n == 8:                                             # from here on, someone reads the Ops
            reader = observe.add(OpReader())
        prepared[n % 3](n)
        ch.copy_to_host_async(out[n + 2], U[(n + 2) % 3], s, level=n + 2)
    s.synchronize()
    observe.remove(reader)
    np.testing.assert_array_equal(out, ch.reference_solution(p))
    assert len(direct.packs) == 3 and len(direct.launches) == 8       # levels 2..9 by the runtime itself
    for u in U:                                                # again, unwatched: the steps' amplitudes
        ch.memory.zero_async(u, s)                             # are now read from the table
    for n in range(p.nt - 2):
        prepared[n % 3](n)
        ch.copy_to_host_async(out[n + 2], U[(n + 2) % 3], s, level=n + 2)
    s.synchronize()
    np.testing.assert_array_equal(out, ch.reference_solution(p))
    assert len(direct.packs) == 3 and len(direct.launches) == 8 + p.nt - 2
    with pytest.raises(ValueError, match="step number"):
        prepared[0](-1)                                        # outside the table: launch_wave2d's checks


# -- the Observer protocol: one list of notifications, and every callback and call true to it ----------
PACKAGE = pathlib.Path(observe.__file__).resolve().parent.parent


def _signature(fn):
    """``(parameters but self, each with its annotation as written; the return annotation)`` of a def."""
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return ([(a.arg, a.annotation and ast.unparse(a.annotation)) for a in args[1:]],
            fn.returns and ast.unparse(fn.returns))


def _protocol():
    tree = ast.parse(pathlib.Path(observe.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Observer")
    return {f.name: _signature(f) for f in cls.body if isinstance(f, ast.FunctionDef)}


def _package_trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text())


def test_the_protocol_is_the_one_list_of_notifications():
    assert tuple(_protocol()) == observe.NOTIFICATIONS
    assert typing.get_args(observe.Notification) == observe.NOTIFICATIONS
    for name in observe.NOTIFICATIONS:
        assert getattr(observe.Observer, name).__doc__, f"Observer.{name} has no docstring"


def test_every_observer_method_of_the_package_has_the_protocol_s_signature():
    declared, found = _protocol(), []
    for path, tree in _package_trees():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name != "Observer"):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in declared and _signature(fn) != declared[fn.name]:
                    found.append(f"{path}:{fn.lineno} {cls.name}.{fn.name}{_signature(fn)}, "
                                 f"declared {declared[fn.name]}")
    assert not found, "\n".join(found)


def test_every_notification_sent_is_declared_with_as_many_arguments():
    declared, found, sent = _protocol(), [], set()
    for path, tree in _package_trees():
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in ("notify", "hears") or not call.args:
                continue
            what = call.args[0]
            if not (isinstance(what, ast.Constant) and what.value in declared):
                found.append(f"{path}:{call.lineno} {ast.unparse(call)}: not a notification of observe.Observer")
            elif name == "notify":
                sent.add(what.value)
                if len(call.args) - 1 != len(declared[what.value][0]):
                    found.append(f"{path}:{call.lineno} {ast.unparse(call)}: Observer.{what.value} takes "
                                 f"{[p for p, _ in declared[what.value][0]]}")
    assert not found, "\n".join(found)
    assert sent == set(declared), f"declared but never sent: {set(declared) - sent}"
