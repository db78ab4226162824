"""What the helper costs the host, next to plain CuPy. Run on a GPU:

    python -m benchmarks.host_cost --out benchmarks/host_cost.json

1. Per operation: a kernel launch, an event record, a ``wait_event`` and an
   async device-to-host copy, each called ``--calls`` times in a row through
   the helper (trace off) and through the CuPy call underneath; the host time
   per call (median of the repeats, helper and raw alternating).
2. Per loop: the sequential, streams and events strategies at 256² x 640
   through ``solve(trace=False)`` against the plain-CuPy loops with the same
   dependencies (:mod:`course_helper.raw_cupy`), in the same process.
3. Tracing: the events loop at 256² x 640, helper and plain CuPy, untraced and with
   CUPTI's activity records on (the helper through ``solve(trace=True)``, the plain loop
   inside a bare CUPTI session), taking turns: what CUPTI itself costs, and what the
   helper's recording adds.
4. The loops of part 2 (events) once more, after part 3: what a CUPTI recording leaves behind
   in the process.
The problem of part 1 is tiny (64²), so that the device never holds the host back.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

import course_helper as ch
from course_helper import raw_cupy


def per_call_us(fn, calls):
    sync = ch.synchronize
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    sync()
    return t / calls * 1e6


def operations(calls, repeats):
    import cupy
    from course_helper.wave import _compiled

    p = ch.WaveProblem(n0=64, n1=64, nt=3)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    s, io = ch.create_streams(2)
    ev, = ch.create_events(1)
    host = ch.pinned_empty(p.shape)
    kernel = _compiled(cupy.cuda.Device().id)
    n0, n1 = p.shape
    grid = ((n1 + 31) // 32, (n0 + 7) // 8)
    scalars = (np.int32(n0), np.int32(n1), np.float32(p.dt ** 2), np.float32(1 / p.dx0 ** 2),
               np.float32(1 / p.dx1 ** 2), *(np.int32(q) for q in p.source))
    rt = cupy.cuda.runtime

    def raw_launch():
        with s.raw:
            kernel(grid, (32, 8), (U[0], U[1], U[2], V, *scalars, p.source_amplitude(0)))

    ev.record(s)
    pairs = {
        "kernel launch": (lambda: ch.launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=s), raw_launch),
        "event record": (lambda: s.record(ev), lambda: ev.raw.record(s.raw)),
        "wait_event": (lambda: io.wait_event(ev), lambda: io.raw.wait_event(ev.raw)),
        "async D2H copy": (lambda: ch.copy_to_host_async(host, U[2], io),
                           lambda: rt.memcpyAsync(host.ctypes.data, U[2].data.ptr, U[2].nbytes,
                                                  rt.memcpyDeviceToHost, io.raw.ptr)),
    }
    rows = {}
    for name, (helper, raw) in pairs.items():
        per_call_us(helper, calls)           # warm-up
        per_call_us(raw, calls)
        h, r = [], []
        for _ in range(repeats):
            h.append(per_call_us(helper, calls))
            r.append(per_call_us(raw, calls))
        rows[name] = {"helper_us": statistics.median(h), "raw_cupy_us": statistics.median(r),
                      "ratio": statistics.median(h) / statistics.median(r)}
        print(f"{name:<15} helper {rows[name]['helper_us']:7.2f} us   raw CuPy {rows[name]['raw_cupy_us']:7.2f} us"
              f"   ratio {rows[name]['ratio']:.2f}", flush=True)
    return rows


def loops(n, nt, repeats, names=("sequential", "streams", "events")):
    p = ch.WaveProblem(n0=n, n1=n, nt=nt)
    pairs = {"sequential": raw_cupy.sequential_loop, "streams": raw_cupy.streams_loop,
             "events": raw_cupy.events_loop}
    rows = {}
    for name in names:
        raw = pairs[name]
        ch.solve(p, name, trace=False)
        raw(p)
        h, r = [], []
        for _ in range(repeats):
            res = ch.solve(p, name, trace=False)
            h.append(res.elapsed_ms)
            images, ms = raw(p)
            r.append(ms)
        same = bool(np.array_equal(res.images, images))
        rows[name] = {"helper_ms": statistics.median(h), "raw_cupy_ms": statistics.median(r),
                      "ratio": statistics.median(h) / statistics.median(r), "ratio_of_minima": min(h) / min(r),
                      "identical": same, "helper_times_ms": h, "raw_cupy_times_ms": r}
        print(f"{n}^2x{nt} {name:<11} helper {rows[name]['helper_ms']:7.2f} ms   raw CuPy "
              f"{rows[name]['raw_cupy_ms']:7.2f} ms   ratio {rows[name]['ratio']:.2f} (of the minima "
              f"{rows[name]['ratio_of_minima']:.2f})   identical {same}", flush=True)
    return rows


def tracing(n, nt, repeats):
    """The four runs take turns, repeat after repeat, so that a drift of the host's speed
    during the measurement touches all of them alike."""
    from course_helper.timelines import cupti_trace

    p = ch.WaveProblem(n0=n, n1=n, nt=nt)
    ok, why = cupti_trace.available()
    if not ok:
        return {"skipped": why}

    def raw_under_cupti():
        session = cupti_trace.ActivitySession().start()
        try:
            return raw_cupy.events_loop(p)[1]
        finally:
            session.stop()

    runs = {"helper untraced": lambda: ch.solve(p, "events", trace=False).elapsed_ms,
            "raw CuPy": lambda: raw_cupy.events_loop(p)[1],
            "helper traced (CUPTI)": lambda: ch.solve(p, "events", trace=True).elapsed_ms,
            "raw CuPy under CUPTI": raw_under_cupti}
    times = {label: [] for label in runs}
    for fn in runs.values():
        fn()                                        # warm-up
    for _ in range(repeats):
        for label, fn in runs.items():
            times[label].append(fn())
    rows = {label: {"median_ms": statistics.median(t), "min_ms": min(t), "times_ms": t} for label, t in times.items()}
    for label, row in rows.items():
        print(f"{n}^2x{nt} events {label:<22} median {row['median_ms']:7.2f} ms   min {row['min_ms']:7.2f} ms",
              flush=True)
    helper_x = rows["helper traced (CUPTI)"]["median_ms"] / rows["helper untraced"]["median_ms"]
    cupti_x = rows["raw CuPy under CUPTI"]["median_ms"] / rows["raw CuPy"]["median_ms"]
    rows["helper_trace_overhead"], rows["cupti_overhead_on_plain_cupy"] = helper_x, cupti_x
    print(f"trace overhead (medians): helper {helper_x:.2f}x, plain CuPy under CUPTI {cupti_x:.2f}x", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if ch.backend_name() != "gpu":
        print("host_cost.py compares with plain CuPy: it needs a GPU")
        return 1
    doc = {"machine": ch.device_report(), "calls": args.calls, "repeats": args.repeats,
           "per_operation": operations(args.calls, args.repeats),
           "loops_256x640": loops(256, 640, args.repeats),
           "tracing_256x640": tracing(256, 640, args.repeats)}
    if "skipped" not in doc["tracing_256x640"]:
        after = loops(256, 640, args.repeats, names=("events",))["events"]
        before = doc["loops_256x640"]["events"]
        doc["after_cupti_256x640"] = {
            "events": after, "helper_slowdown": after["helper_ms"] / before["helper_ms"],
            "raw_cupy_slowdown": after["raw_cupy_ms"] / before["raw_cupy_ms"]}
        print(f"after a CUPTI recording, untraced: helper {doc['after_cupti_256x640']['helper_slowdown']:.2f}x, "
              f"plain CuPy {doc['after_cupti_256x640']['raw_cupy_slowdown']:.2f}x of before", flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
