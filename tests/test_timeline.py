import errno
import json
import os
import stat

import pytest

import course_helper as ch
from course_helper.timeline import Trace, TraceEvent


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
    assert s["overlap_fraction"] == pytest.approx(0.5)


def test_summary_of_empty_and_copy_free_traces():
    assert Trace([], []).summary()["overlap_fraction"] == 0.0
    t = Trace([TraceEvent("compute", "kernel", "k", 0, 1)], ["compute"])
    assert t.summary() == {"compute_ms": 1, "copy_ms": 0, "overlap_ms": 0, "host_wait_ms": 0,
                           "total_ms": 1, "overlap_fraction": 0.0, "timing": "not recorded"}


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
        for (a0, a1), (b0, _) in zip(s, s[1:]):
            assert b0 >= a1 - 1e-6, f"events overlap on track {names[tid]}"
    return names


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
    assert [l.get_text() for l in ax.get_yticklabels()][0] == "compute"
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


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) for a real full disk")
def test_full_disk_names_the_file_and_leaves_nothing_behind(tmp_path):
    from course_helper.timeline import write_atomically

    def write_onto_a_full_disk(f):
        f.write("partial")
        with open("/dev/full", "w") as full:     # every write there fails with ENOSPC
            full.write("x")

    with pytest.raises(OSError) as info:
        write_atomically(tmp_path / "x.json", write_onto_a_full_disk)
    assert info.value.errno == errno.ENOSPC
    assert str(tmp_path / "x.json") in str(info.value) and "free some space" in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)],
                         ids=["umask-022", "umask-077", "umask-002"])
def test_files_get_the_usual_mode_under_the_umask(tmp_path, umask, mode):
    from course_helper.timeline import write_atomically
    previous = os.umask(umask)
    try:
        path = write_atomically(tmp_path / "x.json", lambda f: f.write("{}"))
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode


def test_failed_write_removes_the_temporary_file(tmp_path):
    from course_helper.timeline import write_atomically

    def boom(f):
        f.write("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomically(tmp_path / "x.json", boom)
    assert os.listdir(tmp_path) == []


def test_plot_keeps_the_legend_off_the_bars_and_every_operation_visible(cpu):
    import matplotlib.pyplot as plt
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
    widths = [path.get_extents(transform=ax.transData).width
              for bars in ax.collections for path in bars.get_paths()]
    assert len(widths) == len(t.events)
    assert min(widths) >= 0.999, f"an operation drawn {min(widths):.2f} pixels wide"
    plt.close(fig)
