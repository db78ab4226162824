"""Which clock times a trace, and how CUPTI's records are matched with the queued operations."""
import numpy as np
import pytest

import course_helper as ch
from course_helper.timelines import cupti_trace
from course_helper import raw_cupy


class _S:
    def __init__(self, name):
        self.name = name


def _noted(kind, name, stream, level):
    """An operation as CuptiTimer.queued_ops gives it."""
    return (kind, name, stream, level, 0, False)


def test_the_timer_keeps_what_cupti_times_and_whether_a_graph_captured_it():
    timer = object.__new__(cupti_trace.CuptiTimer)      # no CUPTI session: only the bookkeeping
    timer.journal = []
    assert not hasattr(timer, "op_queued")               # it reads no Op, so none is built for it
    s = _S("io 1")
    timer.journal.append(("D2H", "D2H level 4", s, 4, 64))
    timer.journal.append(("host func", "log", s, None, 0))
    timer.capture_started(s)
    timer.journal.append(("kernel", "wave2d_4o level 9", s, 9, 0))
    timer.capture_ended(s, None)
    timer.journal.append(("memset", "zero", s, None, 8))
    assert timer.queued_ops() == [("D2H", "D2H level 4", s, 4, 64, False),
                                  ("kernel", "wave2d_4o level 9", s, 9, 0, True),
                                  ("memset", "zero", s, None, 8, False)]


def _rec(start, name="wave2d_4o", cls="kernel"):
    return {"cls": cls, "start_ns": start, "end_ns": start + 5, "name": name, "stream_id": 1, "graph_id": 0}


def test_timing_choice(monkeypatch, backend):
    monkeypatch.setenv(cupti_trace.TIMING_ENV, "events")
    assert cupti_trace.wanted() is False
    monkeypatch.setenv(cupti_trace.TIMING_ENV, "sometimes")
    with pytest.raises(ValueError, match="COURSE_HELPER_TIMING"):
        cupti_trace.wanted()
    monkeypatch.delenv(cupti_trace.TIMING_ENV)
    ok, why = cupti_trace.available()
    assert cupti_trace.wanted() is ok
    if backend == "cpu":
        assert not ok and "GPU backend" in why
        monkeypatch.setenv(cupti_trace.TIMING_ENV, "cupti")
        with pytest.raises(RuntimeError, match="CUPTI cannot be used"):
            cupti_trace.wanted()


def test_every_trace_names_its_clock(backend, monkeypatch):
    p = ch.WaveProblem(n0=32, n1=32, nt=12)
    expected = {"cpu": "modelled H200"}.get(backend, "CUPTI" if cupti_trace.available()[0] else "CUDA events")
    t = ch.solve(p, "events").trace
    assert t.timing == expected == t.summary()["timing"] == t.to_chrome()["otherData"]["timing"]
    assert expected in t.describe()
    assert expected in t.plot().get_title()
    if backend == "gpu":
        monkeypatch.setenv(cupti_trace.TIMING_ENV, "events")
        assert ch.solve(p, "events").trace.timing == "CUDA events"


def test_stream_records_pair_in_queue_order_and_skip_foreign_kernels():
    s = _S("compute")
    ops = [_noted("kernel", f"wave2d_4o level {k}", s, k) for k in (2, 3)]
    recs = [_rec(10), _rec(20, name="cupy_multiply"), _rec(30)]
    pairs = cupti_trace._match_stream(ops, recs)
    assert [(op[3], [r["start_ns"] for r in rs]) for op, rs in pairs] == [(2, [10]), (3, [30])]
    # fewer records than operations: the rest stay unmatched (and are reported)
    assert cupti_trace._match_stream(ops, recs[:1])[1][1] == []


def test_graph_records_pair_in_start_order_per_replay():
    s = _S("io 0")
    ops = [_noted("D2H", f"D2H level {k}", s, k) for k in range(3)]
    recs = [_rec(t, cls="DTOH") for t in (50, 10, 30, 40, 60, 20)]   # two replays, out of order
    pairs = cupti_trace._match_graph(ops, recs)
    assert [[r["start_ns"] for r in rs] for _, rs in pairs] == [[10, 40], [20, 50], [30, 60]]


def test_raw_loop_needs_the_gpu(backend):
    p = ch.WaveProblem(n0=32, n1=32, nt=12)
    if backend == "cpu":
        with pytest.raises(RuntimeError, match="GPU backend"):
            raw_cupy.events_loop(p)
        return
    images, ms = raw_cupy.events_loop(p, every=3)
    assert ms > 0
    assert np.array_equal(images, ch.solve(p, "events", every=3, trace=False).images)


def test_a_cupti_trace_builds_no_op_description(backend, monkeypatch):
    """Timed by CUPTI, a traced loop queues its work as an untraced one does and only notes what
    it queued (in the op journal); the modelled GPU runs from Op descriptions, so there every op has one."""
    from course_helper.runtime import observe
    built, real_op = [], observe.Op
    monkeypatch.setattr(observe, "Op", lambda *a, **k: built.append(a[0]) or real_op(*a, **k))
    p = ch.WaveProblem(n0=32, n1=32, nt=12)
    t = ch.solve(p, "events", trace=True).trace
    kernels = [e for e in t.events if e.kind == "kernel"]
    assert [e.level for e in kernels] == list(range(2, p.nt))
    if t.timing == "CUPTI":
        assert built == []
    else:
        assert built.count("kernel") == p.nt - 2 and built.count("D2H") == p.nt


def test_a_cupti_trace_leaves_out_its_own_set_up_launch(backend):
    """A CUPTI recording starts with a launch of its own (CUPTI's kernel tracing is set up at a
    session's first launch, untimed): that launch is in no trace, and the loop's kernels all are."""
    if not cupti_trace.available()[0]:
        pytest.skip("needs CUPTI: " + cupti_trace.available()[1])
    with ch.tracing() as t:
        pass
    assert t.trace.events == [] and t.trace.meta["cupti_records"] == 0
    p = ch.WaveProblem(n0=32, n1=32, nt=12)
    tr = ch.solve(p, "events").trace
    assert tr.meta["cupti_other_records"] == 0 and tr.meta["cupti_unmatched_ops"] == 0
    assert [e.level for e in tr.events if e.kind == "kernel"] == list(range(2, p.nt))


def test_the_set_up_launch_needs_the_gpu(backend):
    if backend == "cpu":
        with pytest.raises(RuntimeError, match="needs the GPU backend"):
            cupti_trace.warm_up()
    else:
        cupti_trace.warm_up()          # returns once the launch has run


def test_a_bare_session_records_only_the_kinds_asked_for(backend):
    if not cupti_trace.available()[0]:
        pytest.skip("needs CUPTI: " + cupti_trace.available()[1])
    with pytest.raises(ValueError, match="kinds must be some of"):
        cupti_trace.ActivitySession(("kernel", "copies"))
    session = cupti_trace.ActivitySession(("memcpy",)).start()
    try:
        cupti_trace.warm_up()
        host = ch.pinned_empty((8, 8))
        ch.copy_to_host_async(host, ch.device_zeros((8, 8)), ch.default_stream())
        ch.synchronize()
    finally:
        session.stop()
    classes = {r["cls"] for r in session.records}
    assert "DTOH" in classes and "kernel" not in classes, classes


def test_the_two_clocks_are_read_together_in_the_tightest_bracket():
    # host readings (ms) around each CUPTI reading: brackets 2.0, 0.5 (the tightest), 3.0 ms wide
    host = iter([10.0, 12.0, 20.0, 20.5, 30.0, 33.0])
    cupti = iter([111_000_000, 222_000_000, 333_000_000])
    assert cupti_trace.read_clocks_together(lambda: next(host), lambda: next(cupti), tries=3) == (20.25, 222_000_000)


def _session(*pairs):
    s = object.__new__(cupti_trace.ActivitySession)      # no CUPTI: only the clock mapping
    s.clock_pairs = list(pairs)
    return s


def test_cupti_times_are_mapped_onto_the_host_clock():
    with pytest.raises(RuntimeError, match="start"):
        _session().host_ms_of(0)
    # one joint reading: host 500 ms at CUPTI 7e9 ns; an offset, the same rate
    s = _session((500.0, 7_000_000_000))
    assert s.host_ms_of(7_002_500_000) == pytest.approx(502.5)
    assert s.host_ms_of(6_999_000_000) == pytest.approx(499.0)
    # a second reading at stop: a rate 0.01% apart is corrected (between and beyond the readings)
    s = _session((500.0, 7_000_000_000), (600.01, 7_100_000_000))
    assert s.host_ms_of(7_050_000_000) == pytest.approx(550.005)
    assert s.host_ms_of(7_100_000_000) == pytest.approx(600.01)
    # one 1% apart means a reading was interrupted: the rates are taken as equal
    s = _session((500.0, 7_000_000_000), (601.0, 7_100_000_000))
    assert s.host_ms_of(7_050_000_000) == pytest.approx(550.0)
