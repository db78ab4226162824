"""The sweeps' report: the machine they ran on, the table, the figure and the results file."""
from __future__ import annotations

import json
import os
import platform
from typing import TYPE_CHECKING

import numpy as np

from .. import runtime
from ..files import write_atomically
from ..runtime.backend import device_report
from ..runtime.ops import OpKind

if TYPE_CHECKING:
    import matplotlib.figure

__all__ = ["machine_info", "table", "plot_bench", "write_json"]


def machine_info() -> dict:
    """The machine a benchmark ran on, as its results file records it."""
    rep = device_report()
    info = {k: rep[k] for k in ("backend", "device", "memory_gib", "compute_capability",
                                "async_engine_count", "runtime_version", "driver_version", "cupy",
                                "numpy", "python", "cpu", "cores")}
    info["platform"] = platform.platform()
    rt = runtime.get()
    if rt.predicts_times:
        info["clock"] = rt.device_label              # the times are modelled, on this profile
        info["profile"] = rt.provenance
        info["computed"] = rt.computes_data
    return info


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
        for r in p["strategies"].values():        # the plain-CuPy row (sweep.RAW_ROW) carries the ratio
            if "events_over_raw" in r:
                lines.append(f"{'':<18} the helper's events loop over the plain-CuPy one, round by round: "
                             f"{r['events_over_raw']:.2f}x")
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
