"""Compression on the GPU while computing (``compress="gpu-zstd"``): is it right, and how fast is it
against zstd on the writer threads?

One run on one GPU (under 3 minutes), at 1024² x 320 with every level saved (1.34 GB):

* ``timing``: in one process, round after round, the events loop streamed raw, the events loop
  with zstd on 4 writer threads (the issue's baseline), and the GPU-compressed runs (nvCOMP zstd
  on the device): the staged loop with 32 levels (128 MiB) per chunk (and 16), and the events loop with one
  level per chunk; each run's store deleted before the next one starts. The goal: the
  GPU-compressed staged run takes at most 0.35 of the host-zstd run's time (medians);
* ``readback``: the GPU-compressed store read back through ``ch.open_store``, ``zarr.open`` and
  ``xarray.open_zarr``, compared bit for bit with the in-memory solve, and its peaks;
* ``fit``: the device compression's own time per chunk at 32 levels and at 1 level per call,
  fitted as latency + bytes / bandwidth: the figures of the profile's ``compress`` section.

Each part runs in a child process with a time limit of its own: a part that fails prints its
error and the rest still run; one that hangs is killed at its limit and the next part starts in
a new process. The table and the JSON name every part's result or error.

    python -m benchmarks.gpu_compress_check --out benchmarks/gpu_compress.json [--disk /tmp]

Needs a GPU with CuPy and nvCOMP (``pip install -e '.[nvcomp]'``: nvidia-nvcomp-cu13).
``--backend cpu --n 128 --nt 48`` tries the script itself on the CPU backend (modelled times).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

N, NT, BATCH = 1024, 320, 32      # BATCH: ch.disk.device_batch at 1024² (128 MiB of levels per call)
#: part -> (seconds it may take, what it measures)
PARTS = {
    "setup": (60, "the device, nvCOMP, Zarr and a small GPU-compressed run (kernel and codec set up)"),
    "timing": (120, "raw, host zstd and GPU zstd runs, 3 rounds, one process"),
    "readback": (90, "the GPU-compressed store read back through the course, Zarr and xarray"),
    "fit": (60, "the device compression's time per chunk, 32 levels and 1 level per call"),
}
ROUNDS = 3
#: (label, strategy, compress, batch) of the timed runs
RUNS = [("raw, events", "events", None, None), ("host zstd, events", "events", "zstd", None),
        (f"gpu-zstd, staged x{BATCH}", "staged", "gpu-zstd", BATCH), ("gpu-zstd, staged x16", "staged", "gpu-zstd", 16),
        ("gpu-zstd, events", "events", "gpu-zstd", None)]


def _problem(ch):
    return ch.WaveProblem(n0=SIZE["n"], n1=SIZE["n"], nt=SIZE["nt"])


SIZE = {"n": N, "nt": NT}       # (set from the command line in a child process)


def _streamed(ch, folder, strategy, compress, batch, keep=False):
    """One run streamed to a new store under ``folder``; the store is deleted unless ``keep``."""
    work = tempfile.mkdtemp(dir=folder)
    os.sync()
    try:
        r = ch.solve(_problem(ch), strategy, trace=False, store=os.path.join(work, "s.zarr"), compress=compress,
                     batch=batch)
        stored = ch.disk.open_store(r.store).stored_nbytes()
        if compress == "gpu-zstd" and r.compression["where"] not in ("device", "modelled"):
            raise RuntimeError(f"the chunks were not compressed on the GPU: {r.compression['why']}")
        return r, stored, work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def part_setup(ch, folder):
    import numcodecs
    import zarr
    from course_helper.disk import compression
    nvcomp = compression.nvcomp_module() if ch.backend_name() == "gpu" else None
    small = ch.WaveProblem(n0=256, n1=256, nt=64)
    work = tempfile.mkdtemp(dir=folder)
    try:
        r = ch.solve(small, "staged", trace=False, store=os.path.join(work, "s.zarr"), compress="gpu-zstd", batch=16)
        ok = np.array_equal(ch.disk.open_store(r.store).images[:], ch.solve(small, "events", trace=False).images)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"device": ch.device_report()["device"], "nvcomp": getattr(nvcomp, "__version__", "?"),
            "zarr": zarr.__version__, "numcodecs": numcodecs.__version__, "cupy": ch.device_report()["cupy"],
            "disk_folder": str(folder), "small_run": {"where": r.compression["where"], "identical": ok}}


def part_timing(ch, folder):
    raw = _problem(ch).nt * _problem(ch).nbytes_level
    times = {label: [] for label, *_ in RUNS}
    extra = {}
    for turn in ("warm-up", *range(ROUNDS)):
        for label, strategy, compress, batch in RUNS:
            try:
                r, stored, _ = _streamed(ch, folder, strategy, compress, batch)
            except Exception as exc:  # noqa: BLE001 - one run's failure is reported, the others still run
                extra.setdefault(label, {})["error"] = f"{type(exc).__name__}: {exc}"
                continue
            if turn != "warm-up":
                times[label].append(r.elapsed_ms)
            extra[label] = {"ratio": raw / stored, "compression": r.compression}
    rows = {label: {"times_ms": t, "median_ms": float(np.median(t)) if t else None, **extra.get(label, {})}
            for label, t in times.items()}
    host, gpu = rows["host zstd, events"]["median_ms"], rows[f"gpu-zstd, staged x{BATCH}"]["median_ms"]
    goal = {"gpu_over_host_zstd": gpu / host if host and gpu else None, "at_most": 0.35}
    goal["met"] = goal["gpu_over_host_zstd"] is not None and goal["gpu_over_host_zstd"] <= 0.35
    return {"output_bytes": raw, "rounds": ROUNDS, "runs": rows, "goal": goal}


def part_readback(ch, folder):
    import xarray as xr
    import zarr
    ref = ch.solve(_problem(ch), "events", trace=False).images
    r, stored, work = _streamed(ch, folder, "staged", "gpu-zstd", BATCH, keep=True)
    try:
        opened = ch.disk.open_store(r.store)
        readers = {"ch.open_store": lambda: opened.images[:],
                   "zarr.open": lambda: zarr.open_array(os.path.join(r.store, "u"), mode="r")[:],
                   "xarray.open_zarr": lambda: xr.open_zarr(r.store)["u"].values}
        same = {}
        for name, read in readers.items():
            got = read()
            same[name] = bool(got.shape == ref.shape and np.array_equal(got.view(np.uint32), ref.view(np.uint32)))
            del got
        peaks = bool(np.array_equal(opened.group["peak"][:], np.abs(ref).max(axis=(1, 2))))
        return {"bit_identical": same, "complete": int(opened.complete.sum()), "levels": len(ref),
                "peaks_identical": peaks, "stored_bytes": stored, "ratio": ref.nbytes / stored,
                "shards": opened.images.shards, "inner_chunks": opened.images.chunks}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def part_fit(ch, folder):
    per_chunk = {}
    for levels, strategy, batch in ((BATCH, "staged", BATCH), (1, "events", None)):
        ms = []
        for _ in range(3):
            r, _, _ = _streamed(ch, folder, strategy, "gpu-zstd", batch)
            ms.append(r.compression["busy_ms"] / r.compression["chunks"])
        per_chunk[levels] = float(np.median(ms))
    nbytes = _problem(ch).nbytes_level
    big, small = per_chunk[BATCH], per_chunk[1]
    gbps = (BATCH - 1) * nbytes / (big - small) / 1e6 if big > small else float("inf")
    latency_us = (small - nbytes / (gbps * 1e6)) * 1e3
    return {"ms_per_chunk": {str(k): v for k, v in per_chunk.items()}, "level_bytes": nbytes,
            "profile_compress_zstd": {"gbps": round(gbps, 1), "latency_us": round(latency_us, 1)},
            "note": "time compressing a chunk as the host saw it (waiting for the copy excluded, the compressed "
                    "sizes read back included), median of 3 runs each"}


def _child(parts, folder, backend):
    import course_helper as ch
    ch.set_backend(backend)
    for name in parts:
        t0 = time.perf_counter()
        try:
            out = {"part": name, "result": globals()[f"part_{name}"](ch, folder)}
        except Exception as exc:  # noqa: BLE001 - reported; the next part runs
            out = {"part": name, "error": f"{type(exc).__name__}: {exc}"}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        print("PART " + json.dumps(out, default=str), flush=True)


def _run_parts(parts, folder, options):
    """Run ``parts`` in child processes, each part within its time limit; returns {part: entry}."""
    done, todo = {}, list(parts)
    while todo:
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_compress_check", "--child", ",".join(todo),
                                  "--disk", str(folder), *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        lines = queue.SimpleQueue()
        threading.Thread(target=lambda: [lines.put(x) for x in child.stdout] + [lines.put(None)], daemon=True).start()
        errors = []
        threading.Thread(target=lambda: errors.extend(child.stderr), daemon=True).start()
        while todo:
            name = todo[0]
            deadline = time.monotonic() + PARTS[name][0]
            line = ""
            while line is not None and not line.startswith("PART "):
                try:
                    line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    line = "timeout"
                    break
            if line is None or line == "timeout":
                child.kill()
                child.wait()
                why = (f"took longer than its limit of {PARTS[name][0]} s and was stopped" if line == "timeout"
                       else f"its process ended (exit status {child.poll()}): {''.join(errors[-3:]).strip()[-500:]}")
                done[name] = {"part": name, "error": why}
                print(f"{name}: {why}", flush=True)
                todo.pop(0)
                break                                    # the next parts start in a new process
            entry = json.loads(line[5:])
            done[entry["part"]] = entry
            print(f"{entry['part']}: {'error: ' + entry['error'] if 'error' in entry else 'done'} "
                  f"({entry['seconds']} s)", flush=True)
            todo.remove(entry["part"])
        else:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    return done


def _table(doc):
    lines = []
    timing = doc["parts"].get("timing", {}).get("result")
    if timing:
        size = f"{doc['size']['n']}^2 x {doc['size']['nt']}"
        lines.append(f"{'run (' + size + ', every level)':<28} {'median ms':>10} {'ratio':>7}  compressed")
        for label, row in timing["runs"].items():
            c = row.get("compression") or {}
            where = f"{c.get('where', '')} {c.get('gbps', 0):.1f} GB/s" if "gbps" in c else c.get("where", "")
            med = f"{row['median_ms']:10.1f}" if row.get("median_ms") else f"{'-':>10}"
            lines.append(f"{label:<28} {med} {row.get('ratio', 0):7.1f}  {where} {row.get('error', '')}")
        g = timing["goal"]
        if g["gpu_over_host_zstd"] is not None:
            lines.append(f"GPU zstd (staged x{BATCH}) / host zstd (events): {g['gpu_over_host_zstd']:.3f} "
                         f"(goal: at most {g['at_most']}) -> {'met' if g['met'] else 'NOT met'}")
    back = doc["parts"].get("readback", {}).get("result")
    if back:
        lines.append(f"read back bit-identical: {back['bit_identical']}; peaks identical: {back['peaks_identical']}; "
                     f"{back['complete']}/{back['levels']} complete; ratio {back['ratio']:.1f}")
    fit = doc["parts"].get("fit", {}).get("result")
    if fit:
        lines.append(f"device compression per chunk: {fit['ms_per_chunk']} ms -> profile compress.zstd "
                     f"{fit['profile_compress_zstd']}")
    for name, entry in doc["parts"].items():
        if "error" in entry:
            lines.append(f"{name}: ERROR {entry['error']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--disk", default=tempfile.gettempdir(), help="folder the stores are written under")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts (default: {','.join(PARTS)})")
    parser.add_argument("--backend", default="gpu", choices=("gpu", "cpu"), help="gpu (default), or cpu to try the "
                        "script itself on the modelled GPU (with a small --n and --nt)")
    parser.add_argument("--n", type=int, default=N, help=f"grid size (default {N})")
    parser.add_argument("--nt", type=int, default=NT, help=f"time levels, every one saved (default {NT})")
    parser.add_argument("--child", help=argparse.SUPPRESS)        # the parts one child process runs
    args = parser.parse_args(argv)
    SIZE.update(n=args.n, nt=args.nt)
    if args.child:
        _child(args.child.split(","), args.disk, args.backend)
        return 0
    parts = [p.strip() for p in args.parts.split(",")]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    t0 = time.perf_counter()
    options = ["--backend", args.backend, "--n", str(args.n), "--nt", str(args.nt)]
    doc = {"what": __doc__.split("\n\n")[1], "size": dict(SIZE), "backend": args.backend,
           "parts": _run_parts(parts, args.disk, options), "seconds": round(time.perf_counter() - t0, 1)}
    print(_table(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
