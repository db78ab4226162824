"""The benchmark sweep: how close does each strategy get to the physical limit?

For one run, no overlap strategy can beat

    B = max(compute-only time, output bytes / peak pinned device-to-host bandwidth)

both measured in the same process on the same device. ``efficiency = B / time``.
Run it with::

    python -m course_helper bench --out benchmarks/

It writes ``bench.json`` (the machine, every point, every repeat) and
``bench.png`` (efficiency and speedup per strategy per size). Timings belong
here, not in tests: the tests only check that the numbers are well formed.

Each strategy's row also says how much of its work overlapped, from its traced
runs (CUPTI on a GPU, the model on the CPU; :meth:`Trace.overlap`): compute and
device-to-host copy busy times, the time both ran at once, and the hidden
fraction (overlap / the shorter of the two). ``--nscratch 5,8,12`` repeats every
point at each ring depth, e.g. the balanced point's ring sweep::

    python -m course_helper bench --points 3072x320x16 --nscratch 5,8,12,16,20,24 --out benchmarks/ring
"""
from __future__ import annotations

import datetime
import json
import os
import platform
from typing import TYPE_CHECKING

import numpy as np

from .. import checks, raw_cupy, runtime
from ..disk import DEFAULT_WRITERS, SHARDED, codec_speed, device_batch, measure_disk_bandwidth, open_store
from ..runtime.backend import backend_name, device_report
from ..runtime.ops import OpKind
from .compare import nscratch_for, baseline_first, time_strategies
from ..graphs import capture_graph, graphs_supported
from ..memory import copy_to_host_async, device_zeros, pinned_empty, to_device
from ..solver import STRATEGIES, available_strategies, chunk_levels, plan_memory, solve, suggest_nscratch
from ..wave import saved_levels
from ..streams import create_streams, synchronize
from ..timing import benchmark
from ..files import write_atomically
from ..wave import WaveProblem, launch_wave2d

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    import matplotlib.figure

__all__ = ["DEFAULT_POINTS", "BALANCED_POINT", "EVERY_POINTS", "QUICK_POINTS", "peak_d2h_gbps", "parse_nscratch",
           "compute_only_ms", "physical_limit", "bench_point", "run_bench", "plot_bench", "DISK_POINTS", "disk_point",
           "RAW_ROW", "paired_ratio", "add_trace_cost", "measure_trace_cost", "check_disk_folder"]

#: (n, nt, every) where overlap is the lesson: compute and copies take about as long, so overlapping
#: them can nearly halve the time if the ring is deep enough; and a kernel is long next to the Python
#: that queues each turn, so the compute stream has no host gaps for the copies to fall into. What
#: was measured there, on which GPU: docs/results.md.
BALANCED_POINT = (3072, 320, 16)
#: (n, nt, every): the course sweep, from launch-bound to IO-bound, and the balanced point.
DEFAULT_POINTS = [(256, 640, 1), (1024, 640, 1), (2048, 320, 8), (2048, 320, 16), BALANCED_POINT, (4096, 128, 8)]
#: A sweep of the snapshot interval at one size: the crossover from IO-bound to compute-bound.
EVERY_POINTS = [(2048, 320, e) for e in (1, 2, 4, 16, 32)]
#: Small enough for the CPU backend.
QUICK_POINTS = [(64, 80, 1), (128, 80, 4)]
#: The reference row of a GPU sweep: the events loop in plain CuPy (:mod:`raw_cupy`).
RAW_ROW = "raw-cupy-events"


def peak_d2h_gbps(mib: float = 512, repeats: int = 5) -> float:
    """Device-to-host bandwidth of one large pinned copy, in GB/s (1 GB = 1e9 bytes)."""
    n = int(mib * 2**20) // 4
    src = device_zeros(n)
    dst = pinned_empty(n)
    (s,) = create_streams(1, name="bandwidth")
    rt = runtime.get()
    with rt.times_only(rt.modelled):         # only the time is asked for
        ms = benchmark(lambda: copy_to_host_async(dst, src, s), s, n_repeat=repeats, n_warmup=1).median_ms
    return n * 4 / (ms * 1e-3) / 1e9


def compute_only_ms(problem: WaveProblem, repeats: int = 5) -> float:
    """Device time of the run's kernels alone, no copies.

    On the GPU both a plain launch loop and its CUDA graph are timed and the
    faster is taken: the best the device can compute, without Python's launch
    cost where the graph removes it.
    """
    U = [device_zeros(problem.shape) for _ in range(3)]
    V = to_device(problem.velocity)
    (s,) = create_streams(1, name="compute")
    synchronize()

    def loop():
        for level in range(2, problem.nt):
            launch_wave2d(U[(level - 2) % 3], U[(level - 1) % 3], U[level % 3], V, problem,
                          level - 2, stream=s)

    rt = runtime.get()
    with rt.times_only(rt.modelled):         # only the time is asked for
        best = benchmark(loop, s, n_repeat=repeats, n_warmup=1).median_ms
        if graphs_supported()[0]:
            with capture_graph(s) as cap:
                loop()
            best = min(best, benchmark(cap.graph.launch, s, n_repeat=repeats, n_warmup=1).median_ms)
    return best


def physical_limit(problem: WaveProblem | None = None, every: int = 1, peak_gbps: float | None = None,
                   repeats: int = 5) -> dict[str, float | str]:
    """The fastest any overlap strategy could run ``problem`` saving every ``every``-th level.

    Returns a dict: ``peak_d2h_gbps`` (measured here unless given),
    ``compute_only_ms`` (the kernels alone, no copies), ``copy_floor_ms``
    (the output bytes at the peak bandwidth), ``bound_ms`` = B, the larger of
    the two, and ``bound_by`` ("compute" or "copies").
    """
    problem = WaveProblem() if problem is None else problem
    output_bytes = plan_memory(problem, "sequential", every)["host"]     # also checks the arguments
    peak = peak_d2h_gbps() if peak_gbps is None else checks.positive_float("peak_gbps", peak_gbps)
    compute = compute_only_ms(problem, repeats)
    copies = output_bytes / (peak * 1e9) * 1e3
    return {"peak_d2h_gbps": peak, "compute_only_ms": compute, "copy_floor_ms": copies,
            "bound_ms": max(compute, copies), "bound_by": "compute" if compute >= copies else "copies"}


def _fits(output_bytes, strategies):
    """None when the point fits in host memory, else the reason it does not."""
    # the sequential answer is kept for comparison while each other strategy runs
    need = output_bytes * (2 if len(strategies) > 1 else 1)
    avail = checks.host_memory_shortfall(need)
    if avail is not None:
        return (f"needs {need / 2**30:.1f} GiB of host memory for the output stacks but only "
                f"{avail / 2**30:.1f} GiB are available")
    return None


def parse_nscratch(text: str) -> list[int]:
    """The ring depths of ``--nscratch``, e.g. ``"5,8,12"`` -> ``[5, 8, 12]`` (each at least 1;
    whether a strategy can run with it is checked before anything is measured)."""
    depths = []
    for item in str(text).split(","):
        try:
            k = int(item.strip())
        except ValueError:
            k = 0
        if k < 1:
            raise ValueError(f"cannot read the ring depth {item.strip()!r} in --nscratch {text!r}; give whole "
                             "numbers of scratch buffers separated by commas, e.g. --nscratch 5,8,12")
        depths.append(k)
    return list(dict.fromkeys(depths))


def _check_point(n, nt, every, strategies, nscratch):
    """Refuse a point that a strategy cannot run (at this ring depth), before anything is measured;
    returns the output bytes."""
    problem = WaveProblem(n0=n, n1=n, nt=nt)
    for name in strategies:
        depth, least = nscratch_for(name, nscratch), STRATEGIES[name].min_nscratch
        if depth is not None and depth < least:        # the benchmark times safe runs only
            raise ValueError(f"nscratch={depth} is unsafe for the {name!r} strategy (it races: "
                             f"the level being copied shares a buffer with the one being computed); the "
                             f"benchmark times safe runs only: use ring depths of at least {least}")
        plan_memory(problem, name, every, depth)
    return plan_memory(problem, "sequential", every)["host"]


def bench_point(n: int, nt: int, every: int, strategies: Iterable[str], repeats: int = 5,
                peak_gbps: float | None = None, trace_cost: bool = True, nscratch: int | None = None) -> dict:
    """Measure one (n, nt, every) point: B's two parts and each strategy's times (and, with
    ``trace_cost``, what tracing costs and how much overlapped: see :func:`add_trace_cost`).
    ``nscratch`` is the ring depth of the strategies that take one (None: their defaults)."""
    problem = WaveProblem(n0=n, n1=n, nt=nt)
    order = baseline_first(strategies)
    output_bytes = _check_point(n, nt, every, order, nscratch)      # refuses bad input before measuring
    point = {"n": n, "nt": nt, "every": every, "saved_levels": len(saved_levels(nt, every)),
             "output_bytes": output_bytes, "nscratch": nscratch}
    reason = _fits(output_bytes, order) if runtime.get().computes_data else None   # times only: no stacks held
    if reason is not None:
        point["skipped"] = reason
        return point
    point.update(physical_limit(problem, every, peak_gbps, repeats))
    # On a GPU the events loop in plain CuPy is the reference row: it runs right after the
    # helper's events loop in every round (the helper's overhead is the gap), before any traced
    # (CUPTI) run.
    raw = backend_name() == "gpu" and "events" in order
    # The same ring as the helper's events loop: the depth given, or the one solve chooses by default.
    ring = {"nscratch": nscratch if nscratch is not None else suggest_nscratch(problem, every, "events")[0]}
    also = {RAW_ROW: lambda: raw_cupy.events_loop(problem, every, **ring)} if raw else None
    timed = time_strategies(problem, order, repeats, every, nscratch=nscratch, also=also,
                            also_after="events" if raw else None)
    point["strategies"] = {
        name: {"times_ms": t["times_ms"], "median_ms": t["median_ms"], "min_ms": t["min_ms"],
               "max_ms": t["max_ms"], "efficiency": point["bound_ms"] / t["median_ms"],
               "identical_to_sequential": None if t["max_diff"] is None else t["max_diff"] == 0.0,
               "speedup": t["speedup"]}
        for name, t in timed.items()}
    if raw:
        point["strategies"][RAW_ROW]["events_over_raw"] = paired_ratio(timed["events"]["times_ms"],
                                                                        timed[RAW_ROW]["times_ms"])
    if trace_cost:
        add_trace_cost(point, order, repeats)
    return point


def add_trace_cost(point: dict, strategies: Iterable[str], repeats: int = 5) -> dict:
    """Add to each strategy of a measured ``point`` what recording its timeline costs
    (``trace_overhead``: traced over untraced, in rounds of one of each, see :func:`measure_trace_cost`),
    the clock that timed the traces, and how much of the work overlapped in them
    (``compute_busy_ms``, ``copy_busy_ms``, ``overlap_ms``, ``hidden_fraction``); returns ``point``.

    Run it after every untraced measurement of the process: a CUPTI recording leaves the rest
    of the process slower, plain CuPy and the helper alike (docs/tracing.md), and the untraced
    times must not pay for it."""
    if "strategies" not in point:
        return point
    problem = WaveProblem(n0=point["n"], n1=point["n"], nt=point["nt"])
    for name in strategies:
        row = point["strategies"][name]
        row.update(measure_trace_cost(problem, name, point["every"], repeats, point.get("nscratch")))
    return point


def measure_trace_cost(problem: WaveProblem, name: str, every: int, repeats: int,
                       nscratch: int | None = None) -> dict:
    """What recording a timeline costs: ``repeats`` rounds of one untraced and one traced run,
    back to back (a host whose speed drifts slows both alike). Returns the medians
    (``traced_ms``, ``untraced_beside_ms``), ``trace_overhead``, the median of the rounds'
    traced / untraced ratios, ``trace_timing``, the clock that timed the traces, the medians
    over the traces of :meth:`Trace.overlap`'s numbers (``compute_busy_ms``, ``copy_busy_ms``,
    ``overlap_ms``, ``hidden_fraction``; ``overlap_timing`` is ``trace_timing``) and the ring
    depth the runs used (``nscratch``; ``nscratch`` asks for one where the strategy takes it)."""
    repeats = checks.positive_int("repeats", repeats)
    untraced, traced, overlaps = [], [], []
    nscratch = nscratch_for(name, nscratch)
    for _ in range(repeats):
        untraced.append(solve(problem, name, every=every, nscratch=nscratch, trace=False).elapsed_ms)
        r = solve(problem, name, every=every, nscratch=nscratch, trace=True)
        traced.append(r.elapsed_ms)
        overlaps.append(r.trace.overlap().as_dict())
    timing = overlaps[-1]["overlap_timing"]
    busy = {key: float(np.median([o[key] for o in overlaps]))
            for key in ("compute_busy_ms", "copy_busy_ms", "overlap_ms", "hidden_fraction")}
    return {"traced_ms": float(np.median(traced)), "untraced_beside_ms": float(np.median(untraced)),
            "trace_overhead": paired_ratio(traced, untraced), "trace_timing": timing, **busy,
            "overlap_timing": timing, "nscratch": r.nscratch}


def paired_ratio(times: Sequence[float], reference_times: Sequence[float]) -> float:
    """The median over rounds of ``times[i] / reference_times[i]``: two loops timed back to back
    in each round, compared round by round, so that the host's drift between rounds cancels."""
    if len(times) != len(reference_times) or not times:
        raise ValueError("paired_ratio needs two equally long, non-empty lists of times")
    return float(np.median([t / r for t, r in zip(times, reference_times)]))


#: (n, nt, every) of the disk points: about 1.3 GB of output each.
DISK_POINTS = [(1024, 320, 1), (2048, 320, 4)]


def _settle():
    # Flush what earlier deletions left to the disk (a file system mounted with `discard` trims
    # freed blocks at its next commit), so that neither a run nor a measurement pays for what
    # came before it.
    if hasattr(os, "sync"):
        os.sync()


def check_disk_folder(folder: str | os.PathLike) -> str | os.PathLike:
    """Refuse a folder the disk points cannot write their stores into (before measuring anything)."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"the disk folder must be a path, got {type(folder).__name__}")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"the disk folder {folder} does not exist (or is not a folder); create it "
                                "on the disk to measure, or give another")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"the disk folder {folder} is not writable; give a folder on the disk to measure")
    return folder


def disk_bandwidth(where: str | os.PathLike, mib: float, chunk_mib: float) -> float:
    """The disk's sustained write bandwidth in GB/s under ``where``, as a streamed run uses it
    (``mib`` MiB in files of ``chunk_mib``, :data:`DEFAULT_WRITERS` threads, fsync'ed);
    on the CPU backend the modelled disk's."""
    rt = runtime.get()
    if rt.modelled:
        return rt.profile["disk"]["gbps"]
    _settle()
    return measure_disk_bandwidth(where, mib=mib, chunk_mib=chunk_mib, writers=DEFAULT_WRITERS)


def disk_point(n: int, nt: int, every: int, folder: str | os.PathLike,
               strategies: Sequence[str] = ("events", "staged"),
               compress: Sequence[str | None] = (None, "zstd", "blosc", "gpu-zstd"), repeats: int = 3,
               peak_gbps: float | None = None) -> dict:
    """One run streamed to a store under ``folder``, against the bound with the disk in it:
    B = max(compute-only, bytes / peak D2H, bytes / sustained disk bandwidth).

    The disk is measured the way the run uses it: the same bytes in files of the run's chunk
    size from the same number of writer threads, each fsync'ed, right before the first
    uncompressed run of a strategy and right after each one, once that run's store is deleted
    (``disk_gbps`` of each run entry: one more measurement than runs). A disk's speed drifts from one second to the
    next, so each run is held against the disk as it was on both sides of it: its own B
    takes the mean of the measurements just before and just after it, and the run's
    ``efficiency`` is the median over its repeats of that B / its time. The point's
    ``disk_gbps`` and ``bound_ms`` (the median of all measurements) are what the table shows,
    and what the compressed runs are held against. A short burst (256 MiB) measured first is
    reported as ``disk_burst_gbps``: a disk may take a burst faster than it sustains, and a
    burst would make B too optimistic. On the CPU backend the disk is the modelled one (the
    profile's ``disk`` section).

    ``"gpu-zstd"`` compresses on the device (one nvCOMP call per chunk): its staged run ships
    chunks of about 64 MiB (:func:`course_helper.disk.device_batch`), its events run one level
    per chunk as the loop hands them over; its entry adds ``compression`` (where, and the
    compression's own speed: :meth:`course_helper.disk.DiskSink.compression_summary`) and
    ``batch``."""
    import shutil
    import tempfile
    check_disk_folder(folder)
    problem = WaveProblem(n0=n, n1=n, nt=nt)
    nbytes = plan_memory(problem, "sequential", every)["host"]
    level_mib = problem.nbytes_level / 2**20
    point = {"n": n, "nt": nt, "every": every, "output_bytes": nbytes, "writers": DEFAULT_WRITERS,
             "disk_burst_gbps": disk_bandwidth(folder, min(256, nbytes / 2**20), level_mib),
             "peak_d2h_gbps": peak_gbps if peak_gbps is not None else peak_d2h_gbps(),
             "compute_only_ms": compute_only_ms(problem, repeats), "runs": []}
    sample = None
    for codec in compress:
        for name in strategies:
            times, stored, summary = [], None, None
            batch = device_batch(problem.nbytes_level) if codec in SHARDED and name == "staged" else None
            # the disk just before the first run, then after each one (raw bytes only)
            chunk_mib = level_mib * chunk_levels(problem, name, every)
            disk = [disk_bandwidth(folder, nbytes / 2**20, chunk_mib)] if codec is None else []
            for _ in range(repeats if codec is None else 1):
                work = tempfile.mkdtemp(dir=folder)
                try:
                    _settle()
                    r = solve(problem, name, every=every, trace=False, store=os.path.join(work, "s.zarr"),
                              compress=codec, batch=batch)
                    times.append(r.elapsed_ms)
                    summary = r.compression
                    opened = open_store(r.store)
                    stored = opened.stored_nbytes()
                    if sample is None:           # about 16 levels across the run, for the codecs alone
                        sample = opened.images[::max(1, len(opened.levels) // 16)]
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                if codec is None:
                    # The disk as this run used it, right after it, once the store is deleted: each
                    # measurement then follows the deletion of a run's files and each run the
                    # deletion of a measurement's, so neither inherits the other's freed blocks.
                    disk.append(disk_bandwidth(folder, nbytes / 2**20, chunk_mib))
            med = float(np.median(times))
            run = {"strategy": name, "compress": codec, "times_ms": times, "median_ms": med,
                   "ratio": nbytes / stored, "write_gbps": nbytes / (med * 1e-3) / 1e9}
            if disk:
                run["disk_gbps"] = disk
            if codec in SHARDED:
                run.update(batch=batch or chunk_levels(problem, name, every), compression=summary)
            point["runs"].append(run)
    point["disk_gbps"] = float(np.median([g for r in point["runs"] for g in r.get("disk_gbps", [])]
                                         or [point["disk_burst_gbps"]]))

    def bound(gbps):
        parts = {"compute": point["compute_only_ms"], "copies": nbytes / (point["peak_d2h_gbps"] * 1e9) * 1e3,
                 "disk": nbytes / (gbps * 1e9) * 1e3}
        return max(parts.values()), max(parts, key=parts.get)

    point["bound_ms"], point["bound_by"] = bound(point["disk_gbps"])
    for run in point["runs"]:
        if "disk_gbps" in run:          # each repeat against the disk on both sides of it
            g = run["disk_gbps"]
            run["bound_ms"] = [bound((g[i] + g[i + 1]) / 2)[0] for i in range(len(run["times_ms"]))]
            run["efficiency"] = float(np.median([b / t for b, t in zip(run["bound_ms"], run["times_ms"])]))
        else:
            run["efficiency"] = point["bound_ms"] / run["median_ms"]
    point["codec_single_thread"] = {c: codec_speed(sample, c) for c in compress if c is not None and c not in SHARDED}
    return point


def machine_info() -> dict:
    """The machine a benchmark ran on, as its results file records it."""
    rep = device_report()
    info = {k: rep[k] for k in ("backend", "device", "memory_gib", "compute_capability",
                                "async_engine_count", "runtime_version", "driver_version", "cupy",
                                "numpy", "python", "cpu", "cores")}
    info["platform"] = platform.platform()
    rt = runtime.get()
    if rt.modelled:
        info["clock"] = rt.device_label              # the times are modelled, on this profile
        info["profile"] = rt.profile["provenance"]
        info["computed"] = rt.computes_data
    return info


def run_bench(points: Iterable[tuple[int, int, int]] | None = None, strategies: Iterable[str] | None = None,
              repeats: int = 5, progress: Callable[[dict, str], object] | None = None,
              nscratch: Iterable[int] | None = None) -> dict:
    """Run the sweep and return ``{"machine": ..., "points": [...]}``.

    ``nscratch``: a list of ring depths; every point is then measured once at each (an entry
    of ``points`` per point and depth, its ``nscratch`` saying which). Every point's untraced
    runs come first, then every point's traced ones (see :func:`add_trace_cost`);
    ``progress(point, stage)`` is called after each point of each pass, ``stage`` being
    ``"untraced"`` or ``"traced"``."""
    if points is None:
        points = DEFAULT_POINTS if backend_name() == "gpu" else QUICK_POINTS
    strategies = baseline_first(available_strategies() if strategies is None else strategies)
    repeats = checks.positive_int("repeats", repeats)
    depths = [None] if nscratch is None else [checks.positive_int("nscratch", k) for k in nscratch]
    if not depths:
        raise ValueError("nscratch: give at least one ring depth, or None for the strategies' defaults")
    runs = [(n, nt, every, k) for n, nt, every in points for k in depths]
    for n, nt, every, k in runs:                 # every point and depth checked before any is measured
        _check_point(n, nt, every, strategies, k)
    peak = peak_d2h_gbps()
    doc = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "repeats": repeats, "peak_d2h_gbps": peak,
           "definition": "B = max(compute-only ms, output bytes / peak pinned D2H bandwidth); "
                         "efficiency = B / median time", "points": []}
    # Every untraced run of the sweep first, then the traced ones: a CUPTI recording leaves the
    # process slower (see add_trace_cost).
    for n, nt, every, k in runs:
        doc["points"].append(bench_point(n, nt, every, strategies, repeats, peak_gbps=peak, trace_cost=False,
                                         nscratch=k))
        if progress is not None:
            progress(doc["points"][-1], "untraced")
    for point in doc["points"]:
        add_trace_cost(point, strategies, repeats)
        if progress is not None:
            progress(point, "traced")
    return doc


def _label(p):
    """A point as the table names it, e.g. "2048^2x320 e16 s12" (s: the ring depth asked for)."""
    return f"{p['n']}^2x{p['nt']} e{p['every']}" + (f" s{p['nscratch']}" if p.get("nscratch") else "")


def _overlap_cells(row):
    """A strategy's compute / D2H / overlap ms and hidden fraction, as the table shows them."""
    if "hidden_fraction" not in row:          # no traced run (the plain-CuPy row, or not traced yet)
        return f"{'-':>8} {'-':>7} {'-':>8} {'-':>6}"
    return (f"{row['compute_busy_ms']:8.2f} {row['copy_busy_ms']:7.2f} {row['overlap_ms']:8.2f} "
            f"{100 * row['hidden_fraction']:5.0f}%")


def table(doc: dict) -> str:
    """The sweep as aligned text, one line per point and strategy ("traced": a traced run's time
    over the untraced median, what recording the timeline costs; compute, D2H, overlap ms and
    hidden: from the traced runs, see :func:`measure_trace_cost`)."""
    lines = [f"{'point':<18} {'B ms':>8} {'bound by':<8} {'strategy':<15} {'median ms':>10} {'efficiency':>10} "
             f"{'speedup':>8} {'traced':>7} {'compute':>8} {OpKind.D2H:>7} {'overlap':>8} {'hidden':>6} identical"]
    for p in doc["points"]:
        label = _label(p)
        if "skipped" in p:
            lines.append(f"{label:<18} skipped: {p['skipped']}")
            continue
        for name, r in p["strategies"].items():
            traced = f"{r['trace_overhead']:6.2f}x" if "trace_overhead" in r else f"{'-':>7}"
            lines.append(f"{label:<18} {p['bound_ms']:8.2f} {p['bound_by']:<8} {name:<15} {r['median_ms']:10.2f} "
                         f"{r['efficiency']:10.2f} {r['speedup']:7.2f}x {traced} {_overlap_cells(r)} "
                         f"{_identical(r)}")
            label = ""
        if "events_over_raw" in p["strategies"].get(RAW_ROW, {}):
            lines.append(f"{'':<18} the helper's events loop over the plain-CuPy one, round by round: "
                         f"{p['strategies'][RAW_ROW]['events_over_raw']:.2f}x")
    return "\n".join(lines)


def _identical(row):
    same = row["identical_to_sequential"]
    return "not computed (times only)" if same is None else same


def plot_bench(doc: dict, path: str | os.PathLike | None = None) -> matplotlib.figure.Figure:
    """Efficiency and speedup per strategy per point; returns the figure (and saves it to ``path``)."""
    import matplotlib.pyplot as plt
    pts = [p for p in doc["points"] if "strategies" in p]
    names = list(pts[0]["strategies"]) if pts else []
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    # One panel above the other, so each point's label has the figure's whole width.
    fig, axes = plt.subplots(2, 1, figsize=(12, 7.2), sharex=True, layout="constrained")
    x = np.arange(len(pts))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        eff = [p["strategies"][name]["efficiency"] for p in pts]
        spd = [p["strategies"][name]["speedup"] for p in pts]
        axes[0].bar(x + i * width, eff, width, label=name)
        axes[1].bar(x + i * width, spd, width, label=name)
    labels = [f"{p['n']}²×{p['nt']}\nevery {p['every']}" + (f", ring {p['nscratch']}" if p.get("nscratch") else "")
              + f"\n({p['bound_by']}-bound)" for p in pts]
    axes[1].set_xticks(x + width * (len(names) - 1) / 2, labels, fontsize=8)
    for ax, title in zip(axes, ("efficiency = B / time (1 = the physical limit)", "speedup over sequential")):
        ax.set_title(title, fontsize=10, loc="left")
    axes[0].axhline(0.9, color="grey", ls="--", lw=0.8)
    axes[0].set_ylim(0, 1.1)
    # Log scale with plain numbers (1x, 2x, 5x), and at least 0.5x to 2x so there are ticks to read.
    speedups = [r["speedup"] for p in pts for r in p["strategies"].values()] or [1.0]
    axes[1].set_yscale("log")
    axes[1].set_ylim(min(0.5, min(speedups) / 1.3), max(2.0, max(speedups) * 1.3))
    axes[1].yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    axes[1].yaxis.set_minor_formatter(NullFormatter())
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=8, ncols=len(names) or 1, loc="lower left", bbox_to_anchor=(0, 1.08),
                   borderaxespad=0)
    clock = doc["machine"].get("clock", "host clock")        # the untraced runs' times
    fig.suptitle(f"{doc['machine']['device']} ({doc['machine']['backend']} backend, clock: {clock})")
    if path is not None:
        write_atomically(os.fspath(path), lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    return fig


def write_json(doc: dict, path: str | os.PathLike) -> str:
    """Write a sweep's results file (``bench.json``) whole or not at all; returns the path."""
    return os.fspath(write_atomically(path, lambda f: json.dump(doc, f, indent=1), binary=False))
