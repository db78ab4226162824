"""How cheap and how accurate are the course's timelines? Run on a GPU:

    python benchmarks/trace_check.py --out benchmarks/trace_check.json

1. Tracing overhead: each strategy is run traced and untraced, alternately, and
   the medians compared (the ratio traced / untraced, measured in one process).
2. Accuracy: one traced run of each strategy under CUPTI (needs the 'cupti'
   extra); the event timeline is compared with CUPTI's record of the same run.
"""
import argparse
import json
import statistics
import sys

import course_helper as ch
import cupti_check   # benchmarks/cupti_check.py, beside this script


def overhead(problem, strategies, repeats):
    rows = {}
    for name in strategies:
        ch.solve(problem, name, trace=True)
        untraced, traced = [], []
        for _ in range(repeats):
            untraced.append(ch.solve(problem, name, trace=False).elapsed_ms)
            traced.append(ch.solve(problem, name, trace=True).elapsed_ms)
        rows[name] = {"untraced_ms": statistics.median(untraced), "traced_ms": statistics.median(traced),
                      "ratio": statistics.median(traced) / statistics.median(untraced)}
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    strategies = [s for s in ch.STRATEGIES if s not in ("graph", "graph-staged") or ch.graphs_supported()[0]]
    doc = {"machine": ch.device_report(), "overhead": {}, "cupti": {}}
    for n, nt in ((256, 640), (1024, 640)):
        p = ch.WaveProblem(n0=n, n1=n, nt=nt)
        doc["overhead"][f"{n}x{nt}"] = overhead(p, strategies, args.repeats)
        for name, r in doc["overhead"][f"{n}x{nt}"].items():
            print(f"overhead {n}^2x{nt} {name:<13} untraced {r['untraced_ms']:8.2f} ms  traced "
                  f"{r['traced_ms']:8.2f} ms  ratio {r['ratio']:.3f}", flush=True)
    ok, why = cupti_check.cupti_available()
    if ok:
        for n in (256, 1024):
            p = ch.WaveProblem(n0=n, n1=n, nt=640)
            for name in strategies:
                result, records = cupti_check.run_with_cupti(lambda: ch.solve(p, name, trace=True))
                agree = cupti_check.agreement(result.trace, records)
                doc["cupti"][f"{n}x640 {name}"] = agree
                print(f"cupti {n}^2 {name:<13} " + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in agree.items()), flush=True)
    else:
        doc["cupti"] = {"skipped": why}
        print("cupti skipped:", why)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
