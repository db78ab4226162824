"""The streamed run against the disk, round by round, on a GPU.

Five rounds (``--rounds``) at 1024² x 320, every level streamed (4 MiB chunks, 4 writers); each
round: the disk measured as ``bench --disk`` measures it (files of one chunk from one buffer, 4
threads, fsync'ed), an events run to a store, the same measurement writing from six different
buffers, then from six pinned buffers (a run writes from the slots of its ring), and a staged run.
Every figure is GB/s of the run's 1.34 GB; a run's figure over the disk's is its efficiency
against the disk-bound B (compute and copies take a few per cent of the disk's time here).

    python -m benchmarks.disk_rounds FOLDER --out benchmarks/disk_rounds.json
"""
import argparse
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

import course_helper as ch
from course_helper import disk


def write_rate(folder, nbytes, chunk, buffers):
    """The disk as ``bench --disk`` measures it (fsync'ed files of one chunk, its writer threads),
    file i written from ``buffers[i % len(buffers)]``."""
    os.sync()
    return disk.measure_disk_bandwidth(folder, mib=nbytes / 2**20, chunk_mib=chunk / 2**20, buffers=buffers)


def run_rate(folder, problem, strategy, nbytes):
    work = tempfile.mkdtemp(dir=folder)
    os.sync()
    try:
        r = ch.solve(problem, strategy, trace=False, store=os.path.join(work, "s.zarr"))
    finally:
        shutil.rmtree(work)
    return nbytes / (r.elapsed_ms * 1e-3) / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a folder on the disk to measure")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    problem = ch.WaveProblem(n0=1024, n1=1024, nt=320)
    chunk, nbytes = problem.nbytes_level, problem.nbytes_level * problem.nt
    rng = np.random.default_rng(0)
    one = [rng.integers(0, 255, chunk, dtype=np.uint8)]
    six = [rng.integers(0, 255, chunk, dtype=np.uint8) for _ in range(6)]
    pinned = [ch.pinned_empty((chunk,), np.uint8) for _ in range(6)]
    for p, a in zip(pinned, six):
        p[:] = a
    steps = {"probe_one": lambda: write_rate(args.folder, nbytes, chunk, one),
             "events": lambda: run_rate(args.folder, problem, "events", nbytes),
             "probe_six": lambda: write_rate(args.folder, nbytes, chunk, six),
             "probe_six_pinned": lambda: write_rate(args.folder, nbytes, chunk, pinned),
             "staged": lambda: run_rate(args.folder, problem, "staged", nbytes)}
    steps["events"]()                                   # warm-up
    res = {name: [] for name in steps}
    for i in range(args.rounds):
        for name, step in steps.items():
            res[name].append(step())
        print(i, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
    print("medians (GB/s):", {k: round(float(np.median(v)), 3) for k, v in res.items()})
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
