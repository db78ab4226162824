"""The benchmark sweep: every strategy timed at each point against the physical limit B,
and what tracing its runs costs.

``efficiency = B / time`` (B: :mod:`course_helper.measure.limit`). Each strategy's row also
says how much of its work overlapped, from its traced runs (CUPTI on a GPU, the model on the
CPU; :meth:`Trace.overlap`).
"""
from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from .. import checks, raw_cupy, runtime
from ..solver import Plan, UnsafeRing, available_strategies, plan, solve
from ..wave import WaveProblem, saved_levels
from .compare import baseline_first, nscratch_for, time_plans
from .limit import peak_d2h_gbps, physical_limit
from .report import machine_info

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

__all__ = ["DEFAULT_POINTS", "BALANCED_POINT", "EVERY_POINTS", "QUICK_POINTS", "RAW_ROW", "parse_nscratch",
           "bench_point", "add_trace_cost", "measure_trace_cost", "paired_ratio", "run_bench"]

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


def _host_shortfall(output_bytes, strategies):
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
    """The checked plan of each strategy at this point and ring depth (``{name: Plan}``, the
    baseline first): a point that a strategy cannot run is refused before anything is measured."""
    problem = WaveProblem(n0=n, n1=n, nt=nt)
    plans = {}
    for name in strategies:
        try:
            plans[name] = plan(problem, name, every, nscratch_for(name, nscratch))
        except UnsafeRing as err:           # the solver's rule, and the benchmark's fix (it has no unsafe=True)
            raise ValueError(f"{err.rule}; the benchmark times safe runs only: use ring depths of at least "
                             f"{err.minimum}") from None
    return plans


def bench_point(n: int, nt: int, every: int, strategies: Iterable[str], repeats: int = 5,
                peak_gbps: float | None = None, trace_cost: bool = True, nscratch: int | None = None) -> dict:
    """Measure one (n, nt, every) point: B's two parts and each strategy's times (and, with
    ``trace_cost``, what tracing costs and how much overlapped: see :func:`add_trace_cost`).
    ``nscratch`` is the ring depth of the strategies that take one (None: their defaults)."""
    plans = _check_point(n, nt, every, baseline_first(strategies), nscratch)   # refuses bad input before measuring
    return _measure_point(plans, repeats, peak_gbps, trace_cost, nscratch)


def _measure_point(plans, repeats, peak_gbps, trace_cost, nscratch):
    """:func:`bench_point` of the checked ``plans`` of one point (see :func:`_check_point`)."""
    base = plans["sequential"]
    problem, every, output_bytes = base.problem, base.every, base.need["host"]
    point = {"n": problem.n0, "nt": problem.nt, "every": every, "saved_levels": len(saved_levels(problem.nt, every)),
             "output_bytes": output_bytes, "nscratch": nscratch}
    reason = _host_shortfall(output_bytes, plans) if runtime.get().computes_data else None  # times only: no stacks
    if reason is not None:
        point["skipped"] = reason
        return point
    point.update(physical_limit(base, peak_gbps=peak_gbps, repeats=repeats))
    # On a GPU the events loop in plain CuPy is the reference row: it runs right after the
    # helper's events loop in every round (the helper's overhead is the gap), before any traced
    # (CUPTI) run.
    raw = runtime.get().runs_cuda and "events" in plans
    # The same ring as the helper's events loop: the depth given, or the one solve chooses by default.
    also = {RAW_ROW: lambda: raw_cupy.events_loop(problem, every, nscratch=plans["events"].nscratch)} if raw else None
    timed = time_plans(list(plans.values()), repeats, also=also, also_after="events" if raw else None)
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
        add_trace_cost(point, plans, repeats)
    return point


def add_trace_cost(point: dict, strategies: Iterable[str] | Mapping[str, Plan], repeats: int = 5) -> dict:
    """Add to each strategy of a measured ``point`` what recording its timeline costs
    (``trace_overhead``: traced over untraced, in rounds of one of each, see :func:`measure_trace_cost`),
    the clock that timed the traces, and how much of the work overlapped in them
    (``compute_busy_ms``, ``copy_busy_ms``, ``overlap_ms``, ``hidden_fraction``); returns ``point``.
    ``strategies``: their names, or ``{name: Plan}``, the plans the point was measured with.

    Run it after every untraced measurement of the process: a CUPTI recording leaves the rest
    of the process slower, plain CuPy and the helper alike (docs/tracing.md), and the untraced
    times must not pay for it."""
    if "strategies" not in point:
        return point
    if not isinstance(strategies, Mapping):
        strategies = _check_point(point["n"], point["nt"], point["every"], strategies, point.get("nscratch"))
    for name, checked in strategies.items():
        point["strategies"][name].update(_trace_cost(checked, repeats))
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
    return _trace_cost(plan(problem, name, every, nscratch_for(name, nscratch)), repeats)


def _trace_cost(checked, repeats):
    """:func:`measure_trace_cost` of one checked plan."""
    repeats = checks.positive_int("repeats", repeats)
    untraced, traced, overlaps = [], [], []
    for _ in range(repeats):
        untraced.append(solve(checked, trace=False).elapsed_ms)
        r = solve(checked, trace=True)
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
        # The quick sweep where a model computes every wavefield in NumPy (not where it predicts times only).
        rt = runtime.get()
        points = QUICK_POINTS if rt.predicts_times and rt.computes_data else DEFAULT_POINTS
    strategies = baseline_first(available_strategies() if strategies is None else strategies)
    repeats = checks.positive_int("repeats", repeats)
    depths = [None] if nscratch is None else [checks.positive_int("nscratch", k) for k in nscratch]
    if not depths:
        raise ValueError("nscratch: give at least one ring depth, or None for the strategies' defaults")
    # every point and depth checked before any is measured; each measured with the plans checked here
    runs = [(k, _check_point(n, nt, every, strategies, k)) for n, nt, every in points for k in depths]
    peak = peak_d2h_gbps()
    doc = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "repeats": repeats, "peak_d2h_gbps": peak,
           "definition": "B = max(compute-only ms, output bytes / peak pinned D2H bandwidth); "
                         "efficiency = B / median time", "points": []}
    # Every untraced run of the sweep first, then the traced ones: a CUPTI recording leaves the
    # process slower (see add_trace_cost).
    for k, plans in runs:
        doc["points"].append(_measure_point(plans, repeats, peak, False, k))
        if progress is not None:
            progress(doc["points"][-1], "untraced")
    for point, (_, plans) in zip(doc["points"], runs):
        add_trace_cost(point, plans, repeats)
        if progress is not None:
            progress(point, "traced")
    return doc
