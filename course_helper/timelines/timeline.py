"""A recorded timeline: export to Perfetto, plot inline, summarise in numbers."""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import files
from ..runtime.ops import COLOURS, COPY_KINDS, OpKind

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    import matplotlib.axes

__all__ = ["Trace", "TraceEvent", "Overlap", "KINDS", "COMPRESS", "LANES", "MAX_LANES", "lane_of", "plot_compared",
           "merge_intervals", "covered_length", "intersection_length", "clip_intervals"]

#: The kind of a chunk's compression on the device (nvCOMP's kernels, or the modelled engine's work).
COMPRESS = "compress"
#: Kinds of timeline entry and the colour each is drawn in, each its own so that the legend tells
#: them apart (the table of :mod:`course_helper.runtime.ops`, which Nsight Systems' NVTX ranges take
#: their colours from too).
KINDS = COLOURS
# Colours for kinds outside KINDS, handed out in turn, so that unknown kinds do not share one.
_SPARE_COLOURS = ("#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173")
#: The most lanes one panel draws: more would be too thin to read. A trace with more tracks draws
#: the numbered streams of one pool ("io 0" ... "io 7") on one lane (see :meth:`Trace.lane_names`).
MAX_LANES = 6

#: How a picture lays out its lanes: ``"engines"`` (the default) one lane per engine and purpose,
#: ``"streams"`` one lane per recorded track (stream, host, writer thread), as the Chrome export has them.
LANES = ("engines", "streams")
# The engines view's shared lanes, by kind of work, in the order they are drawn after the streams'
# own lanes: the halo exchange, copies by direction, the disk writers, the host's waits.
_SHARED_LANE = {OpKind.HALO: "halo", OpKind.H2D: OpKind.H2D, OpKind.D2H: OpKind.D2H, "disk write": "disk",
                "host wait": "host"}
_RANK = re.compile(r"(rank \d+ )(.*)")           # a lane of one rank in a merged multi-rank trace


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
    copy of the kinds asked for ran (by default the device-to-host copies); ``overlap_ms``:
    time both ran at once; ``hidden_fraction``: overlap / the shorter of the two busy times
    (1.0: the shorter stage ran entirely under the longer one; 0.0: never at once, or one of
    them did not run); ``timing``: the clock that timed the trace.

    The two ratios go by these two names everywhere: ``hidden_fraction``, of the *shorter* busy
    time (words: "of the shorter of their busy times"), and :attr:`copy_fraction`, of the copy
    time (words: "of the copy time", "of the copying").
    """
    compute_ms: float
    copy_ms: float
    overlap_ms: float
    hidden_fraction: float
    timing: str

    @property
    def copy_fraction(self) -> float:
        """overlap / copy busy time: the share of the copying that ran while a kernel ran (0.0
        when nothing was copied)."""
        return self.overlap_ms / self.copy_ms if self.copy_ms > 0 else 0.0

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


def clip_intervals(intervals: Iterable[list[float]], lo: float, hi: float) -> list[list[float]]:
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


def _check_lanes(lanes):
    if lanes not in LANES:
        raise ValueError(f"lanes must be one of {', '.join(repr(x) for x in LANES)}, got {lanes!r}: "
                         "'engines' draws a lane per engine and purpose, 'streams' a lane per stream")
    return lanes


def lane_of(event: TraceEvent, lanes: str = "engines", grouped: bool = False) -> str:
    """The lane a picture draws ``event`` on.

    ``lanes="streams"``: its own track; with ``grouped=True`` (what a picture of more than
    :data:`MAX_LANES` tracks uses) a numbered stream of a pool ("io 7") shares its pool's lane ("io").
    ``lanes="engines"``: copies to and from the host share their direction's lane (``"D2H"``,
    ``"H2D"``) whatever stream queued them, the disk writers share ``"disk"``, the halo exchange has
    ``"halo"`` and host waits ``"host"``; other work (kernels, fills, device-to-device copies,
    compression) stays on its stream's lane, streams of one name ("compute 0", "compute 1") sharing
    one. A merged multi-rank trace keeps each rank's prefix ("rank 1 D2H").

    >>> lane_of(TraceEvent("io 7", "D2H", "copy", 0.0, 1.0))
    'D2H'
    >>> lane_of(TraceEvent("io 7", "D2H", "copy", 0.0, 1.0), lanes="streams")
    'io 7'
    >>> lane_of(TraceEvent("rank 1 compute", "kernel", "k", 0.0, 1.0))
    'rank 1 compute'
    >>> lane_of(TraceEvent("io 7", "D2H", "copy", 0.0, 1.0), lanes="streams", grouped=True)
    'io'
    """
    if _check_lanes(lanes) == "streams":
        return _pool(event.track) if grouped else event.track
    return _engine_lane(event.track, event.kind)


def _pool(track):
    """The pool a numbered stream belongs to ("io 7" -> "io", "rank 1 io 3" -> "rank 1 io"); a track
    without a number is its own."""
    match = _RANK.fullmatch(track)
    rank, name = match.groups() if match else ("", track)
    head, _, number = name.rpartition(" ")
    return rank + (head if head and number.isdigit() else name)


def _engine_lane(track, kind):
    """:func:`lane_of` in the engines view, for work of ``kind`` on ``track``."""
    match = _RANK.fullmatch(track)
    rank, track = match.groups() if match else ("", track)
    if kind in _SHARED_LANE:
        return rank + _SHARED_LANE[kind]
    return rank + _pool(track)


def _lane_order(lane, first_track):
    """Sort key of an engines-view lane: by rank, then the streams' own lanes in the order of their
    first track, then the shared lanes in :data:`_SHARED_LANE`'s order."""
    match = _RANK.fullmatch(lane)
    rank, name = match.groups() if match else ("", lane)
    shared = list(_SHARED_LANE.values())
    rank_number = int(rank.split()[1]) if rank else -1
    return (rank_number, 1, shared.index(name), 0) if name in shared else (rank_number, 0, 0, first_track)


def _rows(events):
    """A row index for each of ``events`` (sorted by start) such that no two on one row overlap
    (first fit): work that ran at once on a shared lane is drawn in thinner rows, side by side
    instead of on top of each other. Returns (rows, number of rows)."""
    ends, rows = [], []
    for e in events:
        row = next((r for r, end in enumerate(ends) if end <= e.start_ms + 1e-6), len(ends))
        if row == len(ends):
            ends.append(e.end_ms)
        else:
            ends[row] = e.end_ms
        rows.append(row)
    return rows, max(len(ends), 1)


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
        return self.of_kind(*COPY_KINDS)

    def window_for_levels(self, first: int, last: int) -> tuple[float, float]:
        """(start_ms, end_ms) covering every event of levels ``first`` .. ``last``."""
        sel = [e for e in self.events if e.level is not None and first <= e.level <= last]
        if not sel:
            raise ValueError(f"no traced work belongs to levels {first}..{last}")
        return min(e.start_ms for e in sel), max(e.end_ms for e in sel)

    def shifted(self, by_ms: float) -> Trace:
        """The same timeline with every time moved by ``by_ms`` (``-start`` puts ``start`` at zero)."""
        return Trace([TraceEvent(e.track, e.kind, e.name, e.start_ms + by_ms, e.end_ms + by_ms, e.bytes, e.level)
                      for e in self.events], self.tracks, self.meta)

    # -- numbers ----------------------------------------------------------
    def summary(self) -> dict[str, float | str]:
        """Busy times and overlap, in ms.

        Returns a dict: ``compute_ms`` (time at least one kernel ran),
        ``copy_ms`` (time at least one copy ran), ``overlap_ms`` (both at
        once), ``host_wait_ms``, ``total_ms`` (first start to last end) and
        ``copy_fraction`` = overlap / copy time (how much of the copying
        was hidden behind compute; 0 when nothing was copied: :attr:`Overlap.copy_fraction`), and ``timing``:
        what timed the device work ("CUPTI", "CUDA events", or the modelled GPU, e.g.
        "modelled H200").
        """
        both = self.overlap((OpKind.D2H, OpKind.H2D))          # the copies to and from the host
        host = merge_intervals((e.start_ms, e.end_ms) for e in self.of_kind("host wait"))
        total = (max(e.end_ms for e in self.events) - min(e.start_ms for e in self.events)) if self.events else 0.0
        return {"compute_ms": both.compute_ms, "copy_ms": both.copy_ms, "overlap_ms": both.overlap_ms,
                "host_wait_ms": covered_length(host), "total_ms": total,
                "copy_fraction": both.copy_fraction, "timing": self.timing}

    def overlap(self, copies: tuple[str, ...] = (OpKind.D2H,)) -> Overlap:
        """Compute busy, copy busy (the copies of the kinds ``copies``: by default those to the
        host), their overlap and the shares hidden: an :class:`Overlap`. This is the one place
        these numbers are computed; :meth:`summary` (both directions), tables and the
        benchmark's JSON (copies to the host) take them from here."""
        kern = merge_intervals((e.start_ms, e.end_ms) for e in self.kernels)
        copy = merge_intervals((e.start_ms, e.end_ms) for e in self.of_kind(*copies))
        both = intersection_length(kern, copy)
        shorter = min(covered_length(kern), covered_length(copy))
        return Overlap(compute_ms=covered_length(kern), copy_ms=covered_length(copy), overlap_ms=both,
                       hidden_fraction=both / shorter if shorter > 0 else 0.0, timing=self.timing)

    def lane_names(self, lanes: str = "engines") -> list[str]:
        """The lanes a picture of the trace draws, top to bottom: with ``lanes="streams"`` its
        tracks, with ``"engines"`` (the default) one per engine and purpose (:func:`lane_of`):
        e.g. ``["compute", "D2H", "host"]`` for the streams loop, however many IO streams it used.

        At most :data:`MAX_LANES`: with more tracks than that, the streams view draws the numbered
        streams of one pool ("io 0" ... "io 16") on one lane ("io"), as the engines view does. A
        pool of streams whose work all went to the shared lanes (the IO streams' copies, on "D2H")
        gets no empty lane of its own in the engines view.
        """
        if _check_lanes(lanes) == "streams":
            if len(self.tracks) <= MAX_LANES:
                return list(self.tracks)
            return list(dict.fromkeys(_pool(track) for track in self.tracks))
        kinds = {}
        for e in self.events:
            kinds.setdefault(e.track, set()).add(e.kind)
        first = {}                              # lane -> the first track that has work on it
        for i, track in enumerate(self.tracks):
            if track not in kinds and self.events and _pool(track) != track:
                continue                        # an idle stream of a pool: its work is on the shared lanes
            for kind in sorted(kinds.get(track, {"no work"})):
                first.setdefault(_engine_lane(track, kind), i)
        return sorted(first, key=lambda lane: _lane_order(lane, first[lane]))

    def _grouped(self, lanes):
        """Whether a picture in the ``lanes`` view draws a pool's streams on one lane."""
        return lanes == "streams" and len(self.tracks) > MAX_LANES

    def busy_fractions(self, window: tuple[float, float] | None = None, lanes: str = "engines") -> dict[str, float]:
        """``{lane: fraction}``: the share of ``window`` (``(start_ms, end_ms)``; default: first
        start to last end) during which each lane (:meth:`lane_names`; ``lanes="streams"``: each
        track) had work (on the host lane: waited)."""
        names = self.lane_names(lanes)
        if window is None:
            if not self.events:
                return {name: 0.0 for name in names}
            window = (min(e.start_ms for e in self.events), max(e.end_ms for e in self.events))
        lo, hi = window
        if not hi > lo:
            raise ValueError(f"the window must end after it starts, got {window}")
        grouped = self._grouped(lanes)
        return {name: covered_length(clip_intervals(merge_intervals((e.start_ms, e.end_ms) for e in self.events
                                                           if lane_of(e, lanes, grouped) == name), lo, hi)) / (hi - lo)
                for name in names}

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
        staging = len(self.of_kind(OpKind.D2D))
        moved = (f"{len(self.of_kind(OpKind.D2H, OpKind.H2D))} host copies"
                 + (f", {staging} device copies" if staging else ""))
        clock = f" ({self.meta['clock']})" if self.meta.get("clock") else ""
        return (f"{len(self.kernels)} kernels and {moved} in {s['total_ms']:.2f} ms{clock}: "
                f"compute busy {s['compute_ms']:.2f} ms, copies busy {s['copy_ms']:.2f} ms, "
                f"{100 * s['copy_fraction']:.0f}% of copy time overlapped a kernel, "
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
             levels: tuple[int, int] | None = None, title: str | None = None,
             lanes: str = "engines") -> matplotlib.axes.Axes:
        """Draw the timeline: a lane per engine and purpose (or per stream), work in its kind's colour.

        By default (``lanes="engines"``) the copies of all IO streams share their direction's lane
        ("D2H"), each bar labelled with its stream where the label fits, so a loop with 17 IO
        streams draws as few lanes as one with a single stream (:meth:`lane_names`); work that ran
        at once on a shared lane is drawn in thinner rows side by side. ``lanes="streams"`` draws a
        lane per stream, as recorded (the Chrome export, :meth:`to_chrome_json`, always does, for
        zooming in Perfetto).

        Each operation is drawn exactly as long as it ran, so a lane that was busy 5% of a
        whole run looks it; operations shorter than a pixel are gathered into one-pixel columns
        shaded by how much of the column they fill, so that no work drops out of the picture and
        each lane's ink still matches its busy time, and
        each lane's label says how busy it was in the time shown ("compute / 5% busy"; the
        host lane: how much of it the host waited). The title names the clock that timed the
        trace (:attr:`clock`). The legend sits to the right of the axes, never over a bar.
        To compare runs on one time axis, see :func:`plot_compared`.

        Parameters
        ----------
        ax : matplotlib Axes, optional
            Default: a new figure, its height set by the number of lanes.
        window : (start_ms, end_ms), optional
            Zoom to this time range.
        levels : (first, last), optional
            Zoom to the work of these time levels (e.g. ``(100, 104)``). Work of other levels that
            ran inside that time (a ring's next kernels, queued ahead) is drawn faded, so that the
            bright bars are the levels named.
        title : str, optional
            Default: the strategy. The clock is added unless the title names it.
        lanes : {"engines", "streams"}
            A lane per engine and purpose (default), or per stream.
        """
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        names = self.lane_names(lanes)          # checks `lanes` before anything is drawn
        if len(names) > MAX_LANES:
            raise ValueError(f"this trace has {len(names)} lanes ({', '.join(names)}), more than the {MAX_LANES} "
                             "a panel draws readably: plot each rank's own trace (a multi-rank run keeps one per "
                             "rank), or export it with to_chrome_json and open it in Perfetto, which scrolls "
                             "through any number of lanes")
        if levels is not None:
            window = self.window_for_levels(*levels)
        if ax is None:
            # Constrained layout keeps room for the legend outside the axes.
            _, ax = plt.subplots(figsize=(10, _LANE_INCHES * len(names) + 1.4), layout="constrained")
        if window is not None:
            pad = 0.02 * (window[1] - window[0])
            ax.set_xlim(window[0] - pad, window[1] + pad)
        elif self.events:
            ax.set_xlim(0, max(e.end_ms for e in self.events) * 1.01)
        colours = _colours(self.events)
        if colours:                                  # beside the axes, never over a bar
            ax.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()],
                      loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize="small")
        on_lane = {name: [] for name in names}
        grouped = self._grouped(lanes)
        for e in self.events:                        # in time order
            on_lane[lane_of(e, lanes, grouped)].append(e)
        busy = self.busy_fractions(window, lanes) if self.events else {name: 0.0 for name in names}
        ax.set_yticks(range(len(names)), [_lane_label(name, on_lane[name], busy[name]) for name in names])
        ax.set_ylim(max(len(names), 1) - 0.5, -0.5)
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
        def faded(e):
            return levels is not None and e.level is not None and not levels[0] <= e.level <= levels[1]

        for i, name in enumerate(names):
            _draw_lane(ax, i, on_lane[name], colours, faded)
        return ax


#: Height of one lane in a figure the plots make themselves (inches): room for a two-line label.
_LANE_INCHES = 0.55
#: A lane's bars fill this much of its height (the rest separates the lanes).
_BAR_HEIGHT = 0.8


def _colours(events):
    """``{kind: colour}`` of the kinds among ``events``: :data:`KINDS`'s, in its order, then any
    other kind in a spare colour of its own, so that nothing recorded is left undrawn and the legend
    tells every kind apart."""
    present = {e.kind for e in events}
    colours = {k: c for k, c in KINDS.items() if k in present}
    others = sorted(present - set(KINDS))
    colours.update({k: _SPARE_COLOURS[i % len(_SPARE_COLOURS)] for i, k in enumerate(others)})
    return colours


def _lane_label(name, events, busy):
    """A lane's tick label: its name, how many streams (or writer threads) share it where more than
    one does, and how busy it was ("D2H (17 streams)" / "22% busy")."""
    tracks = {e.track for e in events}
    shared = f" ({len(tracks)} {'threads' if name.endswith('disk') else 'streams'})" if len(tracks) > 1 else ""
    return f"{name}{shared}\n{_percent(busy)} {'waiting' if name.endswith('host') else 'busy'}"


#: Opacity of work drawn faded: other levels' work in a window chosen by levels.
_FADED = 0.25


def _draw_lane(ax, index, events, colours, faded=lambda e: False):
    """Draw one lane's ``events`` (in time order) as bars around y = ``index``, in rows where work
    overlapped (those ``faded`` says, at a quarter of their colour), and label each bar of a lane
    that several tracks share with its track where the label fits inside it."""
    from matplotlib.colors import to_rgb
    rows, nrows = _rows(events)
    height = _BAR_HEIGHT / nrows
    bars = {}
    for e, row in zip(events, rows):
        bars.setdefault((e.kind, row, faded(e)), []).append((e.start_ms, e.duration_ms))
    pixel_ms = _pixel_ms(ax)
    for (kind, row, dim), spans in bars.items():
        strength = _FADED if dim else 1.0
        wide = [s for s in spans if s[1] >= pixel_ms]
        narrow = [s for s in spans if s[1] < pixel_ms]
        y = (index - _BAR_HEIGHT / 2 + row * height, height)
        if wide:
            ax.broken_barh(wide, y, facecolors=[(*to_rgb(colours[kind]), strength)], edgecolor="none")
        if narrow:
            shaded, alphas = _pixel_shades(narrow, pixel_ms, ax.get_xlim()[0])
            ax.broken_barh(shaded, y, facecolors=[(*to_rgb(colours[kind]), a * strength) for a in alphas],
                           edgecolor="none")
    if len({e.track for e in events}) < 2:
        return
    # Only bars that could hold a label at all (a sixtieth of the view or more) get one: a whole
    # run's hundreds of thin bars stay unlabelled and cheap to draw.
    lo, hi = ax.get_xlim()
    label = _label_in_bar()
    for e, row in zip(events, rows):
        if e.duration_ms >= (hi - lo) / 60:
            match = _RANK.fullmatch(e.track)
            bottom = index - _BAR_HEIGHT / 2 + row * height
            name = match.group(2) if match else e.track
            ax.add_artist(label((e.start_ms, e.end_ms), (bottom, bottom + height), name))


def _pixel_ms(ax):
    """How many ms one pixel of ``ax`` spans at its present size and limits."""
    lo, hi = ax.get_xlim()
    return (hi - lo) / max(ax.get_window_extent().width, 1.0)


def _pixel_shades(spans, pixel_ms, origin):
    """Spans narrower than a pixel as one-pixel columns shaded by how much of each column they fill.

    A bar far under a pixel wide is dropped or drawn at a random strength by the renderer, so a lane
    of 600 short kernels would look almost idle. Here each pixel column holds the summed length of the
    spans inside it, drawn with that fraction as its opacity: the lane's ink (width x opacity, added
    up) equals the time its work took, as its "busy" label says. Returns the columns as
    ``(start, width)`` pairs and their opacities."""
    starts = np.array([s for s, _ in spans], dtype=float)
    ends = starts + np.array([d for _, d in spans], dtype=float)
    first = np.floor((starts - origin) / pixel_ms).astype(np.int64)
    last = np.floor((ends - origin) / pixel_ms).astype(np.int64)
    filled: dict[int, float] = {}
    for a, b, s, e in zip(first, last, starts, ends):
        for column in range(int(a), int(b) + 1):     # a span under a pixel touches at most two columns
            lo = origin + column * pixel_ms
            part = min(e, lo + pixel_ms) - max(s, lo)
            if part > 0:
                filled[column] = filled.get(column, 0.0) + part
    columns = sorted(filled)
    return ([(origin + c * pixel_ms, pixel_ms) for c in columns],
            [min(filled[c] / pixel_ms, 1.0) for c in columns])


@functools.cache
def _label_in_bar():
    """The class of a bar's label: a matplotlib Text that draws itself only where it fits inside its
    bar, checked at every draw, so that zooming or resizing never prints a label over its
    neighbours. (Made on first use: importing the package does not import matplotlib.)"""
    from matplotlib.text import Text

    class LabelInBar(Text):
        def __init__(self, xspan, yspan, text):
            # Under the fade that plot_compared lays over work outside a panel's part (zorder 2.2).
            super().__init__(sum(xspan) / 2, sum(yspan) / 2, text, ha="center", va="center", color="black",
                             fontsize="x-small", clip_on=True, zorder=2.1)
            self.corners = [(xspan[0], yspan[0]), (xspan[1], yspan[1])]

        def fits(self, renderer):
            """Whether the label, as ``renderer`` draws it, fits inside its bar."""
            (left, top), (right, bottom) = self.axes.transData.transform(self.corners)
            text = self.get_window_extent(renderer)
            return text.width + 4 <= abs(right - left) and text.height <= abs(bottom - top)

        def draw(self, renderer):
            if self.fits(renderer):
                super().draw(renderer)

    return LabelInBar


def plot_compared(traces: Mapping[str, object] | Sequence[Trace], levels: tuple[int, int] | None = None,
                  window: tuple[float, float] | None = None, lanes: str = "engines",
                  width: float = 11.0) -> list[matplotlib.axes.Axes]:
    """Draw timelines one above the other on one time axis, so that their lengths compare at a glance.

    Every panel shows the same part of its run on the same scale: with ``levels=(first, last)`` the
    work of those levels, each run's time counted from its first operation of level ``first`` (the
    title says how long the levels took); with ``window`` the same time range of each run; else the
    whole runs, each from its first operation, titled with its length as :meth:`Trace.summary`
    (``total_ms``) and the doctor's headline give it. A lane is equally tall in every panel.

    Parameters
    ----------
    traces : mapping of name to Trace, or a sequence of Traces
        E.g. ``{name: r.trace for name, r in comparison.results.items()}``; a mapping's values may be
        ``solve``'s results themselves (their ``trace`` is drawn). Names title the panels (default:
        each trace's strategy).
    levels : (first, last), optional
    window : (start_ms, end_ms), optional
    lanes : {"engines", "streams"}
        As in :meth:`Trace.plot`.
    width : float
        Figure width in inches (11: a notebook's text width).

    Returns
    -------
    list of matplotlib Axes
        One per trace, top to bottom, sharing their x axis.

    Examples
    --------
    >>> ch.timelines.plot_compared(comparison.results, levels=(160, 208))   # doctest: +SKIP
    """
    import matplotlib.pyplot as plt

    _check_lanes(lanes)
    if levels is not None and window is not None:
        raise ValueError("give levels or window, not both: levels picks the same levels in each run, "
                         "window the same time range")
    named = dict(traces) if hasattr(traces, "keys") else dict(enumerate(traces))
    if not named:
        raise ValueError("no timelines to compare: pass at least one Trace")
    panels = []
    for key, item in named.items():
        # A Trace, or a run that holds one in its ``trace`` (a solver's Result, a layer above:
        # its property raises a ValueError that says how to record one).
        try:
            trace = item if isinstance(item, Trace) else item.trace
        except AttributeError:
            trace = None
        if not isinstance(trace, Trace):
            what = f"the run {key!r}" if isinstance(key, str) else f"item {key}"
            raise TypeError(f"{what} holds no timeline ({type(item).__name__}): pass Traces, or results of a "
                            "solve run with trace=True (the default)")
        title = key if isinstance(key, str) else trace.meta.get("strategy", "timeline")
        if len(trace.lane_names(lanes)) > MAX_LANES:        # refused before any panel is drawn
            raise ValueError(f"{title}: {len(trace.lane_names(lanes))} lanes, more than the {MAX_LANES} a panel "
                             "draws readably: compare each rank's own trace, or export it with to_chrome_json "
                             "for Perfetto")
        if levels is not None:
            try:
                start, end = trace.window_for_levels(*levels)
            except ValueError as err:
                raise ValueError(f"{title}: {err}") from None
            trace = trace.shifted(-start)
            span = (0.0, end - start)
            title = f"{title}: levels {levels[0]} to {levels[1]} in {span[1]:.2f} ms"
        elif window is not None:
            span = window
        elif trace.events:
            # Each run from its first operation, its length as its summary (and the doctor) states it.
            trace = trace.shifted(-min(e.start_ms for e in trace.events))
            span = (0.0, trace.summary()["total_ms"])
            title = f"{title}: {span[1]:.2f} ms"
        else:
            span = (0.0, 0.0)
        panels.append((trace, span, title))
    lane_counts = [len(trace.lane_names(lanes)) for trace, _, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, layout="constrained", squeeze=False,
                             figsize=(width, sum(_LANE_INCHES * n + 0.9 for n in lane_counts) + 0.5),
                             height_ratios=[_LANE_INCHES * n + 0.9 for n in lane_counts])
    axes = list(axes[:, 0])
    for ax, (trace, span, title) in zip(axes, panels):
        if levels is not None:          # the shifted trace's levels span the panel, other levels faded
            trace.plot(ax=ax, levels=levels, title=title, lanes=lanes)
        else:
            trace.plot(ax=ax, window=span if span[1] > span[0] else None, title=title, lanes=lanes)
        ax.set_xlabel("")
    lo = min(span[0] for _, span, _ in panels)
    hi = max(span[1] for _, span, _ in panels)
    if hi > lo:
        pad = 0.02 * (hi - lo)
        axes[0].set_xlim(lo - pad, hi + pad)        # shared: every panel shows this window
        for ax, (_, span, _) in zip(axes, panels):
            # Work outside a panel's own part (a shorter run's later levels) shows faded, so that
            # each panel's length is where its bright bars end.
            for outside in ((lo - pad, span[0]), (span[1], hi + pad)):
                if outside[1] > outside[0]:
                    ax.axvspan(*outside, facecolor="white", alpha=0.75, edgecolor="none", zorder=2.2)
    clock = panels[-1][0].meta.get("clock")
    unit = f"ms, {clock}" if clock else "ms"
    if levels is not None:
        axes[-1].set_xlabel(f"time since the first operation of level {levels[0]} ({unit})")
    else:
        axes[-1].set_xlabel(f"time ({unit})" if window is not None
                            else f"time since each run's first operation ({unit})")
    return axes
