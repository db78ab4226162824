"""Run several strategies on one problem and put them side by side.

:func:`time_strategies` is the timing both :func:`compare_strategies` and the
benchmark's sweep (:mod:`course_helper.measure.sweep`) use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import checks, runtime
from ..solver import STRATEGIES, Plan, plan, solve, stack_difference
from ..wave import WaveProblem

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    import matplotlib.axes

    from ..solver import Result

__all__ = ["compare_strategies", "Comparison", "time_strategies", "time_plans", "baseline_first"]


def baseline_first(strategies: str | Iterable[str]) -> list[str]:
    """Checked strategy names, each once, with ``"sequential"`` (the baseline) first."""
    if isinstance(strategies, str):
        strategies = [strategies]
    strategies = list(strategies)
    if not strategies:
        raise ValueError(f"give at least one strategy out of {', '.join(STRATEGIES)}")
    for s in strategies:
        checks.one_of("strategy", s, tuple(STRATEGIES))
    return ["sequential"] + [s for s in dict.fromkeys(strategies) if s != "sequential"]


def nscratch_for(name: str, nscratch: int | None) -> int | None:
    """``nscratch`` for a strategy that takes a chosen number of scratch buffers, else None."""
    return nscratch if STRATEGIES[name].max_nscratch is None else None


def time_strategies(problem: WaveProblem, strategies: str | Iterable[str], repeats: int, every: int = 1,
                    nscratch: int | None = None, progress: Callable[[str, int], object] | None = None,
                    also: dict[str, Callable[[], tuple[np.ndarray, float]]] | None = None,
                    also_after: str | None = None) -> dict[str, dict]:
    """Time each strategy on ``problem``: :func:`time_plans` of their plans (:func:`~course_helper.solver.plan`),
    the sequential strategy (the baseline) first. ``nscratch`` goes to the strategies that can
    use a chosen number of scratch buffers."""
    checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    plans = [plan(problem, name, every, nscratch_for(name, nscratch)) for name in baseline_first(strategies)]
    return time_plans(plans, repeats, progress, also, also_after)


def time_plans(plans: Sequence[Plan], repeats: int, progress: Callable[[str, int], object] | None = None,
               also: dict[str, Callable[[], tuple[np.ndarray, float]]] | None = None,
               also_after: str | None = None) -> dict[str, dict]:
    """Time each plan (one per strategy, the sequential one first: the baseline): one untimed
    warm-up solve each (kernel loading, pinned pool), then ``repeats`` rounds of timed solves,
    untraced.

    The strategies take turns: every round runs each of them once, the baseline first. A host
    whose speed drifts during the measurement (clock ramps, other work on the machine) then
    slows them alike, instead of the strategies that happened to run during a slow spell.
    ``also`` maps more row names to functions returning ``(images, elapsed_ms)`` (the
    benchmark's plain-CuPy loop), timed in the same turns and compared with the same
    reference: at the end of each round, or right after the strategy ``also_after`` (so that a
    row and the strategy it is held against run back to back, on the host as it is at that
    moment).

    Returns ``{name: {"times_ms", "median_ms", "min_ms", "max_ms", "speedup",
    "max_diff"}}``: ``speedup`` is the sequential median over this median,
    ``max_diff`` the largest difference of the last round's images from the
    sequential ones (0.0: identical; None where a modelled GPU predicted the
    times only and computed no images).
    """
    for p in plans:
        checks.instance("each plan", p, Plan, "a Plan (ch.plan(problem, strategy, ...))")
    order = [p.strategy for p in plans]
    if order[:1] != ["sequential"] or len(set(order)) != len(order):
        raise ValueError(f"time_plans needs one plan per strategy, the sequential one first (the baseline); "
                         f"got {order}")
    repeats = checks.positive_int("repeats", repeats)
    if also_after is not None and also_after not in order:
        raise ValueError(f"also_after={also_after!r} is not one of the strategies timed: {order}")
    runs = {}
    for p in plans:
        runs[p.strategy] = _solver(p)
        if p.strategy == also_after:
            runs.update(also or {})
    if also_after is None:
        runs.update(also or {})                     # at the end of the round
    for run in runs.values():
        run()                                               # warm-up
    times = {name: [] for name in runs}
    rows, reference = {}, None
    computed = runtime.get().computes_data      # False: times predicted only, no images
    for i in range(repeats):
        for name, run in runs.items():
            images, ms = run()
            times[name].append(ms)
            if i == repeats - 1:                # the last round: compare, one output stack at a time
                if not computed:
                    diff = None
                elif reference is None:         # the baseline runs first: the reference itself
                    reference, diff = images, 0.0
                else:
                    diff = stack_difference(images, reference)
                rows[name] = {"max_diff": diff}
            del images
            if progress is not None:
                progress(name, i)
    base = float(np.median(times["sequential"]))
    for name, row in rows.items():
        t = times[name]
        row.update(times_ms=t, median_ms=float(np.median(t)), min_ms=float(min(t)), max_ms=float(max(t)),
                   speedup=base / float(np.median(t)))
    return {name: rows[name] for name in runs}


def _solver(plan):
    """A function solving ``plan`` untraced: ``(images, elapsed_ms)``."""
    def run():
        r = solve(plan, trace=False)
        return r.images, r.elapsed_ms
    return run


class Comparison:
    """The table :func:`compare_strategies` returns.

    ``rows`` is a list of dicts with ``strategy``, ``median_ms``, ``min_ms``,
    ``max_ms``, ``speedup`` (sequential median / this median),
    ``max_diff`` (largest difference from the sequential images; None where they were not
    computed, inside ``timing_only()`` on the CPU backend), from one
    traced run (:meth:`~course_helper.timelines.timeline.Trace.overlap`): ``compute_busy_ms``,
    ``copy_busy_ms`` (device-to-host copies), ``overlap_ms`` (both at once),
    ``hidden_fraction`` (overlap / the shorter of the two) and ``overlap_timing`` (the
    clock that timed that run), and ``copy_fraction`` (the share of all host-copy time a
    kernel ran too, :meth:`~course_helper.timelines.timeline.Trace.summary`). ``results`` keeps the
    last Result of each strategy (with its trace).
    """

    def __init__(self, rows: list[dict], results: dict[str, Result], problem: WaveProblem, every: int):
        self.rows = rows
        self.results = results
        self.problem = problem
        self.every = every

    @property
    def computed(self) -> bool:
        """False when the images were not computed (a comparison inside ``timing_only()`` on the
        CPU backend): there is nothing to compare, and ``max_diff`` is None."""
        return all(r["max_diff"] is not None for r in self.rows)

    @property
    def agree(self) -> bool | None:
        """True when every strategy gave exactly the sequential images; None when the images
        were not computed (see :attr:`computed`)."""
        if not self.computed:
            return None
        return all(r["max_diff"] == 0.0 for r in self.rows)

    def table(self, timings: bool = True) -> str:
        """The rows as aligned text. ``timings=False`` leaves out machine-dependent columns."""
        timings = checks.flag("timings", timings)
        head = ["strategy"] + (["median ms", "min ms", "max ms", "speedup", "compute ms", "D2H ms", "overlap ms",
                                "hidden"] if timings else []) + ["max diff"]
        lines = []
        for r in self.rows:
            cells = [r["strategy"]]
            if timings:
                cells += [f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", f"{r['max_ms']:.2f}",
                          f"{r['speedup']:.2f}x", f"{r['compute_busy_ms']:.2f}", f"{r['copy_busy_ms']:.2f}",
                          f"{r['overlap_ms']:.2f}", f"{100 * r['hidden_fraction']:.0f}%"]
            cells.append("not computed" if r["max_diff"] is None else f"{r['max_diff']:.3g}")
            lines.append(cells)
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        fmt = lambda cells: "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths))  # noqa: E731
        note = [f"({self._clocks()})"] if timings and self.rows else []
        return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines] + note)

    def _clocks(self):
        """Which clocks the table's numbers come from."""
        label = next(iter(self.results.values())).time_label if self.results else ""
        timing = self.rows[0].get("overlap_timing", "not recorded") if self.rows else "not recorded"
        return (f"times: {label or 'host clock'}, untraced runs; busy and overlap: one traced run each, "
                f"timing: {timing}")

    def __str__(self):
        return self.table()

    def _repr_pretty_(self, p, cycle):
        p.text(self.table())

    def plot(self, ax: matplotlib.axes.Axes | None = None) -> matplotlib.axes.Axes:
        """Bar chart of the median times, annotated with the speedup."""
        import matplotlib.pyplot as plt
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 3.2))
        names = [r["strategy"] for r in self.rows]
        med = [r["median_ms"] for r in self.rows]
        err = [[r["median_ms"] - r["min_ms"] for r in self.rows],
               [r["max_ms"] - r["median_ms"] for r in self.rows]]
        bars = ax.bar(names, med, yerr=err, capsize=4,
                      color=["#7f7f7f" if n == "sequential" else "#1f77b4" for n in names])
        for bar, r in zip(bars, self.rows):          # above the error bar's cap, not on it
            ax.annotate(f"{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, r["max_ms"]),
                        ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
        ax.set_ylabel("time (ms), median over repeats")
        p = self.problem
        label = next(iter(self.results.values())).time_label if self.results else ""
        ax.set_title(f"{p.n0}x{p.n1}, {p.nt} levels, every {self.every} (clock: {label or 'host clock'})")
        ax.set_ylim(0, max(r["max_ms"] for r in self.rows) * 1.2)   # room for the labels
        return ax


def compare_strategies(problem: WaveProblem | None = None,
                       strategies: str | Iterable[str] = ("sequential", "streams", "events"), repeats: int = 3,
                       every: int = 1, nscratch: int | None = None,
                       progress: Callable[[str, int], object] | None = None) -> Comparison:
    """Run each strategy ``repeats`` times on the same problem and tabulate them.

    The sequential strategy is always run (first) as the baseline for speedup
    and difference, even when not listed. Each strategy is run once more
    before timing, as a warm-up (kernel compilation, pinned pool).

    Parameters
    ----------
    progress : callable, optional
        Called as ``progress(strategy, repeat)`` after each run (the CLI hangs
        a progress bar on it).

    Returns
    -------
    Comparison
    """
    problem = WaveProblem() if problem is None else problem
    checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    rt = runtime.get()
    # A modelled GPU's times do not depend on the data, so its timed runs skip the arithmetic;
    # the traced run below computes it, and the images are compared from there.
    with rt.times_only(rt.predicts_times):
        timed = time_strategies(problem, strategies, repeats, every, nscratch, progress)
    results, rows = {}, []
    for name, t in timed.items():
        # Time untraced runs; keep one traced run for the overlap figure and pictures.
        results[name] = solve(problem, name, every=every, nscratch=nscratch_for(name, nscratch), trace=True)
        trace = results[name].trace
        compared = results[name].computed and results["sequential"].computed
        rows.append({"strategy": name, "median_ms": t["median_ms"], "min_ms": t["min_ms"], "max_ms": t["max_ms"],
                     "speedup": t["speedup"],
                     "max_diff": results[name].max_difference(results["sequential"]) if compared else None,
                     "copy_fraction": trace.summary()["copy_fraction"], **trace.overlap().as_dict()})
    return Comparison(rows, results, problem, every)
