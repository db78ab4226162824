"""How cheap and how accurate are the course's timelines? Run on a GPU:

    python -m benchmarks.trace_check --out benchmarks/trace_check.json

1. Overhead: each strategy run traced and untraced, alternately; ``ratio`` is the
   median over the rounds of traced / untraced (``ratio_of_medians`` beside it).
   Traces are timed by CUPTI where ``cupti-python`` works, else by CUDA events
   (the JSON says which).
2. Mapping (CUPTI): every kernel and copy of a CUPTI-timed trace is found and
   put on its lane and level: kernels run in level order, and no copy of a
   level starts before the kernel that computed it has ended.
3. The fallback: an event-timed trace (``COURSE_HELPER_TIMING=events``) run
   under CUPTI, and the two records of that same run compared.
4. CUPTI alone (256² x 640): each strategy untraced, alternately without and
   inside a bare CUPTI session (no recording by the helper, no notes), and the
   graph replays also with CUPTI tracing only kernels or only copies: how much of
   the tracing cost is CUPTI's own, and which of its records it comes from.
"""
import argparse
import json
import os
import statistics
import sys

import course_helper as ch
from benchmarks import cupti_check
from course_helper.timelines import cupti_trace


def overhead(problem, strategies, repeats):
    rows = {}
    for name in strategies:
        ch.solve(problem, name, trace=True)                             # warm-up
        cost = ch.measure.measure_trace_cost(problem, name, 1, repeats)           # rounds of untraced, traced
        rows[name] = {"untraced_ms": cost["untraced_beside_ms"], "traced_ms": cost["traced_ms"],
                      "ratio": cost["trace_overhead"],
                      "ratio_of_medians": cost["traced_ms"] / cost["untraced_beside_ms"]}
    return rows


def under_cupti(fn, kinds=("kernel", "memcpy", "memset")):
    """``fn()`` inside a bare CUPTI session recording ``kinds`` (after the session's set-up
    launch, as a recording makes it), the records thrown away."""
    session = cupti_trace.ActivitySession(kinds).start()
    try:
        cupti_trace.warm_up()
        session.begin_here()
        return fn()
    finally:
        session.stop()


def cupti_alone(problem, strategies, repeats):
    rows = {}
    for name in strategies:
        def untraced():
            return ch.solve(problem, name, trace=False).elapsed_ms
        runs = {"untraced": untraced, "all": lambda: under_cupti(untraced)}
        if ch.STRATEGIES[name].graph:
            runs["kernels only"] = lambda: under_cupti(untraced, ("kernel",))
            runs["copies only"] = lambda: under_cupti(untraced, ("memcpy",))
        times = {k: [] for k in runs}
        for fn in runs.values():
            fn()
        for _ in range(repeats):
            for k, fn in runs.items():
                times[k].append(fn())
        rows[name] = {"untraced_ms": statistics.median(times["untraced"]),
                      **{f"cupti_{k}_ratio": ch.measure.paired_ratio(t, times["untraced"])
                         for k, t in times.items() if k != "untraced"}}
    return rows


def mapping(problem, name):
    """Checks of one CUPTI-timed trace: counts, level order, copies after their kernels."""
    trace = ch.solve(problem, name, trace=True).trace
    kernels = sorted(trace.kernels, key=lambda e: e.start_ms)
    levels = [e.level for e in kernels]
    made = {e.level: e.end_ms for e in kernels}
    d2h = trace.of_kind("D2H")
    # a staged batch is labelled with its first level; its last level is made later
    late = [e for e in d2h if e.start_ms < made.get(e.level, float("-inf")) - 1e-6]
    s = trace.summary()
    return {"timing": trace.timing, "kernels": len(kernels), "d2h_copies": len(d2h),
            "d2d_copies": len(trace.of_kind("D2D")), "memsets": len(trace.of_kind("memset")),
            "kernels_in_level_order": levels == sorted(levels), "copies_before_their_kernel": len(late),
            "lanes": trace.tracks, **{k: trace.meta[k] for k in trace.meta if k.startswith("cupti_")},
            "compute_ms": s["compute_ms"], "copy_ms": s["copy_ms"], "overlap_ms": s["overlap_ms"],
            "overlap_fraction": s["copy_fraction"], "total_ms": s["total_ms"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    strategies = [s for s in ch.STRATEGIES if s not in ("graph", "graph-staged") or ch.graphs_supported()[0]]
    ok, why = cupti_check.cupti_available()
    doc = {"machine": ch.device_report(), "timing": "CUPTI" if cupti_trace.wanted() else "CUDA events",
           "overhead": {}, "mapping": {}, "fallback_vs_cupti": {}, "cupti_alone": {}}
    for n in (256, 1024):
        p = ch.WaveProblem(n0=n, n1=n, nt=640)
        doc["overhead"][f"{n}x640"] = overhead(p, strategies, args.repeats)
        for name, r in doc["overhead"][f"{n}x640"].items():
            print(f"overhead {n}^2x640 {name:<13} untraced {r['untraced_ms']:8.2f} ms  traced "
                  f"{r['traced_ms']:8.2f} ms  ratio {r['ratio']:.3f}", flush=True)
    if not ok:
        doc["mapping"] = doc["fallback_vs_cupti"] = doc["cupti_alone"] = {"skipped": why}
        print("cupti skipped:", why)
    else:
        p = ch.WaveProblem(n0=256, n1=256, nt=640)
        doc["cupti_alone"]["256x640"] = cupti_alone(p, strategies, args.repeats)
        for name, r in doc["cupti_alone"]["256x640"].items():
            print(f"cupti alone 256^2x640 {name:<13} " + ", ".join(f"{k}={v:.3f}" for k, v in r.items()), flush=True)
        for n in (256, 1024):
            p = ch.WaveProblem(n0=n, n1=n, nt=640)
            for name in strategies:
                m = doc["mapping"][f"{n}x640 {name}"] = mapping(p, name)
                print(f"mapping {n}^2 {name:<13} " + ", ".join(f"{k}={v}" for k, v in m.items()
                                                               if not isinstance(v, float)), flush=True)
        before = os.environ.get(cupti_trace.TIMING_ENV)
        os.environ[cupti_trace.TIMING_ENV] = "events"       # the fallback, recorded under CUPTI
        try:
            for n in (256, 1024):
                p = ch.WaveProblem(n0=n, n1=n, nt=640)
                for name in strategies:
                    result, records = cupti_check.run_with_cupti(lambda: ch.solve(p, name, trace=True))
                    agree = cupti_check.agreement(result.trace, records)
                    doc["fallback_vs_cupti"][f"{n}x640 {name}"] = agree
                    print(f"fallback {n}^2 {name:<13} " + ", ".join(
                        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in agree.items()),
                        flush=True)
        finally:
            if before is None:
                del os.environ[cupti_trace.TIMING_ENV]
            else:
                os.environ[cupti_trace.TIMING_ENV] = before
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
