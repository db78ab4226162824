"""Command line: ``python -m course_helper compare`` (also installed as ``course-compare``).

Run it with::

    python -m course_helper compare --n 256 --nt 640 --repeats 3 --out results/
    python -m course_helper bench --out benchmarks/
    python -m course_helper calibrate --out my_gpu.json      (on a GPU)

It prints the comparison table, writes each strategy's Chrome trace (open it
in https://ui.perfetto.dev) and a PNG timeline to ``--out``, and exits with
status 1 if the strategies do not give identical images.
"""
from __future__ import annotations

import argparse
import os
import sys


def _parser():
    p = argparse.ArgumentParser(prog="python -m course_helper",
                                description="Overlapping GPU compute with IO: the course's headless tools.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="run the IO strategies on one size and compare them")
    c.add_argument("--n", type=int, default=256, help="grid size N0 = N1 (default 256)")
    c.add_argument("--nt", type=int, default=None, help="number of time levels (default: the box-crossing time)")
    c.add_argument("--every", type=int, default=1, help="save every k-th level (default 1)")
    c.add_argument("--strategies", default="sequential,streams,events",
                   help="comma-separated strategies (default: all three)")
    c.add_argument("--repeats", type=int, default=3, help="timed runs per strategy (default 3)")
    c.add_argument("--backend", choices=("auto", "gpu", "cpu"), default=None,
                   help="backend (default: $COURSE_HELPER_BACKEND or auto)")
    c.add_argument("--out", default=None, help="folder for traces (JSON) and timelines (PNG)")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    b = sub.add_parser("bench", help="sweep sizes and strategies against the physical limit B")
    b.add_argument("--points", default=None,
                   help="comma-separated NxNTxEVERY points, e.g. 256x640x1,2048x320x8 "
                        "(default: the course sweep on a GPU, a small one on the CPU)")
    b.add_argument("--every-sweep", action="store_true",
                   help="also sweep the snapshot interval at 2048^2 x 320 (every 1..32)")
    b.add_argument("--strategies", default=None, help="comma-separated strategies (default: all available)")
    b.add_argument("--repeats", type=int, default=5, help="timed runs per strategy and point (default 5)")
    b.add_argument("--backend", choices=("auto", "gpu", "cpu"), default=None,
                   help="backend (default: $COURSE_HELPER_BACKEND or auto); on the CPU the sweep is "
                        "predicted by the modelled GPU")
    b.add_argument("--profile", default=None,
                   help="device profile the CPU backend models (default: $COURSE_HELPER_PROFILE or h200)")
    b.add_argument("--compute", action="store_true",
                   help="on the CPU backend, also compute the wavefields (default: predict times only)")
    b.add_argument("--out", default=None, help="folder for bench.json and bench.png")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    k = sub.add_parser("calibrate", help="measure this GPU's profile for the CPU backend's modelled GPU")
    k.add_argument("--out", required=True, help="the profile to write (JSON), e.g. my_gpu.json")
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
    from . import backend, bench, runtime

    if args.backend or args.profile:
        backend.set_backend(args.backend or os.environ.get(backend.ENV_VAR, "auto"), profile=args.profile)
    else:
        backend.backend_name()
    rt = runtime.get()
    predict = rt.modelled and not args.compute
    if predict:
        print(f"predicting the sweep on the {rt.device_label} (times only: the wavefields are not "
              "computed; pass --compute to compute them too)", file=sys.stderr)
    if args.points:
        points = _parse_points(args.points)
    else:
        points = list(bench.DEFAULT_POINTS if backend.backend_name() == "gpu" or predict else bench.QUICK_POINTS)
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
        with rt.times_only(predict):
            doc = bench.run_bench(points, strategies, repeats=args.repeats, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    clock = f" ({rt.device_label})" if rt.modelled else ""
    print(f"{doc['machine']['device']}{clock}, peak pinned D2H {doc['peak_d2h_gbps']:.1f} GB/s, "
          f"{args.repeats} repeats; B = the physical limit of each point")
    print(bench.table(doc))
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        print("wrote", bench.write_json(doc, os.path.join(args.out, "bench.json")))
        if any("strategies" in p for p in doc["points"]):
            bench.plot_bench(doc, os.path.join(args.out, "bench.png"))
            print("wrote", os.path.join(args.out, "bench.png"))
    agree = all(r["identical_to_sequential"] is not False for p in doc["points"] if "strategies" in p
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
    from . import backend, compare, runtime, wave
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
    label = runtime.time_label()
    print(f"{problem.n0}x{problem.n1} grid, {problem.nt} levels, every {args.every}, "
          f"{args.repeats} repeats, {backend.backend_name()} backend" + (f", times {label}" if label else ""))
    print(cmp.table())
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


def calibrate_main(args):
    import json

    from . import backend, calibrate, profiles
    from .timeline import write_atomically

    if backend.backend_name() != "gpu":
        raise RuntimeError("calibrate measures a real GPU, and this process runs on the CPU backend "
                           f"({backend.device_report()['device']}); run it on a machine with a CUDA GPU")
    folder = os.path.dirname(os.path.abspath(args.out))
    _check_out(folder)
    doc = profiles.validate(calibrate.calibrate(progress=lambda what: print("measuring", what, file=sys.stderr)))
    write_atomically(args.out, lambda f: json.dump(doc, f, indent=1))
    print(f"wrote {args.out}: {doc['provenance']['device']}, {doc['provenance']['date']}")
    return 0


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        if args.command == "compare":
            return compare_main(args)
        if args.command == "bench":
            return bench_main(args)
        if args.command == "calibrate":
            return calibrate_main(args)
    except (ValueError, TypeError, MemoryError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 2


def compare_entry():
    """Console-script alias: ``course-compare [options]``."""
    sys.exit(main(["compare", *sys.argv[1:]]))
