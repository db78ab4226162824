"""The race sanitizer: vector-clock rules on hand-built sequences, and mutants of the
lesson's loops (each with one dependency removed) that must all be caught."""
import ast
import dataclasses
import inspect
import textwrap
import threading

import numpy as np
import pytest

import course_helper as ch
from course_helper.runtime import observe
from course_helper import solver, strategies
from course_helper.sanitizer import Sanitizer

PROBLEM = dict(n0=24, n1=24, nt=24)


# --------------------------------------------------------------------------
# Hand-built sequences: the rules of happens-before, one at a time
# --------------------------------------------------------------------------
class FakeStream(ch.streams.Stream):
    """A stream as the sanitizer sees it (its class, name and ordering), with no runtime behind it."""

    def __init__(self, name, blocking=False, is_default=False):     # not the Stream's: no runtime
        self.name, self.blocking, self.is_default = name, blocking, is_default


class FakeEvent:
    pass


def op(stream, reads=(), writes=(), kind="kernel", level=None):
    return observe.Op(kind, f"{kind} {level}", stream, level, 0, tuple(reads), tuple(writes))


@pytest.fixture
def world():
    buf = np.zeros((4, 8), np.float32).view(ch.memory.CpuDeviceArray)
    host = np.zeros((4, 8), np.float32)
    san = Sanitizer({"buf": buf, "host": host})
    return san, buf, host, FakeStream("a"), FakeStream("b")


def test_same_stream_is_ordered(world):
    san, buf, _, a, _ = world
    san.op_queued(op(a, writes=[buf]))
    san.op_queued(op(a, reads=[buf]))
    san.op_queued(op(a, writes=[buf]))


def test_two_streams_writing_one_buffer_race(world):
    san, buf, _, a, b = world
    san.op_queued(op(a, writes=[buf]))
    with pytest.raises(ch.RaceError, match="race on buf") as info:
        san.op_queued(op(b, reads=[buf]))
    assert "record an event on `a`" in str(info.value) and "make `b` wait for it" in str(info.value)


def test_reads_on_two_streams_do_not_race(world):
    san, buf, _, a, b = world
    san.op_queued(op(a, reads=[buf]))
    san.op_queued(op(b, reads=[buf]))


def test_disjoint_views_do_not_race_overlapping_views_do(world):
    san, buf, _, a, b = world
    san.op_queued(op(a, writes=[buf[:2]]))
    san.op_queued(op(b, writes=[buf[2:]]))
    with pytest.raises(ch.RaceError):
        san.op_queued(op(b, reads=[buf[1:3, ::2]]))      # strided view reaching into rows of `a`


def test_host_and_device_are_different_address_spaces(world):
    san, buf, host, a, b = world
    host_alias = buf.view(np.ndarray)                   # same bytes, but tagged as host memory
    san.op_queued(op(a, writes=[buf]))
    san.op_queued(op(b, writes=[host_alias]))


def test_a_later_record_does_not_order_an_earlier_wait(world):
    san, buf, _, a, b = world
    e = FakeEvent()
    san.event_recorded(a, e)                            # recorded before the write
    san.event_waited(b, e)
    san.op_queued(op(a, writes=[buf]))
    san.event_recorded(a, e)                            # re-recorded after: too late for b's wait
    with pytest.raises(ch.RaceError):
        san.op_queued(op(b, reads=[buf]))


def test_event_wait_ordering(world):
    san, buf, _, a, b = world
    e = FakeEvent()
    san.op_queued(op(a, writes=[buf]))
    san.event_recorded(a, e)
    san.event_waited(b, e)
    san.op_queued(op(b, reads=[buf]))
    with pytest.raises(ch.RaceError, match="make `a` wait|record an event on `b`"):
        san.op_queued(op(a, writes=[buf]))              # a does not wait for b's read


def test_host_synchronise_of_stream_event_and_device(world):
    san, buf, _, a, b = world
    for sync in (lambda: san.host_synced(a), lambda: san.host_synced(None)):
        san.op_queued(op(a, writes=[buf]))
        sync()
        san.op_queued(op(b, writes=[buf]))              # queued after the host saw `a` finish
        san.host_synced(b)
    e = FakeEvent()
    san.op_queued(op(a, writes=[buf]))
    san.event_recorded(a, e)
    san.host_synced(e)
    san.op_queued(op(b, writes=[buf]))


def test_host_access_of_a_buffer_a_pending_copy_writes(world):
    san, _, host, a, _ = world
    san.op_queued(op(a, writes=[host[1]], kind="D2H", level=3))
    with pytest.raises(ch.RaceError, match="synchronise `a`") as info:
        san.host_access(host, "r", "the checker")
    assert "the host (the checker) reads host" in str(info.value)


def test_host_access_after_synchronise_is_fine(world):
    san, _, host, a, _ = world
    san.op_queued(op(a, writes=[host[1]], kind="D2H", level=3))
    san.host_synced(a)
    san.host_access(host, "r", "the checker")


def test_legacy_default_stream_orders_blocking_streams_not_non_blocking(world):
    san, buf, _, a, _ = world
    default = FakeStream("default", blocking=True, is_default=True)
    blocking = FakeStream("blocking", blocking=True)
    san.op_queued(op(blocking, writes=[buf]))
    san.op_queued(op(default, writes=[buf]))            # waits for the blocking stream
    san.op_queued(op(blocking, writes=[buf]))           # waits for the default stream
    with pytest.raises(ch.RaceError):
        san.op_queued(op(a, writes=[buf]))              # non-blocking: no implicit order


def test_graph_capture_edges_and_replay(world):
    san, buf, _, a, b = world
    fork, join, graph = FakeEvent(), FakeEvent(), object()
    san.capture_started(a)
    san.op_queued(op(a, writes=[buf]))
    san.event_recorded(a, fork)
    san.event_waited(b, fork)
    san.op_queued(op(b, reads=[buf]))                   # captured fork: ordered by the event
    san.event_recorded(b, join)
    san.event_waited(a, join)
    san.capture_ended(a, graph)
    san.graph_launched(graph, a)
    san.op_queued(op(a, reads=[buf]))                   # after the whole replay on `a`
    with pytest.raises(ch.RaceError, match="replayed in a graph"):
        san.op_queued(op(b, writes=[buf]))              # `b` outside the graph is not ordered


def test_a_race_inside_a_capture_is_found(world):
    san, buf, _, a, b = world
    san.capture_started(a)
    san.op_queued(op(a, writes=[buf]))
    with pytest.raises(ch.RaceError):
        san.op_queued(op(b, reads=[buf]))


def test_copy_of_an_overwritten_level(world):
    san, buf, host, a, _ = world
    san.op_queued(op(a, writes=[buf], level=7))
    with pytest.raises(ch.RaceError, match="no longer holds level 4"):
        san.op_queued(op(a, reads=[buf], writes=[host], kind="D2H", level=4))


def test_messages_print_plain_numbers(world):
    san, buf, _, a, b = world
    san.op_queued(op(a, writes=[buf], kind="D2D", level=np.int64(37)))
    with pytest.raises(ch.RaceError) as info:
        san.op_queued(op(b, reads=[buf]))
    assert "level 37" in str(info.value) and "np.int64" not in str(info.value)


# --------------------------------------------------------------------------
# The lesson's loops
# --------------------------------------------------------------------------
LOOPS = [name for name, entry in solver.STRATEGIES.items() if not entry.graph]   # graphs capture these same loops
ORDERING_CALLS = ("wait_event", "record", "synchronize")


def solve_kwargs(name, nscratch=None):
    kw = dict(trace=False, sanitize=True, nscratch=nscratch)
    if name in ("staged", "graph-staged"):
        kw.update(nstaging=2, batch=2)                  # the staging ring wraps several times
    return kw


def depths(name):
    """The scratch depths a loop is checked at: the default, and the documented minimum where the
    loop takes a chosen depth (an off-by-one ring index is safe in a deep ring, not at the minimum)."""
    entry = solver.STRATEGIES[name]
    return [None] if entry.max_nscratch is not None else [None, entry.min_nscratch]


def mutants(name):
    """Every variant of the loop ``name`` with one ordering line (a record, a wait_event or a
    host synchronize) replaced by ``pass``: ``(description, loop)`` pairs."""
    fn = solver.STRATEGIES[name].loop
    source = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(source)
    lines = [node for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
             and getattr(node.value.func, "attr", getattr(node.value.func, "id", None)) in ORDERING_CALLS]
    out = []
    for target in lines:
        mutated = ast.parse(source)
        for node in ast.walk(mutated):
            for field in ("body", "orelse"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    for i, stmt in enumerate(block):
                        if isinstance(stmt, ast.Expr) and stmt.lineno == target.lineno:
                            block[i] = ast.copy_location(ast.Pass(), stmt)
        namespace = dict(vars(strategies))
        exec(compile(mutated, inspect.getsourcefile(fn), "exec"), namespace)
        out.append((f"{name} without line {target.lineno}: {ast.unparse(target)}", namespace[fn.__name__]))
    return out


ALL_MUTANTS = [m for name in LOOPS for m in [(name, d, f) for d, f in mutants(name)]]
AT_DEPTHS = [(name, what, loop, n) for name, what, loop in ALL_MUTANTS for n in depths(name)]


def test_every_concurrent_loop_has_mutants():
    covered = {name for name, _, _ in ALL_MUTANTS}
    assert {"streams", "events", "staged"} <= covered
    assert len(ALL_MUTANTS) >= 11


@pytest.mark.parametrize("name,what,loop,nscratch", AT_DEPTHS,
                         ids=[f"{d} (nscratch {n or 'default'})" for _, d, _, n in AT_DEPTHS])
def test_removing_any_ordering_line_is_a_race(backend, monkeypatch, name, what, loop, nscratch):
    monkeypatch.setitem(solver.STRATEGIES, name, dataclasses.replace(solver.STRATEGIES[name], loop=loop))
    with pytest.raises(ch.RaceError):
        ch.solve(ch.WaveProblem(**PROBLEM), name, **solve_kwargs(name, nscratch))
    # the process stays usable: the same solve without the mutant runs cleanly afterwards
    monkeypatch.undo()
    ch.solve(ch.WaveProblem(**PROBLEM), name, **solve_kwargs(name, nscratch))


@pytest.mark.parametrize("name,nscratch", [(name, n) for name in solver.STRATEGIES for n in depths(name)])
def test_correct_loops_never_raise(backend, name, nscratch):
    ok, why = solver.STRATEGIES[name].available()
    if not ok:
        pytest.skip(why)
    problem = ch.WaveProblem(**PROBLEM)
    r = ch.solve(problem, name, **solve_kwargs(name, nscratch))
    assert nscratch is None or r.nscratch == nscratch
    assert r.max_difference(ch.solve(problem, "sequential", trace=False)) == 0


def test_too_few_buffers_is_reported(backend):
    with pytest.raises(ch.RaceError, match="no longer holds level"):
        ch.solve(ch.WaveProblem(**PROBLEM), "events", nscratch=3, unsafe=True, sanitize=True)


def test_sanitize_block_and_names(backend):
    shape = (16, 16)
    stack = ch.pinned_empty((4, *shape))
    buf = ch.device_zeros(shape)
    io, = ch.create_streams(1, name="io")
    with pytest.raises(ch.RaceError, match=r"stack\[2\]") as info:
        with ch.sanitize(names={"stack": stack, "buf": buf}):
            ch.copy_to_host_async(stack[2], buf, io, level=2)
            ch.check_layer_cake(stack)                   # the host reads the stack too early
    assert "synchronise `io`" in str(info.value)
    with ch.sanitize():                                  # usable again, and nothing left over
        ch.copy_to_host_async(stack[2], buf, io, level=2)
        io.synchronize()
        stack[2].sum()                                   # the level the copy filled: the rest is uninitialised
    assert not observe.active()


def test_off_means_no_observer(backend):
    assert not observe.active()
    ch.solve(ch.WaveProblem(**PROBLEM), "events", trace=False)
    assert not observe.active()


def test_a_never_recorded_event_orders_nothing(world):
    san, buf, _, a, b = world
    never = FakeEvent()
    san.op_queued(op(a, writes=[buf]))
    san.event_waited(b, never)                          # counts as done: no wait at all
    san.host_synced(never)
    with pytest.raises(ch.RaceError):
        san.op_queued(op(b, reads=[buf]))


def test_to_device_reads_a_host_buffer_a_pending_copy_writes(backend):
    host, src = ch.memory.pinned_zeros((8, 8)), ch.device_zeros((8, 8))   # src kept: letting it go races too
    io, = ch.create_streams(1, name="io")
    with pytest.raises(ch.RaceError, match=r"the host \(to_device\) reads"):
        with ch.sanitize():
            ch.copy_to_host_async(host, src, io)
            ch.to_device(host)


def test_message_names_both_operations_and_the_wait_to_add(cpu):
    loop = next(f for d, f in mutants("events") if "io[c].wait_event(ready[c])" in d)
    original = solver.STRATEGIES["events"]
    solver.STRATEGIES["events"] = dataclasses.replace(original, loop=loop)
    try:
        with pytest.raises(ch.RaceError) as info:
            ch.solve(ch.WaveProblem(**PROBLEM), "events", trace=False, sanitize=True)
    finally:
        solver.STRATEGIES["events"] = original
    msg = str(info.value)
    assert "race on U[2] (device memory)" in msg
    assert "the kernel `wave2d_4o level 2` on `compute` writes U[2]" in msg
    assert "the D2H copy of level 2 on `io 2` reads U[2]" in msg
    assert "make `io 2` wait for the event recorded after the kernel `wave2d_4o level 2` on `compute`" in msg


# --------------------------------------------------------------------------
# Host waits the sanitizer must count, and work queued from other threads
# --------------------------------------------------------------------------
def _poll_event(stream):
    ev = stream.record()
    while not ev.done:
        pass


def _poll_stream(stream):
    while not stream.done:
        pass


@pytest.mark.parametrize("wait", [_poll_event, _poll_stream], ids=["event.done", "stream.done"])
def test_polling_to_completion_is_a_host_wait(backend, wait):
    a, b = ch.create_streams(2)
    buf = ch.device_empty((8, 8))
    with ch.sanitize(names={"buf": buf}):
        ch.bake_layer(buf, 1, a)
        wait(a)                                # the host knows the bake has finished
        ch.bake_layer(buf, 2, b)               # so this write comes after it
        ch.synchronize()
    with pytest.raises(ch.RaceError, match="race on buf"):       # and without the poll it races
        with ch.sanitize(names={"buf": buf}):
            ch.bake_layer(buf, 1, a)
            ch.bake_layer(buf, 2, b)


def test_to_host_is_a_host_wait(backend):
    a, b = ch.create_streams(2)
    buf = ch.device_empty((8, 8))
    with ch.sanitize(names={"buf": buf}):
        ch.bake_layer(buf, 1, a)
        plane = ch.to_host(buf)                # synchronises the device before copying
        ch.bake_layer(buf, 2, b)
        ch.synchronize()
    np.testing.assert_array_equal(plane, ch.exercises.layer_values(1, (8, 8)))


def _racy_pair(buf, a, b, errors):
    def queue():
        try:
            ch.bake_layer(buf, 1, a)
            ch.bake_layer(buf, 2, b)           # nothing orders it after the first
        except ch.RaceError as err:
            errors.append(err)
    return queue


def test_a_race_queued_from_a_worker_thread_is_reported(backend):
    a, b = ch.create_streams(2)
    buf = ch.device_empty((8, 8))
    errors = []
    with pytest.raises(ch.RaceError, match="race on buf") as info:
        with ch.sanitize(names={"buf": buf}):
            worker = threading.Thread(target=_racy_pair(buf, a, b, errors))
            worker.start()
            worker.join()
    assert errors == [info.value]              # raised in the worker, and again when the block ended


def test_ordered_work_of_two_threads_is_no_race(backend):
    a, b = ch.create_streams(2)
    buf = ch.device_empty((8, 8))
    baked = ch.create_events(1)[0]

    failed = []

    def first():
        try:
            ch.bake_layer(buf, 1, a)
            a.record(baked)
        except BaseException as exc:  # noqa: BLE001 - handed to the test (a thread's exception is lost)
            failed.append(exc)

    with ch.sanitize(names={"buf": buf}):
        worker = threading.Thread(target=first)
        worker.start()
        worker.join()
        if failed:
            raise failed[0]                 # in this thread, where pytest sees it
        b.wait_event(baked)                    # another thread's record orders this thread's work
        ch.bake_layer(buf, 2, b)
        ch.synchronize()


# -- byte ranges at their edges --------------------------------------------------------
def test_a_strided_view_spans_its_first_to_one_past_its_last_byte(world):
    _, buf, _, _, _ = world
    ptr = buf.__array_interface__["data"][0]
    for view in (buf[::3, ::7], buf[::-3, ::-7], buf.T):     # each reaches the first and the last element
        assert ch.runtime.base.byte_span(view) == ("device", ptr, ptr + buf.nbytes)
    assert ch.runtime.base.byte_span(buf[1:3, 2::3]) == ("device", ptr + 4 * 10, ptr + 4 * 22)


def test_a_strided_view_races_on_its_last_element(world):
    san, buf, _, a, b = world
    san.op_queued(op(a, writes=[buf[3, 7:]]))                # the last element only
    with pytest.raises(ch.RaceError):
        san.op_queued(op(b, reads=[buf[::3, ::7]]))


def test_views_sharing_one_byte_race_views_touching_do_not(world):
    san, buf, _, a, b = world
    raw = buf.view(np.uint8)                                 # byte-sized elements, still device memory
    san.op_queued(op(a, writes=[raw[0, 4:8]]))
    san.op_queued(op(b, writes=[raw[0, 0:4]]))               # touching: no byte in common
    with pytest.raises(ch.RaceError):
        san.op_queued(op(b, reads=[raw[0, 2:5]]))            # one byte of a's write


def test_a_later_write_forgets_only_what_it_covers(world):
    """An ordered write over part of an earlier one replaces that part only: the rest of the
    earlier write still races with an unordered reader."""
    san, buf, _, a, b = world
    c, ev = FakeStream("c"), FakeEvent()
    san.op_queued(op(a, writes=[buf[2:]]))                   # rows 2 and 3
    san.event_recorded(a, ev)
    san.event_waited(b, ev)
    san.op_queued(op(b, writes=[buf[1:3]]))                  # rows 1 and 2, after a's write
    with pytest.raises(ch.RaceError):
        san.op_queued(op(c, reads=[buf[3]]))                 # row 3 is still a's, and c is not after a
