"""Failure modes: bad input is refused early and clearly, nothing is lost or
invented, races are caught by the course's own checks, and faults leave the
process usable. Runs on the CPU backend always and on the GPU where there is one."""
import gc
import threading
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import course_helper as ch
from course_helper.measure import compare
from course_helper import solver, strategies
from conftest import course_threads

P = dict(n0=24, n1=24, nt=12)


def _problem():
    return ch.WaveProblem(**P)


def _dev(shape=(24, 24), dtype=np.float32):
    return ch.device_zeros(shape, dtype)


def _pin(shape=(24, 24), dtype=np.float32):
    return ch.pinned_empty(shape, dtype)


def _stream():
    return ch.create_streams(1)[0]


def _event(timing=False):
    return ch.create_events(1, timing=timing)[0]


# (label, call, expected exception, words the message must contain)
BAD_INPUT = [
    ("create_streams n=0", lambda: ch.create_streams(0), ValueError, "at least 1"),
    ("create_streams n=-3", lambda: ch.create_streams(-3), ValueError, "at least 1"),
    ("create_streams n=2.5", lambda: ch.create_streams(2.5), TypeError, "whole number"),
    ("create_streams n='4'", lambda: ch.create_streams("4"), TypeError, "whole number"),
    ("create_streams priority too low", lambda: ch.create_streams(1, priority=99), ValueError, "outside"),
    ("create_streams priority too high", lambda: ch.create_streams(1, priority=-99), ValueError, "outside"),
    ("create_streams priority float", lambda: ch.create_streams(1, priority=-0.5), TypeError, "int"),
    ("create_streams name not str", lambda: ch.create_streams(1, name=3), TypeError, "string"),
    ("create_events n=0", lambda: ch.create_events(0), ValueError, "at least 1"),
    ("create_events n=None", lambda: ch.create_events(None), TypeError, "whole number"),
    ("wait_event on a non-event", lambda: _stream().wait_event("e"), TypeError, "Event"),
    ("record a non-event", lambda: _stream().record(1), TypeError, "Event"),
    ("event.record on a non-stream", lambda: _event().record("s"), TypeError, "Stream"),
    ("wait_stream on a non-stream", lambda: _stream().wait_stream(None), TypeError, "Stream"),
    ("launch_host_func not callable", lambda: _stream().launch_host_func(5), TypeError, "callable"),
    ("elapsed_ms without timing", lambda: ch.elapsed_ms(_event(), _event()), ValueError, "without timing"),
    ("elapsed_ms never recorded", lambda: ch.elapsed_ms(_event(True), _event(True)), ValueError, "never recorded"),
    ("elapsed_ms not events", lambda: ch.elapsed_ms(1, 2), TypeError, "Event"),
    ("pinned_empty negative shape", lambda: ch.pinned_empty((-1, 3)), ValueError, "non-negative"),
    ("pinned_zeros shape text", lambda: ch.memory.pinned_zeros("big"), ValueError, "non-negative"),
    ("device_empty float shape", lambda: ch.device_empty((2.5,)), ValueError, "non-negative"),
    ("device_zeros shape object", lambda: ch.device_zeros(object()), TypeError, "tuple"),
    ("to_device of a device array", lambda: ch.to_device(_dev()), TypeError, "device array"),
    ("to_device of a list", lambda: ch.to_device([1, 2]), TypeError, "NumPy"),
    ("to_host of a host array", lambda: ch.to_host(np.zeros(3)), TypeError, "device array"),
    ("copy_to_host_async pageable", lambda: ch.copy_to_host_async(np.zeros((24, 24), np.float32), _dev()),
     ValueError, "pageable"),
    ("copy_to_host_async shape", lambda: ch.copy_to_host_async(_pin((24, 25)), _dev()), ValueError, "shape"),
    ("copy_to_host_async dtype", lambda: ch.copy_to_host_async(_pin(dtype=np.float64), _dev()), ValueError, "dtype"),
    ("copy_to_host_async strided", lambda: ch.copy_to_host_async(_pin((24, 48))[:, ::2], _dev()),
     ValueError, "contiguous"),
    ("copy_to_host_async host src", lambda: ch.copy_to_host_async(_pin(), np.zeros((24, 24), np.float32)),
     TypeError, "device array"),
    ("copy_to_host_async device dst", lambda: ch.copy_to_host_async(_dev(), _dev()), TypeError, "host"),
    ("copy_to_host_async bad stream", lambda: ch.copy_to_host_async(_pin(), _dev(), "io"), TypeError, "Stream"),
    ("copy_to_device_async pageable", lambda: ch.copy_to_device_async(_dev(), np.zeros((24, 24), np.float32)),
     ValueError, "pageable"),
    ("copy_to_device_async host dst", lambda: ch.copy_to_device_async(_pin(), _pin()), TypeError, "device"),
    ("copy_on_device_async host src", lambda: ch.memory.copy_on_device_async(_dev(), _pin()), TypeError, "device"),
    ("copy_on_device_async shape", lambda: ch.memory.copy_on_device_async(_dev((3, 3)), _dev()), ValueError, "shape"),
    ("copy_to_host device dst", lambda: ch.memory.copy_to_host(_dev(), _dev()), TypeError, "host"),
    ("zero_async host array", lambda: ch.memory.zero_async(np.zeros(3)), TypeError, "device"),
    ("measure_bandwidth no sizes", lambda: ch.measure_bandwidth(()), ValueError, "non-empty"),
    ("measure_bandwidth repeats 0", lambda: ch.measure_bandwidth((1,), repeats=0), ValueError, "at least 1"),
    ("WaveProblem grid too small", lambda: ch.WaveProblem(4, 24), ValueError, "padding"),
    ("WaveProblem dx=0", lambda: ch.WaveProblem(dx=0), ValueError, "above 0"),
    ("WaveProblem velocity<0", lambda: ch.WaveProblem(velocity=-1), ValueError, "above 0"),
    ("WaveProblem velocity shape", lambda: ch.WaveProblem(24, 24, velocity=np.ones((3, 3))), ValueError, "shape"),
    ("WaveProblem nt=2", lambda: ch.WaveProblem(nt=2), ValueError, "at least 3"),
    ("WaveProblem unstable cfl", lambda: ch.WaveProblem(cfl=0.9), ValueError, "stability"),
    ("WaveProblem source on wall", lambda: ch.WaveProblem(24, 24, source=(0, 5)), ValueError, "interior"),
    ("launch_wave2d in place", lambda: (lambda U: ch.launch_wave2d(U, U, U, _dev(), _problem(), 0))(_dev()),
     ValueError, "different buffer"),
    ("launch_wave2d host arrays", lambda: ch.launch_wave2d(*(np.zeros((24, 24), np.float32),) * 4, _problem(), 0),
     TypeError, "device array"),
    ("launch_wave2d wrong shape", lambda: ch.launch_wave2d(_dev(), _dev(), _dev((8, 8)), _dev(), _problem(), 0),
     ValueError, "shape"),
    ("launch_wave2d n<0", lambda: ch.launch_wave2d(_dev(), _dev(), _dev(), _dev(), _problem(), -1),
     ValueError, "at least 0"),
    ("reference_solution every=0", lambda: ch.reference_solution(_problem(), every=0), ValueError, "at least 1"),
    ("solve unknown strategy", lambda: ch.solve(_problem(), "warp"), ValueError, "unknown strategy"),
    ("solve every=0", lambda: ch.solve(_problem(), every=0), ValueError, "at least 1"),
    ("solve every>=nt", lambda: ch.solve(_problem(), every=12), ValueError, "below nt"),
    ("solve nscratch=3", lambda: ch.solve(_problem(), "events", nscratch=3), ValueError, "race"),
    ("solve nscratch=2 unsafe", lambda: ch.solve(_problem(), "events", nscratch=2, unsafe=True),
     ValueError, "at least 3"),
    ("solve nstaging=0", lambda: ch.solve(_problem(), "staged", nstaging=0), ValueError, "at least 1"),
    ("solve batch for events", lambda: ch.solve(_problem(), "events", batch=4), ValueError, "staged"),
    ("solve not a problem", lambda: ch.solve("problem"), TypeError, "WaveProblem"),
    ("solve unsafe='no'", lambda: ch.solve(_problem(), "events", nscratch=3, unsafe="no"), TypeError,
     "unsafe must be True or False"),
    ("solve trace='no'", lambda: ch.solve(_problem(), trace="no"), TypeError, "trace must be True or False"),
    ("solve trace=1", lambda: ch.solve(_problem(), trace=1), TypeError, "True or False"),
    ("prepare unsafe=1", lambda: ch.prepare(_problem(), "events", nscratch=3, unsafe=1), TypeError,
     "True or False"),
    ("solve nstaging=2000", lambda: ch.solve(_problem(), "staged", nstaging=2000), ValueError, "at most 32"),
    ("solve nscratch=200", lambda: ch.solve(_problem(), "events", nscratch=200), ValueError, "at most 32"),
    ("plan_memory every=0", lambda: ch.solver.plan_memory(_problem(), every=0), ValueError, "at least 1"),
    ("plan_memory nscratch<0", lambda: ch.solver.plan_memory(_problem(), nscratch=-4), ValueError, "at least 3"),
    ("plan_memory not a problem", lambda: ch.solver.plan_memory("problem"), TypeError, "WaveProblem"),
    ("create_streams blocking='no'", lambda: ch.create_streams(1, blocking="no"), TypeError,
     "blocking must be True or False"),
    ("create_events timing=1", lambda: ch.create_events(1, timing=1), TypeError, "timing must be True or False"),
    ("device_report print_it='yes'", lambda: ch.device_report(print_it="yes"), TypeError, "True or False"),
    ("Comparison.table timings='no'", lambda: compare.Comparison([], {}, _problem(), 1).table(timings="no"),
     TypeError, "timings must be True or False"),
    ("compare_strategies repeats=0", lambda: ch.compare_strategies(_problem(), repeats=0), ValueError, "at least 1"),
    ("compare_strategies unknown", lambda: ch.compare_strategies(_problem(), ["fast"]), ValueError, "unknown"),
    ("compare_strategies none", lambda: ch.compare_strategies(_problem(), []), ValueError, "at least one"),
    ("plot_slices 2D array", lambda: ch.plot_slices(np.zeros((3, 3))), ValueError, "stack"),
    ("plot_slices device array", lambda: ch.plot_slices(_dev((2, 3, 3))), TypeError, "host array"),
    ("plot_slices clip 0", lambda: ch.plot_slices(np.zeros((2, 3, 3)), clip=0), ValueError, "clip"),
    ("compare_slices shapes", lambda: ch.compare_slices(np.zeros((2, 3, 3)), np.zeros((3, 3, 3))),
     ValueError, "shape"),
    ("animate step 0", lambda: ch.animate(np.zeros((2, 3, 3)), step=0), ValueError, "step"),
    ("set_backend unknown", lambda: ch.set_backend("tpu"), ValueError, "not a backend"),
    ("bake_layer host plane", lambda: ch.bake_layer(np.zeros((3, 3), np.float32), 0), TypeError, "device"),
    ("check_layer_cake 2D", lambda: ch.check_layer_cake(np.zeros((3, 3))), ch.LayerCakeError, "3D"),
]


@pytest.mark.parametrize("label,call,exc,words", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_is_refused_with_a_clear_message(backend, label, call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words.lower() in str(info.value).lower(), f"{label}: message {info.value!r} lacks {words!r}"
    ch.synchronize()                                     # and nothing half-queued breaks the device


def test_bad_input_leaves_nothing_queued(backend):
    (s,) = ch.create_streams(1)
    for call in (lambda: ch.copy_to_host_async(np.zeros((24, 24), np.float32), _dev(), s),
                 lambda: ch.copy_to_host_async(_pin((24, 25)), _dev(), s),
                 lambda: ch.launch_wave2d(_dev(), _dev(), _dev((8, 8)), _dev(), _problem(), 0, stream=s)):
        with pytest.raises((ValueError, TypeError)):
            call()
    assert s.done


def test_graph_strategy_refusal_names_reason_and_alternative(cpu, monkeypatch):
    from course_helper import runtime
    why = "this CuPy is built for ROCm, where the course does not use graphs; use 'staged' or 'events'"
    monkeypatch.setattr(runtime.get(), "graphs_supported", lambda: (False, why))
    with pytest.raises(ch.graphs.GraphsUnsupported, match="ROCm.*'staged' or 'events'"):
        ch.solve(_problem(), "graph")
    with pytest.raises(ch.graphs.GraphsUnsupported):
        with ch.graphs.capture_graph(ch.create_streams(1)[0]):
            pass


# --- nothing lost, nothing invented ------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n0=st.integers(5, 30), n1=st.integers(5, 30), nt=st.integers(3, 28), data=st.data())
def test_every_saved_level_is_written_once_and_right(cpu, n0, n1, nt, data):
    problem = ch.WaveProblem(n0, n1, nt=nt)
    every = data.draw(st.integers(1, nt - 1), label="every")
    strategy = data.draw(st.sampled_from(solver.available_strategies()), label="strategy")
    entry = ch.STRATEGIES[strategy]
    kwargs = {}
    if entry.max_nscratch is None:
        kwargs["nscratch"] = data.draw(st.integers(entry.min_nscratch, entry.min_nscratch + 3), label="nscratch")
    if entry.staged:
        kwargs["nstaging"] = data.draw(st.integers(1, 4), label="nstaging")
        kwargs["batch"] = data.draw(st.integers(1, 6), label="batch")
    r = ch.solve(problem, strategy, every=every, **kwargs)
    expected = ch.reference_solution(problem, every=every)
    assert not np.isnan(r.images).any()
    assert np.array_equal(r.images, expected)
    copied = Counter()
    for e in r.trace.of_kind("D2H"):
        copied.update(range(e.level, e.level + (e.bytes // problem.nbytes_level) * every, every))
    assert copied == Counter(range(0, nt, every))


def test_gpu_strategies_on_random_sizes_match_sequential(backend):
    rng = np.random.default_rng(7)
    names = solver.available_strategies()
    for _ in range(4):
        n0, n1 = (int(x) for x in rng.integers(5, 70, size=2))
        nt = int(rng.integers(3, 40))
        every = int(rng.integers(1, nt))
        p = ch.WaveProblem(n0, n1, nt=nt)
        base = ch.solve(p, "sequential", every=every, trace=False).images
        for name in names:
            r = ch.solve(p, name, every=every, trace=False)
            assert not np.isnan(r.images).any()
            assert np.array_equal(r.images, base), (name, n0, n1, nt, every)


# --- races are caught ----------------------------------------------------------------
def _run(loop, problem, nscratch=4):
    with ch.prepare(problem, "streams", nscratch=nscratch) as run:
        loop(run)
    return run.images


def _slow_copies(monkeypatch):
    """Make every copy of the lesson's loops wait 10 ms first, as if the copy engine were busy."""
    real = strategies.copy_to_host_async

    def slow(dst, src, stream, level=None):
        stream.launch_host_func(lambda: time.sleep(0.01))
        real(dst, src, stream, level=level)

    monkeypatch.setattr(strategies, "copy_to_host_async", slow)


def test_a_missing_host_wait_is_caught_when_copies_are_slow(cpu, monkeypatch):
    problem = ch.WaveProblem(32, 32, nt=30)
    good = ch.reference_solution(problem)
    _slow_copies(monkeypatch)
    # The lesson's stream loop, correct even when copies are slow:
    assert np.array_equal(_run(strategies.with_streams, problem), good)

    def without_host_wait(run):
        for io in run.io:
            io.synchronize = lambda: None            # the bug: the host no longer waits on io[b]
        strategies.with_streams(run)

    racy = _run(without_host_wait, problem)
    bad_levels = [k for k in range(problem.nt) if not np.array_equal(racy[k], good[k])]
    assert bad_levels, "the race should corrupt some level, and the comparison must see it"


def test_the_unsafe_ring_is_caught_by_comparison(backend):
    p = ch.WaveProblem(40, 40, nt=30)
    good = ch.solve(p, "sequential", trace=False)
    for name in ("streams", "events"):
        assert ch.solve(p, name, nscratch=3, unsafe=True, trace=False).max_difference(good) > 0


# --- faults leave the process usable -------------------------------------------------
@pytest.mark.parametrize("fault", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("strategy", ["sequential", "events", "staged"])
def test_a_fault_mid_solve_leaves_the_process_usable(backend, monkeypatch, fault_at_launch, fault, strategy):
    p = ch.WaveProblem(40, 40, nt=30)
    good = ch.solve(p, strategy, trace=False).images
    threads_before = len(course_threads())
    pool = None
    if backend == "gpu":
        import cupy
        pool = cupy.get_default_memory_pool()
        used_before = pool.used_bytes()
    real = fault_at_launch(12, fault)
    with pytest.raises(fault):
        ch.solve(p, strategy)
    monkeypatch.setattr(strategies, "launch_wave2d", real)
    gc.collect()
    from course_helper.timelines import recording
    assert recording.current() is None                       # no recording left switched on
    deadline = time.time() + 5
    while len(course_threads()) > threads_before and time.time() < deadline:
        time.sleep(0.01)
    assert len(course_threads()) <= threads_before            # worker threads released
    if pool is not None:
        assert pool.used_bytes() <= used_before               # device buffers released
    assert np.array_equal(ch.solve(p, strategy).images, good)  # and the next solve is right


def test_device_memory_is_checked_before_it_is_taken(backend, monkeypatch):
    if backend != "gpu":
        pytest.skip("device memory is the GPU's; the CPU backend checks host memory (test_solver)")
    import cupy
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: (1024, 1024))
    cupy.get_default_memory_pool().free_all_blocks()          # no pooled memory to count either
    used = cupy.get_default_memory_pool().used_bytes()
    with pytest.raises(MemoryError, match="device memory"):
        ch.solve(ch.WaveProblem(512, 512, nt=10), "events")
    assert cupy.get_default_memory_pool().used_bytes() == used


def test_threads_do_not_pile_up_over_many_solves(cpu):
    before = threading.active_count()
    for _ in range(5):
        ch.solve(ch.WaveProblem(16, 16, nt=8), "events")
    time.sleep(0.2)
    assert threading.active_count() <= before + 1


# --- a failing streamed run leaves nothing behind ---------------------------------------
@pytest.mark.parametrize("compress", [None, "gpu-zstd"])
@pytest.mark.parametrize("strategy", ["events", "staged"])
@pytest.mark.parametrize("fault", ["deferred", "in the loop"])
def test_a_failing_streamed_run_leaks_no_thread_and_no_ring(cpu, tmp_path, monkeypatch, ctrl_c_at_copy,
                                                             fault_at_launch, strategy, fault, compress):
    import weakref
    from course_helper.disk import sink
    slots = []
    real_ring = sink.Ring.__init__

    def ring(self, *args, **kwargs):
        real_ring(self, *args, **kwargs)
        slots.extend(weakref.ref(s) for s in self.slots)

    monkeypatch.setattr(sink.Ring, "__init__", ring)
    if fault == "deferred":
        ctrl_c_at_copy(30)
        expected = KeyboardInterrupt
    else:
        fault_at_launch(25, RuntimeError)
        expected = RuntimeError
    with pytest.raises(expected) as info:
        ch.solve(ch.WaveProblem(48, 48, nt=60), strategy, store=tmp_path / "s.zarr", batch=2 if strategy == "staged"
                 else None, compress=compress)
    assert not course_threads()                          # disk writers, peaks and flags threads stopped
    assert any("levels are complete and flagged" in note and "to run again" in note
               for note in info.value.__notes__)          # what the store keeps, and how to run again
    # The ring is let go once the error is (its traceback's frames name a few slots until then)
    del info
    gc.collect()
    assert slots and not [s for s in slots if s() is not None]
    monkeypatch.undo()
    s = ch.disk.open_store(tmp_path / "s.zarr")
    assert s.state == "failed" and 0 < s.complete.sum() < len(s.levels)


def test_sanitize_works_on_a_streamed_run(cpu, tmp_path):
    p = ch.WaveProblem(40, 40, nt=30)
    for strategy, compress in (("events", None), ("staged", None), ("events", "gpu-zstd"), ("staged", "gpu-zstd")):
        r = ch.solve(p, strategy, sanitize=True, store=tmp_path / f"{strategy}-{compress}.zarr", compress=compress)
        assert np.array_equal(r.images[:], ch.solve(p, strategy, trace=False).images)
    with pytest.raises(ch.RaceError, match="ring slot|U\\["):     # a race is still caught with a store
        ch.solve(p, "events", nscratch=3, unsafe=True, sanitize=True, store=tmp_path / "race.zarr")
    assert not course_threads()


def test_a_failed_run_that_saved_nothing_leaves_no_store_in_the_way(cpu, tmp_path, monkeypatch, ctrl_c_at_copy):
    p = ch.WaveProblem(40, 40, nt=30)
    ctrl_c_at_copy(1)
    with pytest.raises(KeyboardInterrupt) as info:
        ch.solve(p, "events", store=tmp_path / "s.zarr")
    assert not (tmp_path / "s.zarr").exists()
    assert any("no level was saved" in note for note in info.value.__notes__)
    monkeypatch.undo()
    r = ch.solve(p, "events", store=tmp_path / "s.zarr")          # the same path runs again
    assert ch.disk.open_store(tmp_path / "s.zarr").complete.all() and r.store == tmp_path / "s.zarr"
