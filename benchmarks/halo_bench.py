"""Scaling of the decomposed solve on two GPUs (notebook 12's figures).

Run on a machine with two GPUs, from the repository root::

    mpiexec -n 2 python -m benchmarks.halo_bench --out benchmarks/

It writes ``halo.json``: weak scaling (an N x N grid on one GPU against 2N x N
on two), strong scaling (one grid on one and on two GPUs), every halo strategy
(blocking, overlap, overlap-graph) side by side, each point with its bound (the
slowest of compute, halo exchange and snapshot copies, each measured alone) and
each strategy's efficiency against it (``bound_efficiency``), and the
timelines of one short traced run of each strategy. The one-GPU runs use rank 0 alone with the
same code (no neighbour, no exchange).
"""
import argparse
import json
import os
import platform
import time

from course_helper import distributed as halo
from course_helper.distributed.rank import RankRun
from course_helper.streams import synchronize
from course_helper.wave import WaveProblem

WEAK = (2048, 4096, 8192)       # grid rows per GPU (N x N on one GPU, 2N x N on two)
STRONG = 16384                  # one 16384^2 grid (1 GiB a level) on one and on two GPUs


def point(team, problem, strategies, every, repeats):
    """Time each strategy on this team (median of repeats, slowest rank) and measure the bound."""
    row = {"ranks": team.size, "n0": problem.n0, "n1": problem.n1, "nt": problem.nt, "every": every,
           "strategies": {}}
    for s in strategies:
        res = halo.run_rank(team, problem, s, every=every, repeats=repeats)
        row["strategies"][s] = {"ms": team.max(res.elapsed_ms), "runs_ms": res.times_ms,
                                "queued_ms": team.max(res.queued_ms)}   # close to ms: the host sets the pace
    row.update(halo.measure_parts(team, problem, every))
    for r in row["strategies"].values():
        r["bound_efficiency"] = row["bound_ms"] / r["ms"]          # 1 = at the distributed bound
    return row


def host_us_per_call(team, problem, calls=300):
    """Host microseconds per call of each kind a halo step makes, each queued ``calls`` times back to
    back (slowest rank): where the time goes when the host sets the pace. ``calls`` stays well below
    the thousand or so launches a CUDA stream holds pending: past that, a launch waits for the device
    to finish an earlier one, and the figure would be the kernel's time, not the host's."""
    run = RankRun(team, problem, "blocking", None, None)
    out = {}

    def timed(name, work):
        synchronize()
        team.comm.Barrier()
        t0 = time.perf_counter()
        for i in range(calls):
            work(i)
        out[name] = team.max((time.perf_counter() - t0) / calls * 1e6)
        synchronize()

    try:
        event = run.computed
        timed("record", lambda i: run.compute.record(event))
        timed("wait_event", lambda i: run.compute.wait_event(event))
        timed("launch (whole slab)", lambda i: run.launch(run.whole, 2 + i % 3, run.compute))
        timed("launch (edge rows)", lambda i: run.launch(run.edges[0], 2 + i % 3, run.compute))
        timed("halo exchange", lambda i: run.link.exchange(run.U[i % run.m], i, after=event))
    finally:
        run.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--nt", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    team = halo.Team()
    solo = team.split(1)
    t_start = time.time()
    doc = {"machine": {"device": team.device, "ranks": team.size, "host": platform.node(),
                       "transport": "NCCL send/recv (cupy.cuda.nccl)" if team.backend == "gpu" else "MPI",
                       "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")},
           "weak": [], "strong": []}
    every_strategy = halo.STRATEGIES

    def log(msg):
        if team.rank == 0:
            print(f"[{time.time() - t_start:6.1f} s] {msg}", flush=True)

    for n in WEAK:
        every = args.nt // 4
        if solo is not None:
            doc["weak"].append(point(solo, WaveProblem(n0=n, n1=n, nt=args.nt), ("blocking",), every, args.repeats))
        team.comm.Barrier()
        doc["weak"].append(point(team, WaveProblem(n0=2 * n, n1=n, nt=args.nt), every_strategy, every, args.repeats))
        log(f"weak {n}: " + "; ".join(f"{p['ranks']} GPU(s) " + ", ".join(
            f"{s} {r['ms']:.1f} ms (queued {r['queued_ms']:.1f})" for s, r in p["strategies"].items())
            for p in doc["weak"][-2:]))
        if n == WEAK[0] and team.size > 1:
            doc["host_us_per_call"] = host_us_per_call(team, WaveProblem(n0=2 * n, n1=n, nt=args.nt))
            log(f"host us per call at {n} per GPU: {doc['host_us_per_call']}")
    nt = args.nt // 3
    if solo is not None:
        strong = WaveProblem(n0=STRONG, n1=STRONG, nt=nt)
        doc["strong"].append(point(solo, strong, ("blocking",), nt // 2, args.repeats))
    team.comm.Barrier()
    doc["strong"].append(point(team, WaveProblem(n0=STRONG, n1=STRONG, nt=nt), every_strategy, nt // 2, args.repeats))
    log(f"strong: {[(p['ranks'], p['strategies']) for p in doc['strong']]}")

    # One traced run of each strategy for the timeline pictures (short, so the file stays small), at
    # 8192^2 per GPU: tracing adds host time to every call, and at 4096^2 one rank's host could then
    # set the pace, its neighbour's exchange waiting for it after its own kernel had ended.
    doc["timelines"], doc["exchange_hidden"] = {}, {}
    for s in every_strategy:
        res = halo.run_rank(team, WaveProblem(n0=16384, n1=8192, nt=24), s, every=8, trace=True)
        traces = team.comm.gather(res.trace, root=0)
        if team.rank == 0:
            doc["timelines"][s] = halo.chrome_trace(traces)
            doc["exchange_hidden"][s] = [halo.exchange_hidden(t) for t in traces]   # per rank
    log(f"exchange hidden under the kernels (per rank): {doc['exchange_hidden']}")
    if team.rank == 0:
        with open(os.path.join(args.out, "halo.json"), "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {os.path.join(args.out, 'halo.json')}")


if __name__ == "__main__":
    main()
