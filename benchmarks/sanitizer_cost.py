"""What the race sanitizer costs a run. On a GPU or on the CPU backend:

    python -m benchmarks.sanitizer_cost --out benchmarks/sanitizer_cost.json

For each size and strategy, ``solve(problem, strategy, trace=False)`` is timed on the host's
wall clock from the call to its return (the device is done by then), with the sanitizer off and
on (``sanitize=True``), taking turns, ``--repeats`` times each after one untimed run of each;
the result is the ratio of the medians, on vs off. The sanitizer works on the host only (it
follows every operation the helper queues and every host access to pinned arrays), so its cost
is host time: large next to a run the host sets the pace of, small next to one the device does.
On the CPU backend the wall clock includes NumPy's arithmetic, which stands in for the device.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import course_helper as ch

SIZES = ((256, 640), (1024, 320))
STRATEGIES = ("sequential-pinned", "events", "staged")


def wall_ms(problem: ch.WaveProblem, strategy: str, sanitize: bool) -> float:
    """One solve's wall time, from the call to its return, in ms."""
    t0 = time.perf_counter()
    ch.solve(problem, strategy, trace=False, sanitize=sanitize)
    return (time.perf_counter() - t0) * 1e3


def measure(repeats: int) -> dict:
    rows = []
    for n, nt in SIZES:
        problem = ch.WaveProblem(n, n, nt=nt)
        for strategy in STRATEGIES:
            times = {False: [], True: []}
            for sanitize in (False, True):               # one untimed run of each: compile, allocate
                wall_ms(problem, strategy, sanitize)
            for _ in range(repeats):
                for sanitize in (False, True):
                    times[sanitize].append(wall_ms(problem, strategy, sanitize))
            off, on = statistics.median(times[False]), statistics.median(times[True])
            rows.append({"n": n, "nt": nt, "strategy": strategy, "off_ms": off, "on_ms": on, "ratio": on / off,
                         "off_runs_ms": times[False], "on_runs_ms": times[True]})
            print(f"{n}^2 x {nt} {strategy:>18}: off {off:8.1f} ms, on {on:8.1f} ms, {on / off:5.2f}x", flush=True)
    return {"device": ch.device_report()["device"], "backend": ch.backend_name(), "repeats": repeats,
            "what": "wall time of solve(trace=False) with the race sanitizer off and on; medians; ratio = on / off",
            "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each, taking turns (default 3)")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args(argv)
    doc = measure(args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
