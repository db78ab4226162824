"""The benchmark sweep: how close does each strategy get to the physical limit?

For one run, no overlap strategy can beat

    B = max(compute-only time, output bytes / peak pinned device-to-host bandwidth)

both measured in the same process on the same device. ``efficiency = B / time``.
Run it with::

    python -m course_helper bench --out benchmarks/

It writes ``bench.json`` (the machine, every point, every repeat) and
``bench.png`` (efficiency and speedup per strategy per size). Timings belong
here, not in tests: the tests only check that the numbers are well formed.
"""
from __future__ import annotations

import datetime
import json
import os
import platform

import numpy as np

from . import checks, runtime
from .backend import backend_name, device_report
from .graphs import capture_graph, graphs_supported
from .memory import copy_to_host_async, device_zeros, host_memory_available, pinned_empty, to_device
from .solver import STRATEGIES, plan_memory, solve
from .streams import create_events, create_streams, elapsed_ms, synchronize
from .timeline import write_atomically
from .wave import WaveProblem, launch_wave2d

__all__ = ["DEFAULT_POINTS", "EVERY_POINTS", "QUICK_POINTS", "peak_d2h_gbps", "compute_only_ms",
           "bench_point", "run_bench", "plot_bench"]

#: (n, nt, every): the issue's sweep, from launch-bound to IO-bound.
DEFAULT_POINTS = [(256, 640, 1), (1024, 640, 1), (2048, 320, 8), (4096, 128, 8)]
#: A sweep of the snapshot interval at one size: the crossover from IO-bound to compute-bound.
EVERY_POINTS = [(2048, 320, e) for e in (1, 2, 4, 16, 32)]
#: Small enough for the CPU backend.
QUICK_POINTS = [(64, 80, 1), (128, 80, 4)]


def _median_ms(fn, stream, repeats):
    start, end = create_events(2, timing=True)
    times = []
    for _ in range(repeats):
        synchronize()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(elapsed_ms(start, end))
    return float(np.median(times))


def peak_d2h_gbps(mib=512, repeats=5):
    """Device-to-host bandwidth of one large pinned copy, in GB/s (1 GB = 1e9 bytes)."""
    n = int(mib * 2**20) // 4
    src = device_zeros(n)
    dst = pinned_empty(n)
    (s,) = create_streams(1, name="bandwidth")
    rt = runtime.get()
    with rt.times_only(rt.modelled):         # only the time is asked for
        copy_to_host_async(dst, src, s)      # warm-up
        s.synchronize()
        ms = _median_ms(lambda: copy_to_host_async(dst, src, s), s, repeats)
    return n * 4 / (ms * 1e-3) / 1e9


def compute_only_ms(problem, repeats=5):
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
        loop()
        best = _median_ms(loop, s, repeats)
        if graphs_supported()[0]:
            with capture_graph(s) as cap:
                loop()
            cap.graph.launch()
            best = min(best, _median_ms(cap.graph.launch, s, repeats))
    return best


def _fits(problem, every, strategies):
    """None when the point fits in host memory, else the reason it does not."""
    avail = host_memory_available()
    host = plan_memory(problem, every)["host"]
    # the sequential answer is kept for comparison while each other strategy runs
    need = host * (2 if len(strategies) > 1 else 1)
    if avail is not None and need > 0.8 * avail:
        return (f"needs {need / 2**30:.1f} GiB of host memory for the output stacks but only "
                f"{avail / 2**30:.1f} GiB are available")
    return None


def bench_point(n, nt, every, strategies, repeats=5, peak_gbps=None):
    """Measure one (n, nt, every) point: B's two parts and each strategy's times."""
    problem = WaveProblem(n0=n, n1=n, nt=nt)
    from .solver import _validate
    every = _validate(problem, "sequential", every, None, False)[0]   # refuse bad input before measuring
    order = ["sequential"] + [s for s in strategies if s != "sequential"]
    point = {"n": n, "nt": nt, "every": every,
             "saved_levels": len(range(0, nt, every)),
             "output_bytes": plan_memory(problem, every)["host"]}
    reason = _fits(problem, every, order)
    if reason is not None:
        point["skipped"] = reason
        return point
    peak = peak_gbps if peak_gbps is not None else peak_d2h_gbps()
    point["peak_d2h_gbps"] = peak
    point["compute_only_ms"] = compute_only_ms(problem, repeats)
    point["copy_floor_ms"] = point["output_bytes"] / (peak * 1e9) * 1e3
    point["bound_ms"] = max(point["compute_only_ms"], point["copy_floor_ms"])
    point["bound_by"] = "compute" if point["compute_only_ms"] >= point["copy_floor_ms"] else "copies"
    results = {}
    reference = None
    for name in order:
        solve(problem, name, every=every, trace=False)                      # warm-up
        times = []
        last = None
        for _ in range(repeats):
            last = solve(problem, name, every=every, trace=False)
            times.append(last.elapsed_ms)
        if not runtime.get().computes_data:
            identical = None                      # times predicted only: nothing to compare
        elif reference is None:
            reference = last.images
            identical = True
        else:
            identical = bool(np.array_equal(last.images, reference))
        del last
        med = float(np.median(times))
        results[name] = {"times_ms": times, "median_ms": med, "min_ms": float(min(times)),
                         "max_ms": float(max(times)), "efficiency": point["bound_ms"] / med,
                         "identical_to_sequential": identical}
    base = results["sequential"]["median_ms"]
    for r in results.values():
        r["speedup"] = base / r["median_ms"]
    point["strategies"] = results
    return point


def _machine():
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


def run_bench(points=None, strategies=None, repeats=5, progress=None):
    """Run the sweep and return ``{"machine": ..., "points": [...]}``."""
    if points is None:
        points = DEFAULT_POINTS if backend_name() == "gpu" else QUICK_POINTS
    if strategies is None:
        strategies = [s for s in STRATEGIES if s not in ("graph", "graph-staged") or graphs_supported()[0]]
    for s in strategies:
        checks.one_of("strategy", s, tuple(STRATEGIES))
    repeats = checks.positive_int("repeats", repeats)
    peak = peak_d2h_gbps()
    doc = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": _machine(), "repeats": repeats, "peak_d2h_gbps": peak,
           "definition": "B = max(compute-only ms, output bytes / peak pinned D2H bandwidth); "
                         "efficiency = B / median time", "points": []}
    for n, nt, every in points:
        point = bench_point(n, nt, every, strategies, repeats, peak_gbps=peak)
        doc["points"].append(point)
        if progress is not None:
            progress(point)
    return doc


def best(point):
    """(strategy, efficiency) of the most efficient strategy at a measured point."""
    name = max(point["strategies"], key=lambda s: point["strategies"][s]["efficiency"])
    return name, point["strategies"][name]["efficiency"]


def table(doc):
    """The sweep as aligned text, one line per point and strategy."""
    lines = [f"{'point':<18} {'B ms':>8} {'bound by':<8} {'strategy':<13} {'median ms':>10} {'efficiency':>10} "
             f"{'speedup':>8} identical"]
    for p in doc["points"]:
        label = f"{p['n']}^2x{p['nt']} e{p['every']}"
        if "skipped" in p:
            lines.append(f"{label:<18} skipped: {p['skipped']}")
            continue
        for name, r in p["strategies"].items():
            lines.append(f"{label:<18} {p['bound_ms']:8.2f} {p['bound_by']:<8} {name:<13} {r['median_ms']:10.2f} "
                         f"{r['efficiency']:10.2f} {r['speedup']:7.2f}x {_identical(r)}")
            label = ""
    return "\n".join(lines)


def _identical(row):
    same = row["identical_to_sequential"]
    return "not computed (times only)" if same is None else same


def plot_bench(doc, path=None):
    """Efficiency and speedup per strategy per point; returns the figure (and saves it to ``path``)."""
    import matplotlib.pyplot as plt
    pts = [p for p in doc["points"] if "strategies" in p]
    names = list(pts[0]["strategies"]) if pts else []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    x = np.arange(len(pts))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        eff = [p["strategies"][name]["efficiency"] for p in pts]
        spd = [p["strategies"][name]["speedup"] for p in pts]
        axes[0].bar(x + i * width, eff, width, label=name)
        axes[1].bar(x + i * width, spd, width, label=name)
    labels = [f"{p['n']}²×{p['nt']}\nevery {p['every']}\n({p['bound_by']}-bound)" for p in pts]
    for ax, title in zip(axes, ("efficiency = B / time (1 = the physical limit)", "speedup over sequential")):
        ax.set_xticks(x + width * (len(names) - 1) / 2, labels, fontsize=8)
        ax.set_title(title)
    axes[0].axhline(0.9, color="grey", ls="--", lw=0.8)
    axes[0].set_ylim(0, 1.1)
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=8, ncols=2)
    clock = f", times {doc['machine']['clock']}" if "clock" in doc["machine"] else ""
    fig.suptitle(f"{doc['machine']['device']} ({doc['machine']['backend']} backend{clock})")
    fig.tight_layout()
    if path is not None:
        write_atomically(os.fspath(path), lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    return fig


def write_json(doc, path):
    return write_atomically(os.fspath(path), lambda f: json.dump(doc, f, indent=1))
