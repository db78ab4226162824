"""Command line: ``python -m course_helper compare`` (also installed as ``course-compare``).

Run it with::

    python -m course_helper compare --n 256 --nt 640 --repeats 3 --out results/
    python -m course_helper bench --out benchmarks/
    python -m course_helper run --store run.zarr --n 512 --nt 1000 --compress zstd
    python -m course_helper run --store run.zarr --n 1024 --strategy staged --batch 16 --compress gpu-zstd
    python -m course_helper calibrate --out my_gpu.json      (on a GPU)
    python -m course_helper preflight                        (is this machine ready for the course?)
    python -m course_helper grade submissions/*              (learners' notebooks, on the CPU backend)
    python -m course_helper doctor --out results/ my_loop.py --steps 8

It prints the comparison table, writes each strategy's Chrome trace (open it
in https://ui.perfetto.dev) and a PNG timeline to ``--out``, and exits with
status 1 if the strategies do not give identical images.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import struct
import sys
import termios
import textwrap
import time
from typing import TYPE_CHECKING, NoReturn, TextIO

import numpy as np

from .runtime import backend, interrupts, observe, profiles
from .runtime.ops import OpKind
from .measure import bench, calibrate, compare
from . import runtime, solver, timelines, timing, wave
from . import distributed as halo
from .distributed.launch import check_job
from . import disk
from .strategies import STRATEGIES
from .files import write_atomically
from . import grading, preflight

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from .runtime.observe import Op


#: What ``compare`` runs by default: the ladder of notebooks 5 to 7, one change per row.
LADDER = ("sequential", "sequential-pinned", "streams", "events")

#: Printed under the compare table, and in `compare --help`.
COMPARE_COLUMNS = """\
columns: median/min/max ms = host wall time of the untraced runs' loops, the device synchronised
  at the end (a graph's one-off capture not included); speedup = sequential median / this median;
  from one traced run (CUPTI on a GPU, the model on the CPU): compute ms = time a kernel ran,
  D2H ms = time a device-to-host copy ran, overlap ms = time both ran at once,
  hidden = overlap / the shorter of the two (100% = the shorter stage ran entirely under the other);
  max diff = largest absolute difference between this strategy's images and the sequential ones
  (0 = bit-identical)."""


def _first_sentence(doc):
    """The first sentence of a docstring, whole, on one line."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def _strategies_text():
    """Every registered strategy, each with a line on what it does (its ``help``, else the first
    sentence of its loop's docstring, so a strategy registered without one is listed too)."""
    width = max(len(name) for name in STRATEGIES)
    lines = [textwrap.fill(entry.help or _first_sentence(entry.loop.__doc__), width=98,
                           initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4))
             or f"  {name}"                    # a loop with no docstring: its name alone (fill drops it)
             for name, entry in STRATEGIES.items()]
    return "strategies:\n" + "\n".join(lines)


def _wrapped(text: str) -> str:
    """``text`` wrapped to a terminal's width, for help shown by the raw formatter (which keeps the
    strategies' table as it is laid out, and so wraps nothing itself)."""
    return textwrap.fill(text, width=min(shutil.get_terminal_size().columns, 100) - 2)


def _progress_bar(total: int, desc: str, unit: str):
    """A progress bar on stderr. On a terminal it is cleared when done; written to a file (or a pipe)
    its last frame is kept and ends its line, so that what the command prints next starts on a line
    of its own instead of after the frame."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=not sys.stderr.isatty())


def _parser():
    p = argparse.ArgumentParser(prog="python -m course_helper",
                                description="Overlapping GPU compute with IO: the course's headless tools. "
                                            "Run 'python3 -m course_helper COMMAND --help' for a command's options.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("compare", help="run the IO strategies on one size and compare them",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       # the raw formatter keeps the epilog's table as laid out; the prose is wrapped here
                       description=_wrapped("Run each strategy on one grid size, time it, check that its images "
                                            "are identical to the sequential loop's, and print a table. With --out, "
                                            "also write each strategy's trace (for https://ui.perfetto.dev) and a "
                                            "timeline picture. Exits with status 1 when a strategy's images differ."),
                       epilog=_strategies_text() + "\n\n" + COMPARE_COLUMNS)
    c.add_argument("--n", type=int, default=256, help="grid size N0 = N1 (default 256)")
    c.add_argument("--nt", type=int, default=None, help="number of time levels (default: the box-crossing time)")
    c.add_argument("--every", type=int, default=1, help="save every k-th level (default 1)")
    c.add_argument("--strategies", default=",".join(LADDER),
                   help="comma-separated strategies, from the list below (default: the ladder of notebooks "
                        f"5 to 7, {','.join(LADDER)})")
    c.add_argument("--repeats", type=int, default=3, help="timed runs per strategy (default 3)")
    c.add_argument("--backend", choices=backend.CHOICES, default=None,
                   help="backend (default: $COURSE_HELPER_BACKEND or auto)")
    c.add_argument("--out", default=None, help="folder for traces (JSON) and timelines (PNG)")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    b = sub.add_parser("bench", help="sweep sizes and strategies against the physical limit B",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=_wrapped("Time every strategy at several grid sizes and snapshot intervals and "
                                            "compare each with B, the physical limit of that point: max(compute-only "
                                            "time, output bytes / peak pinned device-to-host bandwidth). Prints a "
                                            "table; with --out, writes bench.json and bench.png."),
                       epilog=_strategies_text() + "\n\n" + _wrapped(
                           "columns: efficiency = B / median time (1 = the limit); speedup = sequential median / "
                           "this median; identical = the images equal the sequential ones."))
    b.add_argument("--points", default=None,
                   help="comma-separated NxNTxEVERY points, e.g. 256x640x1,2048x320x8 "
                        "(default: the course sweep; on the CPU backend its times are predicted by the "
                        "modelled GPU, and with --compute a small sweep is computed instead)")
    b.add_argument("--every-sweep", action="store_true",
                   help="also sweep the snapshot interval at 2048^2 x 320 (every 1..32)")
    b.add_argument("--strategies", default=None,
                   help="comma-separated strategies, from the list below (default: all that run on this backend)")
    b.add_argument("--repeats", type=int, default=5, help="timed runs per strategy and point (default 5)")
    b.add_argument("--backend", choices=backend.CHOICES, default=None,
                   help="backend (default: $COURSE_HELPER_BACKEND or auto); on the CPU the sweep is "
                        "predicted by the modelled GPU")
    b.add_argument("--profile", default=None,
                   help="device profile the CPU backend models (default: $COURSE_HELPER_PROFILE or h200)")
    b.add_argument("--compute", action="store_true",
                   help="on the CPU backend, also compute the wavefields (default: predict times only)")
    b.add_argument("--out", default=None, help="folder for bench.json and bench.png")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    b.add_argument("--disk", default=None, metavar="FOLDER",
                   help="instead: stream each point to stores under FOLDER and measure against "
                        "B = max(compute, bytes / D2H, bytes / disk); writes disk.json to --out")
    b.add_argument("--nscratch", default=None, metavar="K[,K...]",
                   help="ring depths (scratch buffers) to measure every point at, e.g. 5,8,12,16,20,24 "
                        "(default: each strategy's own)")
    _add_run_parser(sub)
    _halo_parser(sub)
    _doctor_parser(sub)

    k = sub.add_parser("calibrate", help="measure this GPU's profile for the CPU backend's modelled GPU",
                       description="Measure this GPU (kernels, copies, launch costs) and write its profile, "
                                   "which the CPU backend's modelled GPU then follows: "
                                   "COURSE_HELPER_PROFILE=PATH or bench --profile PATH. Needs a GPU.")
    k.add_argument("--out", required=True, help="the profile to write (JSON), e.g. my_gpu.json")
    preflight.add_preflight_parser(sub)
    grading.add_grade_parser(sub)
    return p


def _add_run_parser(sub):
    r = sub.add_parser("run", help="one headless run streamed to a Zarr store on disk",
                       description="Solve once and stream every saved level to a new Zarr v3 store "
                                   "(open it with xarray.open_zarr or plot_slices(PATH)).")
    r.add_argument("--store", required=True, help="path of the new store, e.g. run.zarr (must not exist)")
    r.add_argument("--n", type=int, default=256, help="grid size N0 = N1 (default 256)")
    r.add_argument("--nt", type=int, default=None, help="number of time levels (default: the box-crossing time)")
    r.add_argument("--every", type=int, default=1, help="save every k-th level (default 1)")
    r.add_argument("--strategy", default="events", help="sequential, streams, events or staged (default events)")
    r.add_argument("--compress", choices=[c for c in disk.CODECS if c is not None], default=None,
                   help="compress the chunks: zstd or blosc on the writer threads, gpu-zstd on the device before "
                        "they cross to the host (nvCOMP; pip install -e '.[nvcomp]'; modelled on the CPU backend); "
                        "default: none")
    r.add_argument("--batch", type=int, default=None,
                   help="levels per staging buffer, one chunk of the store (staged only; default about 4 MiB; "
                        "at most the run's saved levels)")
    r.add_argument("--backend", choices=backend.CHOICES, default=None,
                   help="backend (default: $COURSE_HELPER_BACKEND or auto)")
    r.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_main(args: argparse.Namespace) -> int:
    """``run``: one solve streamed to a new Zarr store, with a progress bar; returns the exit status."""
    if args.backend:
        backend.set_backend(args.backend)
    else:
        backend.backend_name()     # its banner on a line of its own, before the progress bar starts
    problem = wave.WaveProblem(n0=args.n, n1=args.n, nt=args.nt)
    nsaved = len(range(0, problem.nt, max(args.every, 1)))
    bar = None if args.no_progress else _progress_bar(nsaved, "levels to disk", "level")

    class Progress:                # counts the saved levels copied off the scratch buffers
        seen = set()

        def op_issued(self, op: Op) -> None:
            # Copies to the host, a staging buffer or a device slot.
            if op.kind in (OpKind.D2H, OpKind.D2D) and op.level is not None:
                levels = set(range(op.level, op.level + op.nbytes // problem.nbytes_level * args.every, args.every))
                bar.update(len(levels - self.seen))
                self.seen |= levels

    watcher = observe.add(Progress()) if bar is not None else None
    try:
        res = solver.solve(problem, args.strategy, every=args.every, trace=False, store=args.store,
                           compress=args.compress, batch=args.batch)
    finally:
        if watcher is not None:
            observe.remove(watcher)
            bar.close()
    stored = disk.open_store(args.store)
    raw = len(res.levels) * problem.nbytes_level
    clock, rate = (f" ({res.time_label} time)", " (modelled)") if res.time_label else ("", "")
    where = res.compression["where"] if args.compress else ""
    engine = {"device": " on the GPU", "modelled": " on the modelled GPU", "host": " on the host"}.get(where, "")
    print(f"{problem.n0}x{problem.n1} grid, {len(res.levels)} of {problem.nt} levels ({raw / 2**20:,.1f} MiB) "
          f"to {args.store} in {res.elapsed_ms:.0f} ms{clock} with {args.strategy!r} on the "
          f"{backend.backend_name()} backend: {raw / res.elapsed_ms / 1e6:.2f} GB/s{rate}, compression ratio "
          f"{raw / max(stored.stored_nbytes(), 1):.2f}{engine}, {int(stored.complete.sum())} levels complete")
    return 0


def _halo_parser(sub):
    h = sub.add_parser("halo", help="one solve split across MPI ranks (run it under mpiexec -n R)",
                       description="The wave problem decomposed along dimension 0 across the ranks of "
                                   "mpiexec, halos exchanged every step (NCCL between GPUs, MPI on the CPU). "
                                   "Example: mpiexec -n 2 python -m course_helper halo --check")
    h.add_argument("--n", type=int, default=256, help="grid size N0 = N1 (default 256)")
    h.add_argument("--nt", type=int, default=None, help="number of time levels (default: the box-crossing time)")
    h.add_argument("--every", type=int, default=1, help="save every k-th level (default 1)")
    h.add_argument("--strategy", choices=tuple(halo.STRATEGIES), default="overlap",
                   help="; ".join(f"{name}: {entry.help}" + (" (default)" if name == "overlap" else "")
                                  for name, entry in halo.STRATEGIES.items()))
    h.add_argument("--check", action="store_true",
                   help="gather on rank 0 and compare bit for bit with the single-device solve (exit 1 if they differ)")
    h.add_argument("--trace", action="store_true", help="record every rank's timeline (needs --out)")
    h.add_argument("--backend", choices=backend.CHOICES, default=None,
                   help="backend of every rank (default: $COURSE_HELPER_BACKEND or auto)")
    h.add_argument("--out", default=None,
                   help="folder for summary.json, images.npy (gathered levels) and trace.json (one process per rank)")


def _parse_points(text):
    if not text.strip():
        raise ValueError("--points is empty; give comma-separated NxNTxEVERY points, e.g. 256x640x1, "
                         "or leave --points out for the default sweep")
    points = []
    for item in text.split(","):
        try:
            n, nt, every = (int(v) for v in item.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"cannot read the point {item!r}; write points as NxNTxEVERY, e.g. 256x640x1") from None
        points.append((n, nt, every))
    return points


def bench_main(args: argparse.Namespace) -> int:
    """``bench``: the benchmark sweep (or ``--disk``: the runs streamed to disk); returns the exit status."""
    if args.backend or args.profile:
        backend.set_backend(args.backend or backend.requested(), profile=args.profile)
    else:
        backend.backend_name()
    if args.disk:
        if args.nscratch:
            raise ValueError("--nscratch sweeps the ring depth of the in-memory sweep; leave it out with --disk")
        return _disk_bench(args)
    nscratch = bench.parse_nscratch(args.nscratch) if args.nscratch else None
    rt = runtime.get()
    predict = rt.predicts_times and not args.compute
    if predict:
        print(f"predicting the sweep on the {rt.device_label} (times only: the wavefields are not "
              "computed; pass --compute to compute them too)", file=sys.stderr)
    if args.points is not None:
        points = _parse_points(args.points)
    else:
        # The quick sweep where the model computes every wavefield in NumPy: the full one on a
        # device that measures its times, or where the model predicts them without computing.
        points = list(bench.QUICK_POINTS if rt.predicts_times and not predict else bench.DEFAULT_POINTS)
    if args.every_sweep:
        points += [p for p in bench.EVERY_POINTS if p not in points]
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else None
    if args.out:
        _check_out(args.out)
    bar = (None if args.no_progress else
           _progress_bar(2 * len(points) * len(nscratch or [None]), "points (untraced, then traced)", "pass"))

    def progress(point, stage):
        if "skipped" in point and stage == "untraced":
            print(f"skipped {point['n']}^2x{point['nt']} every {point['every']}: {point['skipped']}",
                  file=sys.stderr)
        if bar is not None:
            bar.update(1)

    try:
        with rt.times_only(predict):
            doc = bench.run_bench(points, strategies, repeats=args.repeats, progress=progress, nscratch=nscratch)
    finally:
        if bar is not None:
            bar.close()
    clock = f" ({rt.clock_label})" if rt.clock_label else ""
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
    if all("skipped" in p for p in doc["points"]):
        print("ERROR: every point was skipped (see why above), so nothing was measured; choose points that fit "
              "this machine with --points", file=sys.stderr)
        return 1
    agree = all(r["identical_to_sequential"] is not False for p in doc["points"] if "strategies" in p
                for r in p["strategies"].values())
    if not agree:
        print("ERROR: some strategy did not reproduce the sequential images", file=sys.stderr)
        return 1
    return 0


def _disk_bench(args):
    points = _parse_points(args.points) if args.points is not None else bench.DISK_POINTS
    bench.check_disk_folder(args.disk)           # before anything is measured
    if args.out:
        _check_out(args.out)
    strategies = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else ("events", "staged")
    peak = bench.peak_d2h_gbps()
    doc = {"machine": bench.machine_info(), "peak_d2h_gbps": peak, "repeats": args.repeats,
           "definition": "B = max(compute-only ms, bytes / peak pinned D2H, bytes / sustained disk write "
                         "bandwidth). The sustained disk bandwidth is measured right before the first "
                         "uncompressed run of a strategy and right after each one: the run's bytes, in files "
                         "of its chunk size, from as many writer threads, each fsync'ed (runs[].disk_gbps). "
                         "An uncompressed run's efficiency is the median over its repeats of B / time, each "
                         "repeat's B with the mean of the measurements just before and after it "
                         "(runs[].bound_ms); the point's disk_gbps and bound_ms take the median of all "
                         "measurements, and a compressed run's efficiency is that B / its median time. "
                         "disk_burst_gbps is a 256 MiB burst, reported only. gpu-zstd runs compress each chunk "
                         "on the device (one nvCOMP call per chunk; the staged run ships chunks of about 128 MiB, "
                         "runs[].batch levels): runs[].compression says where, and the compression's own GB/s "
                         "(raw bytes / the time compressing, as the host saw it, or modelled)",
           "points": [bench.disk_point(n, nt, every, args.disk, strategies, repeats=args.repeats, peak_gbps=peak)
                      for n, nt, every in points]}
    for p in doc["points"]:
        print(f"{p['n']}^2 x {p['nt']} every {p['every']}: {p['output_bytes'] / 1e9:.2f} GB, disk "
              f"{p['disk_gbps']:.2f} GB/s sustained ({p['disk_burst_gbps']:.2f} burst), B = {p['bound_ms']:.0f} ms "
              f"({p['bound_by']})")
        for r in p["runs"]:
            c = r.get("compression") or {}
            device = (f", compressed on the {c['where']} at {c['gbps']:.1f} GB/s ({r['batch']} levels a chunk)"
                      if "gbps" in c else f", compressed on the {c['where']}" if c else "")
            print(f"  {r['strategy']:>8} {str(r['compress']):>8}: {r['median_ms']:8.0f} ms, efficiency "
                  f"{r['efficiency']:.2f}, ratio {r['ratio']:.2f}, {r['write_gbps']:.2f} GB/s{device}")
    if args.out:
        print("wrote", bench.write_json(doc, os.path.join(args.out, "disk.json")))
    return 0


def _check_out(folder):
    """Make sure the output folder exists and is writable before any run starts."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"--out {folder} is a file, not a folder; give a folder for the results "
                                 "(it is created if missing)")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise type(exc)(f"cannot create the output folder {folder}: {exc.strerror or exc}; "
                        "choose another with --out") from None
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"the output folder {folder} is not writable; choose another with --out")


def compare_main(args: argparse.Namespace) -> int:
    """``compare``: every strategy on one problem, the table, and (``--out``) traces and timelines;
    returns the exit status (1 when the strategies' images differ)."""
    if args.backend:
        backend.set_backend(args.backend)
    else:
        backend.backend_name()
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    problem = wave.WaveProblem(n0=args.n, n1=args.n, nt=args.nt)
    if args.out:
        _check_out(args.out)
    total = (len(set(names) | {"sequential"})) * args.repeats
    bar = None if args.no_progress else _progress_bar(total, "runs", "run")
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
    print(COMPARE_COLUMNS)
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        def save(fig: Any, png: str) -> None:
            write_atomically(png, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
            plt.close(fig)

        for name, res in cmp.results.items():
            path = res.trace.to_chrome_json(os.path.join(args.out, f"trace_{name}.json"))
            fig, ax = plt.subplots(figsize=(11, 0.5 * len(res.trace.tracks) + 1.6), layout="constrained")
            res.trace.plot(ax=ax, title=f"{name}: whole run")
            png = os.path.join(args.out, f"timeline_{name}.png")
            save(fig, png)
            print(f"wrote {path} and {png}")
        # The same few levels of every strategy on one time axis, as notebook 7 draws them: each
        # panel holds the same work, and what lies past a panel's levels is faded.
        mid = problem.nt // 2
        levels = (mid, min(mid + 4, problem.nt - 1))
        axes = timelines.plot_compared(cmp.results, levels=levels)
        png = os.path.join(args.out, "timeline_levels.png")
        save(axes[0].figure, png)
        print(f"wrote {png} (levels {levels[0]} to {levels[1]} of each strategy, one time axis)")
    if not cmp.agree:
        print("ERROR: the strategies do not give identical images", file=sys.stderr)
        return 1
    print("all strategies gave identical images")
    return 0


def halo_main(args: argparse.Namespace) -> int:
    """One decomposed solve on the ranks of ``mpiexec``; rank 0 prints, gathers and checks.

    A Ctrl-C (SIGINT, to one rank or to ``mpiexec``, which passes it on) only marks the rank
    interrupted; it is raised at a safe point (the end of a level, a turn of the modelled device;
    never inside a halo exchange, whose receives are posted into buffers it would let go), and
    the rank then says so and aborts the whole job."""
    if args.backend:
        backend.request(args.backend)      # chosen on first use: the team picks its GPU before that
    with interrupts.deferred():
        world = halo.world()
        try:
            problem = wave.WaveProblem(n0=args.n, n1=args.n, nt=args.nt)
            check_job(problem, world.Get_size(), args.every)
            if args.trace and not args.out:
                raise ValueError("--trace writes trace.json into the --out folder; give --out")
            if args.out:
                _check_out(args.out)
        except (ValueError, TypeError, OSError):
            if world.Get_rank():
                return 2      # every rank finds the same mistake: rank 0 alone says it, on a line of its own
            raise
        # Rank 0 speaks for the job: the other ranks' lines (the backend's banner) would repeat
        # it, run together with it on the shared stdout. Their errors still go to stderr.
        try:
            with contextlib.ExitStack() as quiet:
                if world.Get_rank():
                    quiet.enter_context(contextlib.redirect_stdout(quiet.enter_context(open(os.devnull, "w"))))
                return _halo_ranks(args, problem)
        except BaseException as exc:
            # Anything that ends one rank early - an error, Ctrl-C, sys.exit - must end them all:
            # the others would wait for its halo rows for ever. (Still inside the deferred block:
            # a Ctrl-C now cannot stop the rank before it has aborted the job.)
            if world.Get_size() > 1:
                what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
                print(f"error on rank {world.Get_rank()}: {what}; stopping every rank", file=sys.stderr, flush=True)
                _until_read(sys.stderr)
                world.Abort(130 if isinstance(exc, KeyboardInterrupt) else 2)
            raise


def _until_read(stream: TextIO, seconds: float = 2.0) -> None:
    """Wait, at most ``seconds``, until what was written to ``stream`` has left its pipe. A rank's
    stderr is a pipe that mpiexec reads and relays; an abort ends that relay at once, and a line
    still in the pipe then (the rank's last words: why it stopped the job) is lost."""
    try:
        fd = stream.fileno()
        deadline = timing.wall_ms() + seconds * 1e3
        while struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] and timing.wall_ms() < deadline:
            time.sleep(0.005)
    except (OSError, ValueError, AttributeError):
        pass               # not a pipe (a file, a terminal) or no fileno: nothing waits to be read


def _halo_ranks(args, problem):
    team = halo.Team()
    res = halo.run_rank(team, problem, args.strategy, every=args.every, trace=args.trace)
    images = halo.gather(team, res, problem) if (args.check or args.out) else None
    traces = team.comm.gather(res.trace, root=0)
    rank_ms = team.comm.gather(res.elapsed_ms, root=0)
    identical = None
    if args.check and team.rank == 0:
        single = solver.solve(problem, strategy="events", every=args.every, trace=False)
        identical = bool(np.array_equal(images.view(np.uint32), single.images.view(np.uint32)))
    if team.rank != 0:
        return 0
    label, link = runtime.time_label(), halo.link_note()
    summary = {"ranks": team.size, "strategy": args.strategy, "n0": problem.n0, "n1": problem.n1,
               "nt": problem.nt, "every": args.every, "backend": team.backend, "device": team.device,
               "elapsed_ms": max(rank_ms), "rank_ms": rank_ms, "identical": identical, "time_label": label,
               "link_note": link}
    clock = f" ({label} time; {link})" if label else ""
    print(f"{problem.n0}x{problem.n1} grid, {problem.nt} levels on {team.size} ranks ({team.backend}, "
          f"{args.strategy}): {max(rank_ms):.1f} ms{clock}")
    if args.out:
        out = args.out
        write_atomically(os.path.join(out, "images.npy"), lambda f: np.save(f, images), binary=True)
        if args.trace:
            doc = halo.chrome_trace(traces)
            write_atomically(os.path.join(out, "trace.json"), lambda f: json.dump(doc, f), binary=False)
        write_atomically(os.path.join(out, "summary.json"), lambda f: json.dump(summary, f, indent=1), binary=False)
    if identical is False:
        print("ERROR: the decomposed result differs from the single-device solve", file=sys.stderr)
        return 1
    if identical:
        print(f"identical to the single-device solve, bit for bit ({len(res.levels)} levels)")
    return 0


def calibrate_main(args: argparse.Namespace) -> int:
    """``calibrate``: measure this GPU and write its profile for the modelled device; returns the exit status."""
    if runtime.get().predicts_times:
        raise RuntimeError("calibrate measures a real GPU, and this process runs on the CPU backend "
                           f"({backend.device_report()['device']}); run it on a machine with a CUDA GPU")
    folder = os.path.dirname(os.path.abspath(args.out))
    _check_out(folder)
    doc = profiles.validate(calibrate.calibrate(progress=lambda what: print("measuring", what, file=sys.stderr)))
    write_atomically(args.out, lambda f: json.dump(doc, f, indent=1), binary=False)
    print(f"wrote {args.out}: {doc['provenance']['device']}, {doc['provenance']['date']}")
    return 0


def _doctor_parser(sub):
    d = sub.add_parser("doctor", help="run a script under the overlap doctor and say why it does not overlap",
                       description="Run SCRIPT (with ARGS as its sys.argv) under the overlap doctor "
                                   "(ch.doctor(), docs/doctor.md) and print its report: what ran, how much "
                                   "of the copying ran under kernels, and each finding with the time it cost, "
                                   "the fix and the script's line. On a GPU it measures any CuPy code with "
                                   "CUPTI; on the CPU backend, code written with the helper's API, modelled.")
    d.add_argument("--out", default=None, help="folder for the timeline (doctor_trace.json, for "
                                               "https://ui.perfetto.dev) and the records (doctor_records.json)")
    d.add_argument("--backend", choices=backend.CHOICES, default=None,
                   help="backend (default: $COURSE_HELPER_BACKEND or auto)")
    d.add_argument("script", help="the Python script to run")
    d.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


def doctor_main(args: argparse.Namespace) -> int:
    """``doctor``: run the script under the doctor (as ``python SCRIPT ARGS`` would, through runpy),
    print the report, write the trace and records to ``--out``. Returns the script's exit status as
    Python would give it: its ``sys.exit`` code (1 for a message, printed on stderr), 1 when it
    raised (its traceback on stderr, from the script's own frames), else 0. The report covers what
    the script did until it ended, however it ended."""
    import runpy

    from .timelines import doctor

    if not os.path.isfile(args.script):
        raise FileNotFoundError(f"no script at {args.script}: give the path of a Python file to run under the doctor")
    if args.out:
        _check_out(args.out)
    if args.backend:
        backend.set_backend(args.backend)
    status, argv, path = 0, sys.argv, list(sys.path)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    try:
        with doctor() as dx:
            try:
                runpy.run_path(args.script, run_name="__main__")
            except SystemExit as exc:             # the script's own exit: its status, and the report
                status = _exit_status(exc)
            except Exception as exc:  # noqa: BLE001 - the script's error: its traceback, then the report
                _print_script_error(exc, args.script)
                status = 1
    finally:
        sys.argv, sys.path[:] = argv, path
    print(dx.report())
    if args.out:
        print(f"timeline: {dx.trace.to_chrome_json(os.path.join(args.out, 'doctor_trace.json'))}")
        print(f"records: {dx.records.save(os.path.join(args.out, 'doctor_records.json'))}")
    if status:
        print(f"the script ended with exit status {status}; the report covers what it did until then",
              file=sys.stderr)
    return status


def _exit_status(exc: SystemExit) -> int:
    """The exit status Python gives ``sys.exit(code)``: the number, 0 for None, else 1 with the
    code printed on stderr (``sys.exit("bad input")``)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _print_script_error(exc: BaseException, script: str) -> None:
    """Print the script's traceback on stderr as Python would, from the script's first frame on
    (the doctor's and runpy's frames around it are not the learner's)."""
    import traceback

    tb, mine = exc.__traceback__, os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != mine:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: the process's arguments); returns the exit status
    (2 for bad input, with the error on stderr)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "compare":
            return compare_main(args)
        if args.command == "bench":
            return bench_main(args)
        if args.command == "halo":
            return halo_main(args)
        if args.command == "run":
            return run_main(args)
        if args.command == "calibrate":
            return calibrate_main(args)
        if args.command == "preflight":
            return preflight.preflight_main(args)
        if args.command == "grade":
            return grading.grade_main(args)
        if args.command == "doctor":
            return doctor_main(args)
    except (ValueError, TypeError, MemoryError, OSError, RuntimeError, ImportError) as exc:
        print(f"error: {_with_notes(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"interrupted (Ctrl-C){': ' + _with_notes(exc) if _with_notes(exc) else ''}", file=sys.stderr)
        return 130                               # 128 + SIGINT, as a shell reports a Ctrl-C
    return 2


def _with_notes(exc: BaseException) -> str:
    """An error's message and its notes (what a store keeps, ...), in one line (an OSError's own
    words, which name the file, without its errno and file name repeated around them)."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return "; ".join(" ".join(str(part).split()) for part in (text, *getattr(exc, "__notes__", ())) if str(part))


def compare_entry() -> NoReturn:
    """Console-script alias: ``course-compare [options]``."""
    sys.exit(main(["compare", *sys.argv[1:]]))
