"""Streaming the saved levels to a Zarr store: same results, bounded memory, nothing torn."""
import dataclasses
import errno
import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import course_helper as ch
from course_helper.runtime import observe
from course_helper import disk, files
from course_helper.disk import layout
from course_helper.disk import sink as sink_module

CPU_STRATEGIES = ("sequential", "streams", "events", "staged")
ROOT = Path(__file__).resolve().parents[2]
CHILD_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                 COURSE_HELPER_BACKEND="cpu")


@pytest.fixture(autouse=True)
def _cpu():
    ch.set_backend("cpu")


def _problem(nt=40):
    return ch.WaveProblem(n0=48, n1=40, nt=nt)


@functools.cache
def _in_memory(n, nt, strategy):
    """The saved levels of the in-memory solve of an n x n grid over nt steps on the CPU backend: what
    a streamed run's store must hold. Solved once per process (the kill tests compare against the
    same runs), and read-only, so that no test can change it for the next."""
    ch.set_backend("cpu")
    images = np.array(ch.solve(ch.WaveProblem(n0=n, n1=n, nt=nt), strategy, trace=False).images)  # its own memory
    images.setflags(write=False)
    return images


@pytest.mark.parametrize("strategy", CPU_STRATEGIES)
@pytest.mark.parametrize("every, compress", [(1, None), (3, "zstd"), (2, "blosc"), (2, "gpu-zstd")])
def test_store_equals_in_memory_result(tmp_path, strategy, every, compress):
    p = _problem()
    ref = ch.solve(p, strategy, every=every, trace=False)
    r = ch.solve(p, strategy, every=every, trace=False, store=tmp_path / "run.zarr", compress=compress)
    stored = disk.open_store(tmp_path / "run.zarr")
    assert np.array_equal(stored.images[:], ref.images)
    assert np.array_equal(r.images[:], ref.images)
    assert stored.complete.all()
    assert np.array_equal(stored.levels, ref.levels)
    assert np.allclose(stored.times_ms, ref.times_ms)
    assert stored.attrs["dt_s"] == p.dt and stored.attrs["every"] == every
    assert stored.peak_amplitude() == pytest.approx(float(np.abs(ref.images).max()))
    assert np.array_equal(stored.group["peak"][:], np.abs(ref.images).max(axis=(1, 2)))   # level by level


@pytest.mark.parametrize("strategy", CPU_STRATEGIES)
def test_the_sink_is_a_stage_of_the_pipeline_not_an_observer(tmp_path, monkeypatch, strategy):
    """The copy into a ring slot hands the slot to the sink; the sink never listens to the runtime."""
    added, handed = [], []
    real_add, real_handed = observe.add, sink_module.DiskSink.copy_queued
    monkeypatch.setattr(observe, "add", lambda obs, *a, **k: (added.append(obs), real_add(obs, *a, **k))[1])
    monkeypatch.setattr(sink_module.DiskSink, "copy_queued",
                        lambda self, s, first, n, stream: (handed.append((first, n)), real_handed(self, s, first, n,
                                                                                                   stream))[1])
    p = _problem(nt=12)        # no more chunks than slots: a slot never handed on fails here, not hangs
    r = ch.solve(p, strategy, every=2, trace=True, store=tmp_path / "s.zarr", batch=_batch(strategy))
    assert not [o for o in added if isinstance(o, sink_module.DiskSink)]
    chunk = r.images.chunks[0]
    assert handed == [(first, min(chunk, len(r.levels) - first)) for first in range(0, len(r.levels), chunk)]
    assert disk.open_store(tmp_path / "s.zarr").complete.all()


def test_a_run_streamed_to_a_store_is_checked_once(tmp_path, monkeypatch):
    """solve checks its arguments and the store's target once, into one plan that the memory
    check, the allocation and the sink reuse."""
    from course_helper import solver
    calls = []

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(solver, "_validate", counted("validate", solver._validate))
    monkeypatch.setattr(disk, "check_target", counted("check_target", disk.check_target))
    monkeypatch.setattr(sink_module, "check_target", counted("check_target", sink_module.check_target))
    r = ch.solve(_problem(nt=8), "staged", store=tmp_path / "s.zarr", trace=False)
    assert r.computed and sorted(calls) == ["check_target", "validate"]


def test_a_ring_slot_carries_the_hand_off_and_arrays_made_from_it_do_not(tmp_path):
    sink = disk.DiskSink(tmp_path / "s.zarr", _problem(nt=8), 1, 1)
    try:
        view = sink.ring[0]
        assert isinstance(view, sink_module.Slot) and view.shape == (48, 40) and callable(view.copy_queued)
        # Arrays made from it keep the class's copy_queued, which hands nothing on.
        assert all(vars(a).get("copy_queued") is None for a in (view[1:], view + 1)) and vars(view)["copy_queued"]
        src = ch.memory.device_zeros(view.shape)
        ch.memory.copy_to_host_async(view, src, ch.create_streams(1)[0], level=0)   # hands slot 0 on
        ch.synchronize()
    finally:
        sink.finish()
    stored = disk.open_store(tmp_path / "s.zarr")
    assert stored.complete.tolist() == [True] + [False] * 7 and (stored.images[0] == 0).all()


def test_store_is_an_xarray_dataset_with_coordinates(tmp_path):
    xr = pytest.importorskip("xarray")
    p = _problem()
    ref = ch.solve(p, "staged", every=2, trace=False, store=tmp_path / "s.zarr", batch=3)
    ds = xr.open_zarr(tmp_path / "s.zarr")
    assert ds["u"].dims == ("time", "x0", "x1")
    assert np.allclose(ds["time"].values, ref.levels * p.dt)
    assert np.allclose(ds["x1"].values, np.arange(p.n1) * p.dx1)
    assert ds["u"].encoding["chunks"] == (3, p.n0, p.n1)       # one staging batch per chunk
    assert np.array_equal(ds["u"].isel(time=5).values, disk.open_store(tmp_path / "s.zarr").images[5])


def test_the_timeline_has_a_disk_lane(tmp_path):
    r = ch.solve(_problem(), "events", store=tmp_path / "t.zarr")
    writes = r.trace.of_kind("disk write")
    lanes = {f"disk {i}" for i in range(disk.DEFAULT_WRITERS)}
    assert lanes >= {e.track for e in writes} and "disk 0" in r.trace.tracks
    assert sum(e.bytes for e in writes) == len(r.levels) * _problem().nbytes_level
    assert all(e.end_ms >= e.start_ms for e in writes)


def test_refused_combinations(monkeypatch):
    with pytest.raises(ValueError, match="store=PATH"):
        ch.solve(_problem(), "events", compress="zstd")
    with pytest.raises(ValueError, match="compress"):
        ch.solve(_problem(), "events", store="/nonexistent/x", compress="lzma")
    with pytest.raises(ValueError, match="captured loop"):          # refused on every backend
        ch.solve(_problem(), "graph", store="/nonexistent/x")


def test_existing_or_unreachable_path_is_refused_before_the_run(tmp_path, monkeypatch):
    (tmp_path / "old.zarr").mkdir()
    with pytest.raises(FileExistsError, match="old.zarr"):
        ch.solve(_problem(), "events", store=tmp_path / "old.zarr")
    with pytest.raises(FileNotFoundError, match="missing"):
        ch.solve(_problem(), "events", store=tmp_path / "missing" / "run.zarr")
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(PermissionError, match="not writable"):
        ch.solve(_problem(), "events", store=tmp_path / "ro.zarr")
    assert not (tmp_path / "ro.zarr").exists()


def test_not_enough_free_space_is_refused_before_the_run(tmp_path, monkeypatch):
    p = _problem()
    need = len(range(0, p.nt, 1)) * p.nbytes_level
    monkeypatch.setattr(layout, "free_bytes", lambda folder: need - 1)
    with pytest.raises(OSError, match="full.zarr") as info:
        ch.solve(p, "events", store=tmp_path / "full.zarr")
    assert info.value.errno == errno.ENOSPC
    assert not (tmp_path / "full.zarr").exists()
    monkeypatch.setattr(layout, "free_bytes", lambda folder: need)
    ch.solve(p, "events", store=tmp_path / "fits.zarr", trace=False)
    monkeypatch.setattr(layout, "free_bytes", lambda folder: need - 1)
    with pytest.raises(OSError, match="counted uncompressed"):     # conservative, and says so
        ch.solve(p, "events", store=tmp_path / "zstd.zarr", compress="zstd")
    assert not (tmp_path / "zstd.zarr").exists()


def _batch(strategy):
    return 4 if strategy == "staged" else None       # several chunks even on a small problem


def _assert_never_torn(path, ref_images):
    """Every level is complete and equal to the reference, or all NaN; flagged levels are correct."""
    s = disk.open_store(path)
    images = s.images[:]
    for k, (got, want) in enumerate(zip(images, ref_images)):
        nan = np.isnan(got)
        assert nan.all() or (not nan.any() and np.array_equal(got, want)), f"level index {k} is torn"
        if s.complete[k]:
            assert np.array_equal(got, want), f"level index {k} is flagged complete but wrong"
        elif not nan.all():
            pass        # landed, killed before its flag: complete data, conservatively unflagged
    return s


@pytest.mark.parametrize("compress", [None, "gpu-zstd"])
@pytest.mark.parametrize("strategy", ["events", "staged"])
def test_disk_full_mid_run_names_the_store_and_leaves_no_torn_level(tmp_path, monkeypatch, strategy, compress):
    p = _problem(nt=60)
    ref = ch.solve(p, strategy, trace=False)
    real_put, calls = files.write_atomically, []

    def filling_put(path, data, **kw):
        if "/u/c." in str(path).replace(os.sep, "/"):
            calls.append(path)
            if len(calls) > 5:
                raise OSError(errno.ENOSPC, "No space left on device")
        real_put(path, data, **kw)

    monkeypatch.setattr(files, "write_atomically", filling_put)
    with pytest.raises(OSError, match="full") as info:
        ch.solve(p, strategy, trace=False, store=tmp_path / "d.zarr", batch=_batch(strategy), compress=compress)
    assert str(tmp_path / "d.zarr") in str(info.value)
    s = _assert_never_torn(tmp_path / "d.zarr", ref.images)
    assert 0 < s.complete.sum() < len(ref.levels)


class _CtrlC:
    """Raises KeyboardInterrupt when the copy of ``level`` is queued (to the host, or on the device
    where the store compresses there), as a Ctrl-C there would."""

    def __init__(self, level):
        self.level = level

    def op_queued(self, op):
        if op.kind in ("D2H", "D2D") and op.level == self.level:
            raise KeyboardInterrupt


@pytest.mark.parametrize("compress", [None, "gpu-zstd"])
@pytest.mark.parametrize("strategy", CPU_STRATEGIES)
def test_ctrl_c_leaves_complete_levels_and_no_torn_one(tmp_path, strategy, compress):
    p = _problem(nt=60)
    ref = ch.solve(p, strategy, trace=False)
    stop = 32 if strategy != "staged" else 28        # a staged batch ships from its first level
    observe.add(_CtrlC(stop))
    try:
        with pytest.raises(KeyboardInterrupt):
            ch.solve(p, strategy, trace=False, store=tmp_path / "c.zarr", batch=_batch(strategy), compress=compress)
    finally:
        observe.remove(observe.active()[-1])
    s = _assert_never_torn(tmp_path / "c.zarr", ref.images)
    first_missing = int(np.argmin(s.complete))
    assert 0 < first_missing <= stop and not s.complete[first_missing:].any()
    assert s.complete[:first_missing].all()                # everything before the interrupt landed


_CHILD = textwrap.dedent("""
    import sys, course_helper as ch
    ch.set_backend("cpu")
    p = ch.WaveProblem(n0=96, n1=96, nt=int(sys.argv[2]))
    ch.solve(p, sys.argv[3], trace=False, store=sys.argv[1], compress=sys.argv[4] if len(sys.argv) > 4 else None)
""")


@pytest.mark.parametrize("strategy, compress", [("events", None), ("staged", None), ("staged", "gpu-zstd")])
def test_sigkill_mid_run_leaves_every_level_complete_or_absent(tmp_path, strategy, compress):
    nt = 1500
    path = tmp_path / "k.zarr"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(nt), strategy, *[compress] * bool(compress)],
                             env=CHILD_ENV, stderr=subprocess.PIPE)
    flags = path / "complete" / "c" / "0"          # the flags: one file, rewritten as chunks land
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        if flags.is_file() and len(list((path / "u").glob("c.*"))) >= 3:      # a few chunks have landed
            break
        time.sleep(0.005)
    assert child.poll() is None, f"the run ended before it could be killed: {child.stderr.read()!r}"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    ref = _in_memory(96, nt, strategy)
    s = _assert_never_torn(path, ref)
    assert 0 < s.complete.sum() < len(ref)
    assert np.isnan(s.images[len(ref) - 1]).all()     # the last level never arrived


_MEMORY_CHILD = textwrap.dedent("""
    import json, sys, tracemalloc, course_helper as ch
    ch.set_backend("cpu")
    p = ch.WaveProblem(n0=512, n1=512, nt=500)                     # 500 levels of 1 MiB

    def status(key):    # from /proc/self/status (ru_maxrss would include the parent's at fork time)
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

    # A tiny streamed run first loads what the pipeline loads on first use (codecs, threads), so
    # that what is measured below is what a run's size costs, on any machine's libraries.
    ch.solve(ch.WaveProblem(n0=16, n1=16, nt=8), sys.argv[2], trace=False, store=sys.argv[1] + ".warm")
    before = status("VmRSS:")
    tracemalloc.start()
    r = ch.solve(p, sys.argv[2], trace=False, store=sys.argv[1])
    peak = tracemalloc.get_traced_memory()[1]
    print(json.dumps({"traced_peak": peak, "rss_growth": status("VmHWM:") - before,
                      "nbytes": len(r.levels) * p.nbytes_level}))
""")


def test_a_500_mib_run_streams_in_bounded_host_memory(tmp_path):
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(tmp_path / "m.zarr"), "staged"], env=CHILD_ENV,
                         capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["nbytes"] == 500 * 2**20
    assert got["traced_peak"] < 96 * 2**20       # ring, staging, scratch and chunks in flight (~60 MiB)
    # what the 500 MiB run adds to the process's peak resident memory, whatever the machine's
    # libraries weigh (storing the whole stack would add over 500 MiB)
    assert got["rss_growth"] < 160 * 2**20
    assert disk.open_store(tmp_path / "m.zarr").complete.all()


def test_disk_bandwidth_is_measured_and_cleaned_up(tmp_path):
    gbps = disk.measure_disk_bandwidth(tmp_path, mib=8, chunk_mib=1)
    assert gbps > 0
    assert list(tmp_path.iterdir()) == []


def test_the_disk_measurement_writes_the_buffers_it_is_given(tmp_path, monkeypatch):
    written = []
    real = files.write_atomically
    monkeypatch.setattr(files, "write_atomically", lambda path, data, **kw: (written.append(bytes(data)),
                                                                                real(path, data, **kw)))
    chunks = [np.full(2**20, k, np.uint8) for k in (1, 2, 3)]
    assert disk.measure_disk_bandwidth(tmp_path, mib=6, chunk_mib=1, writers=2, buffers=chunks) > 0
    assert sorted(w[0] for w in written) == [1, 1, 2, 2, 3, 3] and all(len(w) == 2**20 for w in written)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="one chunk each"):
        disk.measure_disk_bandwidth(tmp_path, mib=6, chunk_mib=1, buffers=[np.zeros(10, np.uint8)])


def test_the_profile_disk_section_is_measured_and_cleaned_up(tmp_path):
    from course_helper.measure import calibrate
    spec = calibrate.measure_disk(tmp_path, mib=8, chunk_mib=1, writers=2)
    assert spec["gbps"] > 0 and spec["latency_us"] > 0 and spec["writers"] == 2
    assert "fsync" in spec["provenance"]
    assert list(tmp_path.iterdir()) == []


def test_plot_slices_opens_a_store_lazily(tmp_path, monkeypatch):
    import zarr.storage._local as local
    p = _problem()
    ref = ch.solve(p, "events", every=2, trace=False)
    ch.solve(p, "events", every=2, trace=False, store=tmp_path / "v.zarr")
    viewer = ch.plot_slices(tmp_path / "v.zarr")
    assert not isinstance(viewer.images, np.ndarray)
    assert viewer.vlim == pytest.approx(0.05 * float(np.abs(ref.images).max()))
    real_get, chunks_read = local._get, []

    def counting_get(path, *args, **kwargs):
        if "/u/c." in str(path).replace(os.sep, "/"):
            chunks_read.append(path)
        return real_get(path, *args, **kwargs)

    monkeypatch.setattr(local, "_get", counting_get)
    viewer.slider.value = 7
    assert np.array_equal(viewer.image.get_array(), ref.images[7])
    assert len(chunks_read) == 1                  # one level read, not the whole run
    assert viewer.title.endswith(f"level {ref.levels[7]}, t = {ref.times_ms[7]:.2f} ms")


def test_cli_run_streams_to_a_store(tmp_path, capsys):
    from course_helper import cli
    path = tmp_path / "cli.zarr"
    assert cli.main(["run", "--store", str(path), "--n", "48", "--nt", "30", "--every", "2",
                     "--strategy", "staged", "--compress", "zstd", "--backend", "cpu", "--no-progress"]) == 0
    assert "15 levels complete" in capsys.readouterr().out
    ref = ch.solve(ch.WaveProblem(n0=48, n1=48, nt=30), "staged", every=2, trace=False)
    assert np.array_equal(disk.open_store(path).images[:], ref.images)
    assert cli.main(["run", "--store", str(path), "--n", "48", "--nt", "30", "--backend", "cpu",
                     "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_disk_bench_point_reports_the_bound_with_the_disk(tmp_path):
    from course_helper.measure import bench
    point = bench.disk_point(48, 30, 1, tmp_path, strategies=("staged",), compress=(None, "zstd"), repeats=1)
    out = point["output_bytes"]
    assert point["bound_ms"] == pytest.approx(max(point["compute_only_ms"], out / point["disk_gbps"] / 1e6,
                                                  out / point["peak_d2h_gbps"] / 1e6))
    assert [r["compress"] for r in point["runs"]] == [None, "zstd"]
    assert point["runs"][1]["ratio"] > 1.5 > point["runs"][0]["ratio"] > 0.9   # zeros compress
    assert list(tmp_path.iterdir()) == []


def test_disk_bench_holds_each_run_against_the_disk_on_both_sides_of_it(tmp_path, monkeypatch):
    """The disk is measured before the first raw run and after each; a run's B takes the mean
    of the two measurements around it, and its efficiency is the median of B / time."""
    from course_helper.measure import bench, disk_sweep
    speeds = iter([1.0, 3.0, 1.0, 2.0, 5.0])          # GB/s: a burst, then before run 1, after 1, 2, 3
    monkeypatch.setattr(disk_sweep, "disk_bandwidth", lambda *a: next(speeds))
    point = bench.disk_point(48, 30, 1, tmp_path, strategies=("events",), compress=(None,), repeats=3)
    run = point["runs"][0]
    nbytes = point["output_bytes"]
    assert run["disk_gbps"] == [3.0, 1.0, 2.0, 5.0] and point["disk_gbps"] == 2.5
    disk_ms = [nbytes / (g * 1e9) * 1e3 for g in (2.0, 1.5, 3.5)]            # the means around each run
    bounds = [max(d, point["compute_only_ms"], nbytes / point["peak_d2h_gbps"] / 1e6) for d in disk_ms]
    assert run["bound_ms"] == pytest.approx(bounds)
    assert run["efficiency"] == pytest.approx(np.median([b / t for b, t in zip(bounds, run["times_ms"])]))


def test_the_disk_is_measured_once_the_run_before_is_deleted(tmp_path, monkeypatch):
    """A measurement right after a run must not find that run's store still on the disk: each
    measurement then follows a deletion of a run's files and each run a measurement's, alike."""
    from course_helper.measure import bench, disk_sweep
    stores_seen = []

    def measure(where, *args):
        stores_seen.append(sorted(str(p) for p in Path(tmp_path).rglob("*.zarr")))
        return 1.0

    monkeypatch.setattr(disk_sweep, "disk_bandwidth", measure)
    bench.disk_point(48, 30, 1, tmp_path, strategies=("events",), compress=(None,), repeats=2)
    assert len(stores_seen) == 4 and stores_seen == [[]] * 4        # a burst, before, after 1, after 2


def test_a_failing_peaks_thread_stops_the_run_and_flags_nothing_it_missed(tmp_path, monkeypatch):
    """The peaks are taken beside the writers; if that fails, the run raises (it does not wait
    forever for the slot) and no level without its peak is flagged complete."""
    real = sink_module._peaks
    calls = []

    def flaky(block):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("no memory for the peaks")
        return real(block)

    monkeypatch.setattr(sink_module, "_peaks", flaky)
    with pytest.raises(MemoryError, match="no memory for the peaks"):
        ch.solve(_problem(), "events", trace=False, store=tmp_path / "s.zarr")
    stored = disk.open_store(tmp_path / "s.zarr")
    peak = stored.group["peak"][:]
    assert stored.complete.any() and not stored.complete.all()
    assert np.isfinite(peak[stored.complete[:]]).all()


def _slot_of(ring, view):
    """Index of the ring slot that ``view`` lies in."""
    return next(s for s, slot in enumerate(ring.slots) if np.shares_memory(view, slot))


def test_on_a_gpu_a_full_ring_hands_out_whichever_slot_frees_first(tmp_path):
    """Writers finish out of order; the host takes the first slot freed, not the oldest one."""
    import threading
    sink = disk.DiskSink(tmp_path / "s.zarr", _problem(), 1, 1)
    sink._clock = sink_module._WallClock()   # the real-time path a GPU run takes
    ring, n = sink.ring, len(sink.ring.states)
    try:
        assert [_slot_of(ring, ring[k]) for k in range(n)] == list(range(n))   # all taken
        for slot in ring.states:
            slot.copy_queued()                   # as if their copies were queued: their writers free them
        threading.Timer(0.2, ring.release, args=(ring.states[3],)).start()
        threading.Timer(1.0, ring.release, args=(ring.states[0],)).start()
        assert _slot_of(ring, ring[n]) == 3    # not slot 0, which chunk n would take in turn
    finally:
        for slot in ring.states:
            ring.release(slot)
        sink.finish()


def test_on_a_gpu_a_slot_freed_while_the_host_looks_is_taken_not_refused(tmp_path):
    """The host finds no free slot, then no slot held either: a writer freed one in between.
    The host takes it; it does not call a ring with nothing held one that never frees."""
    sink = disk.DiskSink(tmp_path / "s.zarr", _problem(), 1, 1)
    ring, looks = sink.ring, []
    real = ring.a_free_slot

    def late(timeout=None):            # the first two looks miss the slots that are free
        looks.append(timeout)
        return None if len(looks) <= 2 else real(timeout)
    ring.a_free_slot = late
    try:
        assert not ring.held()
        assert sink_module._WallClock().free_slot(ring, 0, sink.raise_error) is ring.states[0]
        assert looks == [0, 0.05, 0.05]
    finally:
        sink.finish()


def test_a_chunk_that_fails_before_its_rename_leaves_no_file(tmp_path, monkeypatch):
    p = _problem()
    ref = ch.solve(p, "events", trace=False)
    chunks = tmp_path / "e.zarr" / "u"          # chunk K is the file c.K.0.0, written as .c.K.0.0.*.partial
    real_fsync, failed, landed = os.fsync, [], []
    others_landed = threading.Event()

    def failing_fsync(fd):              # chunk 2 fails after its bytes were written, once two others landed
        name = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if name.parent == chunks and name.name.startswith(".c."):
            index = int(name.name.split(".")[2])             # its level index
            if index == 2 and not failed:
                others_landed.wait(timeout=30)               # (writers run in parallel: let two finish first)
                failed.append(index)
                raise OSError(errno.EIO, "Input/output error")
            real_fsync(fd)
            landed.append(index)
            if len(landed) >= 2:
                others_landed.set()
            return
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="e.zarr"):
        ch.solve(p, "events", trace=False, store=tmp_path / "e.zarr")
    monkeypatch.setattr(os, "fsync", real_fsync)
    s = _assert_never_torn(tmp_path / "e.zarr", ref.images)
    assert np.isnan(s.images[failed[0]]).all() and not s.complete[failed[0]]
    assert not list((tmp_path / "e.zarr").rglob("*.partial"))      # the temporary file was removed


# --------------------------------------------------------------------------
# The disk in modelled time (CPU backend) and on the real clock (GPU)
# --------------------------------------------------------------------------
def _disk_spec():
    return ch.runtime.get().profile["disk"]


def _host_waits(trace, name="wait for disk (ring full)"):
    return [e for e in trace.of_kind("host wait") if e.name == name]


def test_a_disk_bound_run_takes_bytes_over_the_modelled_disk_bandwidth(tmp_path):
    p = ch.WaveProblem(n0=256, n1=256, nt=320)                 # 320 levels of 256 KiB, every step saved,
    r = ch.solve(p, "staged", store=tmp_path / "b.zarr", batch=8)   # in chunks of 2 MiB
    spec = _disk_spec()
    nbytes = len(r.levels) * p.nbytes_level
    disk_ms = nbytes / (spec["gbps"] * 1e6)
    # bytes / bandwidth, plus what cannot overlap: the first level's compute and copy, and the
    # latencies no other lane's transfer hides (the first writes start together; the last end
    # alone): at most one per writer lane
    assert disk_ms <= r.elapsed_ms <= disk_ms * 1.03 + spec["writers"] * spec["latency_us"] * 1e-3
    waits = _host_waits(r.trace)
    assert waits and sum(w.duration_ms for w in waits) > 0.5 * r.elapsed_ms   # the compute waits for the disk
    writes = r.trace.of_kind("disk write")
    assert len(writes) == len(r.levels) // 8 and max(e.end_ms for e in writes) <= r.elapsed_ms + 1e-6


def test_a_compute_bound_run_is_not_slowed_by_the_modelled_disk(tmp_path):
    p = ch.WaveProblem(n0=256, n1=256, nt=1200)
    every = 60                                  # 256 KiB per 60 steps: far less than the disk writes meanwhile
    free = ch.solve(p, "events", every=every, trace=False)
    streamed = ch.solve(p, "events", every=every, store=tmp_path / "c.zarr")
    last_write = p.nbytes_level / (_disk_spec()["gbps"] * 1e6) + _disk_spec()["latency_us"] * 1e-3
    # the same run, plus an event record per level and the last level's write after the compute
    assert streamed.elapsed_ms <= free.elapsed_ms * 1.01 + last_write
    assert not _host_waits(streamed.trace)


def test_the_modelled_disk_gives_the_same_times_and_trace_on_every_run(tmp_path):
    p = ch.WaveProblem(n0=128, n1=128, nt=120)

    def run(name):
        r = ch.solve(p, "staged", store=tmp_path / name, batch=4)
        return r.elapsed_ms, [(e.track, e.kind, e.name, e.start_ms, e.end_ms, e.bytes) for e in r.trace.events]

    first, second = run("a.zarr"), run("b.zarr")
    assert first[0] == second[0]
    assert first[1] == second[1]
    assert any(e[1] == "disk write" for e in first[1]) and any(e[2] == "wait for disk (ring full)" for e in first[1])


def test_the_writer_threads_do_not_move_the_model_clock(tmp_path, monkeypatch):
    """Slow real writes (a slow disk, a busy machine) change nothing in modelled time."""
    p = ch.WaveProblem(n0=128, n1=128, nt=60)
    fast = ch.solve(p, "events", store=tmp_path / "f.zarr")
    real_put = files.write_atomically

    def slow_put(path, data, **kw):
        time.sleep(0.01)
        real_put(path, data, **kw)

    monkeypatch.setattr(files, "write_atomically", slow_put)
    slow = ch.solve(p, "events", store=tmp_path / "s.zarr")
    assert slow.elapsed_ms == fast.elapsed_ms
    assert np.array_equal(disk.open_store(tmp_path / "s.zarr").images[:],
                          disk.open_store(tmp_path / "f.zarr").images[:])


def test_a_profile_without_a_disk_section_is_refused_clearly(tmp_path, monkeypatch):
    rt = ch.runtime.get()
    monkeypatch.setattr(rt, "profile", {k: v for k, v in rt.profile.items() if k != "disk"})
    with pytest.raises(RuntimeError, match="no 'disk' section"):
        ch.solve(_problem(), "events", trace=False, store=tmp_path / "n.zarr")


def test_on_a_gpu_the_disk_lanes_are_timed_on_the_real_clock(tmp_path):
    if not ch.runtime.gpu_available():
        pytest.skip("no working CUDA GPU here (the GPU tests run on a GPU machine)")
    ch.set_backend("gpu")
    p = _problem()
    ref = ch.solve(p, "events", trace=False)
    r = ch.solve(p, "events", store=tmp_path / "g.zarr")
    assert np.array_equal(disk.open_store(tmp_path / "g.zarr").images[:], ref.images)
    writes = r.trace.of_kind("disk write")
    assert len(writes) == len(r.levels)
    assert all(e.start_ms < e.end_ms for e in writes)
    # host-clock intervals of the run, which ends when the last write has ended
    assert max(e.end_ms for e in writes) - min(e.start_ms for e in writes) <= r.elapsed_ms


# --------------------------------------------------------------------------
# Nothing wrong is flagged, whatever stops the run (faults, Ctrl-C, a full disk, kills)
# --------------------------------------------------------------------------
def _assert_only_right_levels(path, ref_images):
    """Every level the store holds (and so every level it reports complete) is the reference's:
    no level made by failed or skipped work was written."""
    s = disk.open_store(path)
    images = s.images[:]
    for k, got in enumerate(images):
        if not np.isnan(got).all():
            assert np.array_equal(got, ref_images[k]), f"level index {k} holds wrong data"
    assert not np.isnan(images[s.complete]).any()
    return s


@pytest.mark.parametrize("strategy", ["staged", "events"])
@pytest.mark.parametrize("call, deferred, compress", [(5, True, None), (5, False, None), (23, True, None),
                                                      (40, True, None), (5, True, "gpu-zstd"), (23, True, "gpu-zstd")])
def test_a_failed_copy_leaves_no_level_made_by_failed_or_skipped_work(tmp_path, monkeypatch, ctrl_c_at_copy,
                                                                      strategy, call, deferred, compress):
    p = ch.WaveProblem(n0=64, n1=64, nt=60)
    ref = ch.solve(p, strategy, trace=False)
    ctrl_c_at_copy(call, deferred)
    with pytest.raises(KeyboardInterrupt):
        ch.solve(p, strategy, store=tmp_path / "s.zarr", compress=compress)
    monkeypatch.undo()
    if (tmp_path / "s.zarr").exists():                 # (a store that keeps nothing is removed)
        s = _assert_only_right_levels(tmp_path / "s.zarr", ref.images)
        assert s.state == "failed" and s.interrupted and "KeyboardInterrupt" in s.reason
        assert not s.complete.all()


_SIGINT_CHILD = textwrap.dedent("""
    import sys, course_helper as ch
    ch.set_backend("cpu")
    ch.solve(ch.WaveProblem(n0=128, n1=128, nt=300), "staged", trace=False, store=sys.argv[1])
""")


def test_a_real_ctrl_c_flags_only_right_levels(tmp_path):
    """SIGINT to a process running a streamed staged run, at several moments after its store
    appears: every level it holds (and flags) is the in-memory solve's."""
    ref = ch.solve(ch.WaveProblem(n0=128, n1=128, nt=300), "staged", trace=False).images
    interrupted = 0
    for i, delay in enumerate((0.0, 0.01, 0.02, 0.05, 0.1, 0.2)):
        path = tmp_path / f"i{i}.zarr"
        child = subprocess.Popen([sys.executable, "-c", _SIGINT_CHILD, str(path)], env=CHILD_ENV,
                                 stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not path.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        child.send_signal(signal.SIGINT)
        err = child.communicate(timeout=120)[1].decode()
        assert child.returncode in (0, -signal.SIGINT), err[-2000:]      # (-SIGINT: Python's exit on Ctrl-C)
        if not path.exists():
            interrupted += 1                           # stopped before a level was saved: store removed
            continue
        s = _assert_only_right_levels(path, ref)
        if s.state != "finished":                      # (the SIGINT may come after the run has ended)
            assert s.interrupted and s.state == "failed" and s.reason == "KeyboardInterrupt"
            assert np.array_equal(s.images[np.flatnonzero(s.complete)], ref[s.complete])
            interrupted += 1
    assert interrupted, "no run was still going when its SIGINT came"


def _tmpfs(folder, size):
    """Mount a tmpfs of ``size`` at ``folder`` (skips the test, saying why, where that cannot be done)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("a full disk is made with a small tmpfs, which only root can mount")
    folder.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")


@pytest.mark.parametrize("compress", [None, "gpu-zstd"])
@pytest.mark.parametrize("strategy", ["events", "staged"])
def test_on_a_full_disk_the_flags_survive_and_the_error_says_what_is_flagged(tmp_path, monkeypatch, strategy,
                                                                             compress):
    p = ch.WaveProblem(n0=64, n1=64, nt=70)
    ref = ch.solve(p, strategy, trace=False)
    mount = tmp_path / "small"
    _tmpfs(mount, "1160k" if compress is None else "200k")
    if compress is not None:      # the check before the run counts uncompressed bytes: let the run start
        monkeypatch.setattr(layout, "free_bytes", lambda folder: 2**30)
    try:
        with pytest.raises(OSError, match="is full") as info:
            ch.solve(p, strategy, trace=False, store=mount / "s.zarr", batch=_batch(strategy), compress=compress)
        assert info.value.errno == errno.ENOSPC
        s = _assert_only_right_levels(mount / "s.zarr", ref.images)
        flagged = layout.zarr_module().open_group(str(mount / "s.zarr"), mode="r")["complete"][:]   # the file itself
        chunk = s.images.file_levels
        intact = [k for k in range(len(ref.levels)) if (mount / "s.zarr" / "u" / f"c.{k // chunk}.0.0").is_file()]
        assert 0 < len(intact) < len(ref.levels)
        assert list(np.flatnonzero(flagged)) == intact                 # every landed level is flagged
        assert f"{len(intact)} of {len(ref.levels)} levels are complete and flagged" in str(info.value)
        assert s.state == "failed"
    finally:
        subprocess.run(["umount", str(mount)], check=True)


_KILL_CHILD = textwrap.dedent("""
    import sys, course_helper as ch
    ch.set_backend("cpu")
    ch.solve(ch.WaveProblem(n0=96, n1=96, nt=int(sys.argv[2])), sys.argv[3], trace=False, store=sys.argv[1],
             compress=sys.argv[4] if len(sys.argv) > 4 else None)
""")


def _kill_when(path, strategy, moment, nt=600, compress=None):
    """Start a streamed run into ``path`` in a child process and SIGKILL it at ``moment``."""
    problem = ch.WaveProblem(n0=96, n1=96, nt=nt)
    creating = lambda: any(path.parent.glob(f".{path.name}.*.partial"))        # noqa: E731
    chunks = lambda: list((path / "u").glob("c.*")) if (path / "u").is_dir() else []   # noqa: E731
    until = {"creating": creating,
             "created": path.exists,
             "first chunk": lambda: len(chunks()) >= 1,
             "chunk being written": lambda: any((path / "u").glob(".c.*.partial")) if path.exists() else False,
             "many chunks": lambda: len(chunks()) >= nt // ch.solver.chunk_levels(problem, strategy) // 2}[moment]
    args = [str(path), str(nt), strategy, *[compress] * bool(compress)]
    child = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, *args], env=CHILD_ENV, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not until() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    child.send_signal(signal.SIGKILL)
    err = child.communicate()[1]
    assert child.returncode == -signal.SIGKILL, err.decode()[-2000:]


KILLS = [(strategy, moment, None) for strategy in ("events", "staged")
         for moment in ("creating", "created", "first chunk", "chunk being written", "many chunks")]


@pytest.mark.parametrize("strategy, moment, compress", KILLS + [("staged", "chunk being written", "gpu-zstd"),
                                                                ("events", "many chunks", "gpu-zstd")])
def test_a_store_opens_whenever_its_run_was_killed(tmp_path, strategy, moment, compress):
    path = tmp_path / "k.zarr"
    _kill_when(path, strategy, moment, compress=compress)
    ref = _in_memory(96, 600, strategy)
    if not path.exists():                              # killed before the store appeared whole
        with pytest.raises(FileNotFoundError, match="there is no store"):
            disk.open_store(path)
    else:
        s = _assert_only_right_levels(path, ref)
        assert s.state == "interrupted" and s.interrupted and "killed" in repr(s)
        intact = np.array([not np.isnan(level).all() for level in s.images])
        assert np.array_equal(s.complete, intact)     # every intact level, and only those, is complete
    assert not list(tmp_path.rglob("*.partial"))       # the temporary files are gone
    ch.solve(ch.WaveProblem(n0=96, n1=96, nt=30), strategy, trace=False, store=tmp_path / "again.zarr")


def test_opening_an_interrupted_store_removes_its_temporary_files_but_not_a_live_ones(tmp_path):
    p = _problem()
    ch.solve(p, "events", trace=False, store=tmp_path / "done.zarr")
    leftover = tmp_path / "done.zarr" / "u" / ".c.3.0.0.abc.partial"
    leftover.write_bytes(b"half a chunk")
    disk.open_store(tmp_path / "done.zarr")
    assert leftover.exists()                           # a finished store: nothing to clean, nothing touched
    sink = disk.DiskSink(tmp_path / "live.zarr", p, 1, 1)
    try:
        leftover = tmp_path / "live.zarr" / "u" / ".c.0.0.0.abc.partial"
        leftover.parent.mkdir(exist_ok=True)
        leftover.write_bytes(b"being written")
        s = disk.open_store(tmp_path / "live.zarr")
        assert s.state == "writing" and leftover.exists()          # its writer is alive: left alone
    finally:
        sink.finish()
    assert disk.open_store(tmp_path / "live.zarr").state == "finished"


def test_a_deleted_chunk_is_not_reported_complete(tmp_path):
    p = _problem()
    ch.solve(p, "events", trace=False, store=tmp_path / "d.zarr")
    (tmp_path / "d.zarr" / "u" / "c.3.0.0").unlink()
    s = disk.open_store(tmp_path / "d.zarr")
    assert not s.complete[3] and s.complete.sum() == len(s.levels) - 1
    assert s.missing[3] and s.missing.sum() == 1 and "lost their chunk files" in repr(s)


def test_chunks_carry_zarrs_crc32c_checksum(tmp_path):
    """The writers' chunk files are byte for byte what Zarr's own codecs (crc32c last) make."""
    zarr = layout.zarr_module()
    p = _problem()
    for compress in (None, "zstd"):
        r = ch.solve(p, "staged", trace=False, store=tmp_path / f"{compress}.zarr", compress=compress, batch=4)
        written = r.images.array
        assert [c.to_dict()["name"] for c in written.compressors][-1] == "crc32c"
        twin = zarr.create_array(str(tmp_path / f"twin-{compress}.zarr"), shape=written.shape, chunks=written.chunks,
                                 dtype="float32", fill_value=np.nan, compressors=written.compressors,
                                 chunk_key_encoding={"name": "default", "separator": "."})
        twin[:] = written[:]
        for k in (0, 3):
            mine = (tmp_path / f"{compress}.zarr" / "u" / f"c.{k}.0.0").read_bytes()
            assert mine == (tmp_path / f"twin-{compress}.zarr" / f"c.{k}.0.0").read_bytes()


@pytest.mark.parametrize("compress", [None, "gpu-zstd"])
@pytest.mark.parametrize("damage", ["random bytes", "truncated", "one bit"])
def test_a_damaged_chunk_is_reported_with_its_path_and_levels_not_read_as_data(tmp_path, damage, compress):
    p = ch.WaveProblem(n0=32, n1=32, nt=30)
    ch.solve(p, "staged", trace=False, store=tmp_path / "c.zarr", batch=4, every=2, compress=compress)
    chunk = tmp_path / "c.zarr" / "u" / "c.2.0.0"                 # levels 16..22 (indices 8..11)
    data = bytearray(chunk.read_bytes())
    if damage == "random bytes":
        data = np.random.default_rng(1).integers(0, 256, len(data), dtype=np.uint8).tobytes()
    elif damage == "truncated":
        data = data[:25]
    else:
        data[100] ^= 4                                            # (in a shard: in level index 8's inner chunk)
    chunk.write_bytes(bytes(data))
    s = disk.open_store(tmp_path / "c.zarr")
    for read in (lambda: s.images[8], lambda: s.images[:], lambda: np.asarray(s.images),
                 lambda: ch.plot_slices(tmp_path / "c.zarr").show(8)):
        with pytest.raises(disk.StoreDamaged, match="levels 16..22") as info:
            read()
        assert str(chunk) in str(info.value)
    assert np.isfinite(s.images[7]).all()                         # the other chunks still read
    xr = pytest.importorskip("xarray")
    # xarray reads through Zarr's own codecs, which refuse the chunk too, in words of their own that
    # change between Zarr versions (3.1: a checksum; 3.4: a shard too short to hold its index).
    with pytest.raises(ValueError):
        _ = xr.open_zarr(tmp_path / "c.zarr")["u"].isel(time=8).values


def test_bad_store_metadata_gives_an_error_naming_the_file(tmp_path):
    ch.solve(_problem(), "events", trace=False, store=tmp_path / "j.zarr")
    meta = tmp_path / "j.zarr" / "zarr.json"
    meta.write_text(meta.read_text()[:-40])
    with pytest.raises(disk.StoreDamaged, match="is damaged") as info:
        disk.open_store(tmp_path / "j.zarr")
    assert str(meta) in str(info.value)


# -- a store is checked against itself: what its run wrote, not what its files now say ----------
def _edit_metadata(store, array, edit):
    """Apply ``edit`` to ``array``'s metadata (None: the group's) where Zarr keeps it: in the
    consolidated metadata and in the array's own zarr.json, as a careful editor would."""
    root = store / "zarr.json"
    doc = json.loads(root.read_text())
    edit(doc["consolidated_metadata"]["metadata"][array] if array else doc)
    root.write_text(json.dumps(doc))
    if array:
        own = store / array / "zarr.json"
        doc = json.loads(own.read_text())
        edit(doc)
        own.write_text(json.dumps(doc))


def _set_levels(n):
    def edit(meta):
        meta["shape"][0] = n
    return edit


def _big_endian(meta):
    meta["codecs"][0]["configuration"]["endian"] = "big"


def _reshape(meta):
    meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"] = [20, 40, 48], [1, 40, 48]


def _two_level_chunks(meta):
    meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 2


def _attribute(name, value):
    def edit(doc):
        doc["attributes"][name] = value
    return edit


def _rewrite_level(store):
    zarr = layout.zarr_module()
    zarr.open_array(str(store / "level"), mode="r+")[:] = np.arange(20) * 2


EDITS = {   # what the audit changed, and the words naming what disagrees
    "shape and chunks of u": (lambda s: _edit_metadata(s, "u", _reshape), r"'u' has the shape \(20, 40, 48\)"),
    "byte order of u": (lambda s: _edit_metadata(s, "u", _big_endian), "byte order big"),
    "fewer levels": (lambda s: [_edit_metadata(s, a, _set_levels(15)) for a in ("u", "level", "time")],
                     r"'u' has the shape \(15, 48, 40\), but the attributes \(nt=20, every=1, n0=48, n1=40\)"),
    "more levels": (lambda s: [_edit_metadata(s, a, _set_levels(25)) for a in ("u", "level", "time", "complete")],
                    r"'u' has the shape \(25, 48, 40\)"),
    "chunks of u": (lambda s: _edit_metadata(s, "u", _two_level_chunks), r"chunks \(2, 48, 40\), but the run wrote"),
    "level chunk deleted": (lambda s: (s / "level" / "c" / "0").unlink(),
                            "the coordinate 'level' holds 20 values 0, 0"),
    "level chunk rewritten": (_rewrite_level, "the coordinate 'level' holds 20 values 0, 2"),
    "attribute n0": (lambda s: _edit_metadata(s, None, _attribute("n0", 40)), r"give \(20, 40, 40\)"),
    "attribute every": (lambda s: _edit_metadata(s, None, _attribute("every", 2)), r"give \(10, 48, 40\)"),
    "attribute nt": (lambda s: _edit_metadata(s, None, _attribute("nt", 10)), r"give \(10, 48, 40\)"),
    "attribute dt_s": (lambda s: _edit_metadata(s, None, _attribute("dt_s", 0.002)), "the coordinate 'time' holds"),
    "another attribute": (lambda s: _edit_metadata(s, None, _attribute("cfl", 0.5)),
                          r"zarr.json is not the one the run wrote"),
    "a coordinate's own metadata": (lambda s: (s / "x0" / "zarr.json").write_text(
        (s / "x0" / "zarr.json").read_text().replace('"m"', '"km"')), r"x0/zarr.json is not the one the run wrote"),
    "checksums deleted": (lambda s: (s / ".checksums").unlink(), "has no checksums file"),
    "checksums edited": (lambda s: (s / ".checksums").write_bytes(
        (s / ".checksums").read_bytes().replace(b'"chunk_levels": 1', b'"chunk_levels": 2')),
                         "checksums file .* is damaged"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_store_is_refused_naming_what_disagrees(tmp_path, edit):
    change, says = EDITS[edit]
    store = tmp_path / "e.zarr"
    ch.solve(ch.WaveProblem(n0=48, n1=40, nt=20), "events", trace=False, store=store)
    disk.open_store(store)                           # as written, it opens
    change(store)
    with pytest.raises(disk.StoreDamaged, match=says) as info:
        disk.open_store(store)
    assert str(store) in str(info.value)
    with pytest.raises(disk.StoreDamaged):           # the viewer opens it the same way
        ch.plot_slices(store)


def _inner(edit):
    def change(meta):
        edit(meta["codecs"][0]["configuration"])          # the sharding codec's configuration
    return change


def _big_endian_inner(config):
    config["codecs"][0]["configuration"]["endian"] = "big"


SHARDED_EDITS = {   # a gpu-zstd store's u is sharded: its byte order and chunks sit in the sharding codec
    "byte order of the inner chunks": (lambda s: _edit_metadata(s, "u", _inner(_big_endian_inner)), "byte order big"),
    "levels per shard": (lambda s: _edit_metadata(s, "u", _two_level_chunks),
                         r"chunks \(2, 48, 40\), but the run wrote"),
    "inner chunk shape": (lambda s: _edit_metadata(s, "u", _inner(lambda c: c.update(chunk_shape=[1, 24, 40]))),
                          r"u/zarr.json is not the one the run wrote"),
    "fewer levels": EDITS["fewer levels"],
}


@pytest.mark.parametrize("edit", SHARDED_EDITS)
def test_an_edited_sharded_store_is_refused_naming_what_disagrees(tmp_path, edit):
    change, says = SHARDED_EDITS[edit]
    store = tmp_path / "e.zarr"
    ch.solve(ch.WaveProblem(n0=48, n1=40, nt=20), "events", trace=False, store=store, compress="gpu-zstd")
    disk.open_store(store)
    change(store)
    with pytest.raises(disk.StoreDamaged, match=says) as info:
        disk.open_store(store)
    assert str(store) in str(info.value)


def test_a_written_store_opens_as_plain_zarr_with_its_checksums_beside(tmp_path):
    """The checksums file is beside the Zarr data, not in it: Zarr and xarray read the store
    without the course, and it holds one record per chunk, each set once its chunk is written."""
    store = tmp_path / "p.zarr"
    r = ch.solve(_problem(), "staged", trace=False, store=store, batch=4, every=2)
    record = layout.read_record(store)
    assert record.chunk_levels == 4 and record.nchunks == 5 and all(record.records)
    assert {"zarr.json", "u/zarr.json", "level/c/0"} <= set(record.files)
    assert np.array_equal(layout.zarr_module().open_array(str(store / "u"), mode="r")[:], r.images[:])
    xr = pytest.importorskip("xarray")
    assert set(xr.open_zarr(store).data_vars) == {"u", "complete", "peak"}


def _swap(a, b):
    tmp = a.with_name("swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.parametrize("compress", [None, "gpu-zstd"])
@pytest.mark.parametrize("how", ["swapped", "from another run"])
def test_a_chunk_file_out_of_its_place_is_not_complete_and_not_read(tmp_path, how, compress):
    p = _problem(nt=30)
    store = tmp_path / "s.zarr"
    ref = ch.solve(p, "events", trace=False, store=store, every=2, compress=compress).images[:]
    u = store / "u"
    if how == "swapped":
        _swap(u / "c.5.0.0", u / "c.9.0.0")
        moved = (5, 9)
    else:       # a run of the same shape with the source elsewhere: valid Zarr chunks, another wavefield
        other = ch.WaveProblem(n0=48, n1=40, nt=30, source=(10, 12))
        ch.solve(other, "events", trace=False, store=tmp_path / "o.zarr", every=2, compress=compress)
        (u / "c.7.0.0").write_bytes((tmp_path / "o.zarr" / "u" / "c.7.0.0").read_bytes())
        moved = (7,)
    assert np.isfinite(layout.zarr_module().open_array(str(u), mode="r")[moved[0]]).all()  # Zarr's crc32c passes
    s = disk.open_store(store)
    assert [int(k) for k in np.flatnonzero(~s.complete)] == list(moved)
    assert [int(k) for k in np.flatnonzero(s.damaged)] == list(moved) and "damaged" in repr(s)
    for k in moved:
        with pytest.raises(disk.StoreDamaged, match=f"c.{k}.0.0 .*levels {2 * k}..{2 * k}.* not the one this run"):
            s.images[k]
    with pytest.raises(disk.StoreDamaged):
        s.images[:]
    keep = [k for k in range(len(ref)) if k not in moved]
    assert np.array_equal(s.images[keep[0]], ref[keep[0]]) and np.array_equal(s.images[10:12], ref[10:12])


@pytest.mark.parametrize("key, says", [(np.s_[::-1], r"images\[::-1\].*step >= 1"),
                                       ((5, 70, 70), r"images\[5, 70, 70\].*out of bounds"),
                                       (40, r"images\[40\].*shape \(40, 48, 40\)")])
def test_bad_indexing_of_a_store_is_an_index_error_not_damage(tmp_path, key, says):
    ch.solve(_problem(), "events", trace=False, store=tmp_path / "i.zarr")
    s = disk.open_store(tmp_path / "i.zarr")
    with pytest.raises(IndexError, match=says) as info:
        s.images[key]
    assert not isinstance(info.value, disk.StoreDamaged) and str(tmp_path / "i.zarr") in str(info.value)


# -- a loop that stops feeding the store's ring ends with an error, never a wait -------------
def _register(name, loop):
    return ch.strategies.register(ch.strategies.Strategy(name, loop, nscratch=5, min_nscratch=4))


def _takes_slots_and_never_copies(run):
    for k in range(run.nsaved):
        run.images[k]                                      # a slot, with no copy into it


def _never_copies(run):
    for level in range(2, run.nt):
        ch.launch_wave2d(run.U[(level - 2) % 5], run.U[(level - 1) % 5], run.U[level % 5], run.V, run.problem,
                         level - 2, stream=run.compute)


def _looks_twice_then_copies(run):
    ch.strategies.with_events(dataclasses.replace(run, images=_Twice(run.images)))


class _Twice:
    """run.images for a loop that takes each slot twice (e.g. to look at its shape) before copying."""
    def __init__(self, ring):
        self.ring = ring

    def __getitem__(self, k):
        self.ring[k]
        return self.ring[k]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clock", ["modelled", "real time (GPU)"])
def test_a_loop_that_takes_slots_and_never_copies_stops_with_an_error(tmp_path, monkeypatch, clock):
    if clock != "modelled":             # the path a GPU run takes: the host waits for whichever slot frees
        real = sink_module.DiskSink.__init__

        def real_time(self, *a, **k):
            real(self, *a, **k)
            self._clock = sink_module._WallClock()
        monkeypatch.setattr(sink_module.DiskSink, "__init__", real_time)
    entry = _register("takes-slots", _takes_slots_and_never_copies)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"took run.images\[\d+\].* queued no copy.*instead of waiting for ever"):
            ch.solve(_problem(), entry.name, trace=False, store=tmp_path / "s.zarr")
        assert time.monotonic() - t0 < 30
    finally:
        del ch.STRATEGIES[entry.name]
    assert not (tmp_path / "s.zarr").exists()            # nothing saved: the store is removed


def test_a_loop_that_copies_no_level_fails_instead_of_leaving_an_empty_store(tmp_path):
    entry = _register("no-copies", _never_copies)
    try:
        with pytest.raises(RuntimeError, match=r"copied 0 of the 40 saved levels .*k = 0, 1, 2, 3, 4, \.\.\.") as info:
            ch.solve(_problem(), entry.name, trace=False, store=tmp_path / "s.zarr")
    finally:
        del ch.STRATEGIES[entry.name]
    assert "no level was saved" in "".join(info.value.__notes__)
    ch.solve(_problem(), "events", trace=False, store=tmp_path / "s.zarr")     # the path is free again


def test_a_slot_taken_again_before_its_copy_is_the_same_slot(tmp_path):
    entry = _register("looks-twice", _looks_twice_then_copies)
    try:
        r = ch.solve(_problem(), entry.name, trace=False, store=tmp_path / "s.zarr")
    finally:
        del ch.STRATEGIES[entry.name]
    assert np.array_equal(r.images[:], ch.solve(_problem(), "events", trace=False).images)


# -- each refusal says what was wrong and what to do, naming the user's path -------------------
def test_an_empty_store_path_is_refused_as_empty(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="the store's path is empty"):
        ch.solve(_problem(), "events", store="")
    with pytest.raises(TypeError, match=r"open_store takes the path .* got None \(NoneType\)"):
        disk.open_store(None)
    with pytest.raises(ValueError, match="empty path"):
        disk.open_store("")


def test_a_dangling_link_or_a_too_long_name_is_refused_before_anything_is_made(tmp_path):
    link = tmp_path / "link.zarr"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match=r"link.zarr is a symbolic link \(to .*nowhere\)"):
        ch.solve(_problem(), "events", store=link)
    long = tmp_path / ("r" * 250)
    with pytest.raises(OSError, match="is too long: 250 bytes") as info:
        ch.solve(_problem(), "events", store=long)
    assert info.value.errno == errno.ENAMETOOLONG and ".partial" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.zarr"] and link.is_symlink()


def test_a_small_shortfall_of_disk_space_is_said_in_units_that_show_it(tmp_path, monkeypatch):
    p = ch.WaveProblem(n0=16, n1=16, nt=30)                  # 30 levels of 1 KiB
    monkeypatch.setattr(layout, "free_bytes", lambda folder: 10 * 2**10)
    with pytest.raises(OSError, match="needs 30 KiB but only 10 KiB are free"):
        ch.solve(p, "events", store=tmp_path / "s.zarr")


def test_a_file_system_error_while_creating_the_store_names_the_store_not_its_temporary_folder(tmp_path,
                                                                                              monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(layout.Checksums, "create", full)
    with pytest.raises(OSError, match=r"cannot create the store .*s.zarr: No space left on device; the disk is full") \
            as info:
        ch.solve(_problem(), "events", store=tmp_path / "s.zarr")
    assert info.value.errno == errno.ENOSPC and ".partial" not in str(info.value)
    assert not list(tmp_path.iterdir())                       # nothing left behind


def test_a_run_state_that_is_not_a_file_is_reported_as_damage(tmp_path):
    store = tmp_path / "r.zarr"
    ch.solve(_problem(), "events", trace=False, store=store)
    (store / ".run-state").unlink()
    (store / ".run-state").mkdir()
    with pytest.raises(disk.StoreDamaged, match=r"the run's state .*\.run-state .* is not a file"):
        disk.open_store(store)
