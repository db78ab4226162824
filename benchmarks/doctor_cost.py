"""What the overlap doctor costs a block of plain CuPy code. On a GPU with cupti-python:

    python -m benchmarks.doctor_cost --out benchmarks/doctor_cost.json

The block is a plain CuPy loop at 1024² (float32, 4 MiB a snapshot): per step, KERNELS in-place
kernels on a compute stream, then a device-to-host copy into a pinned ring of two on an IO stream,
ordered by events (the correct loop of docs/doctor.md). It is timed on the host's wall clock from
its first call to the end of its final synchronisation, in three ways, taking turns, ``--repeats``
times each after one untimed run of each: undiagnosed; inside ``ch.doctor()`` (CUPTI's records and
the callbacks that find the learner's lines); inside ``ch.doctor(where=False)`` (the records only).
The ratios of the medians (doctor / undiagnosed) are what the doctor costs the block itself; the
doctor's set-up before the block and its analysis after it are timed apart (``setup_ms``,
``analysis_ms``, medians), since they do not slow the learner's loop.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import course_helper as ch
from course_helper import files

N, STEPS, KERNELS = 1024, 200, 5


def block(a, host, compute, io):
    """The loop under test; returns its wall time in ms."""
    import cupy as cp
    copied = [None, None]
    t0 = time.perf_counter()
    for i in range(STEPS):
        s = i % 2
        with compute:
            if copied[s] is not None:
                compute.wait_event(copied[s])
            for _ in range(KERNELS):
                cp.multiply(a[s], 1.0000001, out=a[s])
            ready = compute.record()
        io.wait_event(ready)
        with io:
            a[s].get(out=host[s], blocking=False)
            copied[s] = io.record()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) * 1e3


def measure(repeats: int) -> dict:
    import cupy as cp
    import cupyx
    a = [cp.random.random((N, N), dtype=cp.float32) for _ in range(2)]
    host = [cupyx.empty_pinned((N, N), dtype=cp.float32) for _ in range(2)]
    compute, io = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    ways = ("undiagnosed", "doctor", "doctor, no lines")
    times = {w: [] for w in ways}
    setup, analysis = [], []

    def once(way):
        if way == "undiagnosed":
            return block(a, host, compute, io), None
        t0 = time.perf_counter()
        with ch.doctor(where=(way == "doctor")) as dx:
            t1 = time.perf_counter()
            ms = block(a, host, compute, io)
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        setup.append((t1 - t0) * 1e3)
        analysis.append((t3 - t2) * 1e3)
        return ms, dx

    for way in ways:                              # untimed: compile, allocate, CUPTI's first session
        once(way)
    setup.clear()
    analysis.clear()
    last = None
    for _ in range(repeats):
        for way in ways:
            ms, dx = once(way)
            times[way].append(ms)
            last = dx if way == "doctor" else last
    base = statistics.median(times["undiagnosed"])
    return {
        "device": ch.runtime.get().device_label,
        "block": f"{N}^2 float32, {STEPS} steps of {KERNELS} kernels and one D2H copy, pinned ring of 2, events",
        "repeats": repeats,
        "median_ms": {w: statistics.median(v) for w, v in times.items()},
        "ratio_doctor": statistics.median(times["doctor"]) / base,
        "ratio_doctor_no_lines": statistics.median(times["doctor, no lines"]) / base,
        "setup_ms": statistics.median(setup), "analysis_ms": statistics.median(analysis),
        "findings_of_last_run": last.codes if last is not None else None,
        "hidden_of_last_run": last.hidden if last is not None else None,
        "times_ms": times,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each way (default 7)")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    args = p.parse_args(argv)
    if ch.backend_name() != "gpu":
        p.error("the doctor's cost is measured on a GPU with CUPTI (cupti-python)")
    result = measure(args.repeats)
    text = json.dumps(result, indent=1, default=str)
    print(f"doctor / undiagnosed: {result['ratio_doctor']:.3f} (no lines: {result['ratio_doctor_no_lines']:.3f}); "
          f"median block {result['median_ms']['undiagnosed']:.2f} ms undiagnosed; set-up "
          f"{result['setup_ms']:.1f} ms, analysis {result['analysis_ms']:.1f} ms")
    if args.out:
        files.write_atomically(args.out, lambda f: f.write(text), binary=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
