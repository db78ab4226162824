import threading
import time

import numpy as np
import pytest

import course_helper as ch
from conftest import course_threads


def _stamp(log, label, delay=0.0):
    def fn():
        t0 = time.perf_counter()
        if delay:
            time.sleep(delay)
        log.append((label, t0, time.perf_counter()))
    return fn


@pytest.mark.parametrize("n", [0, -1])
def test_stream_and_event_counts_must_be_positive(backend, n):
    with pytest.raises(ValueError, match="at least 1"):
        ch.create_streams(n)
    with pytest.raises(ValueError, match="at least 1"):
        ch.create_events(n)


@pytest.mark.parametrize("n", [1.5, "2", None, True])
def test_stream_count_must_be_a_whole_number(backend, n):
    with pytest.raises(TypeError, match="whole number"):
        ch.create_streams(n)


def test_priority_range_is_checked(backend):
    lo, hi = ch.streams.stream_priority_range()
    assert hi <= lo
    s = ch.create_streams(1, priority=hi)[0]
    assert s.priority == hi
    with pytest.raises(ValueError, match="outside this device's range"):
        ch.create_streams(1, priority=lo + 1)
    with pytest.raises(ValueError, match="outside this device's range"):
        ch.create_streams(1, priority=hi - 1)
    with pytest.raises(TypeError):
        ch.create_streams(1, priority=0.5)


def test_streams_are_named_and_flagged(backend):
    io = ch.create_streams(3, name="io")
    assert [s.name for s in io] == ["io 0", "io 1", "io 2"]
    assert not io[0].blocking
    (sync,) = ch.create_streams(1, blocking=True, name="blocking")
    assert sync.blocking and sync.name == "blocking"
    with pytest.raises(TypeError, match="True or False"):
        ch.create_streams(1, blocking="yes")
    if backend == "gpu":
        import cupy
        assert isinstance(io[0].raw, cupy.cuda.Stream)


def test_wait_event_orders_a_stream_after_slow_work_on_another(backend):
    a, b = ch.create_streams(2)
    (ev,) = ch.create_events(1)
    log = []
    a.launch_host_func(_stamp(log, "slow", delay=0.3))
    a.record(ev)
    b.wait_event(ev)
    b.launch_host_func(_stamp(log, "after"))
    b.synchronize()
    assert [x[0] for x in log] == ["slow", "after"]
    assert log[1][1] >= log[0][2]          # started only after the slow work ended


def test_without_wait_the_second_stream_runs_ahead(backend):
    # A long copy on one stream, a short fill on another: with no event between them the
    # second stream is done while the first is still copying.
    a, b = ch.create_streams(2)
    src, dst = ch.device_zeros(16 * 2**20), ch.pinned_empty(16 * 2**20)     # 64 MiB, > 1 ms
    small = ch.device_zeros(1024)
    ch.synchronize()
    ch.copy_to_host_async(dst, src, a)
    ch.memory.zero_async(small, b)
    b.synchronize()
    assert not a.done, "the fill should not have waited for the copy on another stream"
    a.synchronize()


def test_copies_in_opposite_directions_on_two_streams_overlap(backend):
    """A device-to-host and a host-to-device copy use different links (and copy engines), so on
    two streams they run at the same time. (Two copies in the same direction share one link.)"""
    n = 4_000_000
    rng = np.random.default_rng(0)
    down_src = ch.to_device(rng.random(n, dtype=np.float32))
    down = ch.pinned_empty(n)
    up_src = ch.pinned_empty(n)
    up_src[...] = rng.random(n, dtype=np.float32)
    up = ch.device_zeros(n)
    d2h, h2d = ch.create_streams(2)
    ch.synchronize()
    with ch.tracing() as t:
        for rep in range(6):
            ch.copy_to_host_async(down, down_src, d2h, level=rep)
            ch.copy_to_device_async(up, up_src, h2d, level=rep)
    np.testing.assert_array_equal(down, ch.to_host(down_src))
    np.testing.assert_array_equal(ch.to_host(up), up_src)
    per_kind = {k: [(e.start_ms, e.end_ms) for e in t.events if e.kind == k] for k in ("D2H", "H2D")}
    overlapping = sum(1 for a0, a1 in per_kind["D2H"] for b0, b1 in per_kind["H2D"] if max(a0, b0) < min(a1, b1))
    assert overlapping > 0


def test_exception_in_stream_work_is_raised_at_synchronize(cpu):
    (s,) = ch.create_streams(1)

    def broken_step():
        raise ValueError("boom in the worker")

    s.launch_host_func(broken_step)
    with pytest.raises(ValueError, match="boom in the worker") as info:
        s.synchronize()
    assert any(fr.name == "broken_step" for fr in info.traceback)
    log = []
    s.launch_host_func(lambda: log.append("ok"))
    s.synchronize()                      # the stream is usable again
    assert log == ["ok"]


def test_exception_reaches_event_and_device_synchronize(cpu):
    (s,) = ch.create_streams(1)
    (ev,) = ch.create_events(1)
    s.launch_host_func(lambda: 1 / 0)
    s.record(ev)
    with pytest.raises(ZeroDivisionError):
        ev.synchronize()
    with pytest.raises(ZeroDivisionError):
        ch.synchronize()
    ch.synchronize()                     # raised once, then cleared


def test_work_after_a_failure_is_skipped_not_run(cpu):
    (s,) = ch.create_streams(1)
    log = []
    s.launch_host_func(lambda: 1 / 0)
    s.launch_host_func(lambda: log.append("should not run"))
    with pytest.raises(ZeroDivisionError):
        s.synchronize()
    assert log == []


def test_event_done_record_and_elapsed(backend):
    (s,) = ch.create_streams(1)
    start, end = ch.create_events(2, timing=True)
    assert start.done                             # never recorded: complete
    with pytest.raises(ValueError, match="never recorded"):
        ch.elapsed_ms(start, end)
    s.record(start)
    s.launch_host_func(lambda: time.sleep(0.2))
    s.record(end)
    assert not end.done                           # the host did not wait
    assert not s.done
    end.synchronize()
    assert end.done and s.done
    ms = ch.elapsed_ms(start, end)
    assert ms >= 150                              # it measured the sleep, not zero
    (plain,) = ch.create_events(1)
    s.record(plain)
    plain.synchronize()
    with pytest.raises(ValueError, match="without timing"):
        ch.elapsed_ms(plain, end)


def test_elapsed_on_an_unfinished_event_says_to_synchronize(backend):
    (s,) = ch.create_streams(1)
    a, b = ch.create_events(2, timing=True)
    s.record(a)
    s.launch_host_func(lambda: time.sleep(0.3))
    s.record(b)
    with pytest.raises(RuntimeError, match="synchronize"):
        ch.elapsed_ms(a, b)
    s.synchronize()


def test_record_returns_event_and_rejects_non_events(backend):
    (s,) = ch.create_streams(1)
    ev = s.record()
    assert isinstance(ev, ch.streams.Event)
    with pytest.raises(TypeError):
        s.record("not an event")
    with pytest.raises(TypeError):
        s.wait_event(None)
    with pytest.raises(TypeError):
        ev.record("not a stream")
    with pytest.raises(TypeError):
        s.launch_host_func(42)


def test_stream_as_context_manager_sets_current_stream(backend):
    (s,) = ch.create_streams(1)
    assert ch.streams.current_stream().is_default
    with s:
        assert ch.streams.current_stream() is s
        a = ch.device_zeros((4,))
        h = ch.pinned_empty((4,))
        ch.copy_to_host_async(h, a)              # goes to s
    assert ch.streams.current_stream().is_default
    s.synchronize()
    assert np.all(h == 0)


def test_wait_stream(backend):
    a, b = ch.create_streams(2)
    log = []
    a.launch_host_func(_stamp(log, "first", delay=0.2))
    b.wait_stream(a)
    b.launch_host_func(_stamp(log, "second"))
    b.synchronize()
    assert [x[0] for x in log] == ["first", "second"]


def test_the_cpu_backend_starts_no_threads(cpu, small):
    before = threading.active_count()
    streams = ch.create_streams(4)
    for s in streams:
        s.launch_host_func(lambda: None)
    ch.synchronize()
    ch.solve(small, "events")
    assert threading.active_count() == before
    assert not course_threads()


class _Work:
    """Buffers prepared up front, so queueing them later never synchronises."""

    def __init__(self, p, n=8, shape=(2048, 2048)):
        self.p = p
        self.src = ch.device_zeros((n, *shape))
        self.dst = ch.pinned_empty((n, *shape))
        self.U = [[ch.device_zeros(p.shape) for _ in range(3)] for _ in range(2)]
        self.V = ch.to_device(p.velocity)
        for which in range(2):            # load the kernel now: its first launch compiles it on the host
            self.step(ch.default_stream(), which)
        ch.synchronize()

    def copies(self, stream):
        """About 128 MiB of device-to-host copies: long-running device work on either backend."""
        for k in range(len(self.src)):
            ch.copy_to_host_async(self.dst[k], self.src[k], stream, level=k)

    def step(self, stream, which=0):
        U = self.U[which]
        ch.launch_wave2d(U[0], U[1], U[2], self.V, self.p, 0, stream=stream)


def test_device_work_default_stream_semantics(backend):
    work = _Work(ch.WaveProblem(1024, 1024, nt=10))
    (blocking,) = ch.create_streams(1, blocking=True, name="blocking")
    (free,) = ch.create_streams(1, name="non-blocking")
    with ch.tracing() as t:
        work.copies(ch.default_stream())
        work.step(free, 0)
        work.step(blocking, 1)
        ch.synchronize()
    copies_end = max(e.end_ms for e in t.copies)
    started = {e.track: e.start_ms for e in t.kernels}
    assert started["blocking"] >= copies_end            # guaranteed by the default-stream rules
    assert started["non-blocking"] < copies_end         # nothing held it back


def test_device_work_on_two_streams_overlaps(backend):
    work = _Work(ch.WaveProblem(1024, 1024, nt=10))
    io, compute = ch.create_streams(2)
    with ch.tracing() as t:
        work.copies(io)
        work.step(compute)
        ch.synchronize()
    assert t.summary()["overlap_ms"] > 0


def _boom():
    raise ZeroDivisionError("from a host function")


def _outcome(sync):
    try:
        sync()
    except ZeroDivisionError:
        return "raised"
    return "returned"


def test_a_host_function_error_reaches_the_thread_whose_stream_failed(cpu):
    (s,) = ch.create_streams(1, name="worker")
    queued, main_synced, seen = threading.Event(), threading.Event(), {}

    def worker():
        s.launch_host_func(_boom)
        queued.set()
        main_synced.wait(30)
        seen["worker"] = _outcome(s.synchronize)

    thread = threading.Thread(target=worker)
    thread.start()
    queued.wait(30)
    seen["main"] = _outcome(ch.synchronize)    # covers the worker's stream: it may say so...
    main_synced.set()
    thread.join(30)
    assert seen == {"main": "raised", "worker": "raised"}   # ...but the worker's own sync still does
    assert _outcome(ch.synchronize) == "returned"           # and once the worker was told, it is dealt with


def test_a_failed_stream_of_a_finished_thread_is_reported_once(cpu):
    (s,) = ch.create_streams(1, name="worker")
    thread = threading.Thread(target=lambda: s.launch_host_func(_boom))
    thread.start()
    thread.join(30)
    assert _outcome(ch.synchronize) == "raised"              # nobody else can hear it: the first sync does
    assert _outcome(ch.synchronize) == "returned"


def test_streams_and_events_have_one_completion_query_done_as_cupy_spells_it(backend):
    """``.done`` is the one way to ask (CuPy's spelling); there is no second one to keep in step."""
    (s,) = ch.create_streams(1)
    (ev,) = ch.create_events(1)
    for obj in (s, ev):
        assert isinstance(type(obj).done, property)
        assert not hasattr(obj, "query") and not hasattr(obj, "is_done")


def test_looking_at_an_event_costs_the_host_nothing(backend):
    """repr(event) says what the helper knows, with no device query: on the CPU backend it
    leaves the modelled host clock where it was (a query costs the host its profiled time)."""
    (s,) = ch.create_streams(1)
    (e,) = ch.create_events(1)
    assert "never recorded" in repr(e)
    e.record(s)
    before = ch.runtime.host_ms()
    text = [repr(e) for _ in range(100)][-1]
    if ch.backend_name() == "cpu":
        assert ch.runtime.host_ms() == before
    assert text == f"<Event timing=False recorded on {ch.backend_name()}>"
    s.synchronize()
