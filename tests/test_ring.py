"""The ring depth as the knob, and the sequential-pinned strategy that separates the two gains.

``ring_depth`` and the default ``nscratch`` are checked against the formula and
against what the modelled H200 makes of them at the balanced point (3072² x 320,
every 16th level saved): model outcomes, deterministic, not wall timings.
"""
import math

import numpy as np
import pytest

import course_helper as ch
from course_helper import runtime, solver, strategies
from course_helper.runtime.model import kernel_us, link_ms
from course_helper.strategies import COPY_LAG, level_times, ring_depth
from course_helper.timelines.timeline import covered_length, intersection_length, merge_intervals

BALANCED = dict(n0=3072, n1=3072, nt=320)


def hidden_fraction(trace):
    """Overlap of kernels and copies over the shorter of the two busy times."""
    s = trace.summary()
    shorter = min(s["compute_ms"], s["copy_ms"])
    return s["overlap_ms"] / shorter if shorter > 0 else 0.0


def assert_is_the_reference(images, problem, every):
    """The NumPy reference, bit for bit on the CPU backend (the same NumPy arithmetic); on a GPU
    to float32 rounding (the CUDA compiler may fuse a multiply and an add)."""
    expected = ch.reference_solution(problem, every)
    if ch.backend_name() == "cpu":
        assert np.array_equal(images, expected)
    else:
        np.testing.assert_allclose(images, expected, atol=1e-6 * np.abs(expected).max())


def modelled(problem, strategy, **kw):
    """``solve`` on the modelled GPU with the arithmetic skipped (only times are read)."""
    with runtime.get().times_only():
        return ch.solve(problem, strategy, **kw)


# -- ring_depth -----------------------------------------------------------------
@pytest.mark.parametrize("kernel_ms, copy_ms, expected", [
    (1.0, 0.5, COPY_LAG + 1),          # a copy shorter than a kernel: one buffer beyond the lag
    (1.0, 1.0, COPY_LAG + 2),          # a whole-number ratio: the copy would end as the kernel starts
    (0.0241, 0.305, COPY_LAG + 13),    # 12.7 kernels per copy
    (2.0, 7.9, COPY_LAG + 4),
])
def test_ring_depth_is_the_lag_plus_the_kernels_a_copy_spans(kernel_ms, copy_ms, expected):
    assert ring_depth(kernel_ms, copy_ms) == expected == COPY_LAG + math.floor(copy_ms / kernel_ms) + 1


@pytest.mark.parametrize("kernel_ms, copy_ms, error", [
    (0.0, 1.0, ValueError), (1.0, -1.0, ValueError), (float("nan"), 1.0, ValueError),
    ("1", 1.0, TypeError), (1.0, None, TypeError)])
def test_ring_depth_refuses_bad_times(kernel_ms, copy_ms, error):
    with pytest.raises(error, match="kernel_ms|copy_ms"):
        ring_depth(kernel_ms, copy_ms)


def test_level_times_are_what_the_model_charges(cpu):
    p = ch.WaveProblem(**BALANCED)
    t = level_times(p)
    profile = runtime.get().profile
    assert t.kernel_ms == pytest.approx(kernel_us(profile, "wave2d_4o", 4 * p.nbytes_level) * 1e-3)
    assert t.copy_ms == link_ms(profile, "D2H", p.nbytes_level)
    assert t.source == runtime.time_label()
    # and the trace of a run shows the same kernel and copy durations
    r = modelled(ch.WaveProblem(**{**BALANCED, "nt": 40}), "events", every=16, nscratch=8)
    kernel = r.trace.kernels[0].duration_ms
    copy = r.trace.of_kind("D2H")[0].duration_ms
    assert kernel == pytest.approx(t.kernel_ms, rel=1e-4) and copy == pytest.approx(t.copy_ms, rel=1e-3)


@pytest.mark.gpu
def test_level_times_measured_on_the_gpu(backend):
    if backend != "gpu":
        pytest.skip("measures the GPU")
    t = level_times(ch.WaveProblem(n0=1024, n1=1024, nt=3))
    assert 0 < t.kernel_ms < t.copy_ms < 10 and t.source.startswith("measured on")
    assert level_times(ch.WaveProblem(n0=1024, n1=1024, nt=9)) == t      # measured once per shape


# -- the depth at the balanced point, on the modelled H200 -------------------------
def test_deeper_rings_hide_more_until_the_ring_depth(cpu):
    p = ch.WaveProblem(**BALANCED)
    want = ring_depth(*level_times(p)[:2])
    hidden = {n: hidden_fraction(modelled(p, "events", every=16, nscratch=n).trace)
              for n in (5, 8, 12, want)}
    assert hidden[5] < hidden[8] < hidden[12] < hidden[want]
    assert hidden[5] < 0.5                      # the course's old ring of 5 hides under half


def test_default_depth_hides_the_copies_at_the_balanced_point(cpu):
    p = ch.WaveProblem(**BALANCED)
    r = modelled(p, "events", every=16)
    assert r.nscratch == ring_depth(*level_times(p)[:2]) > 5
    assert r.nscratch_reason.startswith(f"{r.nscratch}, chosen")
    assert hidden_fraction(r.trace) >= 0.85
    pinned = modelled(p, "sequential-pinned", every=16)
    assert r.elapsed_ms <= 0.6 * pinned.elapsed_ms


def test_default_is_what_suggest_nscratch_says(cpu, small):
    for name, entry in ch.STRATEGIES.items():
        if not entry.available()[0]:
            continue
        n, why = solver.suggest_nscratch(small, 2, name)
        with ch.prepare(small, name, every=2) as run:
            assert (run.nscratch, run.nscratch_reason) == (n, why)
        assert n == entry.nscratch or entry.ring


def test_default_is_at_least_the_usual_ring(cpu, monkeypatch):
    monkeypatch.setattr(solver, "level_times", lambda p: strategies.LevelTimes(1.0, 0.1, "test"))
    n, why = solver.suggest_nscratch(ch.WaveProblem(n0=64, n1=64, nt=20), 1, "events")
    assert n == ch.STRATEGIES["events"].nscratch and "raised to" in why and "= 4" in why


def test_default_is_capped_at_the_ring_limit(cpu, monkeypatch):
    monkeypatch.setattr(solver, "level_times", lambda p: strategies.LevelTimes(0.001, 1.0, "test"))
    n, why = solver.suggest_nscratch(ch.WaveProblem(n0=64, n1=64, nt=20), 1, "events")
    assert n == solver.MAX_RING and "capped" in why


def test_default_stays_within_device_memory(cpu, monkeypatch):
    p = ch.WaveProblem(**BALANCED)
    fits = 10
    free = (fits + 1) * p.nbytes_level / 0.9 + 1          # room for 10 scratch buffers and the velocity
    monkeypatch.setattr(type(runtime.get()), "device_free_bytes", lambda self: free)
    n, why = solver.suggest_nscratch(p, 16, "events")
    assert n == fits and f"only {fits} fit in device memory" in why
    assert solver.plan_memory(p, "events", 16)["device"] <= 0.9 * free
    with pytest.raises(MemoryError):                        # one more would not have fitted
        ch.prepare(p, "events", every=16, nscratch=fits + 1)


def test_a_run_that_holds_no_output_stack_does_not_count_one_against_its_ring(cpu, monkeypatch, tmp_path):
    """A run streamed to a store (or timed only) keeps no output stack in host memory, so the
    default ring is not cut short for one: where the stack and the ring do not fit together, an
    in-memory run's default ring is shallower, a store run's is the whole depth."""
    p = ch.WaveProblem(n0=512, n1=512, nt=64)                  # 64 saved levels of 1 MiB
    monkeypatch.setattr(solver, "level_times", lambda p: strategies.LevelTimes(0.1, 1.6, "test"))
    want = ring_depth(0.1, 1.6)                                 # 20
    room = (want + 1 + 32) * p.nbytes_level / ch.checks.HOST_MEMORY_SHARE   # the ring and half the stack
    monkeypatch.setattr(ch.checks, "host_memory_available", lambda: room)
    n, why = solver.suggest_nscratch(p, 1, "events")
    assert n < want and "fit in device memory" in why
    with ch.prepare(p, "events", output=False) as run:
        assert run.nscratch == want and "fit" not in run.nscratch_reason
    r = ch.solve(p, "events", trace=False, store=tmp_path / "s.zarr")
    assert r.nscratch == want and "fit" not in r.nscratch_reason
    with ch.timing_only():
        assert ch.solve(p, "events", trace=False).nscratch == want


def test_explicit_nscratch_is_kept_and_said(cpu, small):
    r = ch.solve(small, "events", nscratch=7, trace=False)
    assert r.nscratch == 7 and r.nscratch_reason == "7, as given" and "nscratch 7" in repr(r)


def test_copy_bound_runs_say_so(cpu):
    p = ch.WaveProblem(n0=1024, n1=1024, nt=640)
    kernel, copy, _ = level_times(p)
    assert copy > 8 * kernel                              # the point is copy-bound every 8th
    assert "no depth hides every copy" in solver.suggest_nscratch(p, 8)[1]
    assert "no depth" not in solver.suggest_nscratch(p, math.ceil(copy / kernel))[1]


# -- sequential-pinned ------------------------------------------------------------
def test_sequential_pinned_is_registered_as_a_pinned_single_stream_loop():
    entry = ch.STRATEGIES["sequential-pinned"]
    assert entry.loop is strategies.sequential_pinned and entry.streams and not entry.ring
    names = list(ch.STRATEGIES)
    assert names.index("sequential") < names.index("sequential-pinned") < names.index("events")


@pytest.mark.parametrize("every", [1, 3])
def test_sequential_pinned_gives_the_sequential_result(backend, small, every):
    a = ch.solve(small, "sequential-pinned", every=every, trace=False)
    b = ch.solve(small, "sequential", every=every, trace=False)
    assert ch.memory.is_pinned(a.images) and not ch.memory.is_pinned(b.images)
    assert np.array_equal(a.images, b.images)
    assert_is_the_reference(a.images, small, every)


def test_sequential_pinned_waits_for_every_copy_and_overlaps_nothing(cpu):
    p = ch.WaveProblem(**BALANCED)
    trace = modelled(p, "sequential-pinned", every=16).trace
    copies, waits = trace.of_kind("D2H"), trace.of_kind("host wait")
    kernels = trace.kernels
    assert len(copies) == len(range(0, p.nt, 16))
    for copy in copies:
        # a host wait covers the copy's end, and the next kernel starts after that wait
        wait = next(w for w in waits if w.start_ms <= copy.end_ms <= w.end_ms)
        later = [k for k in kernels if k.start_ms >= copy.start_ms]
        assert all(k.start_ms >= wait.end_ms for k in later)
    overlap = intersection_length(merge_intervals((k.start_ms, k.end_ms) for k in kernels),
                            merge_intervals((c.start_ms, c.end_ms) for c in copies))
    assert overlap == 0 and covered_length(merge_intervals((c.start_ms, c.end_ms) for c in copies)) > 0
    # the events loop at the same point does overlap: the measure can see it
    assert hidden_fraction(modelled(p, "events", every=16, nscratch=8).trace) > 0.3


def test_pageable_pinned_overlapped_each_step_faster_on_the_model(cpu):
    p = ch.WaveProblem(**BALANCED)
    t = {name: modelled(p, name, every=16, trace=False).elapsed_ms
         for name in ("sequential", "sequential-pinned", "events")}
    assert t["sequential"] > t["sequential-pinned"] > t["events"]


# -- the sanitizer passes the new strategy and the deep rings ----------------------
@pytest.mark.parametrize("strategy, nscratch", [("sequential-pinned", None), ("events", 20), ("streams", 24),
                                                ("events", solver.MAX_RING)])
def test_sanitizer_passes(backend, small, strategy, nscratch):
    r = ch.solve(small, strategy, every=2, nscratch=nscratch, sanitize=True, trace=False)
    assert_is_the_reference(r.images, small, 2)


def test_timing_only_keeps_the_modelled_times_and_timeline_and_skips_the_arithmetic():
    import course_helper as ch
    if ch.backend_name() != "cpu":
        pytest.skip("the modelled device skips its arithmetic; a GPU computes anyway")
    p = ch.WaveProblem(n0=64, n1=64, nt=40)
    full = ch.solve(p, "events", every=4, nscratch=6)
    with ch.timing_only():
        quick = ch.solve(p, "events", every=4, nscratch=6)
    assert quick.elapsed_ms == full.elapsed_ms
    assert quick.trace.overlap() == full.trace.overlap()
    assert np.all(np.isfinite(full.images)) and np.all(np.isnan(quick.images))
    again = ch.solve(p, "events", every=4, nscratch=6)           # the block ends: arithmetic is back
    assert np.array_equal(again.images, full.images)


def test_timing_only_refuses_a_store_before_creating_it(tmp_path):
    import course_helper as ch
    if ch.backend_name() != "cpu":
        pytest.skip("a GPU computes inside timing_only(); the refusal is the modelled device's")
    with ch.timing_only(), pytest.raises(ValueError, match="computes no data"):
        ch.solve(ch.WaveProblem(n0=32, n1=32, nt=10), "events", store=tmp_path / "s.zarr")
    assert not (tmp_path / "s.zarr").exists()


def test_default_comes_down_to_the_usual_ring_when_only_that_fits(cpu, monkeypatch):
    p = ch.WaveProblem(**BALANCED)
    usual = ch.STRATEGIES["events"].nscratch
    free = (usual + 1) * p.nbytes_level / 0.9 + 1          # room for the usual ring and the velocity
    monkeypatch.setattr(type(runtime.get()), "device_free_bytes", lambda self: free)
    n, why = solver.suggest_nscratch(p, 16, "events")
    assert n == usual and f"only {usual} fit in device memory" in why


def test_a_strategy_with_a_deepest_ring_takes_it_and_refuses_one_more(cpu, small):
    entry = strategies.register(strategies.Strategy("events-capped", strategies.with_events, nscratch=5,
                                                    min_nscratch=4, max_nscratch=6))
    try:
        with ch.prepare(small, entry.name, nscratch=6) as run:
            assert run.nscratch == 6
        with pytest.raises(ValueError, match="at most 6 scratch wavefields, got nscratch=7"):
            ch.prepare(small, entry.name, nscratch=7)
    finally:
        del strategies.STRATEGIES[entry.name]
