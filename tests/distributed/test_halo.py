"""The decomposed solve: slab arithmetic in-process, and real ranks under mpiexec (CPU backend)."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import course_helper as ch
from course_helper import distributed
from course_helper.distributed.launch import ranks_env
from course_helper.timelines.timeline import Trace, TraceEvent
from course_helper import wave
from course_helper.wave import PAD


# -- decomposition (no MPI) ---------------------------------------------------
@pytest.mark.parametrize("n0,ranks", [(64, 1), (64, 2), (64, 3), (20, 3), (101, 4), (12, 2)])
def test_slabs_tile_the_interior_exactly_and_evenly(n0, ranks):
    slabs = distributed.decompose(n0, ranks)
    assert [s.rank for s in slabs] == list(range(ranks))
    assert slabs[0].first == PAD and slabs[-1].stop == n0 - PAD
    for a, b in zip(slabs, slabs[1:]):
        assert a.stop == b.first                       # no gap, no overlap
    sizes = [s.owned for s in slabs]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 2 * distributed.HALO
    for s in slabs:
        assert (s.lo, s.hi, s.rows) == (s.first - 2, s.stop + 2, s.owned + 4)
        assert s.up == (s.rank - 1 if s.rank else None)
        assert s.down == (s.rank + 1 if s.rank < ranks - 1 else None)


def test_a_slab_too_thin_for_its_boundary_rows_is_refused():
    distributed.decompose(12, 2)                       # 8 interior rows: 4 each, just enough
    with pytest.raises(ValueError, match="at least 4"):
        distributed.decompose(11, 2)
    with pytest.raises(ValueError, match="ranks must be at least 1"):
        distributed.decompose(64, 0)


def test_the_source_belongs_to_exactly_one_rank():
    p = ch.WaveProblem(n0=64, n1=40, nt=10, source=(33, 7))
    slabs = distributed.decompose(p.n0, 3)
    owners = [s.rank for s in slabs if s.owns(p.source[0])]
    assert owners == [distributed.owner_of(p.n0, 3, p.source[0])] == [1]
    assert distributed.owner_of(64, 2, 2) == 0 and distributed.owner_of(64, 2, 61) == 1
    with pytest.raises(ValueError, match="wall row"):
        distributed.owner_of(64, 2, 1)


@pytest.mark.parametrize("n0,ranks", [(64, 3), (20, 3), (101, 4)])
def test_every_interior_row_has_the_owner_whose_slab_holds_it(n0, ranks):
    rows = range(PAD, n0 - PAD)
    assert [distributed.owner_of(n0, ranks, row) for row in rows] == \
        [s.rank for s in distributed.decompose(n0, ranks) for _ in range(s.owned)]


def test_the_bound_is_the_busiest_part_whichever_it_is():
    assert [distributed.halo_bound(*parts) for parts in ((3.0, 1.0, 2.0), (1.0, 3.0, 2.0), (1.0, 2.0, 3.0))] == \
        [3.0, 3.0, 3.0]


def test_adding_negative_zero_leaves_every_float_unchanged_bit_for_bit():
    x = np.array([0.0, -0.0, 1e-45, -3.5, np.inf, 7e37], np.float32)
    assert np.array_equal((x + np.float32(-0.0)).view(np.uint32), x.view(np.uint32))
    # ... which adding +0.0 would not (it turns -0 into +0): why the windows add -0.0
    assert not np.array_equal((x + np.float32(0.0)).view(np.uint32), x.view(np.uint32))


def test_windows_compute_exactly_the_full_grid_step(cpu):
    """Boundary and interior windows of a slab, launched as the ranks launch them, give the
    full-grid kernel's values bit for bit - with and without the source in the window."""
    p = ch.WaveProblem(n0=40, n1=24, nt=20, source=(21, 9))
    rng = np.random.default_rng(0)
    U0, U1 = (ch.to_device(rng.standard_normal(p.shape).astype(np.float32)) for _ in range(2))
    V = ch.to_device(p.velocity)
    full, pieces = ch.device_zeros(p.shape), ch.device_zeros(p.shape)
    n = 5
    ch.launch_wave2d(U0, U1, full, V, p, n)
    for a, b in [(2, 4), (4, 20), (20, 22), (22, 36), (36, 38)]:   # source row 21 in (20, 22)
        w = distributed.Window(p, a, b)
        assert w.holds_source == (a <= 21 < b)
        rows = slice(a - PAD, b + PAD)
        ch.launch_wave2d(U0[rows], U1[rows], pieces[rows], V[rows], w, n)
    ch.synchronize()
    assert np.array_equal(ch.to_host(full).view(np.uint32), ch.to_host(pieces).view(np.uint32))


def test_a_window_keeps_the_problems_time_step_and_wavelet():
    p = ch.WaveProblem(n0=64, n1=48, dx=(2.0, 1.5), cfl=0.3, nt=30, source=(40, 10))
    w = distributed.Window(p, 38, 44)
    assert (w.dt, w.fm, w.td, w.shape) == (p.dt, p.fm, p.td, (10, 48))
    assert w.source == (40 - 38 + PAD, 10)
    assert w.source_amplitude(3) == p.source_amplitude(3)
    far = distributed.Window(p, 2, 6)
    assert not far.holds_source and np.signbit(far.source_amplitude(3)) and far.source_amplitude(3) == 0


# -- real ranks under mpiexec --------------------------------------------------
def _mpiexec():
    try:
        import mpi4py  # noqa: F401
        return distributed.find_mpiexec()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"no MPI here ({exc}); python -m pip install -e '.[distributed]' brings mpi4py and MPICH")


def _run_ranks(ranks, *args, timeout=240):
    return subprocess.run([_mpiexec(), "-n", str(ranks), sys.executable, "-m", "course_helper", "halo", *args],
                          capture_output=True, text=True, timeout=timeout, env=ranks_env("cpu"))


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("strategy", distributed.STRATEGIES)
def test_check_passes_on_several_ranks(ranks, strategy):
    p = _run_ranks(ranks, "--n", "40", "--nt", "45", "--every", "2", "--strategy", strategy, "--check")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"on {ranks} ranks" in p.stdout and "identical to the single-device solve" in p.stdout


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("strategy", distributed.STRATEGIES)
def test_check_passes_for_an_odd_size_of_1023(ranks, strategy, tmp_path):
    """1023 rows: 1019 interior rows, slabs of unequal size; on 2 ranks the centred source sits on
    rank 0's last row, so its wave crosses the slabs' border at once."""
    p = _run_ranks(ranks, "--n", "1023", "--nt", "60", "--every", "59", "--strategy", strategy, "--check",
                   "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "identical to the single-device solve" in p.stdout
    last = np.load(tmp_path / "images.npy")[-1]
    if ranks == 2:
        border = distributed.decompose(1023, 2)[1].first
        assert np.all(last[border - 4:border + 4, 505:518] != 0)    # the wave is on both sides of the border


_BORDERS_SCRIPT = """
import sys, numpy as np, course_helper as ch
from course_helper import distributed
team = distributed.Team()
for s in distributed.decompose(1023, team.size)[1:]:
    problem = ch.WaveProblem(n0=1023, n1=33, nt=40, source=(s.first, 16))   # on this slab's first row
    for strategy in distributed.STRATEGIES:
        images = distributed.gather(team, distributed.run_rank(team, problem, strategy, every=3), problem)
        if team.rank == 0:
            single = ch.solve(problem, "events", every=3, trace=False).images
            crossed = bool(np.all(images[-1][s.first - 6:s.first + 6, 10:23] != 0))
            same = np.array_equal(images.view(np.uint32), single.view(np.uint32))
            print(f"border {s.first} {strategy}: identical={same} crossed={crossed}", flush=True)
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_wave_crossing_every_border_of_an_odd_grid_matches_bit_for_bit(ranks):
    p = subprocess.run([_mpiexec(), "-n", str(ranks), sys.executable, "-c", _BORDERS_SCRIPT], capture_output=True,
                       text=True, timeout=240, env=ranks_env("cpu"))
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if line.startswith("border")]
    assert len(lines) == (ranks - 1) * len(distributed.STRATEGIES), p.stdout
    assert all(line.endswith("identical=True crossed=True") for line in lines), p.stdout


def test_the_source_off_centre_and_uneven_slabs_still_match(tmp_path):
    # 43 rows: 39 interior rows over 2 ranks (20 + 19); the source sits near rank 0's lower edge
    p = _run_ranks(2, "--n", "43", "--nt", "40", "--check", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    images = np.load(tmp_path / "images.npy")
    assert images.shape == (40, 43, 43) and np.all(np.isfinite(images))
    assert np.abs(images[-1]).max() > 0                   # the wave really travelled


def test_launch_halo_returns_the_gathered_levels_and_every_ranks_timeline():
    _mpiexec()
    r = distributed.launch_halo(ranks=2, n=40, nt=30, every=3, strategy="overlap", check=True, trace=True,
                                backend="cpu")
    assert r.identical is True and r.images.shape == (10, 40, 40) and len(r.rank_ms) == 2
    assert r.time_label.startswith("modelled") and r.time_label in repr(r)     # CPU ranks: modelled times
    assert r.link_note == "halo exchanges on the profile's peer link"           # said by the ranks, not this process
    assert [t.meta["rank"] for t in r.traces] == [0, 1]
    for t in r.traces:
        halos = t.of_kind("halo")
        assert sorted(e.level for e in halos) == list(range(2, 30))   # one exchange per step
        assert t.tracks[:2] == ["compute", "halo"]
        assert len([e for e in t.kernels if e.track == "halo"]) == 28    # the edge rows, on the halo stream
    merged = r.trace
    assert merged.tracks[0].startswith("rank 0") and merged.tracks[-1].startswith("rank 1")
    doc = r.chrome()
    assert {e["pid"] for e in doc["traceEvents"]} == {1, 2}
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert names[0].startswith("rank 0") and names[1].startswith("rank 1")


@pytest.mark.parametrize("strategy", distributed.STRATEGIES)
def test_each_ranks_halo_transfers_are_bars_on_a_lane_of_their_own(strategy):
    """In the merged Chrome trace every rank (a process) has a `halo` lane (a thread) holding one
    bar per step, with the bytes it sent, each starting after the kernels that computed the rows it
    sends and ending before the next level's kernels read the rows it received."""
    _mpiexec()
    nt = 20
    r = distributed.launch_halo(ranks=3, n=40, nt=nt, every=5, strategy=strategy, trace=True, backend="cpu")
    doc = r.chrome()
    assert r.traces[0].meta.get("clock", "").startswith("modelled")
    for rank, s in enumerate(distributed.decompose(40, 3)):
        mine = [e for e in doc["traceEvents"] if e["pid"] == rank + 1]
        lanes = {e["tid"]: e["args"]["name"] for e in mine if e.get("name") == "thread_name"}
        on_lane = [e for e in mine if e["ph"] == "X" and lanes[e["tid"]] == "halo"]
        bars = [e for e in on_lane if e["cat"] == "halo"]
        assert [b["args"]["level"] for b in bars] == list(range(2, nt))
        # beside the exchanges, the halo stream runs only the overlap's edge-row kernels
        assert {e["cat"] for e in on_lane} == ({"halo"} if strategy == "blocking" else {"halo", "kernel"})
        neighbours = (s.up is not None) + (s.down is not None)
        assert all(b["args"]["bytes"] == neighbours * distributed.HALO * 40 * 4 for b in bars)
        assert all(b["dur"] > 0 for b in bars)                 # the link is modelled: bars, not ticks
        kernels = [e for e in mine if e["ph"] == "X" and e["cat"] == "kernel"]
        for b in bars:
            level = b["args"]["level"]
            sent = [k for k in kernels if k["args"]["level"] == level and
                    (strategy == "blocking" or lanes[k["tid"]] == "halo")]
            after = [k for k in kernels if k["args"]["level"] == level + 1]
            assert sent and max(k["ts"] + k["dur"] for k in sent) <= b["ts"]
            assert all(b["ts"] + b["dur"] <= k["ts"] for k in after)
    assert [t for t in r.trace.tracks if t.endswith(" halo")] == ["rank 0 halo", "rank 1 halo", "rank 2 halo"]


def test_bad_sizes_stop_every_rank_with_a_message():
    p = _run_ranks(2, "--n", "11", "--nt", "10")
    assert p.returncode == 2
    assert "every rank needs at least 4" in p.stderr


@pytest.mark.parametrize("args,msg", [
    (["--n", "3"], "padding"),
    (["--every", "0"], "every must be at least 1"),
    (["--trace"], "give --out"),
])
def test_the_halo_command_refuses_bad_arguments_before_starting_mpi(args, msg, capsys, monkeypatch):
    from course_helper.cli import main
    monkeypatch.setenv("COURSE_HELPER_BACKEND", os.environ.get("COURSE_HELPER_BACKEND", "auto"))  # restored after
    assert main(["halo", "--backend", "cpu", *args]) == 2
    assert msg in capsys.readouterr().err


def test_the_api_refuses_bad_input_before_starting_ranks():
    with pytest.raises(ValueError, match="unknown strategy"):
        distributed.launch_halo(ranks=2, strategy="eventually")
    with pytest.raises(ValueError, match="every rank needs"):
        distributed.launch_halo(ranks=8, n=32)


_SNAPSHOT_SCRIPT = """
import json, pathlib, sys, numpy as np, course_helper as ch
from course_helper import distributed
team = distributed.Team()
seen = []
def on_snapshot(level, rows, data):
    seen.append((level, rows.start, rows.stop, bool(np.all(np.isfinite(data))), float(np.abs(data).sum())))
p = ch.WaveProblem(n0=40, n1=32, nt=30)
res = distributed.run_rank(team, p, sys.argv[2], every=4, on_snapshot=on_snapshot, repeats=2)
sums = [float(np.abs(res.images[k]).sum()) for k in range(len(res.levels))]
# one file per rank: the ranks' prints share one stdout, where long lines can interleave
out = pathlib.Path(sys.argv[1]) / f"rank{team.rank}.json"
out.write_text(json.dumps({"rank": team.rank, "seen": seen, "sums": sums, "first": res.slab.first,
                           "stop": res.slab.stop}))
"""


@pytest.mark.parametrize("strategy", ["overlap", "overlap-graph"])
def test_every_rank_hands_each_landed_slab_to_the_snapshot_hook_in_order(tmp_path, strategy):
    p = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-c", _SNAPSHOT_SCRIPT, str(tmp_path), strategy],
                       capture_output=True, text=True, timeout=240, env=ranks_env("cpu"))
    assert p.returncode == 0, p.stderr
    ranks = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        levels = [s[0] for s in r["seen"]]
        assert levels == list(range(0, 30, 4)) * 2               # every saved level, in order, each repeat
        assert all(s[1:3] == [r["first"], r["stop"]] and s[3] for s in r["seen"])
        assert [s[4] for s in r["seen"][8:]] == r["sums"]         # the hook saw the data that landed



_TEAM_SCRIPT = """
from course_helper import distributed
team = distributed.Team()
first = team.split(1)
line = f"rank {team.rank}: max {team.max(float(team.rank))}, first {first and (first.rank, first.size)}"
lines = team.comm.gather(line, root=0)     # one print: the ranks' prints to one stdout can interleave
if team.rank == 0:
    print("\\n".join(lines))
"""


def test_a_team_agrees_on_the_largest_value_and_splits_off_its_first_ranks():
    p = subprocess.run([_mpiexec(), "-n", "3", sys.executable, "-c", _TEAM_SCRIPT], capture_output=True, text=True,
                       timeout=120, env=ranks_env("cpu"))
    assert p.returncode == 0, p.stderr
    lines = sorted(line for line in p.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: max 2.0, first (0, 1)", "rank 1: max 2.0, first None", "rank 2: max 2.0, first None"]

class _OneRank:
    """A team of one rank: no neighbour, so no MPI message, and the rank's loop runs in this process."""
    rank, size, nccl, backend, device = 0, 1, None, "cpu", "CPU"
    comm = types.SimpleNamespace(Barrier=lambda: None)


@pytest.mark.parametrize("strategy", distributed.STRATEGIES)
def test_each_saved_level_reaches_the_snapshot_hook_only_once_it_has_landed(cpu, strategy):
    """On a grid this large a level's copy to the host outlasts a step, so the last copies are still
    in flight when the loop has queued its last step: the hook still gets every level, in order,
    each holding the rows that landed (the single-device solve's, bit for bit), not the NaN the
    host buffer starts with."""
    p = ch.WaveProblem(n0=1024, n1=1024, nt=8)
    seen = []
    res = distributed.run_rank(_OneRank(), p, strategy, every=1,
                               on_snapshot=lambda level, rows, data: seen.append((level, rows, data.copy())))
    single = ch.solve(p, strategy="events", every=1, trace=False).images
    assert [level for level, _, _ in seen] == list(range(8)) and list(res.levels) == list(range(8))
    for level, rows, data in seen:
        assert rows == slice(PAD, p.n0 - PAD)
        assert np.array_equal(data.view(np.uint32), single[level, rows].view(np.uint32)), f"level {level}"


@pytest.mark.parametrize("strategy", ["blocking", "overlap"])
def test_a_rank_checks_each_windows_launch_arguments_once_not_every_level(cpu, monkeypatch, strategy):
    """A rank launches on the same few views of its windows every level, so launch_wave2d checks
    an argument set once per window and buffer, not once per level. (Slicing the windows afresh
    each level made every launch a new set: about 60 us of checks on the host a launch on two
    H100s, which set the pace of the eager loops at 2048 x 2048 per GPU.)"""
    checked = []
    real = wave._check_launch
    monkeypatch.setattr(wave, "_check_launch", lambda *args: (checked.append(args), real(*args))[1])
    wave._CHECKED.clear()
    p = ch.WaveProblem(n0=64, n1=64, nt=40)
    res = distributed.run_rank(_OneRank(), p, strategy, every=None, repeats=2)
    # One rank has one window: a set per buffer, and one more for the warm-up's launch on the whole slab.
    assert 0 < len(checked) <= distributed.rank.NSCRATCH + 1
    assert np.isfinite(res.queued_ms) and 0 < res.queued_ms <= res.elapsed_ms


def test_a_ranks_ring_takes_its_depth_from_the_single_gpu_rule(cpu):
    """With snapshots, a rank's ring is as deep as ring_depth asks for one slab's kernel and copy
    (the single-GPU default, at least 5); without snapshots it keeps the fixed five."""
    p = ch.WaveProblem(n0=1024, n1=1024, nt=40)
    slab = distributed.decompose(p.n0, 1)[0]                 # _OneRank's: the whole grid
    kernel_ms, copy_ms, _ = ch.strategies.level_times(ch.WaveProblem(n0=slab.rows, n1=p.n1, nt=p.nt))
    want = min(max(ch.strategies.ring_depth(kernel_ms, copy_ms), 5), ch.solver.MAX_RING)
    assert want > distributed.rank.NSCRATCH                   # a size where the deep ring matters
    run = distributed.rank.RankRun(_OneRank(), p, "overlap", 1, None)
    try:
        assert run.m == want == len(run.U) == len(run.io) and "COPY_LAG" in run.ring_reason
    finally:
        run.close()
    assert distributed.rank.ring_for(slab, p, None)[0] == distributed.rank.NSCRATCH


def test_the_hidden_share_of_an_exchange_is_the_part_under_a_kernel():
    events = [TraceEvent("halo", "halo", "halo level 2", 0.0, 10.0, 64, 2),
              TraceEvent("halo", "halo", "halo level 3", 20.0, 30.0, 64, 3),
              TraceEvent("compute", "kernel", "wave2d_4o level 2", 5.0, 25.0, 0, 2)]
    assert distributed.exchange_hidden(Trace(events, ["compute", "halo"])) == pytest.approx(0.5)
    assert distributed.exchange_hidden(Trace(events[2:], ["compute"])) == 0.0


def test_the_timed_loop_starts_on_an_idle_device(cpu):
    """Each repeat zeroes the buffers and waits for that before the start barrier: the timeline of a
    repeat (times only, a grid whose zeroing takes a while) holds no zeroing and nothing before 0."""
    for strategy in distributed.STRATEGIES:
        with ch.runtime.get().times_only():
            res = distributed.run_rank(_OneRank(), ch.WaveProblem(n0=4096, n1=4096, nt=4), strategy, trace=True,
                                       repeats=2)
        assert res.trace.events and min(e.start_ms for e in res.trace.events) >= 0, strategy
        assert not [e for e in res.trace.events if e.kind == "memset"], strategy

def test_ranks_started_from_here_import_this_copy_of_the_package(tmp_path, monkeypatch):
    """``ranks_env`` puts the folder holding this ``course_helper`` first on the ranks' path, so a
    rank started anywhere (another working directory, another copy installed) runs this code."""
    # As in a notebook: no entry of the path leads to this copy but ranks_env's (entries that hold
    # the course's dependencies stay).
    others = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if e and not (pathlib.Path(e) / "course_helper").is_dir()]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(others))
    env = ranks_env("cpu")
    assert env["COURSE_HELPER_BACKEND"] == "cpu"
    p = subprocess.run([sys.executable, "-c", "import course_helper; print(course_helper.__file__)"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert pathlib.Path(p.stdout.strip()).resolve() == pathlib.Path(ch.__file__).resolve()


def _rank_trace(rank, events):
    return Trace([TraceEvent(track, kind, f"{kind} {level}", start, end, 64, level)
                  for track, kind, start, end, level in events], ["compute", "halo", "io 0", "io 1"],
                 {"rank": rank, "strategy": "overlap", "device": "CPU"})


def test_merged_ranks_share_one_clock_that_starts_at_the_first_event():
    traces = [_rank_trace(0, [("compute", "kernel", 5.0, 6.0, 2), ("io 1", "d2h", 6.5, 7.0, 2)]),
              _rank_trace(1, [("halo", "halo", 5.5, 8.0, 2), ("io 0", "d2h", 8.0, 9.0, 3)])]
    merged = distributed.merge_traces(traces, title="overlap, 2 ranks")
    got = sorted((e.track, e.start_ms, e.end_ms) for e in merged.events)
    assert got == [("rank 0 compute", 0.0, 1.0), ("rank 0 io", 1.5, 2.0), ("rank 1 halo", 0.5, 3.0),
                   ("rank 1 io", 3.0, 4.0)]
    assert merged.tracks == ["rank 0 compute", "rank 0 halo", "rank 0 io", "rank 1 compute", "rank 1 halo",
                             "rank 1 io"]
    assert merged.meta["strategy"] == "overlap, 2 ranks" and "rank" not in merged.meta
    apart = distributed.merge_traces(traces, one_io_lane=False)
    assert sorted(e.track for e in apart.events if " io" in e.track) == ["rank 0 io 1", "rank 1 io 0"]


def test_the_chrome_trace_of_the_ranks_reads_back_as_their_traces():
    traces = [_rank_trace(0, [("compute", "kernel", 5.0, 6.25, 2), ("halo", "halo", 6.25, 7.5, 2)]),
              _rank_trace(1, [("compute", "kernel", 5.5, 6.0, 2)])]
    doc = distributed.chrome_trace(traces)
    bars = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in bars] == [(1, 0.0, 1250.0), (1, 1250.0, 1250.0), (2, 500.0, 500.0)]
    back = distributed.traces_from_chrome(doc)
    assert [t.meta["rank"] for t in back] == [0, 1]
    for t, original in zip(back, traces):
        assert [(e.track, e.kind, e.name, e.start_ms + 5.0, e.end_ms + 5.0, e.bytes, e.level) for e in t.events] == \
            [(e.track, e.kind, e.name, e.start_ms, e.end_ms, e.bytes, e.level) for e in original.events]


# -- nothing hangs: an interrupted rank, an interrupted mpiexec, an interrupted launch_halo ---
# These tests wait for what they assert, never for a time: each rank says when it is in its run,
# the signal goes then, and the test reads the job's stderr until the line it expects arrives or
# the job ends (bounded by one generous deadline, for a loaded machine).
_DEADLINE_S = 240


def _descendants(pid):
    """Pids of every process below ``pid`` (from /proc: mpiexec -> proxy -> ranks)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _ranks_of(pid):
    """The rank processes of a long job below ``pid`` (python -m course_helper halo, not mpiexec)."""
    return [p for p in _descendants(pid)
            if _cmdline(p).split()[1:4] == ["-m", "course_helper", "halo"] and "--nt 2000000" in _cmdline(p)]


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _gone(pids, seconds=_DEADLINE_S):
    """Whether the processes ``pids`` have all ended (within ``seconds``: the kernel reaps them)."""
    deadline = time.monotonic() + seconds
    while any(_cmdline(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_cmdline(p) for p in pids)


def _kill_all(pids):
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Lines:
    """The lines of a process's pipe, read by a thread as they come; :meth:`wait_for` waits
    until one passes a test or the pipe ends."""

    def __init__(self, pipe):
        self.lines, self.ended = [], False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe):
        for line in pipe:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for(self, found, seconds=_DEADLINE_S):
        """The lines once ``found(lines)`` holds, or the pipe has ended, or ``seconds`` have passed."""
        with self._changed:
            self._changed.wait_for(lambda: found(self.lines) or self.ended, seconds)
            return list(self.lines)

    def text(self):
        self._thread.join(_DEADLINE_S)
        return "".join(self.lines)


#: The long job's ranks, each saying on stderr when it is in its run (after MPI and the backend
#: are up, inside halo_main's handling of an interrupt): ``rank R ready, pid P``.
_ANNOUNCING_RANKS = """
import os, sys
from course_helper import cli, distributed
real = distributed.run_rank
def announced(team, *args, **kwargs):
    sys.stderr.write(f"rank {team.rank} ready, pid {os.getpid()}\\n")   # one write: print() makes two, and
    sys.stderr.flush()                                                 # the ranks' lines could run together
    return real(team, *args, **kwargs)
distributed.run_rank = announced
sys.exit(cli.main(sys.argv[1:]))
"""

#: Minutes of work in a loop of small steps, saving 2 levels (the saved levels' host memory is small).
_LONG_JOB = ["halo", "--n", "64", "--nt", "2000000", "--every", "1000000"]


def _ready_pids(lines):
    """``{rank: pid}`` of the ranks that said they are ready (found in the text, not line by line)."""
    return {int(rank): int(pid) for rank, pid in re.findall(r"rank (\d+) ready, pid (\d+)", "".join(lines))}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank processes through /proc")
@pytest.mark.parametrize("target, presses", [("rank 0", 1), ("rank 1", 1), ("mpiexec", 1), ("rank 0", 3),
                                             ("rank 1", 3), ("both ranks", 1)])
def test_an_interrupt_ends_every_rank_of_the_job(target, presses):
    """A Ctrl-C that reaches one rank only (or mpiexec, which passes it on to the ranks) stops
    the whole job, without a crash: the interrupted rank aborts the communicator instead of
    leaving the other waiting for its halo rows for ever. So do Ctrl-Cs pressed again while the
    job stops (they land in the rank's abort), and one that reaches both ranks at once."""
    proc = subprocess.Popen([_mpiexec(), "-n", "2", sys.executable, "-c", _ANNOUNCING_RANKS, *_LONG_JOB],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ranks_env("cpu"),
                            start_new_session=True)
    err = _Lines(proc.stderr)
    try:
        ranks = _ready_pids(err.wait_for(lambda lines: len(_ready_pids(lines)) == 2))
        assert len(ranks) == 2, "the ranks never said they were ready:\n" + "".join(err.lines)[-3000:]
        pids = ([proc.pid] if target == "mpiexec" else list(ranks.values()) if target == "both ranks"
                else [ranks[int(target.split()[1])]])
        for _ in range(presses):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:       # a later press after the rank has ended
                    pass
            time.sleep(0.05)
        err.wait_for(lambda lines: any("interrupted; stopping every rank" in line for line in lines))
        try:
            proc.wait(timeout=_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still ran {_DEADLINE_S} s after an interrupt to {target}")
        text = err.text()
        assert proc.returncode != 0, text[-3000:]
        # No rank crashed: neither mpiexec's exit status nor its report names a segfault.
        assert proc.returncode not in (11, 139, -11) and "signal 11" not in text.lower(), text[-3000:]
        assert "segmentation fault" not in text.lower(), text[-3000:]
        if target != "mpiexec" or "Open MPI" not in _mpi_flavour():
            # (Open MPI's mpiexec ends the ranks itself on a Ctrl-C, before they can say so)
            assert "interrupted; stopping every rank" in text, text[-3000:]
        assert _gone(list(ranks.values())), "a rank outlived the job"
    finally:
        _kill_all([*_descendants(proc.pid), proc.pid])
        proc.wait()


def _mpi_flavour():
    """The first line of ``mpiexec --version`` (e.g. "mpiexec (OpenRTE) 4.1.6" or MPICH's)."""
    out = subprocess.run([_mpiexec(), "--version"], capture_output=True, text=True, timeout=30)
    return "Open MPI" if "OpenRTE" in out.stdout or "Open MPI" in out.stdout else out.stdout.split("\n")[0]


_LAUNCH_SCRIPT = """
import sys
from course_helper import distributed
print("launching", flush=True)
try:
    distributed.launch_halo(ranks=2, n=64, nt=2000000, every=1000000, trace=False, backend="cpu")
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def _wait_for_ranks(pid, count):
    """The ``count`` rank processes below ``pid``, once they all run (launch_halo is then waiting
    for mpiexec), or fail the test."""
    deadline = time.monotonic() + _DEADLINE_S
    while time.monotonic() < deadline:
        ranks = _ranks_of(pid)
        if len(ranks) == count:
            return ranks
        time.sleep(0.1)
    pytest.fail(f"the ranks did not start within {_DEADLINE_S} s")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank processes through /proc")
def test_a_ctrl_c_to_launch_halo_stops_every_rank():
    """Wherever the ranks are (starting up, or in their loop), launch_halo passes a Ctrl-C on to
    mpiexec, waits for the job to end, and raises KeyboardInterrupt."""
    _mpiexec()
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCH_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ranks_env("cpu"))
    try:
        ranks = _wait_for_ranks(proc.pid, 2)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launch_halo still waited {_DEADLINE_S} s after Ctrl-C")
        assert proc.returncode == 130 and "interrupted" in out, err
        assert _gone(ranks), "a rank outlived launch_halo"
    finally:
        _kill_all([*_descendants(proc.pid), proc.pid])
        proc.communicate()


def test_rank_0_alone_prints_and_labels_modelled_times():
    p = _run_ranks(2, "--n", "40", "--nt", "20", "--backend", "cpu")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert sum("course_helper: CPU backend" in line for line in lines) == 1, p.stdout
    timed = [line for line in lines if line.startswith("40x40 grid")]
    assert len(timed) == 1 and "ms (modelled " in timed[0] and "halo exchanges on the profile's peer link" in timed[0]


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(check="no"), TypeError, "check must be True or False"),
    (dict(trace="yes"), TypeError, "trace must be True or False"),
    (dict(every=0), ValueError, "every must be at least 1"),
    (dict(every=30, nt=30), ValueError, "every=30 is not below nt=30"),
    (dict(nt=10**30), ValueError, "2147483647"),
    (dict(nt=2), ValueError, "at least 3"),
    (dict(mpiexec_args="-bind-to core"), TypeError, "shlex.split"),
    (dict(mpiexec_args=["-n", 2]), TypeError, "strings"),
    (dict(timeout=0), ValueError, "timeout"),
])
def test_launch_halo_checks_every_argument_before_starting_mpiexec(kwargs, err, msg, monkeypatch):
    def started(*args, **kw):
        raise AssertionError("mpiexec started before the arguments were checked")
    monkeypatch.setattr(subprocess, "Popen", started)
    monkeypatch.setattr(subprocess, "run", started)
    with pytest.raises(err, match=msg):
        distributed.launch_halo(**{"ranks": 2, "n": 40, "backend": "cpu", **kwargs})


_FAKE_MPIEXEC = """#!{python}
import json, pathlib, sys
args = sys.argv[1:]
out = pathlib.Path(args[args.index("--out") + 1])
verdict = {verdict!r}
if verdict is not None:
    (out / "summary.json").write_text(json.dumps({{"ranks": 2, "strategy": "overlap", "elapsed_ms": 1.0,
                                                  "rank_ms": [1.0, 1.0], "identical": verdict}}))
print("a rank failed", file=sys.stderr)
sys.exit({status})
"""


@pytest.mark.parametrize("status,verdict", [(1, False), (1, True), (1, None), (2, False), (2, True)],
                         ids=["differ", "identical", "no summary", "error after a verdict", "error after a match"])
def test_exit_status_1_is_a_failure_unless_the_check_reported_a_difference(status, verdict, tmp_path, monkeypatch):
    """A rank's crash also exits with status 1: only a summary whose check found a difference
    makes that status a verdict. Any other status is the ranks failing, whatever rank 0 wrote
    before (another rank can fail after it)."""
    fake = tmp_path / "mpiexec"
    fake.write_text(_FAKE_MPIEXEC.format(python=sys.executable, verdict=verdict, status=status))
    fake.chmod(0o755)
    monkeypatch.setenv("COURSE_HELPER_MPIEXEC", str(fake))
    if (status, verdict) == (1, False):
        assert distributed.launch_halo(ranks=2, n=40, nt=20, check=True, trace=False, backend="cpu").identical is False
    else:
        with pytest.raises(RuntimeError, match=f"the ranks failed \\(exit {status}\\)"):
            distributed.launch_halo(ranks=2, n=40, nt=20, check=True, trace=False, backend="cpu")


# -- two GPUs (skipped with fewer) -------------------------------------------------
def _two_gpus():
    if not ch.runtime.gpu_available():
        pytest.skip("no working CUDA GPU here (the GPU tests run on a GPU machine)")
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs: one rank per GPU, halos by NCCL")
    return _mpiexec()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1024, 1023])
@pytest.mark.parametrize("strategy", distributed.STRATEGIES)
def test_two_gpus_give_the_single_device_result_bit_for_bit(strategy, n, tmp_path):
    """NCCL between two GPUs, the captured loop's NCCL send/recv replayed from a CUDA graph included."""
    mpiexec = _two_gpus()
    p = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "course_helper", "halo", "--n", str(n), "--nt", "300",
                        "--every", "50", "--strategy", strategy, "--check", "--trace", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=ranks_env("gpu"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "(gpu, " in p.stdout and "identical to the single-device solve" in p.stdout
    traces = distributed.traces_from_chrome(json.loads((tmp_path / "trace.json").read_text()))
    for t in traces:
        assert "halo" in t.tracks and len(t.of_kind("halo")) == 300 - 2, t.tracks   # one NCCL bar per step
        assert all(e.end_ms >= e.start_ms for e in t.events)      # one time origin for starts and ends


_BOUND_SCRIPT = """
import warnings
warnings.simplefilter("always")
from course_helper import distributed
team = distributed.Team()
distributed.Team(team.comm)                        # a second team of the same ranks: no second warning
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a machine of two cores or more")
@pytest.mark.parametrize("binding", ["core", "none"])
def test_a_rank_bound_to_one_core_says_so_once_and_how_to_start_it(binding):
    """Open MPI binds each of one or two ranks to a core by default; NCCL's proxy thread then polls
    on the core the rank's Python thread queues its work from. The team warns, once per rank."""
    p = subprocess.run([_mpiexec(), "-bind-to", binding, "-n", "2", sys.executable, "-c", _BOUND_SCRIPT],
                       capture_output=True, text=True, timeout=120, env=ranks_env("cpu"))
    assert p.returncode == 0, p.stderr
    warned = [line for line in p.stderr.splitlines() if "may run on one core only" in line]
    if binding == "core":
        assert sorted(line.split("RuntimeWarning: ")[1][:6] for line in warned) == ["rank 0", "rank 1"], p.stderr
        assert all("mpiexec --bind-to none" in line for line in warned)
    else:
        assert warned == []


def test_the_one_core_note_reads_the_process_affinity(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert "--bind-to none" in distributed.link.one_core_note()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3}, raising=False)
    assert distributed.link.one_core_note() is None
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert distributed.link.one_core_note() is None          # a one-core machine: nothing to gain
