"""What a recorded block of device work says about its overlap: the one home of the course's rules.

* :class:`Hidden` and :func:`hidden_by_direction`: how much of each copy direction ran under the
  kernels (the exercises' checkers and the overlap doctor both ask this);
* :class:`Records`: what the overlap doctor recorded of a block (:mod:`.doctor`): the device's work
  (kernels, copies with the kind of host memory they touched, fills, by stream), the host's calls
  that queued copies, launches and fills, and its synchronisations, each with the learner's line
  where it is known. The same small form on both backends (CUPTI's records on a GPU, the modelled
  GPU's on the CPU backend), saved as JSON for the tests;
* :func:`diagnose`: the findings those records support (:data:`CODES`), each with the time it cost.

A finding is made only when its cost reaches :func:`threshold_ms` (docs/doctor.md): a loop that
overlaps well gets none. The findings come root cause first, in the order :data:`CODES` lists them,
so that fixing them one at a time, top down, is a sensible path.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import files
from ..runtime.ops import OpKind
from .timeline import Trace, TraceEvent, clip_intervals, covered_length, intersection_length, merge_intervals

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["Hidden", "hidden_by_direction", "Records", "DeviceOp", "HostCall", "HostSync", "Finding",
           "CODES", "diagnose", "threshold_ms", "records_trace", "MIN_COST_MS", "MIN_COST_SHARE",
           "LAUNCH_SLACK_MS", "FORMAT"]


# --------------------------------------------------------------------------
# Copies hidden under the kernels, per direction
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Hidden:
    """How much of one copy direction ran under the kernels, in ms of one timeline.

    ``copy_ms``: time at least one copy of the direction ran; ``under_kernels_ms``: of that,
    the time a kernel ran too; ``copy_fraction``: their ratio (0.0 when nothing was copied),
    :attr:`~course_helper.timelines.timeline.Overlap.copy_fraction` of the direction."""
    direction: str
    copy_ms: float
    under_kernels_ms: float
    copy_fraction: float

    @property
    def fraction(self) -> float:
        """The same as :attr:`copy_fraction` (the name notebook 13 reads)."""
        return self.copy_fraction


def hidden_by_direction(trace: Trace, directions: tuple[str, ...] = (OpKind.H2D, OpKind.D2H)) -> dict[str, Hidden]:
    """For each copy direction, the share of its copying time during which a kernel ran too.

    (Each direction's :meth:`~course_helper.timelines.Trace.overlap`, its ``copy_fraction``: a
    loop that copies both ways is asked about each direction alone.)"""
    found = {}
    for d in map(str, directions):          # keyed by the plain names
        o = trace.overlap((d,))
        found[d] = Hidden(d, o.copy_ms, o.overlap_ms, o.copy_fraction)
    return found


# --------------------------------------------------------------------------
# The doctor's records
# --------------------------------------------------------------------------
#: The JSON form's name and version (``Records.to_json``).
FORMAT = "course_helper doctor records 1"

_HOST_COPIES = (OpKind.D2H, OpKind.H2D)


class DeviceOp(NamedTuple):
    """One piece of device work: ``kind`` ("kernel", "D2H", "H2D", "D2D", "memset") on ``stream``
    (a key of :attr:`Records.streams`) from ``start`` to ``end`` (ms from the block's start);
    ``host``: for a copy to or from the host, "PINNED" or "PAGEABLE"; ``corr``: the id of the host
    call that queued it (:class:`HostCall`), or None."""
    kind: str
    stream: str
    start: float
    end: float
    bytes: int = 0
    host: str | None = None
    corr: int | None = None
    name: str = ""


class HostCall(NamedTuple):
    """One host call that queued work: ``what`` is "copy", "launch" or "memset"; ``name`` the API
    call ("cudaMemcpyAsync", "cuLaunchKernel"); ``start``/``end`` ms on the block's clock; ``corr``
    joins it with the work it queued; ``where``: the learner's "file:line", or None."""
    what: str
    name: str
    start: float
    end: float
    corr: int | None = None
    where: str | None = None


class HostSync(NamedTuple):
    """One host synchronisation: ``what`` is CUPTI's type ("STREAM_SYNCHRONIZE",
    "EVENT_SYNCHRONIZE", "CONTEXT_SYNCHRONIZE"), ``stream`` the stream waited for (or None),
    ``start``/``end`` ms, ``name`` the API call, ``where`` the learner's "file:line" or None."""
    what: str
    stream: str | None
    start: float
    end: float
    name: str = ""
    where: str | None = None


@dataclass
class Records:
    """What the doctor recorded of one block: the engine's input (:func:`diagnose`).

    ``streams`` maps each stream key to ``{"name": ..., "legacy_default": bool}`` and, where it is
    known (the CPU backend), ``"blocking"``: whether the stream synchronises with the legacy default
    stream (CUPTI's records do not say; such a stream counts as blocking, CUDA's default); ``timing`` names
    the clock ("CUPTI", or e.g. "modelled H200" on the CPU backend, where ``modelled`` is True).
    """
    ops: list[DeviceOp]
    calls: list[HostCall]
    syncs: list[HostSync]
    streams: dict[str, dict[str, Any]]
    timing: str
    device: str = ""
    modelled: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def stream_name(self, key: str | None) -> str:
        """The stream's name on timelines and in messages."""
        if key is None:
            return "the device"
        return str(self.streams.get(str(key), {}).get("name", f"stream {key}"))

    def is_legacy_default(self, key: str) -> bool:
        """Whether ``key`` is the legacy default stream (the one that serialises blocking streams)."""
        return bool(self.streams.get(str(key), {}).get("legacy_default", False))

    def is_blocking(self, key: str) -> bool:
        """Whether ``key`` is a blocking stream, one the legacy default stream serialises with
        (True where the records do not say: a ``cp.cuda.Stream()`` is blocking)."""
        return bool(self.streams.get(str(key), {}).get("blocking", True))

    # -- the JSON form -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: each record a short list, its fields named once in ``fields``."""
        r = _rounded
        return {"format": FORMAT, "timing": self.timing, "device": self.device, "modelled": self.modelled,
                "meta": self.meta, "streams": self.streams,
                "fields": _FIELDS,
                "ops": [[o.kind, o.stream, r(o.start), r(o.end), o.bytes, o.host, o.corr, o.name] for o in self.ops],
                "calls": [[c.what, c.name, r(c.start), r(c.end), c.corr, c.where] for c in self.calls],
                "syncs": [[s.what, s.stream, r(s.start), r(s.end), s.name, s.where] for s in self.syncs]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Records:
        """The records of :meth:`to_dict`; refuses another format with a clear error."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"not the doctor's records (format {found!r}, expected {FORMAT!r}); record them "
                             "with tools/record_doctor_fixtures.py or Diagnosis.save()")
        return cls(ops=[DeviceOp(*o) for o in doc["ops"]], calls=[HostCall(*c) for c in doc["calls"]],
                   syncs=[HostSync(*s) for s in doc["syncs"]], streams=dict(doc["streams"]),
                   timing=doc["timing"], device=doc.get("device", ""), modelled=bool(doc.get("modelled")),
                   meta=dict(doc.get("meta", {})))

    def save(self, path: str | os.PathLike) -> str:
        """Write the records as JSON (compact: a fixture stays small); returns the path."""
        doc = self.to_dict()
        return os.fspath(files.write_atomically(path, lambda f: json.dump(doc, f, separators=(",", ":")),
                                                binary=False))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Records:
        """The records saved at ``path`` (:meth:`save`)."""
        with open(path) as f:
            return cls.from_dict(json.load(f))


#: The field names of each record's list in the JSON form.
_FIELDS = {"ops": ["kind", "stream", "start", "end", "bytes", "host", "corr", "name"],
           "calls": ["what", "name", "start", "end", "corr", "where"],
           "syncs": ["what", "stream", "start", "end", "name", "where"]}


def _rounded(ms):
    return round(float(ms), 5)            # 10 ns: finer than any clock here, and a small file


def records_trace(records: Records) -> Trace:
    """The course's timeline of the records: a lane per stream, host waits on the host lane (the
    synchronisations, and copy calls that held the host over :data:`LAUNCH_SLACK_MS`, e.g. a copy
    to pageable memory), timed as the records are."""
    events, tracks = [], []
    for o in sorted(records.ops, key=lambda o: o.start):
        name = records.stream_name(o.stream)
        if name not in tracks:
            tracks.append(name)
        label = o.name or str(o.kind)
        if o.host:
            label = f"{label} ({o.host.lower()})"
        events.append(TraceEvent(name, str(o.kind), label, o.start, o.end, int(o.bytes or 0)))
    waits = [(s.start, s.end, f"{s.name or s.what}" + (f" at {_short(s.where)}" if s.where else ""))
             for s in records.syncs]
    waits += [(c.start, c.end, f"inside {c.name}" + (f" at {_short(c.where)}" if c.where else ""))
              for c in records.calls if c.what == "copy" and c.end - c.start > LAUNCH_SLACK_MS]
    for a, b, label in waits:
        events.append(TraceEvent("host", "host wait", label, a, b))
    if waits:
        tracks.append("host")
    meta = dict(records.meta, timing=records.timing, device=records.device, strategy="doctor")
    if records.modelled:
        meta["clock"] = records.timing
    return Trace(events, tracks, meta)


def _short(where):
    """"file:line" with the file's folders left out (a message names the line, the report the path)."""
    if not where:
        return "?"
    path, _, line = where.rpartition(":")
    return f"{os.path.basename(path) or path}:{line}"


# --------------------------------------------------------------------------
# The findings
# --------------------------------------------------------------------------
#: Each code, root cause first: (what it means, the fix in the course's words, where the course teaches it).
CODES = {
    "pageable-copy": (
        "copies to or from pageable host memory",
        "copy into pinned memory (cupyx.empty_pinned, or ch.pinned_empty), allocated once before the loop",
        "notebook 03 Pinned memory"),
    "default-stream": (
        "work on the legacy default stream, which waits for every blocking stream and makes them wait for it",
        "queue the kernels on a stream of their own and make the streams non-blocking "
        "(cp.cuda.Stream(non_blocking=True))",
        "notebook 02 Streams and events"),
    "copy-on-compute-stream": (
        "copies queued on the stream the kernels run on, so each waits for the kernels and they for it",
        "queue the copies on a stream of their own, ordered after the kernel that made the data by an event "
        "(io.wait_event(ready))",
        "notebook 06 Concurrent IO with streams"),
    "host-wait-in-loop": (
        "the host waited for the device inside the loop, and the device ran dry while it did",
        "let the streams wait on events instead of the host (stream.wait_event), and wait on the host only "
        "before it reads a buffer the copies still fill, with a ring deep enough that this rarely waits",
        "notebook 07 Concurrent IO with events"),
    "launch-bound": (
        "the device sat idle between kernels, waiting for the host to queue the next one",
        "do more work per kernel, or capture the loop once into a CUDA graph and replay it "
        "(cp.cuda.Stream.begin_capture / ch.graphs)",
        "notebook 10 Reaching the limit"),
    "copies-not-hidden": (
        "copies on their own stream from pinned memory that still did not run under the kernels",
        "give the copies a ring of buffers (two or more) so that a kernel can fill one while another is "
        "copied, and order them with events, not with a shared stream",
        "notebook 07 Concurrent IO with events"),
}

#: A finding is made only when it cost at least this long (ms) ...
MIN_COST_MS = 0.05
#: ... and at least this share of the block's span (docs/doctor.md).
MIN_COST_SHARE = 0.02
#: A kernel that starts within this many ms of the end of the host call that launched it waited for
#: that call: the device had nothing else queued (launch-bound). Also the shortest copy call drawn as
#: a host wait.
LAUNCH_SLACK_MS = 0.02


def threshold_ms(span_ms: float) -> float:
    """The least cost (ms) a finding needs in a block of ``span_ms``: :data:`MIN_COST_MS`, or
    :data:`MIN_COST_SHARE` of the span where that is more."""
    return max(MIN_COST_MS, MIN_COST_SHARE * span_ms)


@dataclass(frozen=True)
class Finding:
    """One thing the doctor found: ``code`` (one of :data:`CODES`), ``message`` (what happened, what
    it cost, the fix, the notebook that teaches it), ``where`` (the learner's "file:line" of the first
    call concerned, or None where it is not known), ``cost_ms`` and the ``numbers`` behind it."""
    code: str
    message: str
    cost_ms: float
    where: str | None = None
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def fix(self) -> str:
        """The fix, in the course's words."""
        return CODES[self.code][1]

    @property
    def section(self) -> str:
        """The notebook that teaches the fix."""
        return CODES[self.code][2]


def _busy(events: Iterable[DeviceOp]) -> list[list[float]]:
    return merge_intervals((e.start, e.end) for e in events)


def _first_where(items):
    """The learner's line most of ``items`` were called from (the first of those tied), or None."""
    lines = [i.where for i in items if i.where]
    return max(dict.fromkeys(lines), key=lines.count) if lines else None


def _make(code, what_happened, cost, where, numbers, modelled):
    meaning, fix, section = CODES[code]
    at = f" (at {_short(where)})" if where else ""
    clock = " (modelled)" if modelled else ""
    message = (f"{code}: {what_happened}{at}. It cost about {cost:.2f} ms{clock}. "
               f"Fix: {fix}. See {section}.")
    return Finding(code, message, round(cost, 4), where, dict(numbers, cost_ms=round(cost, 4)))


def diagnose(records: Records) -> list[Finding]:
    """The findings the records support, root cause first (the order of :data:`CODES`); each costs at
    least :func:`threshold_ms` of the block's span. ``copies-not-hidden`` is the remainder: it is
    reported only where none of the other causes explains the copies' lost overlap."""
    ops, calls, syncs = records.ops, records.calls, records.syncs
    times = [t for o in ops for t in (o.start, o.end)] + [t for c in (*calls, *syncs) for t in (c.start, c.end)]
    if not ops:
        return []
    span = max(times) - min(times)
    floor = threshold_ms(span)
    kernels = sorted((o for o in ops if o.kind == OpKind.KERNEL), key=lambda o: o.start)
    copies = [o for o in ops if o.kind in _HOST_COPIES]
    kern_busy = _busy(kernels)
    window = (kernels[0].start, max(k.end for k in kernels)) if kernels else (0.0, 0.0)
    call_of = {c.corr: c for c in calls if c.corr is not None}
    found = {}

    def lost(selected, inside=None):
        """The overlap ``selected`` copies missed inside the kernels' window (or ``inside``): the shorter
        of their busy time and the kernels' there, less the time both ran at once. What running every
        copy under a kernel (or every kernel under a copy, where the copies take longer) would save."""
        lo, hi = inside or window
        busy, kern = clip_intervals(_busy(selected), lo, hi), clip_intervals(kern_busy, lo, hi)
        return min(covered_length(busy), covered_length(kern)) - intersection_length(busy, kern)

    # pageable-copy: the host held inside each call while the driver staged the copy.
    pageable = [o for o in copies if o.host == "PAGEABLE"]
    if pageable:
        pcalls = [call_of[o.corr] for o in pageable if o.corr in call_of]
        host_ms = sum(c.end - c.start for c in pcalls)
        copy_ms = covered_length(_busy(pageable))
        cost = host_ms if pcalls else copy_ms
        if cost >= floor:
            name = pcalls[0].name if pcalls else "the copy calls"
            direction = "/".join(sorted({str(o.kind) for o in pageable}))
            held = (f"; the host spent {host_ms:.2f} ms inside {name}, held until each copy was done, and queued "
                    "nothing meanwhile" if pcalls else f"; they kept a copy engine busy {copy_ms:.2f} ms")
            found["pageable-copy"] = _make(
                "pageable-copy", f"{len(pageable)} {direction} copies touched PAGEABLE host memory{held}",
                cost, _first_where(pcalls), {"copies": len(pageable), "host_ms": round(host_ms, 4),
                                             "copy_ms": round(copy_ms, 4)}, records.modelled)

    # default-stream: kernels on the legacy default stream, and copies on streams of their own, queued
    # among those kernels, that never ran under them.
    kernel_streams = {k.stream for k in kernels}
    legacy_kernels = [k for k in kernels if records.is_legacy_default(k.stream)]
    among = ((legacy_kernels[0].start, max(k.end for k in legacy_kernels)) if len(legacy_kernels) > 1
             else (0.0, 0.0))
    others = [o for o in copies if o.stream not in kernel_streams and among[0] <= o.start < among[1]]
    if others:
        cost = lost(others, among)
        if cost >= floor:
            share = _share_under(others, _busy(legacy_kernels))
            streams = sorted({records.stream_name(o.stream) for o in others})
            found["default-stream"] = _make(
                "default-stream", f"{len(legacy_kernels)} kernels ran on the legacy default stream and "
                f"{len(others)} copies on {', '.join(streams)}; only {100 * share:.0f}% of the copy time ran "
                "under those kernels, as the default stream serialises blocking streams",
                cost, _first_where([call_of[o.corr] for o in others if o.corr in call_of]),
                {"kernels_on_default": len(legacy_kernels), "copies": len(others),
                 "hidden": round(share, 4)}, records.modelled)

    # ... or the copies on the legacy default stream, the kernels on blocking streams of their own:
    # the copies then wait for the kernels queued before them, and the kernels for the copies.
    on_legacy = [o for o in copies if records.is_legacy_default(o.stream) and o.stream not in kernel_streams]
    blocking = sorted({k.stream for k in kernels if records.is_blocking(k.stream)
                       and not records.is_legacy_default(k.stream)})
    if on_legacy and blocking and "default-stream" not in found:
        cost = lost(on_legacy)
        if cost >= floor:
            share = _share_under(on_legacy, kern_busy)
            streams = ", ".join(records.stream_name(k) for k in blocking)
            found["default-stream"] = _make(
                "default-stream", f"{len(on_legacy)} copies ran on the legacy default stream and the kernels on "
                f"{streams}; only {100 * share:.0f}% of the copy time ran under the kernels, as the default stream "
                "serialises blocking streams",
                cost, _first_where([call_of[o.corr] for o in on_legacy if o.corr in call_of]),
                {"copies_on_default": len(on_legacy), "kernels": len(kernels), "hidden": round(share, 4)},
                records.modelled)

    # copy-on-compute-stream: copies on a stream that ran kernels too.
    shared = [o for o in copies if o.stream in kernel_streams]
    if shared:
        cost = lost(shared)
        if cost >= floor:
            streams = sorted({records.stream_name(o.stream) for o in shared})
            found["copy-on-compute-stream"] = _make(
                "copy-on-compute-stream", f"{len(shared)} copies were queued on {', '.join(streams)}, the "
                "stream the kernels ran on, so each waited for the kernels queued before it and held back "
                "those queued after it",
                cost, _first_where([call_of[o.corr] for o in shared if o.corr in call_of]),
                {"copies": len(shared), "copy_ms": round(covered_length(_busy(shared)), 4)}, records.modelled)

    # host-wait-in-loop: waits after which the device had run dry while the loop went on.
    drained, cost = [], 0.0
    for s in syncs:
        running = any(o.start <= s.end < o.end for o in ops)
        later = [k.start for k in kernels if k.start >= s.end]
        if running or not later:
            continue                      # the device still had work, or the block ended: no harm
        idle = [[s.start, min(later)]]
        idle_ms = covered_length(idle) - intersection_length(idle, kern_busy)
        if idle_ms > 0:
            drained.append(s)
            cost += idle_ms
    if drained and cost >= floor:
        host_ms = sum(s.end - s.start for s in syncs)
        kinds = sorted({s.name or s.what for s in drained})
        found["host-wait-in-loop"] = _make(
            "host-wait-in-loop", f"{len(drained)} of the host's {len(syncs)} synchronisations ({', '.join(kinds)}) "
            f"waited until the device had nothing left to run ({host_ms:.2f} ms of host time in all {len(syncs)}); "
            "after each, the kernels sat idle until the host had queued the next one, which is the cost below",
            cost, _first_where(drained), {"waits": len(drained), "syncs": len(syncs),
                                          "host_sync_ms": round(host_ms, 4)}, records.modelled)

    # launch-bound: gaps between kernels that ended when the next kernel's launch call did, while
    # the device ran nothing else. A host held inside a call is waiting, not launching: inside a copy
    # call (a copy to pageable memory) the gaps it leaves are that copy's cost, told as pageable-copy;
    # inside a launch call the driver's queue was full, and the device, not the host, set the pace.
    # Time a copy ran in a gap is no idle device either: a loop whose copies set the pace leaves its
    # kernels waiting for them, and CUDA graphs would not make it faster.
    held = [c for c in records.calls if c.end - c.start > LAUNCH_SLACK_MS]
    launch_bound = _launch_gaps(kernels, call_of, [*syncs, *held],
                                _busy(o for o in ops if o.kind != OpKind.KERNEL))
    if launch_bound is not None and launch_bound[1]:
        cost, gaps = launch_bound
        if cost >= floor:
            busy_share = covered_length(kern_busy) / (window[1] - window[0]) if window[1] > window[0] else 0.0
            med_kernel = statistics.median(k.end - k.start for k in kernels)
            found["launch-bound"] = _make(
                "launch-bound", f"{len(kernels)} kernels were busy {100 * busy_share:.0f}% of their span; in "
                f"{len(gaps)} gaps the device sat idle (median {1e3 * statistics.median(gaps):.1f} µs, against a "
                f"median kernel of {1e3 * med_kernel:.1f} µs) until the host had launched the next kernel",
                cost, None, {"kernels": len(kernels), "busy": round(busy_share, 4),
                             "median_gap_us": round(1e3 * statistics.median(gaps), 3),
                             "median_kernel_us": round(1e3 * med_kernel, 3)}, records.modelled)

    # copies-not-hidden: the remainder.
    if copies and kernels and not found:
        cost = lost(copies)
        if cost >= floor:
            share = _share_under(copies, kern_busy)
            found["copies-not-hidden"] = _make(
                "copies-not-hidden", f"{len(copies)} copies from pinned memory on their own streams ran "
                f"{100 * share:.0f}% under the kernels; something orders each copy between two kernels "
                "(a ring of one buffer, or an event that makes the kernels wait for the copy)",
                cost, _first_where([call_of[o.corr] for o in copies if o.corr in call_of]),
                {"copies": len(copies), "hidden": round(share, 4)}, records.modelled)
    return [found[code] for code in CODES if code in found]


def _share_under(copies, kern_busy):
    busy = _busy(copies)
    total = covered_length(busy)
    return intersection_length(busy, kern_busy) / total if total > 0 else 0.0


def _launch_gaps(kernels, call_of, waits, other_work):
    """``(idle ms, gaps)``: the gaps between kernels (all streams together) after which the next
    kernel started within :data:`LAUNCH_SLACK_MS` of the end of its own launch call, with no host
    wait (``waits``: synchronisations, or calls that held the host) over the gap; each gap counts
    the time in it that no other device work (``other_work``: busy intervals of copies and fills)
    ran. None when no launch call is known."""
    if not any(k.corr in call_of for k in kernels):
        return None
    waits = merge_intervals((w.start, w.end) for w in waits)
    gaps, end = [], None
    for k in kernels:
        if end is not None and k.start > end:
            call = call_of.get(k.corr)
            gap = [[end, k.start]]
            if call is not None and k.start - call.end <= LAUNCH_SLACK_MS and intersection_length(gap, waits) == 0:
                idle = k.start - end - intersection_length(gap, other_work)
                if idle > 0:
                    gaps.append(idle)
        end = k.end if end is None else max(end, k.end)
    return sum(gaps), gaps
