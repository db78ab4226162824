"""Why did captured loops lose about 10% where copies bound the run? Run on a GPU:

    python -m benchmarks.graph_copies --out benchmarks/graph_copies.json

At 1024² x 640 and 2048² x 320, every level saved (copy-bound), the events
loop and the same loop captured into a graph run untraced, timed on the host,
and once more under CUPTI. Each runs with the copies spread over one IO stream
per scratch buffer, and with every copy on a single IO stream (in a graph:
one branch of copy nodes per IO stream, or a single chain). From CUPTI's
records of each run: how long the copies took and at what bandwidth, how many
ran at once and on which hardware channels, and how long the copy engines sat
idle between the first and the last copy. Then ``solve`` itself (whose graph
strategies capture every copy on one IO stream) against the events loop.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

import course_helper as ch
from benchmarks import cupti_check
from course_helper import strategies
from course_helper.strategies import Run
from course_helper.timelines.timeline import covered_length, merge_intervals


def make_run(problem, nio, images, nscratch=5):
    run = Run(problem, 1, U=[ch.device_zeros(problem.shape) for _ in range(nscratch)],
              V=ch.to_device(problem.velocity), images=images)
    run.compute = ch.create_streams(1, name="compute")[0]
    io = ch.create_streams(nio, name="io")
    run.io = [io[b % nio] for b in range(nscratch)]
    run.ready = ch.create_events(nscratch)
    run.copied = ch.create_events(nscratch)
    ch.synchronize()
    return run


def capture(run):
    """The events loop captured with its IO streams as they are (one branch per IO stream)."""
    with ch.graphs.capture_graph(run.compute) as cap:
        ch.memory.zero_async(run.U[0], run.compute)
        ch.memory.zero_async(run.U[1], run.compute)
        strategies.with_events(run)
        for io in set(run.io):
            run.compute.wait_stream(io)
    return cap.graph


def solve_rows(points, repeats):
    """Median ``solve`` times (untraced) of the events loop and the graph strategies."""
    rows = {}
    for n, nt in points:
        p = ch.WaveProblem(n0=n, n1=n, nt=nt)
        row = rows[f"{n}x{nt} every 1"] = {}
        for name in ("events", "graph", "graph-staged"):
            ch.solve(p, name, trace=False)
            row[name] = statistics.median(ch.solve(p, name, trace=False).elapsed_ms for _ in range(repeats))
        print(f"solve {n}^2x{nt}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()), flush=True)
    return rows


def analyse(records):
    kernels = sorted((r for r in records if r["cls"] == "kernel" and "wave2d" in r["name"]),
                     key=lambda r: r["start_ns"])
    copies = sorted((r for r in records if r["cls"] == "DTOH"), key=lambda r: r["start_ns"])
    ms = lambda ns: ns / 1e6                                   # noqa: E731
    t0 = min(r["start_ns"] for r in kernels + copies)
    busy = merge_intervals((ms(r["start_ns"]), ms(r["end_ns"])) for r in copies)
    window = ms(copies[-1]["end_ns"] - copies[0]["start_ns"])
    dur_us = [(r["end_ns"] - r["start_ns"]) / 1e3 for r in copies]
    # the most copies running at the same moment
    edges = sorted([(r["start_ns"], 1) for r in copies] + [(r["end_ns"], -1) for r in copies])
    running = most = 0
    for _, d in edges:
        running += d
        most = max(most, running)
    gaps_us = [(b["start_ns"] - a["end_ns"]) / 1e3 for a, b in zip(copies, copies[1:])]
    channels = {}
    for r in copies:
        channels[r["channel"]] = channels.get(r["channel"], 0) + 1
    nbytes = sum(r["bytes"] for r in copies)
    return {
        "kernels": len(kernels), "copies": len(copies), "memsets": sum(r["cls"] == "memset" for r in records),
        "device_span_ms": ms(max(r["end_ns"] for r in kernels + copies) - t0),
        "copy_busy_ms": covered_length(busy), "copy_window_ms": window,
        "copy_idle_in_window_ms": window - covered_length(busy),
        "copy_median_us": statistics.median(dur_us), "copy_sum_ms": sum(dur_us) / 1e3,
        "copy_gbps_busy": nbytes / (covered_length(busy) * 1e-3) / 1e9,
        "copy_gbps_median_single": statistics.median(r["bytes"] / (r["end_ns"] - r["start_ns"]) for r in copies),
        "max_concurrent_copies": most, "copy_channels": {str(k): v for k, v in sorted(channels.items())},
        "gap_median_us": statistics.median(gaps_us), "gap_p90_us": float(np.percentile(gaps_us, 90)),
        "first_copy_after_first_kernel_us": (copies[0]["start_ns"] - kernels[0]["start_ns"]) / 1e3,
        "last_copy_after_last_kernel_us": (copies[-1]["end_ns"] - kernels[-1]["end_ns"]) / 1e3,
        "kernel_busy_ms": covered_length(merge_intervals((ms(r["start_ns"]), ms(r["end_ns"])) for r in kernels)),
    }


def variant(problem, images, loop, nio, repeats):
    """Host-timed repeats and one CUPTI record of ``loop`` ("events" or "graph")."""
    run = make_run(problem, nio, images)
    if loop == "graph":
        g = capture(run)
        go = lambda: g.launch()                                # noqa: E731
    else:
        go = lambda: strategies.with_events(run)               # noqa: E731
    go()
    ch.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        go()
        ch.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    _, records = cupti_check.run_with_cupti(go)
    return {"median_ms": statistics.median(times), "times_ms": times, **analyse(records)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ok, why = cupti_check.cupti_available()
    if not ok or not ch.graphs_supported()[0]:
        print("graph_copies.py needs CUDA graphs and CUPTI:", why)
        return 1
    doc = {"machine": ch.device_report(), "points": {}}
    for n, nt in ((1024, 640), (2048, 320)):
        p = ch.WaveProblem(n0=n, n1=n, nt=nt)
        images = ch.pinned_empty((nt, n, n))
        rows = doc["points"][f"{n}x{nt} every 1"] = {}
        for nio in (5, 1):
            for loop in ("events", "graph"):
                r = rows[f"{loop}, {nio} io stream{'s' if nio > 1 else ''}"] = variant(p, images, loop, nio,
                                                                                      args.repeats)
                print(f"{n}^2x{nt} {loop:<6} io={nio} " + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                    if k != "times_ms"), flush=True)
        del images
    doc["solve"] = solve_rows(((256, 640), (1024, 640), (2048, 320)), args.repeats)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
