"""The modelled GPU of the CPU backend: its rules, its determinism, and that it never hangs."""
import contextlib
import gc
import json
import pathlib
import threading
import weakref

import numpy as np
import pytest

import course_helper as ch
from course_helper.measure import calibrate
from course_helper.runtime import model
from course_helper import runtime
from course_helper.cli import main

MIB = 2**20
# Modelled times are whole ticks of about 1 ns (so that runs are exactly repeatable):
# comparisons with the profile's figures allow a tick or two.


@pytest.fixture
def rt(cpu):
    return runtime.get()


@contextlib.contextmanager
def _modelled_with(tmp_path, section, key, value):
    """The CPU backend on the H200 profile with ``profile[section][key] = value``; yields that
    profile, and goes back to the shipped profile after."""
    profile = ch.runtime.profiles.load("h200")
    profile[section][key] = value
    path = tmp_path / f"{section}-{key}.json"
    path.write_text(json.dumps(profile))
    ch.set_backend("cpu", profile=str(path))
    try:
        yield profile
    finally:
        ch.set_backend("cpu")


def _copy_trace(kinds_streams, nbytes):
    """Queue one copy per (kind, stream) at once; return the trace's copy events in order."""
    n = nbytes // 4
    with ch.tracing() as t:
        for kind, s in kinds_streams:
            if kind == "D2H":
                ch.copy_to_host_async(ch.pinned_empty(n), ch.device_zeros(n), s)
            else:
                ch.copy_to_device_async(ch.device_zeros(n), ch.memory.pinned_zeros(n), s)
    return sorted(t.copies, key=lambda e: e.start_ms)


def test_copy_time_is_latency_plus_bytes_over_bandwidth(rt):
    (s,) = ch.create_streams(1)
    for mib in (1, 16):
        (e,) = _copy_trace([("D2H", s)], mib * MIB)
        link = rt.profile["links"]["D2H"]
        expected = link["latency_us"] * 1e-3 + mib * MIB / (link["gbps"] * 1e6)
        assert e.duration_ms == pytest.approx(expected, abs=2e-6)
        assert e.duration_ms == pytest.approx(model.link_ms(rt.profile, "D2H", mib * MIB), abs=2e-6)


def test_two_copies_on_one_link_take_turns_and_two_links_do_not(rt):
    """The H200 profile runs one copy per direction at a time (device.copies_per_link = 1, as
    measured): the second copy starts when the first ends. Opposite directions have own links."""
    assert rt.profile["device"]["copies_per_link"] == 1
    a, b = ch.create_streams(2)
    alone = model.link_ms(rt.profile, "D2H", 16 * MIB)
    first, second = _copy_trace([("D2H", a), ("D2H", b)], 16 * MIB)
    assert first.duration_ms == pytest.approx(alone, abs=2e-6)           # the first at full speed
    assert second.start_ms == pytest.approx(first.end_ms, abs=2e-6)      # the second after it
    assert second.duration_ms == pytest.approx(alone, abs=2e-6)
    d2h, h2d = _copy_trace([("D2H", a), ("H2D", b)], 16 * MIB)
    assert h2d.start_ms < d2h.end_ms                                     # opposite directions: together,
    assert d2h.duration_ms == pytest.approx(alone, abs=2e-6)             # each on its own link
    assert h2d.duration_ms == pytest.approx(model.link_ms(rt.profile, "H2D", 16 * MIB), abs=2e-6)


def test_a_profile_that_shares_links_runs_copies_together(cpu, tmp_path):
    """With copies_per_link 0 two copies in one direction share the link's bandwidth."""
    with _modelled_with(tmp_path, "device", "copies_per_link", 0) as profile:
        a, b = ch.create_streams(2)
        alone = model.link_ms(profile, "D2H", 16 * MIB)
        first, second = _copy_trace([("D2H", a), ("D2H", b)], 16 * MIB)
        assert second.start_ms < first.end_ms                            # they overlap...
        assert first.duration_ms > 1.5 * alone                           # ...each at about half speed
        assert second.end_ms - first.start_ms == pytest.approx(2 * alone, abs=2e-6)   # the link never idles


def test_copies_per_link_reads_two_copies_end_times():
    assert calibrate.copies_per_link(0.311, 0.616) == 1        # the H200: one after the other
    assert calibrate.copies_per_link(0.60, 0.616) == 0         # together: shared


def test_pageable_copies_block_the_host_and_pinned_ones_do_not(rt):
    (s,) = ch.create_streams(1)
    src = ch.device_zeros(4 * MIB)
    t0 = rt.host_ms()
    ch.copy_to_host_async(ch.pinned_empty(4 * MIB), src, s)
    assert rt.host_ms() - t0 == pytest.approx(rt.profile["host_us"]["copy"] * 1e-3, abs=2e-6)   # returned at once
    assert not s.done
    s.synchronize()
    t0 = rt.host_ms()
    ch.copy_to_host_async(np.empty(4 * MIB, np.float32), src, s, allow_pageable=True)   # what the driver does
    assert rt.host_ms() - t0 >= model.link_ms(rt.profile, "D2H_pageable", 16 * MIB)
    assert s.done                                                     # it returned when the copy was done
    rows = {r["memory"]: r for r in ch.measure_bandwidth(sizes_mib=(16,), repeats=2)}
    assert rows["pinned"]["returned_early"] == 1.0 and rows["pageable"]["returned_early"] == 0.0
    assert rows["pinned"]["gb_per_s"] > 2 * rows["pageable"]["gb_per_s"]
    assert rows["pinned"]["correct"] and rows["pageable"]["correct"]


def test_a_host_wait_that_blocks_costs_the_wake_up_and_one_that_does_not_costs_the_call(rt):
    host = rt.profile["host_us"]
    wake, sync = host["wake"] * 1e-3, host["synchronize"] * 1e-3
    (s,) = ch.create_streams(1)
    src, dst = ch.device_zeros(4 * MIB), ch.pinned_empty(4 * MIB)
    copy_ms = model.link_ms(rt.profile, "D2H", 16 * MIB)
    waits = {"stream": s.synchronize, "event": lambda: s.record().synchronize(), "device": ch.synchronize}
    for name, wait in waits.items():
        t0 = rt.host_ms()
        ch.copy_to_host_async(dst, src, s)
        queued = rt.host_ms()
        wait()                                                    # blocks until the copy's end
        assert rt.host_ms() - queued == pytest.approx(copy_ms + wake, abs=4e-6), name
        t1 = rt.host_ms()
        wait()                                                    # nothing left to wait for
        assert rt.host_ms() - t1 == pytest.approx(sync + (name == "event") * host["record"] * 1e-3,
                                                  abs=2e-6), name
        assert queued - t0 == pytest.approx(host["copy"] * 1e-3, abs=2e-6)


def test_the_model_gives_back_the_wake_up_that_calibration_measures(rt):
    """calibrate's measurement, run on the model: the same turns take ``host_us.wake``
    longer after a blocking wait than after calls made without waiting."""
    p = ch.WaveProblem(256, 256, nt=3)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    hold, other = ch.create_streams(2)
    mark, done = ch.create_events(2, timing=True)
    src, dst = ch.device_zeros(4 * MIB), ch.pinned_empty(4 * MIB)

    def turns():
        for _ in range(calibrate.WAKE_TURNS):
            ch.launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=other)
            other.record(done)

    ch.copy_to_host_async(dst, src, hold)      # something long for the host to block on
    hold.record(mark)
    hold.synchronize()
    turns()
    done.synchronize()
    after = ch.elapsed_ms(mark, done)
    turns()
    hold.record(mark)
    turns()
    done.synchronize()
    unhurried = ch.elapsed_ms(mark, done)
    assert calibrate.wake_us([after], [unhurried]) == pytest.approx(rt.profile["host_us"]["wake"], abs=4e-3)


def test_the_wake_up_is_the_difference_of_medians_and_never_negative():
    assert calibrate.wake_us([0.020, 0.030, 0.050], [0.015, 0.016, 0.100]) == pytest.approx(14.0)
    assert calibrate.wake_us([0.010], [0.012]) == 0.0          # no faster than a host that did not wait
    with pytest.raises(ValueError, match="sample"):
        calibrate.wake_us([], [0.01])


def test_the_host_sees_old_contents_until_it_synchronises(rt):
    (s,) = ch.create_streams(1)
    src = ch.to_device(np.arange(1024, dtype=np.float32))
    dst = ch.memory.pinned_zeros(1024)
    dst[...] = -1
    ch.copy_to_host_async(dst, src, s)
    assert np.all(dst == -1)                       # the copy has not ended in modelled time
    s.synchronize()
    assert np.array_equal(dst, np.arange(1024, dtype=np.float32))


def test_a_race_gives_the_same_wrong_answer_every_run(cpu):
    p = ch.WaveProblem(64, 64, nt=40)
    good = ch.solve(p, "sequential", trace=False).images
    runs = [ch.solve(p, "events", nscratch=3, unsafe=True, trace=False).images for _ in range(3)]
    assert not np.array_equal(runs[0], good)
    assert all(np.array_equal(r, runs[0]) for r in runs[1:])


def test_runs_are_deterministic_times_traces_and_results(cpu):
    p = ch.WaveProblem(64, 64, nt=40)
    for strategy in ("sequential", "streams", "events", "graph-staged"):
        a, b = (ch.solve(p, strategy) for _ in range(2))
        assert a.elapsed_ms == b.elapsed_ms > 0
        assert np.array_equal(a.images, b.images)
        key = [(e.track, e.name, e.start_ms, e.end_ms) for e in a.trace.events]
        assert key == [(e.track, e.name, e.start_ms, e.end_ms) for e in b.trace.events]


def test_graph_replay_costs_one_launch_plus_the_device_work(rt):
    p = ch.WaveProblem(256, 256, nt=3)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    (s,) = ch.create_streams(1)
    with ch.graphs.capture_graph(s) as cap:
        for _ in range(50):
            ch.launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=s)
    assert s.done                                  # capture ran nothing
    start, end = ch.create_events(2, timing=True)
    s.record(start)
    t0 = rt.host_ms()
    cap.graph.launch()
    host = rt.host_ms() - t0
    s.record(end)
    end.synchronize()
    assert host == pytest.approx(rt.profile["host_us"]["graph_launch"] * 1e-3, abs=2e-6)
    kernel_ms = (model.kernel_us(rt.profile, "wave2d_4o", 4 * U[2].nbytes)
                 + rt.profile["graph"]["kernel_node_us"]) * 1e-3
    assert ch.elapsed_ms(start, end) == pytest.approx(host + 50 * kernel_ms, abs=60e-6)
    assert 50 * rt.profile["host_us"]["launch"] * 1e-3 > 10 * host     # what the graph saves the host


def test_graph_strategies_run_on_the_cpu_backend(cpu):
    assert ch.graphs_supported() == (True, "")
    p = ch.WaveProblem(48, 48, nt=30)
    ref = ch.reference_solution(p)
    for name in ("graph", "graph-staged"):
        assert np.array_equal(ch.solve(p, name).images, ref)


def test_legacy_default_stream_waits_for_blocking_streams_only(rt):
    (blocking,) = ch.create_streams(1, blocking=True, name="blocking")
    (free,) = ch.create_streams(1, name="non-blocking")
    big = ch.device_zeros(16 * MIB)
    small = ch.device_zeros(1024)
    for stream, waits in ((blocking, True), (free, False)):
        with ch.tracing() as t:
            ch.copy_to_host_async(ch.pinned_empty(16 * MIB), big, stream)
            ch.memory.zero_async(small, ch.default_stream())
        (copy,) = t.copies
        (fill,) = t.of_kind("memset")
        assert (fill.start_ms >= copy.end_ms) == waits, stream.name


def test_blocking_streams_wait_for_the_legacy_default_stream(rt):
    (blocking,) = ch.create_streams(1, blocking=True, name="blocking")
    with ch.tracing() as t:
        ch.copy_to_host_async(ch.pinned_empty(16 * MIB), ch.device_zeros(16 * MIB), ch.default_stream())
        ch.memory.zero_async(ch.device_zeros(1024), blocking)
    assert t.of_kind("memset")[0].start_ms >= t.copies[0].end_ms


def test_work_on_a_closed_stream_is_refused(rt):
    (s,) = ch.create_streams(1)
    rt.close_stream(s.raw)
    with pytest.raises(RuntimeError, match="closed"):
        ch.memory.zero_async(ch.device_zeros(8), s)
    ch.synchronize()                                   # and nothing hangs


def test_a_host_function_that_waits_for_its_stream_raises_instead_of_hanging(cpu):
    (s,) = ch.create_streams(1)
    s.launch_host_func(s.synchronize)
    with pytest.raises(RuntimeError, match="host function"):
        s.synchronize()
    s.launch_host_func(lambda: ch.memory.zero_async(ch.device_zeros(8), s))
    with pytest.raises(RuntimeError, match="host function"):
        ch.synchronize()
    ch.synchronize()                                   # raised once; the device is usable


def test_a_trace_belongs_to_the_thread_that_opened_it(cpu):
    p = ch.WaveProblem(32, 32, nt=20)
    other = {}

    def elsewhere():
        ch.solve(p, "events", trace=False)             # untraced: must not land in the main trace
        other["result"] = ch.solve(p, "streams")       # traced: its own trace, not refused

    with ch.tracing() as t:
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
        ch.memory.zero_async(ch.device_zeros(8))
    assert [e.kind for e in t.events] == ["memset"]
    assert len(other["result"].trace.kernels) == p.nt - 2


def test_no_output_stack_stays_alive_after_the_result_is_deleted(cpu):
    r = ch.solve(ch.WaveProblem(64, 64, nt=30), "sequential", trace=False)
    images = weakref.ref(r.images)
    del r
    gc.collect()
    assert images() is None


def test_a_profile_is_chosen_by_set_backend_and_checked(cpu, tmp_path):
    doc = json.loads(open(pathlib.Path(ch.__file__).parent / "profiles" / "h200.json").read())
    doc["links"]["D2H"]["gbps"] *= 2
    doc["device"]["short_name"] = "H200 x2"
    path = tmp_path / "fast.json"
    path.write_text(json.dumps(doc))
    slow = model.link_ms(runtime.get().profile, "D2H", 64 * MIB)
    try:
        ch.set_backend("cpu", profile=str(path))
        assert runtime.time_label() == "modelled H200 x2"
        (s,) = ch.create_streams(1)
        (e,) = _copy_trace([("D2H", s)], 64 * MIB)
        assert e.duration_ms < 0.6 * slow
    finally:
        ch.set_backend("cpu", profile="h200")
    del doc["host_us"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="host_us"):
        ch.set_backend("cpu", profile=str(path))
    with pytest.raises(ValueError, match="no device profile named"):
        ch.set_backend("cpu", profile="tpu9000")


def test_a_profiles_device_name_is_printed_escaped_never_obeyed(cpu, tmp_path, capsys):
    doc = json.loads(open(pathlib.Path(ch.__file__).parent / "profiles" / "h200.json").read())
    doc["device"]["name"] = "\x1b[2J\x1b[31mEvil\x07 GPU\n"
    doc["device"]["short_name"] = "\x1b]0;title\x07H200"
    path = tmp_path / "escape\x1b[0m.json"
    path.write_text(json.dumps(doc))
    try:
        ch.set_backend("cpu", profile=str(path))
        ch.solve(ch.WaveProblem(32, 32, nt=10), "events", trace=False)
        shown = [runtime.time_label(), ch.device_report(print_it=True)["times"], capsys.readouterr().out]
    finally:
        ch.set_backend("cpu", profile="h200")
    assert not any(c in text for text in shown for c in "\x1b\x07")
    assert shown[0] == "modelled \\x1b]0;title\\x07H200"
    assert "modelled on \\x1b[2J\\x1b[31mEvil\\x07 GPU\\n (profile " in shown[1]


def test_times_are_labelled_modelled(cpu, tmp_path):
    r = ch.solve(ch.WaveProblem(32, 32, nt=20), "events")
    assert r.time_label == "modelled H200" and "modelled H200" in repr(r)
    assert "modelled H200" in r.trace.describe()
    assert "modelled H200" in r.trace.to_chrome()["traceEvents"][0]["args"]["name"]
    ax = r.trace.plot()
    assert "modelled H200" in ax.get_xlabel() and "modelled H200" in ax.get_title()


def test_calibrate_refuses_the_cpu_backend(cpu, tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "p.json")]) == 2
    assert "real GPU" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_kernel_times_interpolate_the_profile():
    prof = {"kernels": {"k": {"points": [[100, 2.0], [300, 4.0]]}}}
    assert model.kernel_us(prof, "k", 50) == 2.0
    assert model.kernel_us(prof, "k", 200) == 3.0
    assert model.kernel_us(prof, "k", 500) == 6.0


def test_the_profile_environment_variable_is_read_and_checked(tmp_path):
    import os
    import subprocess
    import sys
    env = dict(os.environ, COURSE_HELPER_BACKEND="cpu", COURSE_HELPER_PROFILE="no-such-gpu",
               PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-c", "import course_helper as ch; ch.backend_name()"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode != 0 and "no device profile named 'no-such-gpu'" in p.stderr
    env["COURSE_HELPER_PROFILE"] = "h200"
    p = subprocess.run([sys.executable, "-c", "import course_helper as ch; print(ch.device_report()['times'])"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("modelled on NVIDIA H200 (profile h200)")


def test_modelled_times_do_not_depend_on_computing_the_data(rt):
    p = ch.WaveProblem(64, 64, nt=40)
    for strategy in ("sequential", "events", "graph"):
        computed = ch.solve(p, strategy, trace=False).elapsed_ms
        with rt.times_only():
            predicted = ch.solve(p, strategy, trace=False)
        assert predicted.elapsed_ms == computed


def test_each_kernel_costs_the_loop_turn_and_a_copy_does_not(cpu, tmp_path):
    """The profile's host_us.loop_turn (the strategy loop's own Python per turn) is charged with
    every kernel launch, on top of the launch call, and never with a copy."""
    with _modelled_with(tmp_path, "host_us", "loop_turn", 5.0) as profile:
        rt = runtime.get()
        p = ch.WaveProblem(n0=48, n1=48, nt=3)
        U = [ch.device_zeros(p.shape) for _ in range(3)]
        V = ch.to_device(p.velocity)
        (s,) = ch.create_streams(1)
        t0 = rt.host_ms()
        ch.launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=s)
        assert rt.host_ms() - t0 == pytest.approx((profile["host_us"]["launch"] + 5.0) * 1e-3, abs=2e-6)
        t0 = rt.host_ms()
        ch.copy_to_host_async(ch.pinned_empty(p.shape), U[2], s)
        assert rt.host_ms() - t0 == pytest.approx(profile["host_us"]["copy"] * 1e-3, abs=2e-6)


def test_loop_turn_is_the_turn_less_its_six_calls():
    host = {"launch": 9.0, "copy": 5.0, "record": 0.5, "wait_event": 0.5}
    assert calibrate.loop_turn_us(0.0196, host) == pytest.approx(19.6 - 16.0)
    assert calibrate.loop_turn_us(0.010, host) == 0.0                  # never below zero


# --------------------------------------------------------------------------
# What CUDA refuses, the modelled device refuses
# --------------------------------------------------------------------------
def test_an_unjoined_fork_fails_the_capture_as_in_cuda(backend):
    ok, why = ch.graphs_supported()
    if not ok:
        pytest.skip(why)
    origin, side = ch.create_streams(2, name="s")
    buf = ch.device_zeros((8, 8))
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnjoined"):
        with ch.graphs.capture_graph(origin):
            side.wait_event(origin.record())              # side forks from the capture...
            ch.bake_layer(buf, 1, side)                    # ...and its work is never joined back
    if backend == "gpu":
        return
    ch.bake_layer(buf, 2, side)                            # the capture is over: this runs now
    side.synchronize()
    np.testing.assert_array_equal(ch.to_host(buf), ch.exercises.layer_values(2, (8, 8)))
    with ch.graphs.capture_graph(origin) as cap:           # joined back: a graph
        side.wait_event(origin.record())
        ch.bake_layer(buf, 3, side)
        origin.wait_stream(side)
    cap.graph.launch()
    origin.synchronize()
    np.testing.assert_array_equal(ch.to_host(buf), ch.exercises.layer_values(3, (8, 8)))


def test_a_fork_joined_through_another_fork_is_joined(cpu):
    origin, left, right = ch.create_streams(3, name="s")
    bufs = [ch.device_zeros((8, 8)) for _ in range(2)]
    with ch.graphs.capture_graph(origin) as cap:
        forked = origin.record()
        left.wait_event(forked)
        right.wait_event(forked)
        ch.bake_layer(bufs[0], 1, left)
        ch.bake_layer(bufs[1], 2, right)
        left.wait_stream(right)                            # right joins left, left joins the origin
        origin.wait_stream(left)
    cap.graph.launch()
    origin.synchronize()
    assert ch.to_host(bufs[1])[0, 0] == 2


def test_overlapping_device_to_device_copies_are_refused(backend):
    a = ch.device_zeros((4, 8))
    for dst, src in ((a[1:3], a[0:2]), (a[0:2], a[1:3]), (a, a)):
        with pytest.raises(ValueError, match="overlap"):
            ch.memory.copy_on_device_async(dst, src)
    ch.memory.copy_on_device_async(a[2:4], a[0:2])              # side by side: fine
    ch.synchronize()


def test_a_kernel_writing_a_read_only_array_fails_at_launch(cpu):
    (s,) = ch.create_streams(1)
    buf = ch.device_zeros((8, 8))
    buf.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ch.bake_layer(buf, 1, s)
    with pytest.raises(ValueError, match="read-only"):
        with ch.graphs.capture_graph(s):
            ch.bake_layer(buf, 1, s)
    s.synchronize()                                        # nothing was queued to fail later


def test_ctrl_c_during_modelled_work_is_raised_at_once(cpu, monkeypatch):
    import os
    import signal
    real, sent = ch.exercises.layer_values, []

    def interrupted(k, shape):                             # a real SIGINT while layer 3 is baked
        if k == 3 and not sent:
            sent.append(k)
            os.kill(os.getpid(), signal.SIGINT)
        return real(k, shape)

    monkeypatch.setattr(ch.exercises.layer_cake, "layer_values", interrupted)
    (s,) = ch.create_streams(1)
    planes = [ch.device_zeros((8, 8)) for _ in range(200)]
    queued = 0
    with pytest.raises(KeyboardInterrupt):
        for k, plane in enumerate(planes):
            ch.bake_layer(plane, k, s)
            queued += 1
    assert sent and queued < len(planes)                   # not held until the whole loop was queued
    s.synchronize()                                        # the interrupted work runs again, whole
    for k in range(queued):
        np.testing.assert_array_equal(ch.to_host(planes[k]), real(k, (8, 8)))


# --------------------------------------------------------------------------
# Each rule of the model's docstring, asserted directly
# --------------------------------------------------------------------------
def _host_cost(rt, call, n=3):
    """Modelled host ms that ``n`` calls of ``call()`` take."""
    t0 = rt.host_ms()
    for _ in range(n):
        call()
    return rt.host_ms() - t0


def test_no_task_starts_before_the_host_has_queued_it(rt, monkeypatch):
    """The device is simulated up to the host's time only: each kernel is queued after its
    launch call and its loop turn, and starts no earlier, although the device is idle."""
    tasks = []
    add = rt.scheduler.add
    monkeypatch.setattr(rt.scheduler, "add", lambda *a, **kw: tasks.append(add(*a, **kw)) or tasks[-1])
    ch.solve(ch.WaveProblem(n0=48, n1=48, nt=12), "events", every=2, trace=False)
    ran = [t for t in tasks if t.start is not None]
    assert len(ran) == len(tasks) > 12
    assert all(t.start >= t.queued for t in ran)
    assert any(t.start == t.queued for t in ran if t.engine == "compute")    # the bound is reached


def test_a_fill_costs_a_launch_call_and_the_profiles_fill_time(rt):
    """A fill (memset) costs the host one launch call (no loop turn: it is no kernel of the loop)
    and the device the profile's ``fill`` time for its bytes, on the compute engine."""
    (s,) = ch.create_streams(1)
    for mib in (1, 64):
        a = ch.to_device(np.ones(mib * MIB // 4, np.float32))
        with ch.tracing() as t:
            host = _host_cost(rt, lambda: ch.memory.zero_async(a, s), n=1)
            s.synchronize()
        (fill,) = t.of_kind("memset")
        assert host == pytest.approx(rt.profile["host_us"]["launch"] * 1e-3, abs=2e-6)
        assert fill.duration_ms == pytest.approx(model.kernel_us(rt.profile, "fill", mib * MIB) * 1e-3, abs=2e-6)
        assert not ch.to_host(a).any()
    assert model.kernel_us(rt.profile, "fill", MIB) < model.kernel_us(rt.profile, "fill", 64 * MIB)


def test_each_host_call_costs_its_profiled_time_per_call(rt):
    """Each call into the runtime costs the host what that call took on the profiled GPU,
    every time it is made."""
    ms = {k: v * 1e-3 for k, v in rt.profile["host_us"].items()}
    a, b = ch.create_streams(2)
    (e,) = ch.create_events(1)
    x, y = ch.device_zeros(1024), ch.device_zeros(1024)
    calls = {"record": lambda: a.record(e), "wait_event": lambda: b.wait_event(e),
             "query": lambda: (a.done, e.done), "host_func": lambda: a.launch_host_func(lambda: None),
             "copy": lambda: ch.copy_to_device_async(x, ch.memory.pinned_zeros(1024), a),
             "copy_d2d": lambda: ch.memory.copy_on_device_async(x, y, b)}
    for what, call in calls.items():
        per_call = ms[what] * (2 if what == "query" else 1)
        assert _host_cost(rt, call) == pytest.approx(3 * per_call, abs=6e-6), what
    assert len(set(ms[k] for k in calls)) == len(calls)           # the costs tell the calls apart
    ch.synchronize()


def test_a_higher_priority_stream_goes_first_when_work_is_ready_at_once(rt):
    """In a graph's replay the captured calls are all queued at one host time: of two fills that
    become ready together (when the compute engine is free), the higher-priority stream's runs
    first (CUDA: lower number, higher priority), although the other was captured first."""
    least, greatest = ch.streams.stream_priority_range()
    (s,) = ch.create_streams(1, name="origin")
    (low,) = ch.create_streams(1, priority=least, name="low")
    (high,) = ch.create_streams(1, priority=greatest, name="high")
    a, b, busy = ch.device_zeros(4 * MIB), ch.device_zeros(4 * MIB), ch.device_zeros(16 * MIB)
    with ch.tracing() as t:                      # the timeline reads the replay's tasks
        with ch.graphs.capture_graph(s) as cap:
            ch.memory.zero_async(busy, s)        # holds the engine while both are queued
            fork = s.record()
            low.wait_event(fork)
            high.wait_event(fork)
            ch.memory.zero_async(a, low)
            ch.memory.zero_async(b, high)
            s.wait_stream(low)
            s.wait_stream(high)
        cap.graph.launch()
        s.synchronize()
    _, first, second = sorted(t.of_kind("memset"), key=lambda e: e.start_ms)
    assert second.start_ms == pytest.approx(first.end_ms, abs=2e-6)           # one engine, in turn
    assert (first.track, second.track) == ("high", "low")


def test_the_compute_engine_runs_fills_and_device_copies_one_after_another(rt):
    a, b = ch.create_streams(2)
    x, y, z = (ch.device_zeros(64 * MIB // 4) for _ in range(3))
    with ch.tracing() as t:
        ch.memory.copy_on_device_async(x, y, a)
        ch.memory.zero_async(z, b)
        ch.synchronize()
    (copy,) = t.copies
    (fill,) = t.of_kind("memset")
    assert fill.start_ms == pytest.approx(copy.end_ms, abs=2e-6)      # queued together, run in turn


def test_copies_need_a_free_copy_engine(cpu, tmp_path):
    """With one copy engine, copies in opposite directions (each on a link of its own) take turns."""
    with _modelled_with(tmp_path, "device", "async_engine_count", 1):
        a, b = ch.create_streams(2)
        d2h, h2d = _copy_trace([("D2H", a), ("H2D", b)], 16 * MIB)
        assert h2d.start_ms == pytest.approx(d2h.end_ms, abs=2e-6)


def test_wait_event_waits_for_the_record_current_at_call_time(rt):
    """Recording the event again later does not move a wait already queued; waiting on a
    never-recorded event waits for nothing."""
    a, b = ch.create_streams(2)
    (e, never) = ch.create_events(2)
    small = ch.device_zeros(1024)
    with ch.tracing() as t:
        ch.copy_to_host_async(ch.pinned_empty(16 * MIB // 4), ch.device_zeros(16 * MIB // 4), a)
        a.record(e)
        b.wait_event(e)
        ch.copy_to_host_async(ch.pinned_empty(16 * MIB // 4), ch.device_zeros(16 * MIB // 4), a)
        a.record(e)
        ch.memory.zero_async(small, b)
        b.wait_event(never)
        ch.memory.zero_async(small, b)
        ch.synchronize()
    first, second = sorted(t.copies, key=lambda c: c.start_ms)
    fill, after_never = sorted(t.of_kind("memset"), key=lambda c: c.start_ms)
    assert fill.start_ms == pytest.approx(first.end_ms, abs=2e-6) and fill.end_ms < second.end_ms
    assert after_never.start_ms == pytest.approx(fill.end_ms, abs=2e-6)


def test_disk_writes_follow_their_copy_and_their_lane_and_share_the_disk(rt):
    """A write starts after its copy and after its lane's previous write; the lanes' latencies
    overlap and their bytes share the disk's bandwidth; a device synchronise does not wait for
    the disk, ``disk_wait`` moves the host to the write's end."""
    disk = rt.profile["disk"]
    nbytes = MIB
    latency, bytes_ms = disk["latency_us"] * 1e-3, nbytes / (disk["gbps"] * 1e6)
    (s,) = ch.create_streams(1)
    ch.copy_to_host_async(ch.pinned_empty(nbytes // 4), ch.device_zeros(nbytes // 4), s)
    copied = s.record()
    w1, w2 = (rt.disk_write("lane 0", copied.raw, lambda: bytes(nbytes)) for _ in range(2))
    w3 = rt.disk_write("lane 1", copied.raw, lambda: bytes(nbytes))
    ch.synchronize()
    assert not w1.done and not w3.done                           # the host did not wait for the disk
    rt.disk_wait(w2)
    assert rt.host_ms() == w2.interval()[1]
    assert all(w.result() == bytes(nbytes) for w in (w1, w2, w3))
    (s1, e1), (s2, e2), (s3, e3) = (w.interval() for w in (w1, w2, w3))
    assert s1 == s3 == copied.raw.task.end                      # right after the copy, together
    assert e1 - s1 == pytest.approx(latency + 2 * bytes_ms, abs=4e-6)   # latencies overlap, bytes shared
    assert e3 == pytest.approx(e1, abs=2e-6)
    assert s2 == e1                                              # after the lane's previous write
    assert e2 - s2 == pytest.approx(latency + bytes_ms, abs=4e-6)       # alone


def test_blocking_transfers_cost_the_host_a_pageable_copy(rt):
    """to_device and to_host copy through pageable memory while the host waits: the host's
    clock moves by the pageable link's time for the bytes (after the synchronise it makes)."""
    host = np.ones(4 * MIB // 4, np.float32)
    t0 = rt.host_ms()
    dev = ch.to_device(host)
    assert rt.host_ms() - t0 >= model.link_ms(rt.profile, "H2D_pageable", 4 * MIB)
    t0 = rt.host_ms()
    assert ch.to_host(dev).sum() == host.sum()
    assert rt.host_ms() - t0 >= model.link_ms(rt.profile, "D2H_pageable", 4 * MIB)


def test_work_that_waits_for_failed_work_fails_too(rt):
    """A failure is sticky along dependencies, as a CUDA error is: a stream that waits for an
    event of a failed stream fails with the same error, and its later copy is skipped."""
    a, b = ch.create_streams(2)
    src, dst = ch.to_device(np.ones(256, np.float32)), ch.memory.pinned_zeros(256)

    def broken():
        raise ValueError("broken on purpose")
    a.launch_host_func(broken)
    b.wait_event(a.record())
    ch.copy_to_host_async(dst, src, b)
    with pytest.raises(ValueError, match="on purpose"):
        b.synchronize()
    with pytest.raises(ValueError, match="on purpose"):
        a.synchronize()
    assert not dst.any()                                        # the copy after it never ran
    ch.synchronize()


def test_a_replayed_kernel_costs_the_profiles_graph_node_time(cpu, tmp_path):
    """Each kernel node of a replayed graph takes the profile's ``graph.kernel_node_us`` on top of
    the kernel's own time (0 on the H200 profile, so it is set here)."""
    with _modelled_with(tmp_path, "graph", "kernel_node_us", 5.0) as profile:
        z = ch.device_zeros(MIB // 4)
        (s,) = ch.create_streams(1)
        with ch.tracing() as t:
            ch.memory.zero_async(z, s)
            with ch.graphs.capture_graph(s) as cap:
                ch.memory.zero_async(z, s)
            cap.graph.launch()
            s.synchronize()
        direct, replayed = sorted(t.of_kind("memset"), key=lambda e: e.start_ms)
        assert direct.duration_ms == pytest.approx(model.kernel_us(profile, "fill", MIB) * 1e-3, abs=2e-6)
        assert replayed.duration_ms == pytest.approx(direct.duration_ms + 5e-3, abs=2e-6)


RUNTIME_MODULES = sorted(p for p in (pathlib.Path(ch.__file__).parent / "runtime").glob("*.py")
                         if p.name not in ("observe.py", "__init__.py"))


@pytest.mark.parametrize("path", RUNTIME_MODULES, ids=lambda p: p.name)
def test_every_public_function_of_the_runtime_has_type_hints(path):
    """Every public function and method of the runtime (but observe) names its parameters' and
    its return's types."""
    import ast
    tree = ast.parse(path.read_text())
    public = [n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")]
    missing = []
    for node in [*tree.body, *(n for c in public for n in c.body)]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_") \
                or isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            untyped = [a.arg for a in args if a.annotation is None and a.arg not in ("self", "cls")]
            if untyped or node.returns is None:
                missing.append(f"{path.name}:{node.lineno} {node.name} ({', '.join(untyped) or 'return'})")
    assert not missing, "\n".join(missing)


# --------------------------------------------------------------------------
# The scheduler on its own: lanes, one engine, a link and an event, no runtime
# --------------------------------------------------------------------------
def test_the_scheduler_orders_two_lanes_by_their_queues_an_event_and_the_engine():
    from course_helper.runtime.scheduler import Lane, Scheduler, ticks
    sched = Scheduler({"compute": 1, "copy": 1}, {"D2H": 1e6}, 0)   # 1e6 bytes per ms
    compute, io = Lane(sched, 0, "compute"), Lane(sched, 0, "io")
    one = ticks(1.0)
    k1 = sched.add(compute, "kernel 1", 0.0, [], engine="compute", duration=one)
    record = sched.add(compute, "event record", 0.0, [])                # the event: after kernel 1
    k2 = sched.add(compute, "kernel 2", 0.0, [], engine="compute", duration=one)
    copy = sched.add(io, "D2H 1", 0.0, [record], engine="copy", link="D2H", peak=1e6, nbytes=5e5)
    k3 = sched.add(io, "kernel 3", 0.0, [], engine="compute", duration=one)   # after the copy, in io's queue
    sched.run_until(lambda: all(t.done for t in (k1, k2, copy, k3)), "everything")
    assert (k1.start, k1.end) == (0.0, one)
    assert record.end == k1.end                         # a record ends with the work before it
    assert copy.start == k1.end and copy.end == k1.end + 0.5    # waits for the event; 5e5 bytes at 1e6 per ms
    assert (k2.start, k2.end) == (one, 2 * one)         # runs under the copy: another engine
    assert k3.start == max(copy.end, k2.end) == k2.end  # in order on io, and the one compute engine is k2's
    assert k3.end == 3 * one


# -- the capabilities callers ask instead of the backend ---------------------------
def test_the_model_predicts_each_operation_alone_as_a_trace_of_it_shows(rt):
    from course_helper.runtime.ops import CopyCost, FillCost, KernelCost, LinkCost, OpKind
    assert rt.predicts_times and rt.clock_label == rt.device_label == runtime.time_label() == "modelled H200"
    host, dev = ch.pinned_empty((4 * MIB // 4,)), ch.device_zeros((4 * MIB // 4,))
    predicted = {OpKind.D2H: rt.predicted_ms(CopyCost(OpKind.D2H, host, dev)),
                 "D2H_pageable": rt.predicted_ms(CopyCost(OpKind.D2H, np.empty_like(host), dev, pageable=True)),
                 OpKind.MEMSET: rt.predicted_ms(FillCost(dev)),
                 "kernel": rt.predicted_ms(KernelCost("wave2d_4o", 4 * MIB)),
                 "held": rt.predicted_ms(KernelCost("wave2d_4o", 4 * MIB, hold_us=10.0))}
    assert predicted[OpKind.D2H] == model.link_ms(rt.profile, "D2H", 4 * MIB)
    assert predicted["D2H_pageable"] == model.link_ms(rt.profile, "D2H_pageable", 4 * MIB) > predicted[OpKind.D2H]
    assert predicted["kernel"] == model.kernel_us(rt.profile, "wave2d_4o", 4 * MIB) * 1e-3
    assert predicted["held"] == pytest.approx(predicted["kernel"] + 0.010)
    assert rt.predicted_ms(LinkCost("peer", MIB)) == model.link_ms(rt.profile, "peer", MIB)
    # what the device then takes for them, each alone
    (s,) = ch.create_streams(1)
    with ch.tracing() as t:
        ch.copy_to_host_async(host, dev, s)
        s.synchronize()
        ch.memory.zero_async(dev, s)
        s.synchronize()
    (copy,), (fill,) = t.trace.of_kind("D2H"), t.trace.of_kind("memset")
    assert copy.duration_ms == pytest.approx(predicted[OpKind.D2H], abs=2e-6)
    assert fill.duration_ms == pytest.approx(predicted[OpKind.MEMSET], abs=2e-6)


def test_the_model_predicts_nothing_it_has_no_figure_for(rt, tmp_path):
    from course_helper.runtime.ops import KernelCost, LinkCost
    assert rt.predicted_ms(KernelCost("no such kernel", MIB)) is None
    assert rt.predicted_ms(LinkCost("no such link", MIB)) is None
    with pytest.raises(TypeError, match="KernelCost, CopyCost"):
        rt.predicted_ms(MIB)
    ch.set_backend("cpu", profile="h100")              # a profile without a peer link
    try:
        assert runtime.get().predicted_ms(LinkCost("peer", MIB)) is None
        assert ch.distributed.link_note() == "the halo exchanges are not modelled"
    finally:
        ch.set_backend("cpu")
    assert ch.distributed.link_note() == "halo exchanges on the profile's peer link"


def test_the_model_compresses_on_its_device_where_its_profile_measured_it(rt):
    on_device, what = rt.compresses_on_device("zstd")
    assert on_device and "compression engine" in what
    assert rt.compresses_on_device("lz4") == (False, "the profile 'h200' has no measured compression on the device")
    ch.set_backend("cpu", profile="h100")
    try:
        on_device, why = runtime.get().compresses_on_device("zstd")
    finally:
        ch.set_backend("cpu")
    assert not on_device and "the profile 'h100" in why and "no compression on the device was measured" in why


@pytest.mark.gpu
def test_a_gpu_measures_its_times_and_predicts_none(backend):
    if backend != "gpu":
        pytest.skip("asks the GPU runtime")
    from course_helper.runtime.ops import KernelCost, LinkCost, OpKind
    rt = runtime.get()
    assert not rt.predicts_times and rt.clock_label == "" == runtime.time_label()
    assert rt.predicted_ms(KernelCost("wave2d_4o", MIB)) is None and rt.predicted_ms(LinkCost(OpKind.D2H, MIB)) is None
    assert rt.compresses_on_device("zstd") is None                  # nvCOMP decides (disk.compression)
    assert ch.distributed.link_note() == ""


def test_a_link_with_fitted_copy_times_takes_them_alone_and_in_a_loop(cpu, tmp_path):
    """A pageable link fitted to a measured loop (``fitted_us``: per-copy times at the sweep's
    level sizes) makes a copy alone take the interpolated fitted time, in the trace and on the host's
    clock, instead of latency + bytes / bandwidth; a malformed list is refused by name."""
    fitted = [[256 * 1024, 57.0], [4 * MIB, 379.0], [64 * MIB, 4460.0]]
    profile = ch.runtime.profiles.load("h200")
    profile["links"]["D2H_pageable"]["fitted_us"] = fitted
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps(profile))
    try:
        ch.set_backend("cpu", profile=str(path))
        rt = runtime.get()
        for nbytes, us in [(4 * MIB, 379.0), (34 * MIB, (379.0 + 4460.0) / 2)]:
            assert model.link_ms(rt.profile, "D2H_pageable", nbytes) == pytest.approx(us * 1e-3)
        src = ch.device_zeros(MIB)                            # 4 MiB of float32
        dst = np.empty(MIB, np.float32)                       # pageable
        with ch.tracing() as trace:
            ch.memory.copy_to_host(dst, src)
        (copy,) = trace.copies
        assert copy.duration_ms == pytest.approx(0.379, rel=1e-3)
        assert model.link_ms(rt.profile, "D2H", 4 * MIB) < 0.2  # the pinned link keeps its own line
    finally:
        ch.set_backend("cpu", profile="h200")
    for bad, word in [([], "list of"), ([[4 * MIB]], "pair"), ([[4 * MIB, -1.0]], "time")]:
        profile["links"]["D2H_pageable"]["fitted_us"] = bad
        path.write_text(json.dumps(profile))
        with pytest.raises(ValueError, match=rf"links\.D2H_pageable\.fitted_us.*{word}"):
            ch.set_backend("cpu", profile=str(path))
