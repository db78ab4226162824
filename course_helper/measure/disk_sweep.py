"""The disk sweep: runs streamed to a store, against the bound with the disk in it.

    python -m course_helper bench --disk FOLDER
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING

import numpy as np

from .. import runtime
from ..disk import DEFAULT_WRITERS, SHARDED, codec_speed, device_batch, measure_disk_bandwidth, open_store
from ..solver import chunk_levels, plan_memory, solve
from ..wave import WaveProblem, saved_levels
from .limit import compute_only_ms, peak_d2h_gbps

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["DISK_POINTS", "check_disk_folder", "disk_bandwidth", "disk_point"]


#: (n, nt, every) of the disk points: about 1.3 GB of output each.
DISK_POINTS = [(1024, 320, 1), (2048, 320, 4)]


def _settle():
    # Flush what earlier deletions left to the disk (a file system mounted with `discard` trims
    # freed blocks at its next commit), so that neither a run nor a measurement pays for what
    # came before it.
    if hasattr(os, "sync"):
        os.sync()


def check_disk_folder(folder: str | os.PathLike) -> str | os.PathLike:
    """Refuse a folder the disk points cannot write their stores into (before measuring anything)."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"the disk folder must be a path, got {type(folder).__name__}")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"the disk folder {folder} does not exist (or is not a folder); create it "
                                "on the disk to measure, or give another")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"the disk folder {folder} is not writable; give a folder on the disk to measure")
    return folder


def disk_bandwidth(where: str | os.PathLike, mib: float, chunk_mib: float) -> float:
    """The disk's sustained write bandwidth in GB/s under ``where``, as a streamed run uses it
    (``mib`` MiB in files of ``chunk_mib``, :data:`DEFAULT_WRITERS` threads, fsync'ed);
    on the CPU backend the modelled disk's."""
    modelled = runtime.get().predicted_disk_gbps()
    if modelled is not None:
        return modelled
    _settle()
    return measure_disk_bandwidth(where, mib=mib, chunk_mib=chunk_mib, writers=DEFAULT_WRITERS)


def disk_point(n: int, nt: int, every: int, folder: str | os.PathLike,
               strategies: Sequence[str] = ("events", "staged"),
               compress: Sequence[str | None] = (None, "zstd", "blosc", "gpu-zstd"), repeats: int = 3,
               peak_gbps: float | None = None) -> dict:
    """One run streamed to a store under ``folder``, against the bound with the disk in it:
    B = max(compute-only, bytes / peak D2H, bytes / sustained disk bandwidth).

    The disk is measured the way the run uses it: the same bytes in files of the run's chunk
    size from the same number of writer threads, each fsync'ed, right before the first
    uncompressed run of a strategy and right after each one, once that run's store is deleted
    (``disk_gbps`` of each run entry: one more measurement than runs). A disk's speed drifts from one second to the
    next, so each run is held against the disk as it was on both sides of it: its own B
    takes the mean of the measurements just before and just after it, and the run's
    ``efficiency`` is the median over its repeats of that B / its time. The point's
    ``disk_gbps`` and ``bound_ms`` (the median of all measurements) are what the table shows,
    and what the compressed runs are held against. A short burst (256 MiB) measured first is
    reported as ``disk_burst_gbps``: a disk may take a burst faster than it sustains, and a
    burst would make B too optimistic. On the CPU backend the disk is the modelled one (the
    profile's ``disk`` section).

    ``"gpu-zstd"`` compresses on the device (one nvCOMP call per chunk): its staged run ships
    chunks of about 128 MiB (:func:`course_helper.disk.device_batch`), its events run one level
    per chunk as the loop hands them over; its entry adds ``compression`` (where, and the
    compression's own speed: :meth:`course_helper.disk.DiskSink.compression_summary`) and
    ``batch``."""
    check_disk_folder(folder)
    problem = WaveProblem(n0=n, n1=n, nt=nt)
    nbytes = plan_memory(problem, "sequential", every)["host"]
    level_mib = problem.nbytes_level / 2**20
    point = {"n": n, "nt": nt, "every": every, "output_bytes": nbytes, "writers": DEFAULT_WRITERS,
             "disk_burst_gbps": disk_bandwidth(folder, min(256, nbytes / 2**20), level_mib),
             "peak_d2h_gbps": peak_gbps if peak_gbps is not None else peak_d2h_gbps(),
             "compute_only_ms": compute_only_ms(problem, repeats), "runs": []}
    sample = None
    for codec in compress:
        for name in strategies:
            times, stored, summary = [], None, None
            # (at most the run's levels: a short run's chunk holds them all)
            batch = (min(device_batch(problem.nbytes_level), len(saved_levels(nt, every)))
                     if codec in SHARDED and name == "staged" else None)
            # the disk just before the first run, then after each one (raw bytes only)
            chunk_mib = level_mib * chunk_levels(problem, name, every)
            disk = [disk_bandwidth(folder, nbytes / 2**20, chunk_mib)] if codec is None else []
            for _ in range(repeats if codec is None else 1):
                work = tempfile.mkdtemp(dir=folder)
                try:
                    _settle()
                    r = solve(problem, name, every=every, trace=False, store=os.path.join(work, "s.zarr"),
                              compress=codec, batch=batch)
                    times.append(r.elapsed_ms)
                    summary = r.compression
                    opened = open_store(r.store)
                    stored = opened.stored_nbytes()
                    if sample is None:           # about 16 levels across the run, for the codecs alone
                        sample = opened.images[::max(1, len(opened.levels) // 16)]
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                if codec is None:
                    # The disk as this run used it, right after it, once the store is deleted: each
                    # measurement then follows the deletion of a run's files and each run the
                    # deletion of a measurement's, so neither inherits the other's freed blocks.
                    disk.append(disk_bandwidth(folder, nbytes / 2**20, chunk_mib))
            med = float(np.median(times))
            run = {"strategy": name, "compress": codec, "times_ms": times, "median_ms": med,
                   "ratio": nbytes / stored, "write_gbps": nbytes / (med * 1e-3) / 1e9}
            if disk:
                run["disk_gbps"] = disk
            if codec in SHARDED:
                run.update(batch=batch or chunk_levels(problem, name, every), compression=summary)
            point["runs"].append(run)
    point["disk_gbps"] = float(np.median([g for r in point["runs"] for g in r.get("disk_gbps", [])]
                                         or [point["disk_burst_gbps"]]))

    def bound(gbps):
        parts = {"compute": point["compute_only_ms"], "copies": nbytes / (point["peak_d2h_gbps"] * 1e9) * 1e3,
                 "disk": nbytes / (gbps * 1e9) * 1e3}
        return max(parts.values()), max(parts, key=parts.get)

    point["bound_ms"], point["bound_by"] = bound(point["disk_gbps"])
    for run in point["runs"]:
        if "disk_gbps" in run:          # each repeat against the disk on both sides of it
            g = run["disk_gbps"]
            run["bound_ms"] = [bound((g[i] + g[i + 1]) / 2)[0] for i in range(len(run["times_ms"]))]
            run["efficiency"] = float(np.median([b / t for b, t in zip(run["bound_ms"], run["times_ms"])]))
        else:
            run["efficiency"] = point["bound_ms"] / run["median_ms"]
    point["codec_single_thread"] = {c: codec_speed(sample, c) for c in compress if c is not None and c not in SHARDED}
    return point
