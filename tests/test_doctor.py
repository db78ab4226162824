"""The overlap doctor (ch.doctor(), docs/doctor.md): its engine on recorded GPU fixtures and on
hand-made records, on the CPU backend with loops of the helper's API, the command line, and (on a
GPU) plain CuPy loops measured live."""
import importlib.util
import inspect
import json
import pathlib
import sys

import numpy as np
import pytest

import course_helper as ch
from course_helper import cli
from course_helper.timelines import analysis
from course_helper.timelines.analysis import DeviceOp, HostCall, HostSync, Records

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "doctor_fixtures"


def _tool():
    """tools/record_doctor_fixtures.py as a module: its loops, and the cause each must be told."""
    path = ROOT / "tools" / "record_doctor_fixtures.py"
    spec = importlib.util.spec_from_file_location("record_doctor_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


# --------------------------------------------------------------------------
# Recorded on a GPU: the engine names each plain CuPy loop's root cause
# --------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TOOL.LOOPS))
def test_the_engine_names_the_root_cause_of_each_recorded_loop(name):
    path = FIXTURES / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} not recorded yet: run tools/record_doctor_fixtures.py on a GPU "
                    "and commit tests/doctor_fixtures/")
    dx = ch.timelines.diagnose_records(path)
    expected = TOOL.LOOPS[name][1]
    if expected is None:
        assert dx.codes == [], dx.report()
        assert dx.hidden > 0.5, dx.report()
    else:
        assert dx.codes[0] == expected, dx.report()
        assert dx.findings[0].cost_ms >= analysis.threshold_ms(dx.numbers["span_ms"])
        # the learner's line, as the recording machine saw it (relative to the repository): a
        # fixture whose lines no longer match the tool's markers must be recorded again
        assert dx.findings[0].where == _expected_where(name, "tools/record_doctor_fixtures.py"), dx.report()
    if expected != "launch-bound":
        # the kernels here are long: gaps the host left while held in a copy or a wait are those
        # calls' cost, never a launch-bound finding
        assert "launch-bound" not in dx.codes, dx.report()
    assert not dx.modelled and dx.records.timing == "CUPTI"


# --------------------------------------------------------------------------
# The engine on hand-made records: each rule, and the threshold
# --------------------------------------------------------------------------
def _records(ops, calls=(), syncs=(), legacy=()):
    streams = {o.stream: {"name": f"stream {o.stream}", "legacy_default": o.stream in legacy} for o in ops}
    return Records(list(ops), list(calls), list(syncs), streams, timing="CUPTI", device="test")


def _serial(n=8, kernel=1.0, copy=0.5, host="PINNED", copy_stream="1", kernel_stream="1", call_ms=0.005):
    """n steps: a kernel, then a copy that starts when it ends (nothing overlaps); each op has its call."""
    ops, calls, t = [], [], 0.0
    for i in range(n):
        ops.append(DeviceOp("kernel", kernel_stream, t, t + kernel, corr=2 * i))
        calls.append(HostCall("launch", "cuLaunchKernel", t - 0.5, t - 0.5 + call_ms, 2 * i))
        t += kernel
        ops.append(DeviceOp("D2H", copy_stream, t, t + copy, 1 << 20, host, 2 * i + 1))
        calls.append(HostCall("copy", "cudaMemcpyAsync", t - 1.0, t - 1.0 + call_ms, 2 * i + 1, "loop.py:7"))
        t += copy
    return ops, calls


def _overlapped(n=8, kernel=1.0, copy=0.5):
    """The copy of step i runs under the kernel of step i+1, on its own stream, from pinned memory."""
    ops, calls = [], []
    for i in range(n):
        ops.append(DeviceOp("kernel", "1", i * kernel, (i + 1) * kernel, corr=2 * i))
        calls.append(HostCall("launch", "cuLaunchKernel", i * 0.01, i * 0.01 + 0.005, 2 * i))
        ops.append(DeviceOp("D2H", "2", (i + 1) * kernel, (i + 1) * kernel + copy, 1 << 20, "PINNED", 2 * i + 1))
        calls.append(HostCall("copy", "cudaMemcpyAsync", i * 0.01 + 0.005, i * 0.01 + 0.008, 2 * i + 1, "loop.py:9"))
    return ops, calls


def test_a_loop_whose_copies_run_under_its_kernels_gets_no_finding():
    ops, calls = _overlapped()
    dx = ch.timelines.diagnose_records(_records(ops, calls))
    assert dx.codes == []
    assert dx.hidden > 0.8
    assert "No findings" in str(dx)


def test_copies_to_pageable_memory_are_told_with_the_host_time_inside_the_calls():
    ops, calls = _serial(host="PAGEABLE", call_ms=0.6)
    dx = ch.timelines.diagnose_records(_records(ops, calls))
    assert dx.codes[0] == "pageable-copy"
    f = dx.findings[0]
    assert f.where == "loop.py:7"
    assert f.numbers["host_ms"] == pytest.approx(8 * 0.6)
    assert f.cost_ms == pytest.approx(8 * 0.6)
    assert "pinned" in f.message and "notebook 03" in f.message and "4.80 ms" in f.message


def test_copies_on_the_kernels_stream_are_told_with_the_overlap_they_missed():
    ops, calls = _serial(copy_stream="1")
    dx = ch.timelines.diagnose_records(_records(ops, calls))
    assert dx.codes == ["copy-on-compute-stream"]
    # the shorter of copying and computing inside the kernels' window (7 copies of 0.5 ms), none overlapped
    assert dx.findings[0].cost_ms == pytest.approx(7 * 0.5)


def test_copies_on_their_own_stream_that_still_run_between_the_kernels_are_not_hidden():
    ops, calls = _serial(copy_stream="2")
    dx = ch.timelines.diagnose_records(_records(ops, calls))
    assert dx.codes == ["copies-not-hidden"]
    assert dx.findings[0].where == "loop.py:7"
    assert dx.hidden == 0.0


def test_kernels_on_the_legacy_default_stream_serialising_the_copies_are_told():
    ops, calls = _serial(copy_stream="2", kernel_stream="7")
    dx = ch.timelines.diagnose_records(_records(ops, calls, legacy=("7",)))
    assert dx.codes == ["default-stream"]
    # the same loop on a stream that is not the legacy default is only "not hidden"
    assert ch.timelines.diagnose_records(_records(ops, calls)).codes == ["copies-not-hidden"]


def test_copies_on_the_legacy_default_stream_beside_blocking_kernel_streams_are_told():
    ops, calls = _serial(copy_stream="0", kernel_stream="1")
    records = _records(ops, calls, legacy=("0",))
    dx = ch.timelines.diagnose_records(records)
    assert dx.codes == ["default-stream"] and dx.findings[0].where == "loop.py:7"
    # CUPTI does not say whether a stream is blocking (then it counts as blocking, CUDA's default);
    # where the records say the kernels' stream is non-blocking, the default stream is not to blame
    records.streams["1"]["blocking"] = False
    assert ch.timelines.diagnose_records(records).codes == ["copies-not-hidden"]


def test_a_host_wait_that_lets_the_device_run_dry_is_told_and_one_at_the_end_is_not():
    ops, calls = _overlapped()
    # the host waits after step 3's copy until it ends, then the next kernel starts 0.3 ms later
    k4 = next(o for o in ops if o.kind == "kernel" and o.start == 4.0)
    shifted = [o._replace(start=o.start + 1.0, end=o.end + 1.0) if o.start >= 4.0 else o for o in ops]
    wait = HostSync("STREAM_SYNCHRONIZE", "2", 3.9, 4.7, "cudaStreamSynchronize", "loop.py:11")
    at_end = HostSync("CONTEXT_SYNCHRONIZE", None, 9.0, 9.6, "cudaDeviceSynchronize", "loop.py:13")
    dx = ch.timelines.diagnose_records(_records(shifted, calls, [wait, at_end]))
    assert "host-wait-in-loop" in dx.codes
    f = dx.findings[dx.codes.index("host-wait-in-loop")]
    assert f.where == "loop.py:11" and f.numbers["waits"] == 1
    assert f.cost_ms == pytest.approx(5.0 - 4.0)              # no kernel from 4.0 (k3's end) to 5.0
    assert k4.start == 4.0
    assert "host-wait-in-loop" not in ch.timelines.diagnose_records(_records(ops, calls, [at_end])).codes
    # a wait that ends while the device still runs a copy (an older one, in a ring) leaves it no gap to fill
    busy = [o._replace(end=4.8) if o.kind == "D2H" and o.start == 3.0 else o for o in shifted]
    assert "host-wait-in-loop" not in ch.timelines.diagnose_records(_records(busy, calls, [wait, at_end])).codes


def test_a_host_wait_too_short_to_report_leaves_the_other_rules_working():
    # copies on their own stream that never run under a kernel, and one wait that lets the device
    # run dry for 10 µs: under the threshold, so the copies are still told as not hidden
    ops, calls = _serial(copy_stream="2")
    k2 = next(o for o in ops if o.kind == "kernel" and o.corr == 4)
    ops = [o._replace(start=o.start + 0.01, end=o.end + 0.01) if o.start >= k2.start else o for o in ops]
    wait = HostSync("STREAM_SYNCHRONIZE", "2", k2.start - 0.2, k2.start, "cudaStreamSynchronize", "loop.py:11")
    dx = ch.timelines.diagnose_records(_records(ops, calls, [wait]))
    assert dx.codes == ["copies-not-hidden"]


def test_kernels_that_start_when_their_launch_call_ends_are_launch_bound():
    ops, calls = [], []
    for i in range(100):                      # 1 µs kernels, launched every 15 µs
        t = i * 0.015
        calls.append(HostCall("launch", "cuLaunchKernel", t, t + 0.005, i))
        ops.append(DeviceOp("kernel", "1", t + 0.007, t + 0.008, corr=i))
    dx = ch.timelines.diagnose_records(_records(ops, calls))
    assert dx.codes == ["launch-bound"]
    f = dx.findings[0]
    assert f.numbers["median_gap_us"] == pytest.approx(14.0)
    assert "graph" in f.message and "notebook 10" in f.message
    # the same kernels queued long before they run (the device busy with other work) are not
    early = [c._replace(start=c.start - 1.0, end=c.end - 1.0) for c in calls]
    assert ch.timelines.diagnose_records(_records(ops, early)).codes == []
    # launch calls that held the host until just before their kernel ran: the driver's queue was
    # full, the device set the pace, and the host only waited for it
    full = [c._replace(start=c.start - 0.05) for c in calls]
    assert ch.timelines.diagnose_records(_records(ops, full)).codes == []


def test_gaps_between_kernels_filled_by_copies_are_not_launch_bound():
    # kernels of 10 µs, each waiting for a 140 µs copy on another stream: the copies set the pace,
    # and the launch of each kernel ends just before it starts (the host queued it late); the device
    # never sits idle, so CUDA graphs would gain nothing
    ops, calls = [], []
    for i in range(100):
        t = i * 0.15
        ops.append(DeviceOp("D2H", "2", t, t + 0.14, 1 << 22, "PINNED", 1000 + i))
        ops.append(DeviceOp("kernel", "1", t + 0.14, t + 0.15, corr=i))
        calls.append(HostCall("launch", "cuLaunchKernel", t + 0.13, t + 0.135, i))
        calls.append(HostCall("copy", "cudaMemcpyAsync", t - 0.01, t - 0.005, 1000 + i, "loop.py:9"))
    assert "launch-bound" not in ch.timelines.diagnose_records(_records(ops, calls)).codes
    # the same kernels with the copies gone: the device idles in the gaps, and that is launch-bound
    kernels_only = [o for o in ops if o.kind == "kernel"]
    assert ch.timelines.diagnose_records(_records(kernels_only, calls)).codes == ["launch-bound"]


def test_gaps_a_copy_ran_through_are_not_launch_bound():
    """A copy-bound loop: its kernels start as soon as the host launches them, but a copy runs in every
    gap, so the device never sat idle and launching faster would not shorten the block."""
    ops, calls = [], []
    for i in range(100):
        t = i * 0.015
        calls.append(HostCall("launch", "cuLaunchKernel", t, t + 0.005, i))
        ops.append(DeviceOp("kernel", "1", t + 0.007, t + 0.008, corr=i))
        ops.append(DeviceOp("D2H", "2", t + 0.008, t + 0.0225, host="PINNED"))
    assert "launch-bound" not in ch.timelines.diagnose_records(_records(ops, calls)).codes
    # the same gaps with the copies a third as long leave the device idle two thirds of each gap
    short = [o._replace(end=o.start + 0.0045) if o.kind == "D2H" else o for o in ops]
    dx = ch.timelines.diagnose_records(_records(short, calls))
    assert dx.codes == ["launch-bound"]
    assert dx.findings[0].numbers["median_gap_us"] == pytest.approx(14.0 - 4.5)


def test_the_course_events_loop_at_1024_recorded_on_a_gpu_gets_no_finding():
    """The course's events loop at 1024² x 640 (tests/doctor_fixtures/course_events_loop_1024.json,
    recorded with CUPTI on an H200): copy-bound, every copy from pinned memory on its own stream; its
    first kernels wait for the host while the copies already run, which costs nothing."""
    dx = ch.timelines.diagnose_records(FIXTURES / "course_events_loop_1024.json")
    assert dx.records.timing == "CUPTI" and not dx.modelled
    assert len(dx.records.ops) > 1000
    assert dx.codes == [], dx.report()


def test_a_cost_under_the_threshold_is_no_finding():
    ops, calls = _overlapped(n=100)
    # one pageable copy among a hundred, whose call held the host 10 µs: under 0.05 ms
    ops[1] = ops[1]._replace(host="PAGEABLE")
    calls[1] = calls[1]._replace(end=calls[1].start + 0.01)
    assert ch.timelines.diagnose_records(_records(ops, calls)).codes == []
    calls[1] = calls[1]._replace(end=calls[1].start + 3.0)      # 3 ms: over 2% of the 100 ms span
    assert ch.timelines.diagnose_records(_records(ops, calls)).codes == ["pageable-copy"]


def test_records_round_trip_through_json_and_other_files_are_refused(tmp_path):
    ops, calls = _serial(host="PAGEABLE", call_ms=0.6)
    records = _records(ops, calls, [HostSync("EVENT_SYNCHRONIZE", None, 1.0, 2.0, "cudaEventSynchronize", None)])
    path = records.save(tmp_path / "r.json")
    again = Records.load(path)
    assert again.to_dict() == records.to_dict()                 # times kept to 10 ns
    assert len(again.ops) == 16 and again.calls[1].where == "loop.py:7" and again.syncs[0].stream is None
    assert again.ops[1].start == pytest.approx(records.ops[1].start, abs=1e-5)
    assert ch.timelines.diagnose_records(path).codes == ch.timelines.diagnose_records(records).codes
    (tmp_path / "other.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not the doctor's records"):
        ch.timelines.diagnose_records(tmp_path / "other.json")


def test_the_hidden_rule_has_one_home():
    assert ch.exercises.hidden_by_direction is analysis.hidden_by_direction
    assert ch.exercises.core.Hidden is analysis.Hidden


# --------------------------------------------------------------------------
# The CPU backend: loops written with the helper's API, modelled
# --------------------------------------------------------------------------
def _diagnose_strategy(strategy, n, nt, every=1):
    loop = {"sequential": ch.strategies.sequential, "sequential-pinned": ch.strategies.sequential_pinned,
            "events": ch.strategies.with_events}[strategy]
    with ch.timing_only():
        run = ch.prepare(ch.WaveProblem(n0=n, n1=n, nt=nt), strategy, every=every)
        with ch.doctor() as dx:
            with run:
                loop(run)
    return dx


def _loop_line(function, marker):
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, text in enumerate(lines) if marker in text)


def test_the_sequential_loop_is_told_its_copies_are_pageable(cpu):
    dx = _diagnose_strategy("sequential", 1024, 40)
    assert dx.codes[0] == "pageable-copy"
    assert dx.modelled and "(modelled)" in dx.findings[0].message and "(modelled)" in str(dx)
    path, _, line = dx.findings[0].where.rpartition(":")
    assert path.endswith("strategies.py")
    assert int(line) == _loop_line(ch.strategies.sequential, "copy_to_host(")


def test_the_sequential_pinned_loop_is_told_its_copies_share_the_kernels_stream(cpu):
    dx = _diagnose_strategy("sequential-pinned", 1024, 40)
    assert dx.codes[0] == "copy-on-compute-stream"
    assert "pageable-copy" not in dx.codes


def test_the_events_loop_at_the_balanced_point_has_its_copies_hidden(cpu):
    dx = _diagnose_strategy("events", 3072, 320, every=16)
    assert not {"pageable-copy", "copy-on-compute-stream", "copies-not-hidden", "host-wait-in-loop"} & set(dx.codes)
    assert dx.hidden >= 0.85


def test_the_events_loop_at_the_lessons_size_is_launch_bound(cpu):
    dx = _diagnose_strategy("events", 256, 64)
    assert "launch-bound" in dx.codes


def _default_stream_loop(run, wait_each=False):
    """Kernels on the legacy default stream, copies on a blocking IO stream, ordered by events
    (``wait_each``: on a non-blocking compute stream instead, the host waiting for each copy)."""
    U, m = run.U, run.nscratch
    compute = ch.create_streams(1, name="compute")[0] if wait_each else ch.default_stream()
    io, = ch.create_streams(1, blocking=True, name="io")
    ready, copied = ch.create_events(m), ch.create_events(m)
    for level in range(2, run.nt):
        b = level % m
        compute.wait_event(copied[b])
        ch.launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[b], run.V, run.problem, n=level - 2,
                         stream=compute)
        compute.record(ready[b])
        io.wait_event(ready[b])
        ch.copy_to_host_async(run.images[level], U[b], io, level=level)
        io.record(copied[b])
        if wait_each:
            io.synchronize()                   # the host waits here
    ch.synchronize()


def test_kernels_on_the_default_stream_are_told_on_the_cpu_backend_too(cpu):
    with ch.timing_only():
        run = ch.prepare(ch.WaveProblem(n0=2048, n1=2048, nt=40), "events", every=1, nscratch=4)
        with ch.doctor() as dx:
            _default_stream_loop(run)
    assert dx.codes[0] == "default-stream"


def test_a_host_wait_in_the_loop_names_the_learners_line(cpu):
    with ch.timing_only():
        run = ch.prepare(ch.WaveProblem(n0=2048, n1=2048, nt=40), "events", every=1, nscratch=4)
        with ch.doctor() as dx:
            _default_stream_loop(run, wait_each=True)
    assert dx.codes[0] == "host-wait-in-loop"
    assert dx.findings[0].where == f"{__file__}:{_loop_line(_default_stream_loop, 'io.synchronize()')}"


def _learners_ring(run, pageable=False, wait_each=False, blocking=False, copies_on_default=False,
                   wrong_event=False, wait_stream=False, final_syncs=False, one_name=False):
    """A loop as a learner writes it with the helper's API: each saved level copied as soon as it is
    computed, from its own buffer of a ring of ``run.nscratch``, on that buffer's IO stream, ordered
    by events; the kernel that overwrites a buffer waits for its copy. Each flag puts in one fault
    (``pageable``: into pageable memory; ``wait_each``: the host waits for each copy, on its
    "stream", its "event" or the "device"; ``blocking`` and ``copies_on_default``: blocking
    streams, the copies on the legacy default stream;
    ``wrong_event``: each kernel waits for the newest copy, not its buffer's) or one harmless
    variant (``wait_stream`` for the events, ``final_syncs`` after the loop). ``one_name``: every
    stream made alone, with create_streams' default name (the doctor must still tell them apart)."""
    U, m = run.U, run.nscratch
    if one_name:
        compute, *io = (ch.create_streams(1)[0] for _ in range(m + 1))
    else:
        compute, = ch.create_streams(1, blocking=blocking, name="compute")
        io = [ch.default_stream()] * m if copies_on_default else ch.create_streams(m, blocking=blocking, name="io")
    ready, copied = ch.create_events(m), ch.create_events(m)
    out = np.empty_like(run.images) if pageable else run.images
    newest = None
    for level in range(2, run.nt):
        b = level % m
        if wait_stream:
            compute.wait_stream(io[b])
        elif wrong_event:
            if newest is not None:
                compute.wait_event(newest)
        else:
            compute.wait_event(copied[b])
        ch.launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[b], run.V, run.problem, n=level - 2,
                         stream=compute)
        k = run.slot(level)
        if k is None:
            continue
        if wait_stream:
            io[b].wait_stream(compute)
        else:
            compute.record(ready[b])
            io[b].wait_event(ready[b])
        ch.copy_to_host_async(out[k], U[b], io[b], level=level, allow_pageable=pageable)   # doctor: copy
        newest = io[b].record(copied[b])
        if wait_each:                  # the host waits for the copy: on its stream, its event or the device
            wait = {"stream": io[b].synchronize, "event": copied[b].synchronize, "device": ch.synchronize}
            wait[wait_each]()                                                             # doctor: wait
    if final_syncs:
        ch.synchronize()
        for stream in set(io):
            stream.synchronize()


def _staged_ring(run, depth=3):
    """A correct loop of another shape: each saved level staged on the device into a ring of
    ``depth`` buffers, copied to the host from there on the buffer's IO stream."""
    U, m = run.U, run.nscratch
    compute, = ch.create_streams(1, name="compute")
    io = ch.create_streams(depth, name="io")
    stage = [ch.device_empty(U[0].shape) for _ in range(depth)]
    filled, copied = ch.create_events(depth), ch.create_events(depth)
    for level in range(2, run.nt):
        ch.launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[level % m], run.V, run.problem, n=level - 2,
                         stream=compute)
        k = run.slot(level)
        if k is None:
            continue
        s = k % depth
        compute.wait_event(copied[s])
        ch.memory.copy_on_device_async(stage[s], U[level % m], compute, level=level)
        compute.record(filled[s])
        io[s].wait_event(filled[s])
        ch.copy_to_host_async(run.images[k], stage[s], io[s], level=level)
        io[s].record(copied[s])


#: Loops of the learner's own, at the balanced point, with the root cause each must be told (None:
#: no finding) and the marker of the line it must name.
LEARNERS_LOOPS = {
    "pageable copies on their own streams": (dict(pageable=True), "pageable-copy", "# doctor: copy"),
    "a host synchronize of the IO stream after each copy": (dict(wait_each="stream"), "host-wait-in-loop",
                                                          "# doctor: wait"),
    "a host synchronize of the copy's event after each copy": (dict(wait_each="event"), "host-wait-in-loop",
                                                               "# doctor: wait"),
    "ch.synchronize() after each copy": (dict(wait_each="device"), "host-wait-in-loop", "# doctor: wait"),
    "copies on the legacy default stream, kernels on a blocking stream": (
        dict(blocking=True, copies_on_default=True), "default-stream", "# doctor: copy"),
    "each kernel waits for the newest copy (a ring of one)": (dict(wrong_event=True), "copies-not-hidden",
                                                              "# doctor: copy"),
    "a ring of one, its streams all of one name": (dict(wrong_event=True, one_name=True), "copies-not-hidden",
                                                   "# doctor: copy"),
    "a ring of three buffers, too shallow for copies as long as 16 kernels": (
        dict(nscratch=3), "copies-not-hidden", "# doctor: copy"),
    "the ring with events": (dict(), None, None),
    "the ring with events, its streams all of one name": (dict(one_name=True), None, None),
    "the ring with wait_stream instead of events": (dict(wait_stream=True), None, None),
    "the ring and extra synchronisations after the loop": (dict(final_syncs=True), None, None),
    "copies on the legacy default stream, kernels on a non-blocking stream": (
        dict(copies_on_default=True), None, None),
    "a staged ring of three": ("staged", None, None),
}


@pytest.mark.parametrize("name", list(LEARNERS_LOOPS))
def test_a_learners_own_loop_is_told_its_root_cause_at_its_line(cpu, name):
    how, expected, marker = LEARNERS_LOOPS[name]
    flags = dict(how) if how != "staged" else {}
    nscratch = flags.pop("nscratch", None)
    with ch.timing_only():
        # the events loop's run, with its deep ring (or a ring of nscratch): only its buffers are used
        run = ch.prepare(ch.WaveProblem(n0=3072, n1=3072, nt=160), "sequential-pinned" if nscratch else "events",
                         every=16, **({"nscratch": nscratch} if nscratch else {}))
        with ch.doctor() as dx:
            with run:
                if how == "staged":
                    _staged_ring(run)
                else:
                    _learners_ring(run, **flags)
    if expected is None:
        assert dx.codes == [], dx.report()
        assert dx.hidden >= 0.85, dx.report()
        return
    assert dx.codes[0] == expected, dx.report()
    f = dx.findings[0]
    assert f.where == f"{__file__}:{_loop_line(_learners_ring, marker)}", dx.report()
    # the message says what it cost, the fix and where the course teaches it; the notebook view shows it
    assert f"{f.cost_ms:.2f} ms (modelled)" in f.message and f"Fix: {f.fix}" in f.message
    assert f.section in f.message and f"{pathlib.Path(__file__).name}:" in f.message
    view = dx._repr_html_()
    assert "<table>" in view and f"<code>{expected}</code>" in view and f"{f.cost_ms:.2f}" in view
    # one fault, one finding: a pageable copy's wait inside its call is not also a host wait
    assert len(dx.codes) == 1, dx.report()


def test_the_diagnosis_exists_only_after_the_block_and_renders(cpu):
    with ch.doctor() as dx:
        with pytest.raises(RuntimeError, match="after the `with doctor"):
            _ = dx.findings
        a = ch.device_zeros((64, 64))
        ch.to_host(a)
    assert dx.codes == []
    assert "<table>" not in dx._repr_html_() and "Overlap doctor (modelled)" in dx._repr_html_()
    assert dx.trace.timing.startswith("modelled")


def test_the_diagnosis_trace_plots_the_host_waits_and_exports_for_perfetto(cpu, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    dx = _diagnose_strategy("sequential-pinned", 512, 24)
    ax = dx.trace.plot()
    lanes = [t.get_text().split("\n")[0] for t in ax.get_yticklabels()]
    assert lanes[0] == "compute" and "host" in lanes        # the host's waits have a lane of their own
    doc = json.loads(pathlib.Path(dx.trace.to_chrome_json(tmp_path / "block.json")).read_text())
    waits = [e for e in doc["traceEvents"] if e.get("ph") == "X" and "synchronize" in e.get("name", "").lower()]
    assert len(waits) == len(dx.records.syncs) > 0
    matplotlib.pyplot.close("all")


def test_the_doctor_refuses_to_run_inside_a_trace(cpu):
    with ch.tracing():
        with pytest.raises(RuntimeError, match="already being recorded"):
            with ch.doctor():
                pass


# --------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------
SCRIPT = """
import sys
import course_helper as ch
from course_helper import cli
run = ch.prepare(ch.WaveProblem(n0=int(sys.argv[1]), n1=int(sys.argv[1]), nt=24), "sequential-pinned")
with run:
    ch.strategies.sequential_pinned(run)
sys.exit(int(sys.argv[2]))
"""


def test_the_command_line_runs_a_script_under_the_doctor(cpu, tmp_path, capsys):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    argv = list(sys.argv)
    status = cli.main(["doctor", "--backend", "cpu", "--out", str(tmp_path / "out"), str(script), "512", "3"])
    out = capsys.readouterr().out
    assert status == 3                                  # the script's own exit status
    assert sys.argv == argv
    assert "copy-on-compute-stream" in out and "Overlap doctor (modelled)" in out
    doc = json.loads((tmp_path / "out" / "doctor_trace.json").read_text())
    assert doc["traceEvents"]
    assert Records.load(tmp_path / "out" / "doctor_records.json").ops


def test_the_command_line_refuses_a_missing_script(cpu, tmp_path, capsys):
    assert cli.main(["doctor", str(tmp_path / "nowhere.py")]) == 2
    assert "no script at" in capsys.readouterr().err


def test_a_script_that_raises_gets_its_traceback_the_report_and_status_1(cpu, tmp_path, capsys):
    script = tmp_path / "fails.py"
    text = SCRIPT.replace("sys.exit(int(sys.argv[2]))", "raise KeyError('no such level')")
    script.write_text(text)
    line = text.splitlines().index("raise KeyError('no such level')") + 1
    status = cli.main(["doctor", "--backend", "cpu", str(script), "512", "0"])
    captured = capsys.readouterr()
    assert status == 1                                  # as `python fails.py` would exit
    # the script's traceback, from its own line (not the doctor's or runpy's frames), then the report
    # of what it did before it raised
    assert f'File "{script}", line {line}' in captured.err and "KeyError: 'no such level'" in captured.err
    assert "cli.py" not in captured.err and "runpy" not in captured.err
    assert "copy-on-compute-stream" in captured.out
    assert "exit status 1" in captured.err


@pytest.mark.parametrize("ending, status", [("sys.exit('bad arguments')", 1), ("sys.exit()", 0),
                                            ("sys.exit(None)", 0)])
def test_a_script_that_exits_gets_the_status_python_gives_it(cpu, tmp_path, capsys, ending, status):
    script = tmp_path / "exits.py"
    script.write_text(f"import sys\n{ending}\n")
    assert cli.main(["doctor", "--backend", "cpu", str(script)]) == status
    captured = capsys.readouterr()
    assert ("bad arguments" in captured.err) == ("bad arguments" in ending)


def test_a_script_with_no_device_work_is_told_there_was_nothing_to_diagnose(cpu, tmp_path, capsys):
    script = tmp_path / "host_only.py"
    script.write_text("import numpy as np\nprint(np.arange(4).sum())\n")
    assert cli.main(["doctor", "--backend", "cpu", str(script)]) == 0
    out = capsys.readouterr().out
    assert "No device work was recorded" in out and "helper's API" in out and "No findings" not in out


# --------------------------------------------------------------------------
# On a GPU: plain CuPy loops, measured live
# --------------------------------------------------------------------------
def _expected_where(name, path):
    """The "file:line" the root cause of the tool's loop ``name`` must name (``path`` the tool's
    file as the records spell it), or None for a finding that names no line (launch-bound)."""
    loop, expected = TOOL.LOOPS[name]
    if expected == "launch-bound":
        return None
    marker = "# doctor: wait" if expected == "host-wait-in-loop" else "# doctor: copy"
    source = loop if expected not in ("host-wait-in-loop", "default-stream", "copies-not-hidden") else TOOL.ring
    return f"{path}:{_loop_line(source, marker)}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TOOL.LOOPS))
def test_plain_cupy_loops_are_diagnosed_live(gpu, name):
    expected = TOOL.LOOPS[name][1]
    dx = TOOL.diagnosed(name)
    assert dx.records.timing == "CUPTI" and not dx.modelled
    if expected is None:
        assert dx.codes == [], dx.report()
        return
    assert dx.codes[0] == expected, dx.report()
    assert dx.findings[0].where == _expected_where(name, str(ROOT / "tools" / "record_doctor_fixtures.py")), \
        dx.report()


@pytest.mark.gpu
def test_a_gpu_block_records_copies_with_their_memory_kinds(gpu):
    dx = TOOL.diagnosed("asnumpy_pageable")
    copies = [o for o in dx.records.ops if o.kind == "D2H"]
    assert copies and all(o.host == "PAGEABLE" for o in copies)
    assert any(c.name.startswith("cudaMemcpy") for c in dx.records.calls)
    dx = TOOL.diagnosed("pinned_ring_events")
    assert all(o.host == "PINNED" for o in dx.records.ops if o.kind == "D2H")
    assert dx.hidden > 0.5
