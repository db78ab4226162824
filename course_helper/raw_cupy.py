"""The lesson's loops written with CuPy alone: what the helper's verbs do underneath.

:func:`events_loop` runs the ``with_events`` strategy with nothing but CuPy:
its streams and events, a ``RawKernel`` of the same CUDA source, page-locked
host memory from ``cupy.cuda.alloc_pinned_memory`` and
``cupy.cuda.runtime.memcpyAsync``. No argument checks per call, no tracing,
no observers: it is the yardstick for the helper's own host cost (the
``raw-cupy-events`` row of the benchmark), and it gives bit-identical images.
:func:`streams_loop` and :func:`sequential_loop` do the same for the other two
classic strategies (used by ``benchmarks/host_cost.py``).

GPU only (CuPy on an NVIDIA or AMD GPU).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from . import checks
from . import runtime
from .runtime.backend import cupy_module
from .timing import host_timer
from .wave import WaveProblem, kernel_source, saved_levels

if TYPE_CHECKING:
    import cupy

__all__ = ["events_loop", "streams_loop", "sequential_loop", "launch_step", "copy_level_to_host"]


def _prepare(problem, every, nscratch, pinned=True):
    """Everything the loops need, made before the clock starts."""
    if not runtime.get().runs_cuda:
        raise RuntimeError("the raw CuPy loops need the GPU backend (CuPy on a GPU)")
    checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    every = checks.positive_int("every", every)
    nscratch = checks.positive_int("nscratch", nscratch, minimum=3)
    cupy = cupy_module()
    n0, n1 = problem.shape
    nsaved = len(saved_levels(problem.nt, every))
    kernel = cupy.RawModule(code=kernel_source(), options=("--fmad=false",)).get_function("wave2d_4o")
    block = (32, 8)
    if pinned:
        mem = cupy.cuda.alloc_pinned_memory(nsaved * problem.nbytes_level)
        images = np.frombuffer(mem, np.float32, nsaved * n0 * n1).reshape(nsaved, n0, n1)
    else:
        images = np.empty((nsaved, n0, n1), np.float32)
    images.fill(np.nan)
    return SimpleNamespace(
        cupy=cupy, kernel=kernel, block=block, every=every, m=nscratch, nt=problem.nt, images=images,
        grid=((n1 + block[0] - 1) // block[0], (n0 + block[1] - 1) // block[1]),
        # the kernel's arguments after the four arrays, without the source amplitude
        scalars=(np.int32(n0), np.int32(n1), np.float32(problem.dt ** 2), np.float32(1 / problem.dx0 ** 2),
                 np.float32(1 / problem.dx1 ** 2), *(np.int32(p) for p in problem.source)),
        amp=problem.source_amplitude,           # computed per launch, as the helper does
        U=[cupy.zeros((n0, n1), cupy.float32) for _ in range(nscratch)],
        V=cupy.asarray(problem.velocity), nbytes=problem.nbytes_level,
        d2h=cupy.cuda.runtime.memcpyDeviceToHost)


def launch_step(r: SimpleNamespace, level: int, stream: cupy.cuda.Stream) -> None:
    """Queue the kernel that computes ``level`` (into ``U[level % m]``) on ``stream``."""
    U, m = r.U, r.m
    with stream:                                    # a RawKernel launches on the current stream
        r.kernel(r.grid, r.block, (U[(level - 2) % m], U[(level - 1) % m], U[level % m], r.V,
                                   *r.scalars, r.amp(level - 2)))


def copy_level_to_host(r: SimpleNamespace, level: int, stream: cupy.cuda.Stream) -> None:
    """Queue the copy of ``level`` (from ``U[level % m]``) into its slot of the pinned output."""
    r.cupy.cuda.runtime.memcpyAsync(r.images[level // r.every].ctypes.data, r.U[level % r.m].data.ptr,
                                    r.nbytes, r.d2h, stream.ptr)


def _timed(loop, r):
    r.cupy.cuda.Device().synchronize()
    with host_timer() as timed:               # the GPU runtime's host clock: the wall clock
        loop(r)
        r.cupy.cuda.Device().synchronize()
    return r.images, timed.ms


def events_loop(problem: WaveProblem, every: int = 1, nscratch: int = 5) -> tuple[np.ndarray, float]:
    """Solve ``problem`` with the events strategy in plain CuPy.

    Returns ``(images, elapsed_ms)``: the saved levels (a NumPy view of pinned
    memory, shape (nsaved, n0, n1)) and the host wall time of the loop, device
    synchronised at the end (as ``solve`` times it).
    """
    r = _prepare(problem, every, nscratch)
    cuda = r.cupy.cuda
    compute = cuda.Stream(non_blocking=True)
    io = [cuda.Stream(non_blocking=True) for _ in range(r.m)]
    ready = [cuda.Event(disable_timing=True) for _ in range(r.m)]
    copied = [cuda.Event(disable_timing=True) for _ in range(r.m)]

    def loop(r):
        m = r.m
        for level in range(r.nt + 3):
            if level < r.nt:
                b = level % m
                if level >= 2:
                    compute.wait_event(copied[b])    # never recorded yet: no wait
                    launch_step(r, level, compute)
                ready[b].record(compute)
            old = level - 3
            if 0 <= old < r.nt and old % r.every == 0:
                b = old % m
                io[b].wait_event(ready[b])
                copy_level_to_host(r, old, io[b])
                copied[b].record(io[b])

    return _timed(loop, r)


def streams_loop(problem: WaveProblem, every: int = 1, nscratch: int = 5) -> tuple[np.ndarray, float]:
    """The streams strategy in plain CuPy: the host synchronises the IO stream of a
    buffer before the kernel that overwrites it. Returns ``(images, elapsed_ms)``."""
    r = _prepare(problem, every, nscratch)
    cuda = r.cupy.cuda
    compute = cuda.Stream(non_blocking=True)
    io = [cuda.Stream(non_blocking=True) for _ in range(r.m)]
    ready = [cuda.Event(disable_timing=True) for _ in range(r.m)]

    def loop(r):
        m = r.m
        for level in range(r.nt + 3):
            if level < r.nt:
                b = level % m
                if level >= 2:
                    io[b].synchronize()
                    launch_step(r, level, compute)
                ready[b].record(compute)
            old = level - 3
            if 0 <= old < r.nt and old % r.every == 0:
                b = old % m
                io[b].wait_event(ready[b])
                copy_level_to_host(r, old, io[b])

    return _timed(loop, r)


def sequential_loop(problem: WaveProblem, every: int = 1) -> tuple[np.ndarray, float]:
    """The sequential strategy in plain CuPy: default stream, a blocking copy to
    pageable memory after every kernel. Returns ``(images, elapsed_ms)``."""
    r = _prepare(problem, every, 3, pinned=False)
    null = r.cupy.cuda.Stream.null

    def loop(r):
        for level in range(r.nt):
            if level >= 2:
                launch_step(r, level, null)
            if level % r.every == 0:
                copy_level_to_host(r, level, null)
                null.synchronize()                  # the host waits for the copy

    return _timed(loop, r)
