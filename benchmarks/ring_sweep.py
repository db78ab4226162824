"""The ring depth as the knob: the events loop's time and hidden fraction against nscratch.

Run from the repository root::

    python -m benchmarks.ring_sweep            # on a GPU: benchmarks/ring_sweep.json (CUPTI-timed)
    COURSE_HELPER_BACKEND=cpu python -m benchmarks.ring_sweep
                                               # the modelled GPU: benchmarks/ring_sweep_model.json

Two points, each saving every 16th of 320 levels, where a level's copy takes about as long as
14 kernels: the balanced one (3072², ``bench.BALANCED_POINT``), whose ~50 µs kernels are long
next to the Python that queues each turn, and 2048², whose ~23 µs kernels are not, so that
copies also run in the gaps the host leaves on the compute stream. For each depth from 5 to 24 it
records the loop's time (on a GPU: the median of ``--repeats`` untraced runs;
on the model: one run, its times are deterministic) and, from one traced run
(CUPTI on a GPU), compute busy, copy busy, their overlap and the hidden
fraction: overlap / the shorter of the two. Beside them: the sequential
(pageable) and sequential-pinned loops, and the depth ``solve`` picks by
default (``suggest_nscratch``) with its reason.
"""
import argparse
import json
import os
import statistics
import time

import course_helper as ch
from course_helper import runtime, solver, strategies

POINTS = ((dict(n0=3072, n1=3072, nt=320), 16), (dict(n0=2048, n1=2048, nt=320), 16))
DEPTHS = range(5, 25)


def overlap_of(trace):
    """Compute busy, copy busy, overlap (ms) and the hidden fraction of one traced run."""
    o = trace.overlap()
    return {"compute_ms": o.compute_ms, "copy_ms": o.copy_ms, "overlap_ms": o.overlap_ms,
            "hidden_fraction": o.hidden_fraction, "timing": o.timing}


def measure(problem, strategy, every, nscratch, repeats):
    """Time (median of untraced runs, or one modelled run) and the overlap of one traced run."""
    rt = runtime.get()
    if rt.modelled:
        with rt.times_only():                  # the model's times do not depend on the arithmetic
            r = ch.solve(problem, strategy, every=every, nscratch=nscratch, trace=True)
        return dict(ms=r.elapsed_ms, runs_ms=[r.elapsed_ms], nscratch=r.nscratch, **overlap_of(r.trace))
    runs = [ch.solve(problem, strategy, every=every, nscratch=nscratch, trace=False).elapsed_ms
            for _ in range(repeats)]
    r = ch.solve(problem, strategy, every=every, nscratch=nscratch, trace=True)
    return dict(ms=statistics.median(runs), runs_ms=runs, nscratch=r.nscratch, **overlap_of(r.trace))


def sweep(shape, every, repeats, log):
    problem = ch.WaveProblem(**shape)
    kernel_ms, copy_ms, source = strategies.level_times(problem)
    chosen, reason = solver.suggest_nscratch(problem, every, "events")
    point = {**shape, "every": every, "kernel_ms": kernel_ms, "copy_ms": copy_ms, "times_from": source,
             "ring_depth": strategies.ring_depth(kernel_ms, copy_ms), "default_nscratch": chosen,
             "default_reason": reason, "baselines": {}, "sweep": []}
    for name in ("sequential", "sequential-pinned"):
        point["baselines"][name] = measure(problem, name, every, None, repeats)
        log(f"{shape['n0']}² every {every}: {name:18s} {point['baselines'][name]['ms']:8.2f} ms")
    for n in DEPTHS:
        row = measure(problem, "events", every, n, repeats)
        point["sweep"].append(row)
        log(f"{shape['n0']}² every {every}: events nscratch {n:2d} {row['ms']:8.2f} ms, "
            f"hidden {row['hidden_fraction']:.2f}" + ("   <- the default" if n == chosen else ""))
    return point


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON to write (default: benchmarks/ring_sweep.json on a GPU, "
                                  "benchmarks/ring_sweep_model.json on the CPU backend)")
    ap.add_argument("--repeats", type=int, default=5, help="untraced runs per time on a GPU (median)")
    args = ap.parse_args()
    rt = runtime.get()
    here = os.path.dirname(os.path.abspath(__file__))
    out = args.out or os.path.join(here, "ring_sweep_model.json" if rt.modelled else "ring_sweep.json")
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f} s] {msg}", flush=True)

    report = ch.device_report()
    machine = {"device": rt.device_label if rt.modelled else report.get("device"),
               "backend": report["backend"], "times": report.get("times"),
               "timing": "the modelled GPU (one run each)" if rt.modelled else
                         f"host wall time, median of {args.repeats} untraced runs; overlap from one CUPTI-traced run"}
    doc = {"machine": machine, "copy_lag": strategies.COPY_LAG, "date": time.strftime("%Y-%m-%d"),
           "points": [sweep(shape, every, args.repeats, log) for shape, every in POINTS]}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
