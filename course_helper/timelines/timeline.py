"""A recorded timeline: export to Perfetto, plot inline, summarise in numbers."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import files

if TYPE_CHECKING:
    from collections.abc import Iterable

    import matplotlib.axes

__all__ = ["Trace", "TraceEvent", "Overlap", "KINDS", "merge_intervals", "covered_length",
           "intersection_length"]

#: Kinds of timeline entry and the colour each is drawn in.
KINDS = {"kernel": "#1f77b4", "D2H": "#ff7f0e", "H2D": "#2ca02c", "D2D": "#9467bd",
         "memset": "#8c564b", "host wait": "#7f7f7f", "halo": "#d62728", "disk write": "#17becf"}
_COPIES = ("D2H", "H2D", "D2D")


@dataclass
class TraceEvent:
    """One operation on one track; times in ms from the start of the recording."""
    track: str
    kind: str
    name: str
    start_ms: float
    end_ms: float
    bytes: int = 0
    level: int | None = None

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class Overlap:
    """How much compute and copying ran at once in one run (:meth:`Trace.overlap`), in ms.

    ``compute_ms``: time at least one kernel ran; ``copy_ms``: time at least one
    device-to-host copy ran; ``overlap_ms``: time both ran at once; ``hidden_fraction``:
    overlap / the shorter of the two busy times (1.0: the shorter stage ran entirely under
    the longer one; 0.0: never at once, or one of them did not run); ``timing``: the clock
    that timed the trace.
    """
    compute_ms: float
    copy_ms: float
    overlap_ms: float
    hidden_fraction: float
    timing: str

    def as_dict(self) -> dict[str, float | str]:
        """The numbers under the names the benchmark's JSON uses."""
        return {"compute_busy_ms": self.compute_ms, "copy_busy_ms": self.copy_ms, "overlap_ms": self.overlap_ms,
                "hidden_fraction": self.hidden_fraction, "overlap_timing": self.timing}


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[list[float]]:
    """The union of ``(start, end)`` intervals, as a sorted list of disjoint ``[start, end]`` ones
    (what :func:`covered_length` and :func:`intersection_length` take).

    >>> merge_intervals([(3, 4), (0, 1), (0.5, 2)])
    [[0, 2], [3, 4]]
    """
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def covered_length(intervals: Iterable[list[float]]) -> float:
    """Total length of disjoint intervals (from :func:`merge_intervals`): the time something was busy.

    >>> covered_length(merge_intervals([(0, 1), (0.5, 2), (3, 4)]))
    3.0
    """
    return float(sum(b - a for a, b in intervals))


def _clip(intervals, lo, hi):
    """The parts of disjoint sorted intervals that lie inside [lo, hi]."""
    return [[max(a, lo), min(b, hi)] for a, b in intervals if min(b, hi) > max(a, lo)]


def _percent(fraction):
    """A busy fraction as a percentage a reader can trust: "<1%" rather than "0%" for a lane
    that did work, ">99%" rather than "100%" for one that had gaps."""
    if 0 < fraction < 0.005:
        return "<1%"
    if 0.995 <= fraction < 1:
        return ">99%"
    return f"{100 * fraction:.0f}%"


def intersection_length(x: list[list[float]], y: list[list[float]]) -> float:
    """Total length where two disjoint sorted interval lists (from :func:`merge_intervals`) overlap:
    the time both things were busy at once.

    >>> intersection_length(merge_intervals([(0, 2)]), merge_intervals([(1, 3), (4, 5)]))
    1.0
    """
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


class Trace:
    """The timeline of one run: a list of :class:`TraceEvent` on named tracks.

    Attributes
    ----------
    events : list of TraceEvent
    tracks : list of str
        Track names in display order ("compute", "io 0", ..., "host").
    meta : dict
        What was run (strategy, sizes, backend).
    """

    def __init__(self, events: Iterable[TraceEvent], tracks: Iterable[str], meta: dict | None = None):
        self.events = sorted(events, key=lambda e: (e.start_ms, e.end_ms))
        self.tracks = list(tracks)
        for e in self.events:
            if e.track not in self.tracks:
                self.tracks.append(e.track)
        self.meta = dict(meta or {})

    # -- selections -------------------------------------------------------
    def of_kind(self, *kinds: str) -> list[TraceEvent]:
        """The events of these kinds (e.g. ``"kernel"``, ``"D2H"``), in time order."""
        return [e for e in self.events if e.kind in kinds]

    @property
    def kernels(self) -> list[TraceEvent]:
        """The kernels, in time order."""
        return self.of_kind("kernel")

    @property
    def copies(self) -> list[TraceEvent]:
        """The copies (to and from the host, and on the device), in time order."""
        return self.of_kind(*_COPIES)

    def window_for_levels(self, first: int, last: int) -> tuple[float, float]:
        """(start_ms, end_ms) covering every event of levels ``first`` .. ``last``."""
        sel = [e for e in self.events if e.level is not None and first <= e.level <= last]
        if not sel:
            raise ValueError(f"no traced work belongs to levels {first}..{last}")
        return min(e.start_ms for e in sel), max(e.end_ms for e in sel)

    # -- numbers ----------------------------------------------------------
    def summary(self) -> dict[str, float | str]:
        """Busy times and overlap, in ms.

        Returns a dict: ``compute_ms`` (time at least one kernel ran),
        ``copy_ms`` (time at least one copy ran), ``overlap_ms`` (both at
        once), ``host_wait_ms``, ``total_ms`` (first start to last end) and
        ``overlap_fraction`` = overlap / copy time (how much of the copying
        was hidden behind compute; 0 when nothing was copied), and ``timing``:
        what timed the device work ("CUPTI", "CUDA events", or the modelled GPU, e.g.
        "modelled H200").
        """
        kern = merge_intervals((e.start_ms, e.end_ms) for e in self.kernels)
        copy = merge_intervals((e.start_ms, e.end_ms) for e in self.of_kind("D2H", "H2D"))
        host = merge_intervals((e.start_ms, e.end_ms) for e in self.of_kind("host wait"))
        overlap = intersection_length(kern, copy)
        copy_ms = covered_length(copy)
        total = (max(e.end_ms for e in self.events) - min(e.start_ms for e in self.events)) if self.events else 0.0
        return {"compute_ms": covered_length(kern), "copy_ms": copy_ms, "overlap_ms": overlap,
                "host_wait_ms": covered_length(host), "total_ms": total,
                "overlap_fraction": overlap / copy_ms if copy_ms > 0 else 0.0,
                "timing": self.timing}

    def overlap(self) -> Overlap:
        """Compute busy, copy busy (device-to-host copies), their overlap and the hidden fraction:
        an :class:`Overlap`. This is the one place these numbers are computed; tables and the
        benchmark's JSON take them from here."""
        kern = merge_intervals((e.start_ms, e.end_ms) for e in self.kernels)
        d2h = merge_intervals((e.start_ms, e.end_ms) for e in self.of_kind("D2H"))
        both = intersection_length(kern, d2h)
        shorter = min(covered_length(kern), covered_length(d2h))
        return Overlap(compute_ms=covered_length(kern), copy_ms=covered_length(d2h), overlap_ms=both,
                       hidden_fraction=both / shorter if shorter > 0 else 0.0, timing=self.timing)

    def busy_fractions(self, window: tuple[float, float] | None = None) -> dict[str, float]:
        """``{track: fraction}``: the share of ``window`` (``(start_ms, end_ms)``; default: first
        start to last end) during which each track had work (on the host lane: waited)."""
        if window is None:
            if not self.events:
                return {name: 0.0 for name in self.tracks}
            window = (min(e.start_ms for e in self.events), max(e.end_ms for e in self.events))
        lo, hi = window
        if not hi > lo:
            raise ValueError(f"the window must end after it starts, got {window}")
        return {name: covered_length(_clip(merge_intervals((e.start_ms, e.end_ms) for e in self.events
                                                           if e.track == name), lo, hi)) / (hi - lo)
                for name in self.tracks}

    @property
    def clock(self) -> str:
        """The clock of the timeline's device lanes, as plot titles name it: "CUPTI (GPU)",
        "CUDA events (GPU)" or, on the CPU backend, e.g. "modelled H200 profile (predicted)"."""
        if self.meta.get("clock"):                     # the CPU backend's modelled device
            return f"{self.meta['clock']} profile (predicted)"
        if self.timing in ("CUPTI", "CUDA events"):
            return f"{self.timing} (GPU)"
        return f"timing: {self.timing}"

    @property
    def timing(self) -> str:
        """What timed the device work: "CUPTI", "CUDA events" or "modelled H200" (the CPU backend)."""
        return self.meta.get("timing", "not recorded")

    def describe(self) -> str:
        """One sentence stating what the timeline shows."""
        s = self.summary()
        staging = len(self.of_kind("D2D"))
        moved = f"{len(self.of_kind('D2H', 'H2D'))} host copies" + (f", {staging} device copies" if staging else "")
        clock = f" ({self.meta['clock']})" if self.meta.get("clock") else ""
        return (f"{len(self.kernels)} kernels and {moved} in {s['total_ms']:.2f} ms{clock}: "
                f"compute busy {s['compute_ms']:.2f} ms, copies busy {s['copy_ms']:.2f} ms, "
                f"{100 * s['overlap_fraction']:.0f}% of copy time overlapped a kernel, "
                f"host waited {s['host_wait_ms']:.2f} ms (timing: {s['timing']})")

    # -- export -----------------------------------------------------------
    def to_chrome(self, pid: int = 1, process_name: str | None = None) -> dict:
        """The trace as a Chrome Trace Event Format dict (what Perfetto opens).

        ``pid`` and ``process_name`` place it as one process among several (one per rank of a
        distributed run, see :func:`course_helper.distributed.chrome_trace`).
        """
        device = self.meta.get("device", self.meta.get("backend", "device"))
        out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                "args": {"name": process_name or f"course_helper ({device}, timing: {self.timing})"}}]
        tid = {name: i + 1 for i, name in enumerate(self.tracks)}
        for name, t in tid.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t,
                        "args": {"sort_index": t}})
        strategy = self.meta.get("strategy")
        for e in self.events:
            args = {"bytes": int(e.bytes)}
            if e.level is not None:
                args["level"] = int(e.level)
            if strategy is not None:
                args["strategy"] = strategy
            out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": pid, "tid": tid[e.track],
                        "ts": e.start_ms * 1e3, "dur": max(e.end_ms - e.start_ms, 0.0) * 1e3,
                        "args": args})
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": dict(self.meta, timing=self.timing)}

    def to_chrome_json(self, path: str | os.PathLike) -> str:
        """Write the trace for https://ui.perfetto.dev or chrome://tracing; returns the path.

        Written under a temporary name and renamed, so a failure leaves nothing half-written.
        """
        doc = self.to_chrome()
        return os.fspath(files.write_atomically(path, lambda f: json.dump(doc, f), binary=False))

    # -- picture ------------------------------------------------------------
    def plot(self, ax: matplotlib.axes.Axes | None = None, window: tuple[float, float] | None = None,
             levels: tuple[int, int] | None = None, title: str | None = None) -> matplotlib.axes.Axes:
        """Draw the timeline: one lane per track, kernels and copies in their colours.

        Each operation is drawn exactly as long as it ran, so a lane that was busy 5% of a
        whole run looks it (operations far shorter than a pixel show as a faint shade), and
        each lane's label says how busy it was in the time shown ("compute / 5% busy"; the
        host lane: how much of it the host waited). The title names the clock that timed the
        trace (:attr:`clock`). The legend sits to the right of the axes, never over a bar.

        Parameters
        ----------
        ax : matplotlib Axes, optional
        window : (start_ms, end_ms), optional
            Zoom to this time range.
        levels : (first, last), optional
            Zoom to the work of these time levels (e.g. ``(100, 104)``).
        title : str, optional
            Default: the strategy. The clock is added unless the title names it.
        """
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        if ax is None:
            # Constrained layout keeps room for the legend outside the axes.
            _, ax = plt.subplots(figsize=(10, 0.5 * len(self.tracks) + 1.4), layout="constrained")
        if levels is not None:
            window = self.window_for_levels(*levels)
        if window is not None:
            pad = 0.02 * (window[1] - window[0])
            ax.set_xlim(window[0] - pad, window[1] + pad)
        elif self.events:
            ax.set_xlim(0, max(e.end_ms for e in self.events) * 1.01)
        present = {e.kind for e in self.events}
        if present:                                  # beside the axes, never over a bar
            ax.legend(handles=[Patch(color=c, label=k) for k, c in KINDS.items() if k in present],
                      loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize="small")
        busy = self.busy_fractions(window) if self.events else {name: 0.0 for name in self.tracks}
        ax.set_yticks(range(len(self.tracks)),
                      [f"{name}\n{_percent(busy[name])} {'waiting' if name == 'host' else 'busy'}"
                       for name in self.tracks])
        ax.set_ylim(max(len(self.tracks), 1) - 0.5, -0.5)
        if not self.events:
            ax.text(0.5, 0.5, "nothing was recorded", transform=ax.transAxes, ha="center")
        clock = self.meta.get("clock")           # e.g. "modelled H200" on the CPU backend
        ax.set_xlabel(f"time (ms, {clock})" if clock else "time (ms)")
        if title is None:
            title = f"{self.meta.get('strategy', 'timeline')}, clock: {self.clock}"
        elif self.clock not in title:
            title = f"{title} (clock: {self.clock})"
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
        lane = {name: i for i, name in enumerate(self.tracks)}
        for kind, colour in KINDS.items():
            for track in self.tracks:
                bars = [(e.start_ms, e.duration_ms) for e in self.events if e.kind == kind and e.track == track]
                if bars:
                    ax.broken_barh(bars, (lane[track] - 0.4, 0.8), facecolors=colour, edgecolor="none")
        return ax
