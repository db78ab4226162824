"""Ground truth for the course's event timing: a CUPTI activity trace of the same run.

Where CUPTI is missing the course times every operation with CUDA events
recorded around it on its own stream (the fallback of
:mod:`course_helper.timelines.recording`). NVIDIA's CUPTI records what the driver saw
(kernels and memory copies with their stream ids and nanosecond timestamps).
Running an event-timed solve under CUPTI says how closely the fallback matches.
Needs the optional ``cupti-python`` package (the ``cuda13`` extra) and the GPU
backend.
"""
from __future__ import annotations

import numpy as np

from course_helper.timelines import cupti_trace
from course_helper.streams import synchronize
from course_helper.timelines.timeline import covered_length, intersection_length, merge_intervals

__all__ = ["cupti_available", "run_with_cupti", "agreement"]


def cupti_available():
    """``(True, "")`` when CUPTI tracing can run here, else ``(False, reason)``."""
    return cupti_trace.available()


def run_with_cupti(fn):
    """Call ``fn()`` with CUPTI recording kernels, copies and memsets.

    Returns ``(fn's result, records)``; each record is a dict as described in
    :class:`course_helper.timelines.cupti_trace.ActivitySession` (``cls`` is "kernel",
    "memset" or the copy direction, e.g. "DTOH"). Only one CUPTI recording
    runs at a time, so a trace recorded inside ``fn`` is timed by CUDA events.
    """
    ok, why = cupti_available()
    if not ok:
        raise RuntimeError(why)
    session = cupti_trace.ActivitySession().start()
    try:
        result = fn()
        synchronize()
    finally:
        session.stop()
    return result, session.records


def agreement(trace, records):
    """Compare an event-based Trace with CUPTI records of the same run.

    Kernels and device-to-host copies are matched in start order. Returns a
    dict with counts, the median and largest absolute duration difference (µs)
    and the busy/overlap figures from both sources.
    """
    cuk = sorted((r for r in records if r["cls"] == "kernel" and "wave2d" in r["name"]),
                 key=lambda r: r["start_ns"])
    cuc = sorted((r for r in records if r["cls"] == "DTOH"),
                 key=lambda r: r["start_ns"])
    ek = sorted(trace.kernels, key=lambda e: e.start_ms)
    ec = sorted(trace.of_kind("D2H"), key=lambda e: e.start_ms)
    out = {"kernels_events": len(ek), "kernels_cupti": len(cuk),
           "copies_events": len(ec), "copies_cupti": len(cuc)}

    def diffs(ev, cu):
        n = min(len(ev), len(cu))
        d = np.array([abs(e.duration_ms * 1e3 - (c["end_ns"] - c["start_ns"]) / 1e3)
                      for e, c in zip(ev[:n], cu[:n])])
        dur = np.array([(c["end_ns"] - c["start_ns"]) / 1e3 for c in cu[:n]])
        return d, dur

    for label, ev, cu in (("kernel", ek, cuk), ("copy", ec, cuc)):
        d, dur = diffs(ev, cu)
        if len(d):
            out[f"{label}_duration_us_cupti_median"] = float(np.median(dur))
            out[f"{label}_abs_diff_us_median"] = float(np.median(d))
            out[f"{label}_abs_diff_us_max"] = float(d.max())

    k_cu = merge_intervals((r["start_ns"] / 1e6, r["end_ns"] / 1e6) for r in cuk)
    c_cu = merge_intervals((r["start_ns"] / 1e6, r["end_ns"] / 1e6) for r in cuc)
    s = trace.summary()
    out.update({
        "events_compute_ms": s["compute_ms"], "cupti_compute_ms": covered_length(k_cu),
        "events_copy_ms": s["copy_ms"], "cupti_copy_ms": covered_length(c_cu),
        "events_overlap_ms": s["overlap_ms"], "cupti_overlap_ms": intersection_length(k_cu, c_cu),
        "events_overlap_fraction": s["copy_fraction"],
        "cupti_overlap_fraction": (intersection_length(k_cu, c_cu) / covered_length(c_cu)
                                   if covered_length(c_cu) else 0.0),
    })
    return out
