import json
import os
import pathlib
import subprocess
import sys

import pytest

import course_helper as ch
from course_helper.timelines.timeline import (KINDS, Trace, TraceEvent, covered_length, intersection_length,
                                              merge_intervals)


def hand_trace():
    ev = [
        TraceEvent("compute", "kernel", "k1", 0.0, 4.0, 0, 2),
        TraceEvent("compute", "kernel", "k2", 6.0, 10.0, 0, 3),
        TraceEvent("io 0", "D2H", "c1", 2.0, 7.0, 100, 2),     # overlaps k1 by 2 and k2 by 1
        TraceEvent("io 1", "D2H", "c2", 3.0, 5.0, 100, 3),     # inside c1 on another track
        TraceEvent("io 1", "D2H", "c3", 11.0, 12.0, 100, 4),   # overlaps nothing
        TraceEvent("host", "host wait", "w", 1.0, 2.5),
    ]
    return Trace(ev, ["compute", "io 0", "io 1", "host"], {"strategy": "hand"})


def test_summary_arithmetic():
    s = hand_trace().summary()
    assert s["compute_ms"] == pytest.approx(8.0)
    assert s["copy_ms"] == pytest.approx(6.0)          # union of [2,7] and [11,12]
    assert s["overlap_ms"] == pytest.approx(3.0)       # [2,4] and [6,7]
    assert s["host_wait_ms"] == pytest.approx(1.5)
    assert s["total_ms"] == pytest.approx(12.0)
    assert s["copy_fraction"] == pytest.approx(0.5)


def test_summary_of_empty_and_copy_free_traces():
    assert Trace([], []).summary()["copy_fraction"] == 0.0
    t = Trace([TraceEvent("compute", "kernel", "k", 0, 1)], ["compute"])
    assert t.summary() == {"compute_ms": 1, "copy_ms": 0, "overlap_ms": 0, "host_wait_ms": 0,
                           "total_ms": 1, "copy_fraction": 0.0, "timing": "not recorded"}


def validate_chrome(doc):
    """Structural checks of the Chrome Trace Event Format the course writes."""
    assert set(doc) >= {"traceEvents"}
    names, spans = {}, {}
    for e in doc["traceEvents"]:
        assert e["ph"] in ("M", "X")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[e["tid"]] = e["args"]["name"]
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0
            assert isinstance(e["cat"], str) and isinstance(e["args"]["bytes"], int)
            spans.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for tid, s in spans.items():
        assert tid in names, f"track {tid} has no name"
        s.sort()
        for (_, a1), (b0, _) in zip(s, s[1:]):
            assert b0 >= a1 - 1e-6, f"events overlap on track {names[tid]}"
    return names


def from_chrome(doc):
    """TraceEvents read back from a Chrome trace, by the format's own definitions: ``ts`` and
    ``dur`` in microseconds, each ``tid`` named by a ``thread_name`` record."""
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    return [TraceEvent(names[e["tid"]], e["cat"], e["name"], e["ts"] / 1000, (e["ts"] + e["dur"]) / 1000,
                       e["args"]["bytes"], e["args"].get("level"))
            for e in doc["traceEvents"] if e["ph"] == "X"]


def test_chrome_times_are_microseconds():
    t = Trace([TraceEvent("compute", "kernel", "k", 2.0, 3.5, 0, 2)], ["compute"])
    (x,) = [e for e in t.to_chrome()["traceEvents"] if e["ph"] == "X"]
    assert (x["ts"], x["dur"]) == (2000.0, 1500.0)      # 2 ms and 1.5 ms, in µs


def test_chrome_export_round_trips(tmp_path):
    t = hand_trace()
    doc = json.loads(pathlib.Path(t.to_chrome_json(tmp_path / "t.json")).read_text())
    back = from_chrome(doc)
    assert len(back) == len(t.events)
    for got, want in zip(back, t.events):
        assert (got.track, got.kind, got.name, got.bytes, got.level) == \
            (want.track, want.kind, want.name, want.bytes, want.level)
        assert got.start_ms == pytest.approx(want.start_ms) and got.end_ms == pytest.approx(want.end_ms)
    assert Trace(back, t.tracks).summary() == pytest.approx(t.summary())


@pytest.mark.parametrize("strategy", ["sequential", "streams", "events"])
def test_solve_trace_exports_valid_chrome_json(backend, small, tmp_path, strategy):
    every = 3
    r = ch.solve(small, strategy, every=every)
    path = r.trace.to_chrome_json(tmp_path / f"{strategy}.json")
    doc = json.loads(open(path).read())
    names = validate_chrome(doc)
    if strategy == "sequential":
        assert "default" in names.values() and "host" in names.values()
    else:
        assert {"compute", "io 0"} <= set(names.values())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    kernels = [e for e in xs if e["cat"] == "kernel"]
    copies = [e for e in xs if e["cat"] == "D2H"]
    assert sorted(e["args"]["level"] for e in kernels) == list(range(2, small.nt))
    assert sorted(e["args"]["level"] for e in copies) == list(range(0, small.nt, every))
    assert all(e["args"]["strategy"] == strategy for e in xs if e["cat"] != "host wait")
    kernel_end = {e["args"]["level"]: e["ts"] + e["dur"] for e in kernels}
    for c in copies:
        lvl = c["args"]["level"]
        if lvl in kernel_end:
            assert c["ts"] >= kernel_end[lvl] - 1e-3, f"copy of level {lvl} started before its kernel ended"
        assert c["args"]["bytes"] == small.nbytes_level


def test_timeline_shows_the_strategies_differ(backend, small):
    seq = ch.solve(small, "sequential").trace.summary()
    ev = ch.solve(small, "events").trace.summary()
    assert seq["overlap_ms"] == 0.0                   # sequential never overlaps
    assert seq["host_wait_ms"] > 0
    assert ev["host_wait_ms"] == 0.0                  # the event loop never blocks the host


def test_plot_whole_and_zoomed(backend, small):
    import matplotlib.pyplot as plt
    t = ch.solve(small, "streams").trace
    ax = t.plot()
    assert [t.get_text() for t in ax.get_yticklabels()][0].split("\n")[0] == "compute"
    ax2 = t.plot(levels=(20, 23))
    lo, hi = ax2.get_xlim()
    w = t.window_for_levels(20, 23)
    assert lo < w[0] and hi > w[1] and (hi - lo) < 0.5 * t.summary()["total_ms"] + (w[1] - w[0]) * 2
    with pytest.raises(ValueError, match="no traced work"):
        t.window_for_levels(1000, 1001)
    plt.close("all")
    assert "kernels" in t.describe()


def test_learner_loops_can_opt_in_to_tracing(backend, small):
    U = [ch.device_zeros(small.shape) for _ in range(3)]
    V = ch.to_device(small.velocity)
    (s,) = ch.create_streams(1, name="mine")
    with ch.tracing(label="mine") as t:
        for n in range(5):
            ch.launch_wave2d(U[n % 3], U[(n + 1) % 3], U[(n + 2) % 3], V, small, n, stream=s)
        s.synchronize()
    assert [e.level for e in t.kernels] == [2, 3, 4, 5, 6]
    assert t.tracks == ["mine", "host"]
    with pytest.raises(RuntimeError, match="records its own timeline"):
        with ch.tracing():
            ch.solve(small, "events")
    with pytest.raises(RuntimeError, match="already being recorded"):
        with ch.tracing():
            with ch.tracing():
                pass


def test_trace_is_only_ready_after_the_block(backend):
    with ch.tracing() as t:
        with pytest.raises(RuntimeError, match="only after"):
            t.summary()


def test_unwritable_paths_are_refused_by_name_and_leave_nothing_behind(tmp_path):
    t = hand_trace()
    with pytest.raises(FileNotFoundError, match="missing.*does not exist"):
        t.to_chrome_json(tmp_path / "missing" / "t.json")
    # A path under a regular file cannot be written by anyone, root included.
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    target = blocker / "t.json"
    with pytest.raises(NotADirectoryError) as info:
        t.to_chrome_json(target)
    assert str(target) in str(info.value) and "not a folder" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"] and blocker.read_text() == "a file, not a folder"


def test_plot_keeps_the_legend_off_the_bars_and_draws_each_operation_as_long_as_it_ran(cpu):
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    problem = ch.WaveProblem(n0=64, n1=64, nt=300)
    t = ch.solve(problem, "events").trace
    ax = t.plot()
    fig = ax.figure
    fig.draw_without_rendering()
    legend = ax.get_legend().get_window_extent()
    assert not legend.overlaps(ax.get_window_extent()), "the legend covers the plotting area"
    shortest = min(e.duration_ms for e in t.events)
    lo, hi = ax.get_xlim()
    assert shortest < (hi - lo) / ax.get_window_extent().width, "the run has operations under a pixel"
    # Operations of a pixel or more are bars exactly as long as they ran; shorter ones are one-pixel
    # columns whose opacity is the share of the column they fill. Either way each kind's ink
    # (width x opacity, added up) is the time its operations took: nothing drops out of the picture.
    pixel = (hi - lo) / ax.get_window_extent().width
    wide = sorted(round(e.duration_ms, 9) for e in t.events if e.duration_ms >= pixel)
    drawn_wide, ink = [], {}
    for bars in ax.collections:
        for path, colour in zip(bars.get_paths(), bars.get_facecolors()):
            width, alpha = path.get_extents().width, colour[3]
            if alpha == 1.0 and width != pytest.approx(pixel):
                drawn_wide.append(round(width, 9))
            key = tuple(round(c, 3) for c in colour[:3])
            ink[key] = ink.get(key, 0.0) + width * alpha
    assert sorted(drawn_wide) == wide
    colours = {k: tuple(round(c, 3) for c in to_rgb(v)) for k, v in KINDS.items()}
    for kind in {e.kind for e in t.events}:
        assert ink[colours[kind]] == pytest.approx(sum(e.duration_ms for e in t.events if e.kind == kind), rel=1e-6)
    plt.close(fig)


def test_a_whole_run_of_short_kernels_keeps_its_ink(cpu):
    """600 kernels of a tenth of a pixel each: drawn one by one the renderer drops most of them; as
    shaded pixel columns the compute lane's ink is still 600 kernels' time."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    events = [TraceEvent("compute", "kernel", f"k{i}", i * 0.1, i * 0.1 + 0.005) for i in range(600)]
    t = Trace(events, ["compute"])
    ax = t.plot()
    lo, hi = ax.get_xlim()
    assert 0.005 < (hi - lo) / ax.get_window_extent().width, "the kernels are narrower than a pixel"
    blue = to_rgb(KINDS["kernel"])
    ink = sum(path.get_extents().width * colour[3] for bars in ax.collections
              for path, colour in zip(bars.get_paths(), bars.get_facecolors())
              if tuple(colour[:3]) == pytest.approx(blue))
    assert ink == pytest.approx(600 * 0.005, rel=1e-6)
    plt.close("all")


def test_busy_fractions_of_a_hand_built_trace():
    t = hand_trace()          # 0 .. 12 ms
    assert t.busy_fractions(lanes="streams") == pytest.approx({"compute": 8 / 12, "io 0": 5 / 12, "io 1": 3 / 12,
                                                               "host": 1.5 / 12})
    assert t.busy_fractions((2.0, 6.0), lanes="streams") == pytest.approx({"compute": 0.5, "io 0": 1.0, "io 1": 0.5,
                                                                           "host": 0.125})
    # the engines view: both IO streams' copies on one D2H lane, busy for the union [2, 7] and [11, 12]
    assert t.busy_fractions() == pytest.approx({"compute": 8 / 12, "D2H": 6 / 12, "host": 1.5 / 12})
    with pytest.raises(ValueError, match="end after it starts"):
        t.busy_fractions((3.0, 3.0))


def test_each_lane_is_labelled_with_how_busy_it_was_in_the_time_shown():
    import matplotlib.pyplot as plt
    t = hand_trace()
    labels = [x.get_text() for x in t.plot(lanes="streams").get_yticklabels()]
    assert labels == ["compute\n67% busy", "io 0\n42% busy", "io 1\n25% busy", "host\n12% waiting"]
    labels = [x.get_text() for x in t.plot(window=(2.0, 6.0), lanes="streams").get_yticklabels()]
    assert labels == ["compute\n50% busy", "io 0\n100% busy", "io 1\n50% busy", "host\n12% waiting"]
    labels = [x.get_text() for x in t.plot().get_yticklabels()]
    assert labels == ["compute\n67% busy", "D2H (2 streams)\n50% busy", "host\n12% waiting"]
    # a lane that did work is never shown as 0% (nor one with gaps as 100%)
    sparse = Trace([TraceEvent("io 0", "D2H", "c", 0.0, 0.001), TraceEvent("compute", "kernel", "k", 0.0, 0.999),
                    TraceEvent("compute", "kernel", "k", 0.9995, 1.0)], ["compute", "io 0"])
    assert [x.get_text() for x in sparse.plot().get_yticklabels()] == ["compute\n>99% busy", "D2H\n<1% busy"]
    plt.close("all")


@pytest.mark.parametrize("timing,meta,clock", [("CUPTI", {}, "CUPTI (GPU)"), ("CUDA events", {}, "CUDA events (GPU)"),
                                               ("modelled H200", {"clock": "modelled H200"},
                                                "modelled H200 profile (predicted)")])
def test_every_plot_names_its_clock_in_its_title(timing, meta, clock):
    import matplotlib.pyplot as plt
    t = hand_trace()
    t.meta.update(meta, timing=timing)
    assert t.clock == clock
    assert t.plot().get_title() == f"hand, clock: {clock}"
    assert t.plot(title="my loop").get_title() == f"my loop (clock: {clock})"
    assert t.plot(title=f"my loop, {clock}").get_title() == f"my loop, {clock}"     # named once
    plt.close("all")


def test_overlap_of_hand_built_traces():
    o = hand_trace().overlap()
    # kernels [0,4] [6,10]: 8 ms; D2H copies [2,7] [3,5] [11,12]: 6 ms; both at once [2,4] [6,7]: 3 ms
    assert (o.compute_ms, o.copy_ms, o.overlap_ms) == pytest.approx((8.0, 6.0, 3.0))
    assert o.hidden_fraction == pytest.approx(3.0 / 6.0)             # of the shorter stage, the copies
    assert o.as_dict() == {"compute_busy_ms": o.compute_ms, "copy_busy_ms": o.copy_ms, "overlap_ms": o.overlap_ms,
                           "hidden_fraction": o.hidden_fraction, "overlap_timing": "not recorded"}
    # compute the shorter stage, entirely under the copies; host-to-device and device copies are not counted
    t = Trace([TraceEvent("compute", "kernel", "k", 1.0, 2.0), TraceEvent("io 0", "D2H", "c", 0.0, 5.0),
               TraceEvent("io 1", "H2D", "h", 5.0, 9.0), TraceEvent("compute", "D2D", "d", 6.0, 7.0)], [])
    o = t.overlap()
    assert (o.compute_ms, o.copy_ms, o.overlap_ms, o.hidden_fraction) == pytest.approx((1.0, 5.0, 1.0, 1.0))
    # nothing at once; nothing copied
    t = Trace([TraceEvent("compute", "kernel", "k", 0.0, 2.0), TraceEvent("io 0", "D2H", "c", 2.0, 3.0)], [])
    assert t.overlap().overlap_ms == 0.0 and t.overlap().hidden_fraction == 0.0
    assert Trace([TraceEvent("compute", "kernel", "k", 0.0, 2.0)], []).overlap().hidden_fraction == 0.0


def test_overlap_of_a_modelled_run_follows_the_ring_depth(cpu):
    """The modelled H200 at the balanced point: a deeper ring hides more of the copying."""
    p = ch.WaveProblem(n0=2048, n1=2048, nt=320)
    rt = ch.runtime.get()
    with rt.times_only():
        shallow, deep = (ch.solve(p, "events", every=16, nscratch=k).trace.overlap() for k in (5, 20))
    assert shallow.compute_ms > 0 and shallow.copy_ms > 0
    assert 0 <= shallow.hidden_fraction < deep.hidden_fraction <= 1
    assert deep.timing == "modelled H200"


#: Queues kernels on one stream and waits for them, twice (the process's first trace and a later
#: one), and prints where each trace drew the last kernel's end and the host wait.
_WAIT_SCRIPT = """
import json, sys
import course_helper as ch
from course_helper.timelines import cupti_trace
n, kernels = int(sys.argv[1]), int(sys.argv[2])
p = ch.WaveProblem(n0=n, n1=n, nt=kernels + 2)
rt = ch.runtime.get()
U = [ch.device_zeros(p.shape) for _ in range(3)]
V = ch.to_device(p.velocity)
(s,) = ch.create_streams(1, name="compute")
out = []
with rt.times_only(rt.modelled):
    for _ in range(2):
        with ch.tracing() as t:
            for k in range(kernels):
                ch.launch_wave2d(U[k % 3], U[(k + 1) % 3], U[(k + 2) % 3], V, p, k, stream=s)
            s.synchronize()
        wait = [e for e in t.events if e.kind == "host wait"][-1]
        out.append({"timing": t.timing, "cupti": cupti_trace.available()[0],
                    "kernel_end": max(e.end_ms for e in t.kernels),
                    "wait_start": wait.start_ms, "wait_end": wait.end_ms})
print(json.dumps(out))
"""


def _first_and_later_wait(backend, n, kernels, timing="auto"):
    env = dict(os.environ, COURSE_HELPER_BACKEND=backend, COURSE_HELPER_TIMING=timing,
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(ch.__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _WAIT_SCRIPT, str(n), str(kernels)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_wait_ends_with_the_kernels(traces):
    for i, t in enumerate(traces):
        which = "the first trace of the process" if i == 0 else "a later trace"
        assert t["wait_start"] < t["kernel_end"], f"{which}: the host did not wait for the kernels ({t})"
        gap = t["wait_end"] - t["kernel_end"]
        assert abs(gap) <= 0.1, f"{which} ({t['timing']}): the host wait ends {gap:+.3f} ms from the kernels' end"


def test_host_lane_shares_the_device_lanes_origin_on_the_model():
    """On the modelled H200 a host wait for a stream ends where the stream's last kernel does."""
    traces = _first_and_later_wait("cpu", 4096, 12)
    assert traces[0]["timing"] == "modelled H200"
    _assert_wait_ends_with_the_kernels(traces)


@pytest.mark.gpu
@pytest.mark.parametrize("timing", ["auto", "events"])
def test_host_lane_shares_the_device_lanes_origin_on_the_gpu(timing):
    """Timed by CUPTI (where it works; "auto") or by CUDA events, a host wait for a stream of long
    kernels is drawn ending within 0.1 ms of the last kernel's end: in the first trace of a fresh
    process (CUPTI's set-up then takes longest) and in a later one."""
    if not ch.runtime.gpu_available():
        pytest.skip("no working CUDA GPU here (the GPU tests run on a GPU machine)")
    traces = _first_and_later_wait("gpu", 8192, 10, timing)
    expected = "CUPTI" if timing == "auto" and traces[0]["cupti"] else "CUDA events"
    assert [t["timing"] for t in traces] == [expected] * 2
    _assert_wait_ends_with_the_kernels(traces)


def _on_grid(intervals, step=0.25, end=12.0):
    """The grid points ``k * step`` (k < end / step) that lie inside some interval: a slow, plain way to
    measure a union (the intervals below start and end on the grid)."""
    return {k for k in range(int(end / step)) for a, b in intervals if a <= k * step < b}


@pytest.mark.parametrize("x, y", [
    ([(0, 1), (0.5, 2), (3, 4)], [(1.5, 3.25)]),
    ([(5, 6), (0, 10)], [(2, 3), (2.5, 4), (9.75, 11)]),
    ([(1, 1)], [(0, 2)]),                          # an empty interval covers nothing
    ([], [(0, 2)]),
])
def test_the_public_interval_helpers_agree_with_counting_grid_points(x, y):
    """merge_intervals, covered_length and intersection_length (what benchmarks/cupti_check uses)
    against counting the grid points each union covers."""
    mx, my = merge_intervals(x), merge_intervals(y)
    assert all(a < b for a, b in zip([iv[1] for iv in mx], [iv[0] for iv in mx[1:]]))   # disjoint, sorted
    assert covered_length(mx) == pytest.approx(len(_on_grid(x)) * 0.25)
    assert intersection_length(mx, my) == pytest.approx(len(_on_grid(x) & _on_grid(y)) * 0.25)


def test_the_window_for_levels_includes_both_end_levels():
    events = [TraceEvent("compute", "kernel", f"k {lv}", float(lv), lv + 0.5, 0, lv) for lv in (3, 4, 5)]
    events.append(TraceEvent("io", "D2H", "copy 4", 4.2, 6.5, 64, 4))        # level 4's copy ends last
    t = Trace(events, ["compute", "io"])
    assert t.window_for_levels(4, 4) == (4.0, 6.5)
    assert t.window_for_levels(3, 5) == (3.0, 6.5)
    assert t.window_for_levels(5, 9) == (5.0, 5.5)
    with pytest.raises(ValueError, match="no traced work"):
        t.window_for_levels(6, 9)


# -- the default picture: a lane per engine and purpose --------------------------------------------

def test_the_engines_view_puts_each_kind_of_work_on_its_lane():
    from course_helper.timelines.timeline import lane_of
    lanes = {(track, kind): lane_of(TraceEvent(track, kind, "x", 0.0, 1.0))
             for track, kind in [("compute", "kernel"), ("compute", "D2D"), ("io 11", "D2H"), ("io 2", "H2D"),
                                 ("disk 3", "disk write"), ("halo", "halo"), ("host", "host wait"),
                                 ("boundary", "kernel"), ("default", "D2H"), ("mine 2", "kernel"),
                                 ("rank 1 io", "D2H"), ("rank 1 compute", "kernel"), ("rank 10 compute 3", "kernel")]}
    assert lanes == {("compute", "kernel"): "compute", ("compute", "D2D"): "compute", ("io 11", "D2H"): "D2H",
                     ("io 2", "H2D"): "H2D", ("disk 3", "disk write"): "disk", ("halo", "halo"): "halo",
                     ("host", "host wait"): "host", ("boundary", "kernel"): "boundary", ("default", "D2H"): "D2H",
                     ("mine 2", "kernel"): "mine", ("rank 1 io", "D2H"): "rank 1 D2H",
                     ("rank 1 compute", "kernel"): "rank 1 compute",
                     ("rank 10 compute 3", "kernel"): "rank 10 compute"}
    assert lane_of(TraceEvent("io 11", "D2H", "x", 0.0, 1.0), lanes="streams") == "io 11"
    with pytest.raises(ValueError, match="lanes must be one of 'engines', 'streams', got 'stream'"):
        lane_of(TraceEvent("io 11", "D2H", "x", 0.0, 1.0), lanes="stream")


def test_lanes_come_in_order_streams_first_then_copies_disk_and_host_rank_by_rank():
    ev = [TraceEvent(track, kind, "x", 0.0, 1.0) for track, kind in [
        ("rank 1 host", "host wait"), ("rank 1 io", "D2H"), ("rank 1 compute", "kernel"), ("rank 0 halo", "halo"),
        ("rank 0 io", "D2H"), ("rank 0 boundary", "kernel"), ("rank 0 compute", "kernel"), ("rank 0 io", "H2D")]]
    t = Trace(ev, ["rank 0 compute", "rank 0 boundary", "rank 0 halo", "rank 0 io", "rank 1 compute", "rank 1 io",
                   "rank 1 host"])
    assert t.lane_names() == ["rank 0 compute", "rank 0 boundary", "rank 0 halo", "rank 0 H2D", "rank 0 D2H",
                              "rank 1 compute", "rank 1 D2H", "rank 1 host"]
    assert t.lane_names("streams") == t.tracks
    assert Trace([], ["compute", "io 0", "io 1", "host"]).lane_names() == ["compute", "io", "host"]


def _balanced_events_trace():
    n, nt, every = ch.measure.BALANCED_POINT
    with ch.timing_only():
        # The ring the modelled H200 chooses here, on both backends: a GPU measures its own, and
        # a depth that divides the save interval (16 of every 16th level) sends every copy
        # through one IO stream, which leaves no lanes to share.
        return ch.solve(ch.WaveProblem(n0=n, n1=n, nt=nt), "events", every=every, nscratch=17).trace


def test_the_events_loop_at_the_balanced_point_draws_at_most_six_lanes(backend):
    """The timeline notebooks 6 and 7 draw: the deep ring's many IO streams share one copy lane,
    while the Chrome export keeps a lane per stream for zooming in Perfetto."""
    import matplotlib.pyplot as plt
    t = _balanced_events_trace()
    assert len(t.tracks) > 6, t.tracks                     # one per IO stream of the deep ring
    assert t.lane_names() == ["compute", "D2H"]
    ax = t.plot(levels=(160, 208))
    labels = [x.get_text().split("\n")[0] for x in ax.get_yticklabels()]
    assert len(labels) <= 6 and labels == ["compute", f"D2H ({len(t.tracks) - 1} streams)"]
    streams_view = [x.get_text().split("\n")[0] for x in t.plot(lanes="streams").get_yticklabels()]
    assert streams_view == ["compute", f"io ({len(t.tracks) - 1} streams)"]     # the ring's pool on one lane
    doc = t.to_chrome()
    assert [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"] == t.tracks
    plt.close("all")


def _tick_label_boxes(fig):
    """The drawn extents of every visible tick label of every axes of ``fig`` (rendered with Agg)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return [(label.get_text(), label.get_window_extent(renderer)) for ax in fig.axes
            for label in ax.get_xticklabels() + ax.get_yticklabels() if label.get_visible() and label.get_text()]


def _overlapping(boxes):
    return [(a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1:] if box_a.overlaps(box_b)]


def test_no_two_tick_labels_overlap_at_the_notebooks_width(backend):
    import matplotlib.pyplot as plt
    t = _balanced_events_trace()
    for ax in (t.plot(), t.plot(levels=(160, 208)), t.plot(levels=(160, 208), lanes="streams")):
        boxes = _tick_label_boxes(ax.figure)
        assert len(boxes) > 4 and not _overlapping(boxes), _overlapping(boxes)
        # The compute lane (the top one) is as tall as every other lane: its bars fill a lane's whole height.
        boxes = [path.get_extents() for bars in ax.collections for path in bars.get_paths()]
        assert {round(b.height, 9) for b in boxes if b.y0 < 0.5} == {0.8}
        assert max(b.height for b in boxes) == pytest.approx(0.8)
    plt.close("all")


def test_compared_panels_share_one_time_axis_and_one_window(backend):
    """Notebook 7's comparison: the same levels of each run, from their start, on one scale, so
    that the shorter run ends visibly earlier; no tick label overlaps another panel's."""
    import matplotlib.pyplot as plt
    n, nt, every = ch.measure.BALANCED_POINT
    with ch.timing_only():
        runs = {name: ch.solve(ch.WaveProblem(n0=n, n1=n, nt=nt), name, every=every)
                for name in ("sequential-pinned", "events")}
    axes = ch.timelines.plot_compared(runs, levels=(160, 208))
    assert len(axes) == 2 and axes[0].get_xlim() == axes[1].get_xlim()
    spans = {name: r.trace.window_for_levels(160, 208) for name, r in runs.items()}
    lengths = {name: b - a for name, (a, b) in spans.items()}
    lo, hi = axes[0].get_xlim()
    assert lo < 0 < max(lengths.values()) < hi < 1.1 * max(lengths.values())
    for ax, (name, length) in zip(axes, lengths.items()):
        assert ax.get_title().startswith(f"{name}: levels 160 to 208 in {length:.2f} ms")
    assert [x.get_text().split("\n")[0] for x in axes[1].get_yticklabels()][0] == "compute"
    boxes = _tick_label_boxes(axes[0].figure)
    assert not _overlapping(boxes), _overlapping(boxes)
    plt.close("all")


def test_compared_panels_of_whole_runs_and_of_a_window():
    import matplotlib.pyplot as plt
    short = hand_trace()
    long = Trace([TraceEvent("compute", "kernel", "k", 0.0, 30.0, 0, 2)], ["compute"], {"strategy": "long"})
    axes = ch.timelines.plot_compared([short, long])
    assert [ax.get_title().split(" (clock")[0] for ax in axes] == ["hand: 12.00 ms", "long: 30.00 ms"]
    assert axes[0].get_xlim() == axes[1].get_xlim() and axes[0].get_xlim()[1] > 30
    axes = ch.timelines.plot_compared({"a": short, "b": long}, window=(2.0, 6.0))
    assert axes[0].get_xlim() == axes[1].get_xlim() == pytest.approx((1.92, 6.08))
    plt.close("all")


def test_a_whole_run_s_title_states_the_length_its_summary_and_the_doctor_state():
    """A run that starts after its recording did (the doctor's block, whose first kernel comes a
    little after the recording starts) is titled with first start to last end, not last end."""
    import matplotlib.pyplot as plt
    late = hand_trace().shifted(0.12)
    axes = ch.timelines.plot_compared({"late": late})
    total = late.summary()["total_ms"]
    assert axes[0].get_title().split(" (clock")[0] == f"late: {total:.2f} ms" == "late: 12.00 ms"
    assert axes[0].get_xlim()[0] < 0 < 12.0 < axes[0].get_xlim()[1] < 12.5          # from its first operation
    plt.close("all")


def test_compared_panels_refuse_what_they_cannot_draw_before_drawing():
    import matplotlib.pyplot as plt
    plt.close("all")
    with pytest.raises(ValueError, match="levels or window, not both"):
        ch.timelines.plot_compared([hand_trace()], levels=(2, 3), window=(0, 1))
    with pytest.raises(ValueError, match="no timelines to compare"):
        ch.timelines.plot_compared({})
    with pytest.raises(ValueError, match="lanes must be one of"):
        ch.timelines.plot_compared([hand_trace()], lanes="stream")
    with pytest.raises(TypeError, match="the run 'events' holds no timeline .*trace=True"):
        ch.timelines.plot_compared({"hand": hand_trace(), "events": None})
    with pytest.raises(ValueError, match="hand: no traced work belongs to levels 50..60"):
        ch.timelines.plot_compared([hand_trace()], levels=(50, 60))
    assert plt.get_fignums() == []


def test_work_at_once_on_a_shared_lane_is_drawn_side_by_side_and_labelled_where_it_fits():
    """Two copies at once from two streams: two rows of half height on the D2H lane, each bar as long
    as its copy; the long bar carries its stream's name inside it, a bar too thin for the name does
    not show it, and a far thinner one gets no label at all."""
    import matplotlib.pyplot as plt
    t = Trace([TraceEvent("compute", "kernel", "k", 0.0, 10.0), TraceEvent("io 0", "D2H", "c0", 0.0, 8.0),
               TraceEvent("io 1", "D2H", "c1", 2.0, 2.2), TraceEvent("io 1", "D2H", "c2", 9.0, 9.05)], [])
    ax = t.plot()
    bars = sorted((round(b.x0, 6), round(b.width, 6), round(b.height, 6)) for c in ax.collections[1:]
                  for b in (p.get_extents() for p in c.get_paths()))
    assert bars == [(0.0, 8.0, 0.4), (2.0, 0.2, 0.4), (9.0, 0.05, 0.4)]
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = sorted(ax.texts, key=lambda text: text.get_position()[0])
    assert [(text.get_text(), text.fits(renderer)) for text in labels] == [("io 1", False), ("io 0", True)]
    box = labels[1].get_window_extent(renderer)
    (left, top), (right, bottom) = ax.transData.transform([(0.0, 0.6), (8.0, 1.0)])
    assert left < box.x0 < box.x1 < right and min(top, bottom) <= box.y0 < box.y1 <= max(top, bottom)
    plt.close(fig)


def test_a_panel_of_named_levels_fades_the_other_levels_work_inside_its_window():
    """A ring queues the next levels' kernels before the named levels' copies end, so the window
    of levels 2..2 holds level 3's kernel too: it is drawn at a quarter of its colour, level 2's
    work in full, in Trace.plot(levels=...) and in plot_compared alike."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trace = Trace([TraceEvent("compute", "kernel", "k2", 0.0, 1.0, 0, 2),
                   TraceEvent("compute", "kernel", "k3", 1.5, 2.5, 0, 3),
                   TraceEvent("io 0", "D2H", "c2", 1.0, 3.0, 100, 2)], ["compute", "io 0"])

    def strengths(ax):
        """(x of each bar, its opacity) for every bar drawn in ax."""
        found = []
        for bars in ax.collections:
            colours = bars.get_facecolors()
            for path, colour in zip(bars.get_paths(), colours if len(colours) > 1 else [colours[0]] * 99):
                found.append((round(float(path.vertices[:, 0].min()), 3), round(float(colour[3]), 2)))
        return sorted(found)

    ax = trace.plot(levels=(2, 2))
    assert strengths(ax) == [(0.0, 1.0), (1.0, 1.0), (1.5, 0.25)]
    (panel,) = ch.timelines.plot_compared({"ring": trace}, levels=(2, 2))
    assert strengths(panel) == [(0.0, 1.0), (1.0, 1.0), (1.5, 0.25)]
    assert strengths(trace.plot()) == [(0.0, 1.0), (1.0, 1.0), (1.5, 1.0)]     # no levels named: all in full
    plt.close("all")


# -- at most six lanes a panel, every kind of bar in the legend in its own colour --------------------

def _many_streams_trace():
    """A loop with a compute stream, eight IO streams and a host lane: ten tracks."""
    ev = [TraceEvent("compute", "kernel", f"k{i}", 2.0 * i, 2.0 * i + 1.5, 0, i) for i in range(8)]
    ev += [TraceEvent(f"io {i}", "D2H", f"c{i}", 2.0 * i + 1.5, 2.0 * i + 3.0, 100, i) for i in range(8)]
    ev += [TraceEvent("host", "host wait", "w", 3.0, 4.0)]
    return Trace(ev, ["compute"] + [f"io {i}" for i in range(8)] + ["host"], {"strategy": "many"})


def test_a_trace_of_many_streams_draws_its_pool_on_one_lane_in_the_streams_view():
    import matplotlib.pyplot as plt
    from course_helper.timelines.timeline import MAX_LANES
    t = _many_streams_trace()
    assert t.lane_names("streams") == ["compute", "io", "host"]
    ax = t.plot(lanes="streams")
    labels = [x.get_text() for x in ax.get_yticklabels()]
    assert len(labels) <= MAX_LANES and labels[1].startswith("io (8 streams)")
    busy = t.busy_fractions(lanes="streams")
    assert busy["io"] == pytest.approx(covered_length(merge_intervals(
        (e.start_ms, e.end_ms) for e in t.of_kind("D2H"))) / 17.0)          # the pool's union, not one stream's
    few = Trace(t.events[:3], ["compute", "io 0", "io 1"])                 # few tracks: each its own lane
    assert few.lane_names("streams") == ["compute", "io 0", "io 1"]
    plt.close("all")


def _seven_lane_trace():
    ev = [TraceEvent(track, kind, "x", 0.0, 1.0, 0, 1) for track, kind in [
        ("rank 0 compute", "kernel"), ("rank 0 halo", "halo"), ("rank 0 io", "D2H"), ("rank 0 host", "host wait"),
        ("rank 1 compute", "kernel"), ("rank 1 halo", "halo"), ("rank 1 io", "D2H")]]
    return Trace(ev, [e.track for e in ev])


def test_more_than_six_lanes_in_a_panel_are_refused_before_anything_is_drawn():
    import matplotlib.pyplot as plt
    t = _seven_lane_trace()
    assert len(t.lane_names()) == 7
    plt.close("all")
    with pytest.raises(ValueError, match="7 lanes .*more than the 6 a panel draws readably: plot each rank's own"):
        t.plot()
    with pytest.raises(ValueError, match="seven: 7 lanes, more than the 6"):
        ch.timelines.plot_compared({"fine": hand_trace(), "seven": t})
    assert plt.get_fignums() == []                                          # refused before drawing


def test_an_idle_pool_of_streams_gets_no_empty_lane():
    """The GPU-compressed run: its IO streams queue nothing to the host, the compressed bytes
    cross from the compression stream, so an "io" lane would stand empty above the D2H lane."""
    ev = [TraceEvent("compute", "kernel", "k", 0.0, 4.0, 0, 0),
          TraceEvent("compress", "compress", "zstd level 0", 1.0, 3.0, 400, 0),
          TraceEvent("compress", "D2H", "D2H zstd level 0", 3.0, 3.5, 100, 0),
          TraceEvent("disk 0", "disk write", "write level 0", 3.5, 5.0, 100, 0)]
    t = Trace(ev, ["compute", "io 0", "io 1", "compress", "disk 0", "host"])
    assert t.lane_names() == ["compute", "compress", "D2H", "disk", "host"]


def test_every_kind_of_bar_has_a_legend_entry_in_a_colour_of_its_own():
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex
    kinds = ["kernel", "D2H", "H2D", "compress", "disk write", "host wait", "a new kind", "another kind"]
    ev = [TraceEvent(f"stream {i // 2}", kind, "x", float(i), i + 0.5, 0, i) for i, kind in enumerate(kinds)]
    t = Trace(ev, [f"stream {i}" for i in range(4)])
    assert KINDS["compress"] != KINDS["kernel"]
    ax = t.plot(lanes="streams")                               # four lanes, two kinds on each
    legend = {text.get_text(): to_hex(patch.get_facecolor())
              for text, patch in zip(ax.get_legend().get_texts(), ax.get_legend().get_patches())}
    assert set(legend) == set(kinds)
    assert len(set(legend.values())) == len(kinds)            # no two kinds share a colour
    drawn = {to_hex(c) for coll in ax.collections for c in coll.get_facecolors()}
    assert drawn <= set(legend.values())                      # every bar's colour is in the legend
    plt.close("all")


def test_two_streams_of_one_name_get_two_lanes(cpu):
    # create_streams(1) twice names both "stream": their work must not be drawn, or judged, as one
    # stream's (the overlap doctor reads a lane as a stream)
    p = ch.WaveProblem(n0=64, n1=64, nt=4)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    a, b = ch.create_streams(1)[0], ch.create_streams(1)[0]
    with ch.tracing() as t:
        ch.launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=a)
        ch.launch_wave2d(U[1], U[2], U[0], V, p, 1, stream=b)
        ch.launch_wave2d(U[2], U[0], U[1], V, p, 2, stream=a)
    assert a.name == b.name == "stream"
    lanes = sorted(e.track for e in t.kernels)
    assert lanes == ["stream", "stream", "stream (2)"]
