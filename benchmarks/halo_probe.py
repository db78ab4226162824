"""Where the eager halo loops spend their time on two GPUs: host queueing against device time.

Run on a machine with two GPUs, from the repository root::

    mpiexec -n 2 python -m benchmarks.halo_probe --out results/

For each grid per GPU and each halo strategy it times the loop twice over: the host's time to
queue the whole loop (until the last call returns) and the time until the device is done. A loop
whose queueing time is close to its total is host-bound: the Python host, not the GPUs or the
link, sets the pace. It also times each kind of call the loops make (a kernel launch, an event
record and wait, one halo exchange through NCCL), queued back to back, and writes one traced run
of each strategy as a Chrome trace. Writes ``halo_probe.json`` (and the traces) to ``--out``.
"""
import argparse
import json
import os
import platform
import time

import numpy as np

from course_helper import distributed as halo
from course_helper import runtime
from course_helper.distributed import loops
from course_helper.distributed.rank import RankRun
from course_helper.memory import zero_async
from course_helper.streams import synchronize
from course_helper.wave import WaveProblem


def queue_and_finish(team, problem, strategy, every, repeats):
    """(queue ms, total ms) medians over repeats for one eager strategy (slowest rank)."""
    run = RankRun(team, problem, strategy, every, None)
    queued, total = [], []
    try:
        loops._warm_up(run)
        for _ in range(repeats + 1):
            for u in run.U:
                zero_async(u, run.compute)
            synchronize()
            team.comm.Barrier()
            t0 = runtime.host_ms()
            loops._loop(run)
            t1 = runtime.host_ms()
            synchronize()
            t2 = runtime.host_ms()
            queued.append(t1 - t0)
            total.append(t2 - t0)
    finally:
        run.close()
    return team.max(float(np.median(queued[1:]))), team.max(float(np.median(total[1:])))


def per_call_us(team, problem, n=2000):
    """Host microseconds per call, each kind queued n times back to back (slowest rank)."""
    run = RankRun(team, problem, "blocking", None, None)
    out = {}

    def timed(name, work):
        synchronize()
        team.comm.Barrier()
        t0 = time.perf_counter()
        for i in range(n):
            work(i)
        t1 = time.perf_counter()
        synchronize()
        t2 = time.perf_counter()
        out[name] = {"queue_us": team.max((t1 - t0) / n * 1e6), "total_us": team.max((t2 - t0) / n * 1e6)}

    try:
        ev = run.computed
        timed("record", lambda i: run.compute.record(ev))
        timed("wait_event", lambda i: run.compute.wait_event(ev))
        timed("launch_edge", lambda i: run.launch(run.edges[0], 2 + i % 3, run.compute))
        timed("launch_whole", lambda i: run.launch(run.whole, 2 + i % 3, run.compute))
        after = run.compute.record(run.computed)
        timed("exchange", lambda i: run.link.exchange(run.U[i % run.m], i, after=after))
        timed("exchange_join", lambda i: (run.link.exchange(run.U[i % run.m], i, after=after),
                                          run.link.join(run.compute)))
        if team.nccl is not None:
            sends, recvs = halo.link._edges(run.slab, run.U[0])
            timed("nccl_raw", lambda i: run.link.nccl_swap(sends, recvs))
    finally:
        run.close()
    return out


def lean_overlap_step(run, level):
    """The overlap step with the boundary rows computed on the halo stream itself: two events fewer."""
    b = level % run.m
    halo_stream = run.link.stream
    halo_stream.wait_event(run.ready[(level - 1) % run.m])
    halo_stream.wait_event(run.copied[b])
    for window in run.edges:
        run.launch(window, level, halo_stream)
    run.compute.wait_event(run.copied[b])
    if run.inner is not None:
        run.launch(run.inner, level, run.compute)
    sends, recvs = halo.link._edges(run.slab, run.U[b])
    if sends:
        from course_helper.runtime import observe
        nbytes = sum(a.nbytes for _, a in sends)
        op = observe.Op("halo", f"halo level {level}", halo_stream, level, nbytes,
                        tuple(a for _, a in sends), tuple(r for _, r in recvs))
        runtime.submit(halo_stream, op, cuda=lambda raw: run.link.nccl_swap(sends, recvs),
                       numpy=lambda *rows: run.link.mpi_swap(sends, recvs, rows), cost={"peer": nbytes})
    halo_stream.record(run.link.done)
    run.compute.wait_event(run.link.done)
    run.compute.record(run.ready[b])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--nt", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="2048,4096")
    ap.add_argument("--label", default="")
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    team = halo.Team()
    loops.REGISTRY["overlap-lean"] = loops.HaloStrategy(lean_overlap_step)
    loops.STRATEGIES = tuple(loops.REGISTRY)
    doc = {"machine": {"device": team.device, "ranks": team.size, "host": platform.node(),
                       "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}},
           "label": args.label, "points": []}
    t_start = time.time()
    for n in (int(s) for s in args.sizes.split(",")):
        problem = WaveProblem(n0=team.size * n, n1=n, nt=args.nt)
        row = {"n_per_gpu": n, "strategies": {}}
        for s in ("blocking", "overlap", "overlap-lean"):
            q, t = queue_and_finish(team, problem, s, args.nt // 4, args.repeats)
            row["strategies"][s] = {"queue_ms": q, "total_ms": t}
        res = halo.run_rank(team, problem, "overlap-graph", every=args.nt // 4, repeats=args.repeats)
        row["strategies"]["overlap-graph"] = {"total_ms": team.max(res.elapsed_ms)}
        row["per_call_us"] = per_call_us(team, problem)
        doc["points"].append(row)
        if team.rank == 0:
            print(f"[{time.time() - t_start:5.1f} s] {args.label} n={n}: "
                  + "; ".join(f"{k} q {v.get('queue_ms', float('nan')):.1f} t {v['total_ms']:.1f}"
                              for k, v in row["strategies"].items()), flush=True)
            print("   per call us: " + "; ".join(f"{k} q {v['queue_us']:.1f} t {v['total_us']:.1f}"
                                             for k, v in row["per_call_us"].items()), flush=True)
    if args.trace:
        doc["traces"] = {}
        for s in ("blocking", "overlap", "overlap-lean", "overlap-graph"):
            res = halo.run_rank(team, WaveProblem(n0=team.size * 2048, n1=2048, nt=40), s, every=8, trace=True)
            traces = team.comm.gather(res.trace, root=0)
            if team.rank == 0:
                with open(os.path.join(args.out, f"trace_{s}.json"), "w") as f:
                    json.dump(halo.chrome_trace(traces), f)
    if team.rank == 0:
        with open(os.path.join(args.out, f"halo_probe{args.label}.json"), "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
