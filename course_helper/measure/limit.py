"""The physical limit B of a run: the fastest any overlap strategy could run it.

For one run, no overlap strategy can beat

    B = max(compute-only time, output bytes / peak pinned device-to-host bandwidth)

both measured in the same process on the same device (timed with :func:`course_helper.timing.benchmark`).
"""
from __future__ import annotations

from .. import checks, runtime
from ..graphs import capture_graph, graphs_supported
from ..memory import copy_to_host_async, device_zeros, pinned_empty, to_device
from ..solver import Plan, plan
from ..streams import create_streams, synchronize
from ..timing import benchmark
from ..wave import WaveProblem, launch_wave2d

__all__ = ["peak_d2h_gbps", "compute_only_ms", "physical_limit"]


def peak_d2h_gbps(mib: float = 512, repeats: int = 5) -> float:
    """Device-to-host bandwidth of one large pinned copy, in GB/s (1 GB = 1e9 bytes)."""
    n = int(mib * 2**20) // 4
    src = device_zeros(n)
    dst = pinned_empty(n)
    (s,) = create_streams(1, name="bandwidth")
    rt = runtime.get()
    with rt.times_only(rt.predicts_times):         # only the time is asked for
        ms = benchmark(lambda: copy_to_host_async(dst, src, s), s, n_repeat=repeats, n_warmup=1).median_ms
    return n * 4 / (ms * 1e-3) / 1e9


def compute_only_ms(problem: WaveProblem, repeats: int = 5) -> float:
    """Device time of the run's kernels alone, no copies.

    On the GPU both a plain launch loop and its CUDA graph are timed and the
    faster is taken: the best the device can compute, without Python's launch
    cost where the graph removes it.
    """
    U = [device_zeros(problem.shape) for _ in range(3)]
    V = to_device(problem.velocity)
    (s,) = create_streams(1, name="compute")
    synchronize()

    def loop():
        for level in range(2, problem.nt):
            launch_wave2d(U[(level - 2) % 3], U[(level - 1) % 3], U[level % 3], V, problem,
                          level - 2, stream=s)

    rt = runtime.get()
    with rt.times_only(rt.predicts_times):         # only the time is asked for
        best = benchmark(loop, s, n_repeat=repeats, n_warmup=1).median_ms
        if graphs_supported()[0]:
            with capture_graph(s) as cap:
                loop()
            best = min(best, benchmark(cap.graph.launch, s, n_repeat=repeats, n_warmup=1).median_ms)
    return best


def physical_limit(problem: WaveProblem | Plan | None = None, every: int = 1, peak_gbps: float | None = None,
                   repeats: int = 5) -> dict[str, float | str]:
    """The fastest any overlap strategy could run ``problem`` saving every ``every``-th level.

    ``problem`` may be a run's :class:`~course_helper.solver.Plan` instead (the benchmark
    passes the plans it checked): its problem and ``every`` are then used.

    Returns a dict: ``peak_d2h_gbps`` (measured here unless given),
    ``compute_only_ms`` (the kernels alone, no copies), ``copy_floor_ms``
    (the output bytes at the peak bandwidth), ``bound_ms`` = B, the larger of
    the two, and ``bound_by`` ("compute" or "copies").
    """
    if isinstance(problem, Plan):
        if every not in (1, problem.every):
            raise ValueError(f"the plan saves every {problem.every}-th level; leave out every={every}")
        checked = problem
    else:
        checked = plan(WaveProblem() if problem is None else problem, "sequential", every)   # checks the arguments
    problem, output_bytes = checked.problem, checked.need["host"]
    peak = peak_d2h_gbps() if peak_gbps is None else checks.positive_float("peak_gbps", peak_gbps)
    compute = compute_only_ms(problem, repeats)
    copies = output_bytes / (peak * 1e9) * 1e3
    return {"peak_d2h_gbps": peak, "compute_only_ms": compute, "copy_floor_ms": copies,
            "bound_ms": max(compute, copies), "bound_by": "compute" if compute >= copies else "copies"}
