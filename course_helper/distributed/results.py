"""What a distributed run gives back: the ranks' rows gathered on rank 0, their timelines merged
(or as one Chrome trace and back), the bound a rank cannot beat and the parts it is made of, and
:class:`HaloResult`, what :func:`~course_helper.distributed.launch.launch_halo` returns.
"""
from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import runtime
from ..memory import measure_bandwidth
from ..runtime.ops import LinkCost
from ..streams import synchronize
from ..timing import host_times
from ..timelines.timeline import Trace, TraceEvent, covered_length, intersection_length, merge_intervals
from .rank import RankRun
from .slabs import decompose

if TYPE_CHECKING:
    from ..wave import WaveProblem
    from .link import Team
    from .loops import RankResult

__all__ = ["HaloResult", "chrome_trace", "exchange_hidden", "gather", "halo_bound", "link_note", "measure_parts",
           "merge_traces", "traces_from_chrome"]


def gather(team: Team, result: RankResult, problem: WaveProblem) -> np.ndarray | None:
    """Assemble every rank's saved rows on rank 0: (nsaved, n0, n1) there, None elsewhere.

    The wall rows (two on each global edge) are zero, as in the single-device solve.
    """
    if team.rank != 0:
        team.comm.Send(np.ascontiguousarray(result.images), dest=0, tag=7)
        return None
    out = np.zeros((len(result.levels), problem.n0, problem.n1), np.float32)
    for s in decompose(problem.n0, team.size):
        if s.rank == 0:
            part = result.images
        else:
            part = np.empty((len(result.levels), s.owned, problem.n1), np.float32)
            team.comm.Recv(part, source=s.rank, tag=7)
        out[:, s.first:s.stop] = part
    return out


def merge_traces(traces: Sequence[Trace], title: str | None = None, one_io_lane: bool = True) -> Trace:
    """One Trace with every rank's lanes, named ``"rank R compute"`` etc., on a shared clock.

    With ``one_io_lane`` a rank's IO streams share one lane ("rank R io"), to keep the picture short.
    """
    def lane(r, track):
        return f"rank {r} io" if one_io_lane and track.startswith("io ") else f"rank {r} {track}"

    events, tracks = [], []
    origin = min((e.start_ms for t in traces for e in t.events), default=0.0)
    for r, t in enumerate(traces):
        tracks += list(dict.fromkeys(lane(r, name) for name in t.tracks))
        events += [TraceEvent(lane(r, e.track), e.kind, e.name, e.start_ms - origin, e.end_ms - origin,
                              e.bytes, e.level) for e in t.events]
    meta = dict(traces[0].meta) if traces else {}
    meta.pop("rank", None)
    if title:
        meta["strategy"] = title
    return Trace(events, tracks, meta)


def exchange_hidden(trace: Trace) -> float:
    """The share of one rank's halo exchange time that ran under its kernels (0 to 1; 0 with no
    exchanges): how much of the exchange the overlap loop hid behind the interior.

    ``trace`` is one rank's timeline (``RankResult.trace``, or one of ``traces_from_chrome``)."""
    halo = merge_intervals((e.start_ms, e.end_ms) for e in trace.of_kind("halo"))
    busy = covered_length(halo)
    kernels = merge_intervals((e.start_ms, e.end_ms) for e in trace.kernels)
    return intersection_length(halo, kernels) / busy if busy > 0 else 0.0


def chrome_trace(traces: Sequence[Trace]) -> dict[str, Any]:
    """The ranks' timelines as one Chrome trace: one process per rank, its lanes as threads."""
    origin = min((e.start_ms for t in traces for e in t.events), default=0.0)
    doc = {"traceEvents": [], "displayTimeUnit": "ms",
           "otherData": {k: v for k, v in (traces[0].meta if traces else {}).items() if k != "rank"}}
    for r, t in enumerate(traces):
        shifted = Trace([TraceEvent(e.track, e.kind, e.name, e.start_ms - origin, e.end_ms - origin,
                                    e.bytes, e.level) for e in t.events], t.tracks, t.meta)
        part = shifted.to_chrome(pid=r + 1, process_name=f"rank {r} ({t.meta.get('device', '')})")
        doc["traceEvents"] += part["traceEvents"]
    return doc


def link_note() -> str:
    """How printed times count the halo exchanges: on the CPU backend, on the profile's ``peer``
    link, or not at all where the profile has none; on a GPU, measured (``""``)."""
    rt = runtime.get()
    if not rt.predicts_times:
        return ""
    if rt.predicted_ms(LinkCost("peer", 0)) is not None:
        return "halo exchanges on the profile's peer link"
    return "the halo exchanges are not modelled"


def halo_bound(compute_ms: float, exchange_ms: float, io_ms: float) -> float:
    """The distributed run's physical limit: with perfect overlap a rank can finish no sooner
    than the busiest of its compute, its halo exchanges and its copies to the host (each alone)."""
    return max(compute_ms, exchange_ms, io_ms)


def measure_parts(team: Team, problem: WaveProblem, every: int | None, repeats: int = 3) -> dict[str, float]:
    """Each part of a rank's work alone, in ms (slowest rank, median of ``repeats``):
    ``compute_ms`` (the slab's kernels back to back), ``exchange_ms`` (the halo exchanges back to
    back) and ``io_ms`` (the saved bytes at the peak pinned device-to-host bandwidth), with
    ``bound_ms`` = :func:`halo_bound` of the three."""
    run = RankRun(team, problem, "blocking", every, None)
    steps = range(2, problem.nt)

    def kernels():
        for level in steps:
            run.launch(run.whole, level, run.compute)

    def exchanges():
        after = run.compute.record(run.computed)
        for level in steps:
            run.link.exchange(run.U[level % run.m], level, after=after)
            run.link.join(run.compute)

    def timed(work):
        def start_together():
            synchronize()
            team.comm.Barrier()
        times = host_times(work, repeats + 1, before=start_together, after=synchronize)   # the first warms up
        return team.max(float(np.median(times[1:])))

    try:
        compute_ms, exchange_ms = timed(kernels), timed(exchanges)
        peak = max(r["gb_per_s"] for r in measure_bandwidth((64,), repeats=3) if r["memory"] == "pinned")
    finally:
        run.close()
    io_ms = team.max(run.images.nbytes / (peak * 1e9) * 1e3)
    return {"compute_ms": compute_ms, "exchange_ms": exchange_ms, "io_ms": io_ms, "peak_d2h_gbps": peak,
            "bound_ms": halo_bound(compute_ms, exchange_ms, io_ms)}


class HaloResult:
    """What :func:`~course_helper.distributed.launch_halo` returns.

    Attributes
    ----------
    images : numpy.ndarray
        The gathered saved levels, (nsaved, n0, n1).
    identical : bool or None
        With ``check=True``: whether they equal the single-device solve bit for bit.
    elapsed_ms : float
        The slowest rank's loop time (on the CPU backend: modelled, as ``time_label`` says, the
        halo exchanges on the profile's ``peer`` link where it has one, see :func:`link_note`).
    rank_ms : list of float
    link_note : str
        How the ranks timed the halo exchanges (:func:`link_note` in their process; "" on GPUs,
        where they were measured).
    traces : list of Trace
        Each rank's timeline (with ``trace=True``).
    summary : dict
        What the run printed as JSON (sizes, strategy, device, times).
    """

    def __init__(self, folder: str | os.PathLike, summary: dict[str, Any]) -> None:
        self.summary = summary
        self.ranks = summary["ranks"]
        self.strategy = summary["strategy"]
        self.elapsed_ms = summary["elapsed_ms"]
        self.rank_ms = summary["rank_ms"]
        self.identical = summary.get("identical")
        self.time_label = summary.get("time_label", "")   # e.g. "modelled H200" on the CPU backend
        # How the ranks timed their exchanges (link_note() in the ranks' process; "" on GPUs).
        self.link_note = summary.get("link_note", "")
        path = pathlib.Path(folder)
        self.images = np.load(path / "images.npy") if (path / "images.npy").exists() else None
        trace = path / "trace.json"
        self.traces = traces_from_chrome(json.loads(trace.read_text())) if trace.exists() else []

    @property
    def trace(self) -> Trace:
        """Every rank's lanes in one Trace (for ``.plot()``)."""
        if not self.traces:
            raise ValueError("this run recorded no timeline; use launch_halo(..., trace=True)")
        return merge_traces(self.traces, title=f"{self.strategy}, {self.ranks} ranks")

    def chrome(self) -> dict[str, Any]:
        """The merged Chrome trace (one process per rank) as a dict."""
        return chrome_trace(self.traces)

    def __repr__(self) -> str:
        clock = f" {self.time_label}" if self.time_label else ""
        return (f"<HaloResult {self.strategy!r}, {self.ranks} ranks: {self.elapsed_ms:.1f} ms{clock}, "
                f"identical={self.identical}>")


def traces_from_chrome(doc: dict[str, Any]) -> list[Trace]:
    """Split a Chrome trace dict made by :func:`chrome_trace` back into one Trace per rank."""
    traces = []
    for pid in sorted({e["pid"] for e in doc["traceEvents"]}):
        mine = [e for e in doc["traceEvents"] if e["pid"] == pid]
        names = {e["tid"]: e["args"]["name"] for e in mine if e.get("name") == "thread_name"}
        events = [TraceEvent(names[e["tid"]], e["cat"], e["name"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3,
                             e["args"].get("bytes", 0), e["args"].get("level"))
                  for e in mine if e["ph"] == "X"]
        traces.append(Trace(events, [names[t] for t in sorted(names)], dict(doc.get("otherData", {}), rank=pid - 1)))
    return traces
