"""How fast the disk writes and a codec compresses: the disk's term of the bound, and whether
compression pays (``writers * codec speed >= disk bandwidth``)."""
from __future__ import annotations

import math
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .. import checks, files
from ..timing import host_timer, wall_ms
from .layout import NUMCODECS, check_target
from .sink import DEFAULT_WRITERS

__all__ = ["measure_disk_bandwidth", "codec_speed"]


def measure_disk_bandwidth(folder: str | os.PathLike, mib: float = 256, chunk_mib: float = 4,
                           writers: int = DEFAULT_WRITERS, buffers: Sequence[np.ndarray] | None = None) -> float:
    """Write ``mib`` MiB of files in ``chunk_mib`` chunks to ``folder`` from ``writers``
    threads, each file written as the store writes its chunks (:func:`course_helper.files.write_atomically`:
    fsync'ed, renamed), and return GB/s.

    File i holds ``buffers[i % len(buffers)]`` (host arrays of one chunk's bytes each; by
    default one chunk of incompressible bytes). The files are removed afterwards. This is the
    disk term of the bound ``B = max(compute, bytes / D2H bandwidth, bytes / disk bandwidth)``.
    """
    folder = Path(folder)
    mib = checks.positive_float("mib", mib)
    chunk = int(checks.positive_float("chunk_mib", chunk_mib) * 2**20)
    writers = checks.positive_int("writers", writers)
    n = max(1, math.ceil(mib * 2**20 / chunk))
    if buffers is not None:
        buffers = [memoryview(np.ascontiguousarray(b)).cast("B") for b in buffers]
        if not buffers or any(len(b) != chunk for b in buffers):
            raise ValueError(f"buffers must be a non-empty list of arrays of one chunk each ({chunk} bytes), "
                             f"got sizes {[len(b) for b in buffers]}")
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot measure the disk: the folder {folder} does not exist")
    check_target(folder / f".disk-bandwidth-{uuid.uuid4().hex}", n * chunk)
    work = folder / f".disk-bandwidth-{uuid.uuid4().hex}"
    work.mkdir()
    if buffers is None:
        buffers = [np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8).tobytes()]   # incompressible
    jobs = queue.SimpleQueue()
    for i in range(n):
        jobs.put(i)
    errors = []

    def writer():
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                files.write_atomically(work / f"c{i}", buffers[i % len(buffers)])
            except OSError as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=writer, name=f"disk bandwidth {i}") for i in range(writers)]
    try:
        with host_timer(wall_ms) as took:          # this machine's disk, on both backends: its own clock
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        seconds = took.ms / 1e3
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if errors:
        raise OSError(errors[0].errno, f"measuring the disk under {folder} failed: {errors[0]}")
    return n * chunk / seconds / 1e9


def codec_speed(images: Sequence[np.ndarray] | np.ndarray, compress: str, repeats: int = 3) -> dict[str, float]:
    """Single-thread compression speed (GB/s of raw input) and ratio of ``compress`` on ``images``
    (a stack of levels), with the same codec settings the store uses."""
    if compress not in NUMCODECS:
        raise ValueError(f"compress must be one of {tuple(NUMCODECS)}, got {compress!r}")
    c = NUMCODECS[compress]()
    levels = [np.ascontiguousarray(level) for level in images]
    best, size = float("inf"), 0
    for _ in range(checks.positive_int("repeats", repeats)):
        with host_timer(wall_ms) as took:          # the codec on this CPU, on both backends
            size = sum(len(c.encode(level)) for level in levels)
        best = min(best, took.ms / 1e3)
    raw = sum(level.nbytes for level in levels)
    return {"gb_per_s": raw / best / 1e9, "ratio": raw / max(size, 1)}
