"""Measure a GPU's profile for the modelled device of the CPU backend.

Run it on a GPU::

    python -m course_helper calibrate --out course_helper/profiles/h200.json

Device times are read with CUDA events around work queued *behind a spin
kernel*: the stream is busy while the host queues the work, so the events
time the device alone, not the host's calls. Host costs are the wall time of
the helper's own calls (the course's GPU code path), median over many calls.
Each figure's method goes into the profile's provenance.
"""
from __future__ import annotations

import datetime
import platform
import tempfile
from typing import TYPE_CHECKING

import numpy as np

from .. import disk
from .. import runtime
from ..runtime.backend import device_report
from ..runtime.ops import COPY_KINDS, OpKind
from ..exercises.layer_cake import bake_layer
from ..graphs import capture_graph
from ..memory import (copy_on_device_async, copy_to_host, copy_to_host_async, device_zeros, pinned_empty,
                      pinned_zeros, queue_copy, to_device, zero_async)
from ..solver import solve
from ..streams import create_events, create_streams, elapsed_ms, synchronize
from ..timelines.stopwatch import Stopwatch
from ..timing import benchmark, host_times
from ..wave import WaveProblem, launch_wave2d

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["calibrate", "fit_line", "wake_us", "copies_per_link", "loop_turn_us", "measure_disk"]

_MIB = 2**20
#: Loop turns (launch + record) timed after a blocking wait: enough for the host to be back
#: at its usual pace (the first calls after a wait are the slow ones).
WAKE_TURNS = 4


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ys against xs."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def _link(bench, kind, sizes, repeat=10):
    """Latency (µs) and bandwidth (GB/s) of pinned copies of ``kind``, fitted over ``sizes``."""
    pts = []
    for size in sizes:
        n = size // 4
        dev = device_zeros(n)
        host = pinned_zeros(n)
        s = bench.s
        if kind == OpKind.D2H:
            ms = bench.device_ms(lambda: copy_to_host_async(host, dev, s), repeat)
        elif kind == OpKind.H2D:
            ms = bench.device_ms(lambda: queue_copy(OpKind.H2D, dev, host, s, None), repeat)
        else:
            other = device_zeros(n)
            ms = bench.device_ms(lambda: copy_on_device_async(other, dev, s), repeat)
        pts.append((size, ms * 1e3))
        dev = host = other = None             # freed before the next size is allocated
    lat, slope = fit_line(*zip(*pts))
    return {"gbps": round(1e-3 / slope, 2), "latency_us": round(max(lat, 0.0), 3),
            "points_us": [[b, round(t, 3)] for b, t in pts]}


def _pageable(bench, kind, sizes, overhead_us, count=8):
    """Latency and bandwidth of staged (pageable) copies, from the host's wall time of
    blocking copies into successive slices of a stack that has been written once already
    (as solve() fills its output stack before the sequential loop copies into it), less
    the calls' own cost. Untouched pages would add a page fault per page to every copy."""
    pts = []
    for size in sizes:
        n = size // 4
        dev = device_zeros(n)
        stack = np.empty((count, n), np.float32)
        stack.fill(np.nan)                            # touched once, like solve()'s output stack
        rows = iter(stack)

        def copy(rows=rows, dev=dev):
            row = next(rows)
            if kind == OpKind.D2H:
                copy_to_host(row, dev, bench.s)
            else:
                queue_copy(OpKind.H2D, dev, row, bench.s, None, pageable=True)
                bench.s.synchronize()
        times = host_times(copy, count, before=synchronize)
        pts.append((size, float(np.median(times[1:])) * 1e3 - overhead_us))
        del stack, dev, rows, copy                    # free this size before the next is allocated
    lat, slope = fit_line(*zip(*pts))
    return {"gbps": round(1e-3 / slope, 2), "latency_us": round(max(lat, 0.0), 3),
            "points_us": [[b, round(t, 3)] for b, t in pts]}


def wake_us(after_wait_ms: Sequence[float], unhurried_ms: Sequence[float]) -> float:
    """The host's wake-up (µs) from two samples of the same turns' device time: started by
    a host that has just come back from a blocking wait, and by one that has not waited
    (median against median, never below zero)."""
    if not len(after_wait_ms) or not len(unhurried_ms):
        raise ValueError("wake_us needs at least one sample of each kind")
    return max(0.0, float(np.median(after_wait_ms) - np.median(unhurried_ms)) * 1e3)


def _wake(bench, turns=WAKE_TURNS, wait_ms=0.3, n=200):
    """How much later the host's next work reaches an idle device after a blocking wait
    than after calls made without waiting: the wake-up (µs) charged to every host wait
    that blocks.

    Each sample is ``turns`` turns of the course's loops (launch the 256^2 kernel on a
    second stream, record an event there), timed by events from a mark on the device.
    After a wait: the mark ends a spin of ``wait_ms`` on an idle stream that the host
    synchronises (it blocks), and the turns follow at once. Without: the host records the
    mark on the idle stream after ``turns`` untimed turns, and the same turns follow. The
    device keeps up with the host (the kernel is shorter than a launch call), so both time
    the host; the difference is the wake-up: the host coming back from the wait, its first
    calls' extra cost, and the idle device taking up the next command."""
    p = WaveProblem(256, 256, nt=3)
    U = [device_zeros(p.shape) for _ in range(3)]
    V = to_device(p.velocity)
    (other,) = create_streams(1, name="after the wait")
    (done,) = create_events(1, timing=True)     # as the timer's end event: each turn records alike

    def queue_turns(last_record=True):
        # Timed, the last turn's record is the timer's own end event.
        for i in range(turns):
            launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=other)
            if last_record or i < turns - 1:
                other.record(done)

    def woken():
        bench.s.synchronize()                 # blocks until the spin has ended
        queue_turns(last_record=False)

    after, unhurried = [], []
    queue_turns()
    for _ in range(n):
        # The mark ends a spin the host then waits for, and the turns follow at once.
        after += benchmark(woken, bench.s, before=lambda: bench.idle_then_hold(wait_ms), n_repeat=1,
                           end_stream=other).device_ms
        # The host is busy with calls, not back from a wait; the mark goes on the idle stream,
        # not behind the last turn's kernel.
        unhurried += benchmark(lambda: queue_turns(last_record=False), bench.s, before=queue_turns, n_repeat=1,
                               end_stream=other).device_ms
    return wake_us(after, unhurried), after, unhurried


def _kernel_points(bench, sizes, make):
    pts = []
    for n in sizes:
        queue, nbytes = make(n)
        pts.append([nbytes, round(bench.device_ms(queue) * 1e3, 4)])
    return {"points": pts}


def _wave(n, stream):
    p = WaveProblem(n, n, nt=3)
    U = [device_zeros(p.shape) for _ in range(3)]
    V = to_device(p.velocity)
    return (lambda: launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=stream)), 4 * U[2].nbytes


def measure_disk(folder: str | None = None, mib: float = 1024, chunk_mib: float = 4,
                 writers: int | None = None) -> dict:
    """The profile's ``disk`` section: the disk holding ``folder`` (default: the temporary
    folder) measured as a streamed run uses it, in a temporary folder that is removed after.

    Bandwidth: ``mib`` MiB of ``chunk_mib`` MiB files from ``writers`` threads (default: the
    store's writer count), each written, fsync'ed and renamed (the data really on the disk).
    Latency: the time per file of 64 files of 4 KiB from one thread, the same way.
    """
    writers = disk.DEFAULT_WRITERS if writers is None else writers
    with tempfile.TemporaryDirectory(dir=folder, prefix="course-helper-disk-") as work:
        gbps = disk.measure_disk_bandwidth(work, mib=mib, chunk_mib=chunk_mib, writers=writers)
        small = disk.measure_disk_bandwidth(work, mib=64 * 4 / 1024, chunk_mib=4 / 1024, writers=1)
    return {"gbps": round(gbps, 4), "latency_us": round(4096 / (small * 1e9) * 1e6, 1), "writers": writers,
            "provenance": (f"calibrate.measure_disk on {platform.node() or 'this machine'}'s temporary folder: "
                           f"{mib} MiB in {chunk_mib} MiB files from {writers} writer threads, each fsync'ed "
                           "then renamed; latency = time per fsync'ed 4 KiB file from one thread")}


def copies_per_link(first_ms: float, second_ms: float) -> int:
    """1 when two equal copies queued together in one direction ran one after the other (the
    first ended by three quarters of the time the second took), 0 when they shared the link
    (both ended together). The model then runs one copy per link at a time, or shares it."""
    return 1 if first_ms < 0.75 * second_ms else 0


def _copies_together(bench, nbytes=16 * _MIB, trials=5):
    """End times (ms, medians of ``trials``) of two device-to-host copies of ``nbytes`` queued
    at once on two streams, from the moment both may start."""
    a, b = create_streams(2, name="copy")
    n = nbytes // 4
    src, dst = [device_zeros(n) for _ in range(2)], [pinned_empty(n) for _ in range(2)]
    go, end_a, end_b = create_events(3, timing=True)
    ends = []
    for _ in range(trials + 1):                    # the first is a warm-up
        bench.hold()
        bench.s.record(go)
        for s, d, x, end in ((a, dst[0], src[0], end_a), (b, dst[1], src[1], end_b)):
            s.wait_event(go)
            copy_to_host_async(d, x, s)
            s.record(end)
        synchronize()
        ends.append(sorted((elapsed_ms(go, end_a), elapsed_ms(go, end_b))))
    first, second = np.median(np.array(ends[1:]), axis=0)
    return float(first), float(second)


def loop_turn_us(ms_per_level: float, host: dict[str, float]) -> float:
    """The host time (µs) a strategy's loop spends per turn outside the helper's calls: the
    events loop's time per level where the device never holds the host back (``ms_per_level``),
    less the six calls of one of its turns (two waits, a launch, two records, a copy) as
    ``host`` gives them; never below 0."""
    calls = host["launch"] + host["copy"] + 2 * host["record"] + 2 * host["wait_event"]
    return max(0.0, ms_per_level * 1e3 - calls)


def _events_ms_per_level(n=64, nt=640, repeats=9):
    """The events loop's host time per level on an ``n``² grid, so small that the device never
    holds the host back (median of ``repeats`` untraced solves)."""
    p = WaveProblem(n, n, nt=nt)
    solve(p, "events", trace=False)                  # warm-up
    return float(np.median([solve(p, "events", trace=False).elapsed_ms for _ in range(repeats)])) / nt


#: Rounds of the host-cost measurements; each figure of the profile is their median.
HOST_ROUNDS = 5


def calibrate(progress: Callable[[str], object] = print) -> dict:
    """Measure the active GPU and return a profile dict (see :mod:`course_helper.runtime.profiles`)."""
    if runtime.get().predicts_times:
        raise RuntimeError("calibration measures a real GPU: run it on the GPU backend "
                           "(the CPU backend models a GPU from such a profile)")
    rep = device_report()
    bench = Stopwatch()
    s = bench.s
    sizes = [256 * 1024, _MIB, 4 * _MIB, 16 * _MIB, 64 * _MIB]
    progress("host costs of the helper calls")
    p = WaveProblem(256, 256, nt=3)
    U = [device_zeros(p.shape) for _ in range(3)]
    V = to_device(p.velocity)
    out = pinned_zeros((200, *p.shape))
    stage = device_zeros((16, *p.shape))
    (other,) = create_streams(1, name="other")
    (ev,) = create_events(1)
    other.record(ev)
    k = iter(range(10**9))
    with capture_graph(s) as cap:
        launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=s)
    calls = {
        "launch": (lambda: launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=s), True),
        "copy": (lambda: copy_to_host_async(out[next(k) % 200], U[2], s), True),
        "copy_d2d": (lambda: copy_on_device_async(stage[next(k) % 16], U[2], s), True),
        "record": (lambda: s.record(ev), True),
        "wait_event": (lambda: s.wait_event(ev), True),
        "query": (lambda: s.done, True),      # the profile's name: cudaStreamQuery
        "synchronize": (s.synchronize, False),
        "host_func": (lambda: s.launch_host_func(lambda: None), True),
        "graph_launch": (cap.graph.launch, True),
    }
    # A host's speed drifts (clock ramps, the first calls of a process): every figure is the
    # median of HOST_ROUNDS rounds taken one after another over the whole set.
    rounds = []
    for _ in range(HOST_ROUNDS):
        r = {key: bench.host_us(call, busy=busy) for key, (call, busy) in calls.items()}
        r["wake"] = _wake(bench)[0]
        r["loop_turn"] = loop_turn_us(_events_ms_per_level(), r)
        rounds.append(r)
    host = {key: round(float(np.median([r[key] for r in rounds])), 3) for key in rounds[0]}

    progress("links")
    # Keyed by plain strings: the profile is written as JSON.
    links = {str(kind): _link(bench, kind, sizes + ([256 * _MIB] if kind == OpKind.D2D else []))
             for kind in COPY_KINDS}
    staged_overhead = host["copy"] + host["synchronize"]
    first, second = _copies_together(bench)
    together = {"copies_per_link": copies_per_link(first, second),
                "two_16MiB_copies_end_ms": [round(first, 4), round(second, 4)]}
    for kind in (OpKind.D2H, OpKind.H2D):
        links[f"{kind}_pageable"] = _pageable(bench, kind, sizes, staged_overhead)

    progress("kernels")
    grids = [64, 128, 256, 512, 1024, 2048, 4096]
    planes = {}

    def bake(n):
        plane = planes.setdefault(n, device_zeros((n, n)))
        return (lambda: bake_layer(plane, 1, s, oven=False)), plane.nbytes   # the model adds the oven

    def fill(n):
        a = planes.setdefault(("fill", n), device_zeros((n, n)))
        return (lambda: zero_async(a, s)), a.nbytes

    kernels = {"wave2d_4o": _kernel_points(bench, grids, lambda n: _wave(n, s)),
               "bake": _kernel_points(bench, grids, bake),
               "fill": _kernel_points(bench, grids, fill)}

    progress("graph nodes")
    kernel_alone = bench.device_ms(lambda: launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=s)) * 1e3
    copy_alone = bench.device_ms(lambda: copy_to_host_async(out[0], U[2], s)) * 1e3
    with capture_graph(s) as kcap:
        for _ in range(100):
            launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=s)
    # Copies as the event loop makes them: each forked onto one of five IO streams by an
    # event, and joined back at the end.
    io = create_streams(5, name="io")
    forks = create_events(5)
    with capture_graph(s) as ccap:
        for i in range(100):
            s.record(forks[i % 5])
            io[i % 5].wait_event(forks[i % 5])
            copy_to_host_async(out[i], U[2], io[i % 5])
        for stream in io:
            s.wait_stream(stream)
    graph = {"kernel_node_us": round(max(0.0, bench.device_ms(kcap.graph.launch, 5) * 10 - kernel_alone), 3),
             "copy_node_us": round(max(0.0, bench.device_ms(ccap.graph.launch, 5) * 10 - copy_alone), 3)}

    import cupy
    return {
        "name": rep["device"].replace("NVIDIA ", "").lower().replace(" ", "-"),
        "device": {"name": rep["device"], "short_name": rep["device"].replace("NVIDIA ", ""),
                   "async_engine_count": rep["async_engine_count"],
                   "compute_capability": rep["compute_capability"], "memory_gib": rep["memory_gib"],
                   **together},
        "links": links,
        "kernels": kernels,
        "host_us": host,
        "graph": graph,
        "disk": measure_disk(),
        "provenance": {
            "device": f"{rep['device']} ({rep['multiprocessors']} SMs, {rep['memory_gib']} GiB)",
            "driver": f"CUDA driver {rep['driver_version']}, runtime {rep['runtime_version']}",
            "cupy": cupy.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "cpu": rep["cpu"],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "method": ("python -m course_helper calibrate. Device times: CUDA events around 10-20 "
                       "repeats of the operation queued behind a spin kernel (device time only); "
                       "pinned link latency and bandwidth = least-squares line over 256 KiB..64 MiB "
                       "(D2D to 256 MiB). Pageable copies: host wall time of a blocking copy into "
                       "successive slices of a stack written once before (as solve() fills its output "
                       "stack), less the copy and synchronise calls' cost, "
                       "fitted the same way. Kernels: device time per launch for grids 64^2..4096^2 "
                       "(bytes moved = 4 arrays for wave2d_4o, 1 for bake and fill). Host costs: median "
                       "wall time of 200 calls of the helper's own function at 256^2 with the stream busy "
                       f"(synchronize: on an idle stream), median of {HOST_ROUNDS} rounds over the whole set. "
                       "Wake-up (host_us.wake, charged to a host wait "
                       "that blocks): device time by events of 4 turns (a 256^2 launch and an event record "
                       "on a second stream) from the end of a 0.3 ms spin the host was blocked on, less the "
                       "same turns from an event the host recorded without waiting, median of 200 each. "
                       "Loop turn (host_us.loop_turn, charged once per kernel): the events loop's host "
                       "time per level at 64^2 x 640 (median of 9 untraced solves; the device never "
                       "holds the host back there) less one turn's six calls as measured above. "
                       "Copies per link (device.copies_per_link): two 16 MiB device-to-host copies queued "
                       "at once on two streams; 1 when the first ended by 3/4 of the second's time (one "
                       "copy at a time per direction), 0 when they ended together (shared), median of 5. "
                       "Graph node costs: a replayed graph of 100 kernels on one stream / 100 D2H "
                       "copies of 256 KiB forked by events onto 5 streams (as the event loop makes them), "
                       "per node, less the same operation alone."),
        },
    }
