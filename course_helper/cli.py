"""Command line: ``python -m course_helper compare`` (also installed as ``course-compare``).

Run it with::

    python -m course_helper compare --n 256 --nt 640 --repeats 3 --out results/
    python -m course_helper bench --out benchmarks/

It prints the comparison table, writes each strategy's Chrome trace (open it
in https://ui.perfetto.dev) and a PNG timeline to ``--out``, and exits with
status 1 if the strategies do not give identical images.
"""
from __future__ import annotations

import argparse
import os
import sys


#: What each strategy does (the loops are in course_helper/strategies.py).
STRATEGY_HELP = {
    "sequential": "one stream, a blocking copy after every kernel",
    "streams": "compute and IO streams; the host waits on an IO stream before reusing its buffer",
    "events": "the same dependencies as events; the host never waits",
    "staged": "device-to-device copies into a staging ring, batched copies to the host",
    "graph": "the events loop captured into a CUDA graph (GPU only)",
    "graph-staged": "the staged loop captured into a CUDA graph (GPU only)",
}

#: Printed under the compare table, and in `compare --help`.
COMPARE_COLUMNS = """\
columns: median/min/max ms = host wall time of the untraced runs' loops, the device synchronised at
  the end (a graph's one-off capture not included); speedup = sequential median / this median; overlap = share of the copy time during
  which a kernel ran too, from one traced run (copy time hidden behind compute; read it as an upper
  bound, as the timelines mark when a stream was busy); max diff = largest absolute difference
  between this strategy's images and the sequential ones (0 = bit-identical)."""


def _strategies_text():
    return "strategies:\n" + "\n".join(f"  {name:<13} {what}" for name, what in STRATEGY_HELP.items())


def _parser():
    p = argparse.ArgumentParser(prog="python -m course_helper",
                                description="Overlapping GPU compute with IO: the course's headless tools. "
                                            "Run 'python3 -m course_helper COMMAND --help' for a command's options.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("compare", help="run the IO strategies on one size and compare them",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run each strategy on one grid size, time it, check that its images are "
                                   "identical to the sequential loop's, and print a table. With --out, also "
                                   "write each strategy's trace (for https://ui.perfetto.dev) and a timeline "
                                   "picture. Exits with status 1 when a strategy's images differ.",
                       epilog=_strategies_text() + "\n\n" + COMPARE_COLUMNS)
    c.add_argument("--n", type=int, default=256, help="grid size N0 = N1 (default 256)")
    c.add_argument("--nt", type=int, default=None, help="number of time levels (default: the box-crossing time)")
    c.add_argument("--every", type=int, default=1, help="save every k-th level (default 1)")
    c.add_argument("--strategies", default="sequential,streams,events",
                   help="comma-separated strategies, from the list below (default: the lesson's three, "
                        "sequential,streams,events)")
    c.add_argument("--repeats", type=int, default=3, help="timed runs per strategy (default 3)")
    c.add_argument("--backend", choices=("auto", "gpu", "cpu"), default=None,
                   help="backend (default: $COURSE_HELPER_BACKEND or auto)")
    c.add_argument("--out", default=None, help="folder for traces (JSON) and timelines (PNG)")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    b = sub.add_parser("bench", help="sweep sizes and strategies against the physical limit B",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Time every strategy at several grid sizes and snapshot intervals and "
                                   "compare each with B, the physical limit of that point: max(compute-only "
                                   "time, output bytes / peak pinned device-to-host bandwidth). Prints a "
                                   "table; with --out, writes bench.json and bench.png.",
                       epilog=_strategies_text() + "\n\ncolumns: efficiency = B / median time (1 = the "
                              "limit); speedup = sequential median / this median; identical = the images "
                              "equal the sequential ones.")
    b.add_argument("--points", default=None,
                   help="comma-separated NxNTxEVERY points, e.g. 256x640x1,2048x320x8 "
                        "(default: the course sweep on a GPU, a small one on the CPU)")
    b.add_argument("--every-sweep", action="store_true",
                   help="also sweep the snapshot interval at 2048^2 x 320 (every 1..32)")
    b.add_argument("--strategies", default=None,
                   help="comma-separated strategies, from the list below (default: all that run on this backend)")
    b.add_argument("--repeats", type=int, default=5, help="timed runs per strategy and point (default 5)")
    b.add_argument("--backend", choices=("auto", "gpu", "cpu"), default=None)
    b.add_argument("--out", default=None, help="folder for bench.json and bench.png")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _parse_points(text):
    points = []
    for item in text.split(","):
        try:
            n, nt, every = (int(v) for v in item.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"cannot read the point {item!r}; write points as NxNTxEVERY, e.g. 256x640x1") from None
        points.append((n, nt, every))
    return points


def bench_main(args):
    from . import backend, bench

    if args.backend:
        backend.set_backend(args.backend)
    else:
        backend.backend_name()
    if args.points:
        points = _parse_points(args.points)
    else:
        points = list(bench.DEFAULT_POINTS if backend.backend_name() == "gpu" else bench.QUICK_POINTS)
    if args.every_sweep:
        points += [p for p in bench.EVERY_POINTS if p not in points]
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else None
    if args.out:
        _check_out(args.out)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(points), desc="points", unit="point", file=sys.stderr, leave=False)

    def progress(point):
        if "skipped" in point:
            print(f"skipped {point['n']}^2x{point['nt']} every {point['every']}: {point['skipped']}",
                  file=sys.stderr)
        if bar is not None:
            bar.update(1)

    try:
        doc = bench.run_bench(points, strategies, repeats=args.repeats, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    print(f"{doc['machine']['device']}, peak pinned D2H {doc['peak_d2h_gbps']:.1f} GB/s, "
          f"{args.repeats} repeats; B = the physical limit of each point")
    print(bench.table(doc))
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        print("wrote", bench.write_json(doc, os.path.join(args.out, "bench.json")))
        if any("strategies" in p for p in doc["points"]):
            bench.plot_bench(doc, os.path.join(args.out, "bench.png"))
            print("wrote", os.path.join(args.out, "bench.png"))
    agree = all(r["identical_to_sequential"] for p in doc["points"] if "strategies" in p
                for r in p["strategies"].values())
    if not agree:
        print("ERROR: some strategy did not reproduce the sequential images", file=sys.stderr)
        return 1
    return 0


def _check_out(folder):
    """Make sure the output folder exists and is writable before any run starts."""
    os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"the output folder {folder} is not writable; choose another with --out")


def compare_main(args):
    from . import backend, compare, wave
    from .timeline import write_atomically

    if args.backend:
        backend.set_backend(args.backend)
    else:
        backend.backend_name()
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    problem = wave.WaveProblem(n0=args.n, n1=args.n, nt=args.nt)
    if args.out:
        _check_out(args.out)
    total = (len(set(names) | {"sequential"})) * args.repeats
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="runs", unit="run", file=sys.stderr, leave=False)
    try:
        cmp = compare.compare_strategies(problem, names, repeats=args.repeats, every=args.every,
                                         progress=(lambda s, i: bar.update(1)) if bar else None)
    finally:
        if bar is not None:
            bar.close()
    print(f"{problem.n0}x{problem.n1} grid, {problem.nt} levels, every {args.every}, "
          f"{args.repeats} repeats, {backend.backend_name()} backend")
    print(cmp.table())
    print(COMPARE_COLUMNS)
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        for name, res in cmp.results.items():
            path = res.trace.to_chrome_json(os.path.join(args.out, f"trace_{name}.json"))
            fig, axes = plt.subplots(2, 1, figsize=(11, 1.0 * len(res.trace.tracks) + 3))
            res.trace.plot(ax=axes[0], title=f"{name}: whole run")
            mid = problem.nt // 2
            res.trace.plot(ax=axes[1], levels=(mid, mid + 4), title=f"{name}: levels {mid}..{mid + 4}")
            fig.tight_layout()
            png = os.path.join(args.out, f"timeline_{name}.png")
            write_atomically(png, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
            plt.close(fig)
            print(f"wrote {path} and {png}")
    if not cmp.agree:
        print("ERROR: the strategies do not give identical images", file=sys.stderr)
        return 1
    print("all strategies gave identical images")
    return 0


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        if args.command == "compare":
            return compare_main(args)
        if args.command == "bench":
            return bench_main(args)
    except (ValueError, TypeError, MemoryError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 2


def compare_entry():
    """Console-script alias: ``course-compare [options]``."""
    sys.exit(main(["compare", *sys.argv[1:]]))
