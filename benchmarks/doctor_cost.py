"""What the overlap doctor costs a block of code. On a GPU with cupti-python:

    python -m benchmarks.doctor_cost --out benchmarks/doctor_cost.json

Two blocks at 1024² (float32, 4 MiB a level), each timed on the host's wall clock from its first
call to the end of its final synchronisation, in three ways taking turns, ``--repeats`` times each
after one untimed run of each: undiagnosed; inside ``ch.doctor()`` (CUPTI's records and the
callbacks that find the learner's lines); inside ``ch.doctor(where=False)`` (the records only).

* ``course loop``: the course's events loop (notebook 7) on the 1024² x 640 problem, every level
  saved: one stencil kernel a level and one copy to pinned memory, which is the block the doctor is
  meant for (the device sets the pace).
* ``tiny kernels``: a plain CuPy loop of 200 steps, each five in-place elementwise kernels and a
  copy into a pinned ring of two, ordered by events: kernels of a few µs, so the host sets the
  pace and every µs the doctor adds to a call shows in full (the worst case).

The medians of each round's ratio (doctor / undiagnosed) are what the doctor costs the block itself; the
doctor's set-up before the block and its analysis after it are timed apart (``setup_ms``,
``analysis_ms``, medians), since they do not slow the learner's loop.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import course_helper as ch
from course_helper import files

N, STEPS, KERNELS = 1024, 200, 5
#: The course loop's problem: the README's 1024² x 640 point, every level saved.
COURSE_NT = 640


def tiny_kernels():
    """The plain CuPy loop of tiny kernels: returns (the block, its description)."""
    import cupy as cp
    import cupyx
    a = [cp.random.random((N, N), dtype=cp.float32) for _ in range(2)]
    host = [cupyx.empty_pinned((N, N), dtype=cp.float32) for _ in range(2)]
    compute, io = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)

    def block():
        copied = [None, None]
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
    return block, f"{N}^2 float32, {STEPS} steps of {KERNELS} elementwise kernels and one D2H copy, pinned ring of 2"


def course_loop(stack):
    """The course's events loop on the 1024² x 640 problem (allocated once, in ``stack``)."""
    run = stack.enter_context(ch.prepare(ch.WaveProblem(n0=N, n1=N, nt=COURSE_NT), "events"))

    def block():
        ch.strategies.with_events(run)
        ch.synchronize()
    return block, f"the course's events loop, {N}^2 x {COURSE_NT} levels, every level saved (nscratch {run.nscratch})"


def measure(block, what: str, repeats: int) -> dict:
    ways = ("undiagnosed", "doctor", "doctor, no lines")
    times = {w: [] for w in ways}
    setup, analysis = [], []

    def timed():
        t0 = time.perf_counter()
        block()
        return (time.perf_counter() - t0) * 1e3

    def once(way):
        if way == "undiagnosed":
            return timed(), None
        t0 = time.perf_counter()
        with ch.doctor(where=(way == "doctor")) as dx:
            t1 = time.perf_counter()
            ms = timed()
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
    def ratio(way):
        # the median of each round's ratio: the three ways of a round ran one after the other, on the
        # machine in one state, where a host-bound block's own time moves from round to round
        return statistics.median(t / u for t, u in zip(times[way], times["undiagnosed"]))

    return {
        "block": what,
        "median_ms": {w: statistics.median(v) for w, v in times.items()},
        "ratio_doctor": ratio("doctor"),
        "ratio_doctor_no_lines": ratio("doctor, no lines"),
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
    result = {"device": ch.runtime.get().device_label, "repeats": args.repeats, "blocks": {}}
    with contextlib.ExitStack() as stack:
        for name, make in (("course loop", lambda: course_loop(stack)), ("tiny kernels", tiny_kernels)):
            r = result["blocks"][name] = measure(*make(), args.repeats)
            print(f"{name}: doctor / undiagnosed {r['ratio_doctor']:.3f} (no lines: {r['ratio_doctor_no_lines']:.3f}); "
                  f"median block {r['median_ms']['undiagnosed']:.2f} ms undiagnosed; set-up "
                  f"{r['setup_ms']:.1f} ms, analysis {r['analysis_ms']:.1f} ms; findings {r['findings_of_last_run']}")
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        files.write_atomically(args.out, lambda f: f.write(text), binary=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
