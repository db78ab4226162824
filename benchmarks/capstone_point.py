"""Is the capstone's balanced point one where the device sets the pace? Run on a GPU:

    python -m benchmarks.capstone_point --out benchmarks/capstone_point.json

At ``ch.exercises.capstone.BALANCED_POINT`` (Gray-Scott, 3072² x 720 steps, a feed frame uploaded
every 36 steps, a snapshot downloaded every 36 steps) it runs the solution notebook's own loop
(``notebooks/solutions/13_capstone_solution.ipynb``, cell ``s13-loop``) on the active backend
and, in the same run, on the CPU backend's modelled H200, and measures on each:

* one step's kernel, one upload and one download (medians over ``--repeats`` traced runs:
  CUPTI on a GPU);
* how busy the kernels kept the device from the first kernel to the last, the run's time, and
  the share of each copy direction that ran under the kernels (medians);
* the checker's verdict on the solution.

The verdict the capstone needs, on both: the device sets the pace (the kernels run back to back,
at least 95% busy over their span, so the host queues ahead of them and no copy holds them up;
and one copy takes less than a block's kernels) and each copy direction is at least 85% hidden.
It also compares the kernel's snapshots with the NumPy reference on the GPU (bit for bit, or the
largest difference). Without a GPU it measures the model alone.
"""
from __future__ import annotations

import argparse
import json
import linecache
import pathlib
import statistics
import sys

import nbformat
import numpy as np

import course_helper as ch
from course_helper.exercises import capstone

SOLUTION = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "13_capstone_solution.ipynb"
#: The ring depths of the solution at the balanced point (what its timing cell chooses).
DEPTHS = {"IN_DEPTH": 2, "OUT_DEPTH": 1}


def solution_source() -> str:
    """The source of the solution notebook's loop cell (``s13-loop``)."""
    nb = nbformat.read(SOLUTION, as_version=4)
    return next(c.source for c in nb.cells if c.get("id") == "s13-loop")


def solution_loop(in_depth: int = DEPTHS["IN_DEPTH"], out_depth: int = DEPTHS["OUT_DEPTH"],
                  source: str | None = None):
    """The solution's ``run_capstone`` (or the one ``source`` defines), with these ring depths."""
    source = source or solution_source()
    filename = f"<{SOLUTION.name}, cell s13-loop>"       # its lines readable, as a notebook cell's are
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = {"ch": ch, "np": np, "IN_DEPTH": in_depth, "OUT_DEPTH": out_depth}
    exec(compile(source, filename, "exec"), ns)
    return ns["run_capstone"]


def measure(repeats: int) -> dict:
    """The balanced point on the active backend (on the CPU backend for its times only: the
    model skips the arithmetic; on a GPU the device computes as always)."""
    with ch.timing_only():
        row = _measure(repeats)
    try:                                             # the checker runs its small problem computed
        row["check"] = ch.exercises.check_capstone(solution_loop())
        row["check_passed"] = True
    except ch.exercises.CapstoneError as err:
        row["check"], row["check_passed"] = str(err), False
    return row


def _measure(repeats):
    gs = capstone.GrayScott.balanced_point()
    run = solution_loop()
    snapshots = gs.empty_snapshots()
    kept = run(gs, snapshots)                        # warm up: compile, allocate
    ch.synchronize()
    hidden, busy, kernel, h2d, d2h, total, clock = {"H2D": [], "D2H": []}, [], [], [], [], [], ""
    for _ in range(repeats):
        with ch.tracing(strategy="capstone solution") as t:
            kept = run(gs, snapshots)                # its buffers kept until the device is done
            ch.synchronize()
        del kept
        trace = t.trace
        for d, h in ch.exercises.hidden_by_direction(trace).items():
            hidden[d].append(h.fraction)
        kernels = trace.kernels
        span = max(e.end_ms for e in kernels) - min(e.start_ms for e in kernels)
        busy.append(trace.summary()["compute_ms"] / span)
        total.append(trace.summary()["total_ms"])
        kernel += [e.duration_ms for e in kernels]
        h2d += [e.duration_ms for e in trace.of_kind("H2D")]
        d2h += [e.duration_ms for e in trace.of_kind("D2H")]
        clock = trace.clock
    row = {"device": ch.device_report()["device"], "clock": clock, "point": capstone.BALANCED_POINT, **DEPTHS,
           "kernel_us": 1e3 * statistics.median(kernel), "h2d_us": 1e3 * statistics.median(h2d),
           "d2h_us": 1e3 * statistics.median(d2h), "run_ms": statistics.median(total),
           "kernels_busy": statistics.median(busy),
           "hidden": {d: statistics.median(f) for d, f in hidden.items()}, "hidden_runs": hidden}
    row["copy_over_block"] = max(row["h2d_us"], row["d2h_us"]) / (gs.feed_every * row["kernel_us"])
    # The device sets the pace when the kernels run back to back from the first to the last (the host
    # queues ahead of them and no copy holds them up), and each copy takes less than a block's kernels.
    row["device_sets_the_pace"] = bool(row["kernels_busy"] >= 0.95 and row["copy_over_block"] < 1)
    row["hidden_enough"] = bool(min(row["hidden"].values()) >= capstone.HIDDEN_NEEDED)
    return row


def agreement() -> dict:
    """The device's one-stream loop against the NumPy reference, at the checker's size and the
    notebook's."""
    found = {}
    for label, gs in (("check point", capstone.GrayScott(**capstone.CHECK_POINT)), ("notebook", capstone.GrayScott())):
        device, numpy_ = ch.exercises.sequential_snapshots(gs), ch.exercises.reference_snapshots(gs)
        found[label] = {"identical": bool(np.array_equal(device, numpy_)),
                        "max_abs_diff": float(np.abs(device - numpy_).max()), "peak": float(np.abs(numpy_).max())}
    return found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args(argv)
    doc = {"backends": {}}
    backends = ["gpu", "cpu"] if ch.runtime.gpu_available() else ["cpu"]
    for name in backends:
        ch.set_backend(name)
        doc["backends"][name] = row = measure(args.repeats)
        if name == "gpu":
            doc["gpu_against_numpy"] = agreement()
        print(f"{name}: {row['device']} ({row['clock']}): kernel {row['kernel_us']:.1f} µs, upload {row['h2d_us']:.0f} "
              f"µs, download {row['d2h_us']:.0f} µs (one copy / one block's kernels {row['copy_over_block']:.2f}); "
              f"run {row['run_ms']:.2f} ms, kernels busy {row['kernels_busy']:.0%} of their span; hidden H2D "
              f"{row['hidden']['H2D']:.0%}, D2H {row['hidden']['D2H']:.0%}; device sets the pace: "
              f"{row['device_sets_the_pace']}; check passed: {row['check_passed']}")
    verdicts = {(r["device_sets_the_pace"], r["hidden_enough"]) for r in doc["backends"].values()}
    doc["same_verdict"] = len(verdicts) == 1
    print("same verdict on every backend:", doc["same_verdict"])
    if "gpu_against_numpy" in doc:
        print("GPU against NumPy:", doc["gpu_against_numpy"])
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    sys.exit(main())
