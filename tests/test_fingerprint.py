"""The modelled device's times, to the tick, and the bytes a run stores: held to a fingerprint.

Every modelled time is a whole number of ticks (``runtime.scheduler.ticks``), so two runs of the
same code give the same times exactly, and a change to the package that is not meant to change
what the modelled H200 predicts must leave every one of them as it was. Each case below runs one
thing the course times on the CPU backend (every strategy, with and without the race sanitizer,
streamed to a store with and without compression, timed only, the ring depth chosen, the
physical limit, the bandwidth table, the benchmark's rows, a rank's loop, a learner's kernel
and the layer cake's oven) and reduces what it gives (times as exact hexadecimal floats, every
timeline event, the images' bytes, every file of a store) to a digest kept in
``modelled_fingerprint.json`` beside this file. A case whose digest changes names itself.

After a change that is *meant* to change modelled times, write the new digests with
``COURSE_FINGERPRINT_WRITE=1 python3 -m pytest tests/test_fingerprint.py`` and say why in the commit.
"""
import hashlib
import json
import os
import pathlib
import shutil
import types

import numpy as np
import pytest

import course_helper as ch
from course_helper import distributed
from course_helper.exercises import capstone, layer_cake

FILE = pathlib.Path(__file__).with_name("modelled_fingerprint.json")
WRITE = os.environ.get("COURSE_FINGERPRINT_WRITE") == "1"
SMALL = dict(n0=48, n1=48, nt=50)


def _canonical(value):
    """``value`` as plain data in which every float is exact (its hexadecimal form)."""
    if isinstance(value, (bool, type(None), str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value).hex()
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, np.ndarray):
        return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest() + f" {value.dtype} {value.shape}"
    raise TypeError(f"no canonical form for {type(value).__name__}")


def _trace(trace):
    return [[e.track, e.kind, e.name, e.start_ms, e.end_ms, e.bytes, e.level] for e in trace.events] + [trace.tracks]


def _result(r):
    images = None if not r.computed else np.asarray(r.images[:])
    return {"elapsed": r.elapsed_ms, "capture": r.capture_ms, "nscratch": r.nscratch, "why": r.nscratch_reason,
            "nstaging": r.nstaging, "batch": r.batch, "label": r.time_label, "images": images,
            "trace": _trace(r.trace) if r.has_trace else None, "compression": r.compression}


def _store(path):
    files = sorted(p for p in pathlib.Path(path).rglob("*") if p.is_file())
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _solve(strategy, **kw):
    return _result(ch.solve(ch.WaveProblem(**SMALL), strategy, **kw))


def _stored(strategy, compress, tmp_path, **kw):
    path = tmp_path / f"{strategy}-{compress}.zarr"
    r = ch.solve(ch.WaveProblem(**SMALL), strategy, every=2, store=str(path), compress=compress, **kw)
    out = _result(r)
    out["store"] = _store(path)
    shutil.rmtree(path)
    return out


def _timed_only():
    with ch.timing_only():
        return _result(ch.solve(ch.WaveProblem(n0=512, n1=512, nt=40), "events", every=4))


def _suggested():
    return {f"{n} {strategy} {every}": ch.solver.suggest_nscratch(ch.WaveProblem(n0=n, n1=n, nt=64), every, strategy)
            for n in (256, 1024, 3072) for every in (1, 16) for strategy in ("events", "staged", "sequential")}


def _limit():
    return ch.physical_limit(ch.WaveProblem(n0=64, n1=64, nt=40), every=1, repeats=2)


def _bandwidth():
    return ch.measure_bandwidth((1, 4), repeats=2)


def _bench():
    point = ch.measure.bench.bench_point(64, 40, 2, ["sequential", "events", "staged"], repeats=2)
    return point


def _disk(tmp_path):
    point = ch.measure.bench.disk_point(64, 40, 1, tmp_path, strategies=("events", "staged"),
                                        compress=(None, "gpu-zstd"), repeats=1)
    point.pop("codec_single_thread")          # wall-clock speeds of the codecs on this machine
    for run in point["runs"]:
        if run.get("compression"):
            run["compression"] = dict(run["compression"])
    return point


class _OneRank:
    """A team of one rank (as in tests/distributed/test_halo.py): its loop runs in this process."""
    rank, size, nccl, backend, device = 0, 1, None, "cpu", "CPU"
    comm = types.SimpleNamespace(Barrier=lambda: None)


def _rank(strategy):
    res = distributed.run_rank(_OneRank(), ch.WaveProblem(n0=64, n1=64, nt=30), strategy, every=3, trace=True,
                               repeats=2)
    return {"elapsed": res.elapsed_ms, "times": res.times_ms, "queued": res.queued_ms, "images": res.images,
            "trace": _trace(res.trace)}


def _halo(strategy):
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec is not installed (the distributed extra: docs/gpu-setup.md)")
    r = distributed.launch_halo(ranks=2, n=40, nt=20, every=5, strategy=strategy, trace=True, backend="cpu")
    return {"elapsed": r.elapsed_ms, "ranks": r.rank_ms, "images": r.images,
            "traces": [_trace(t) for t in r.traces]}


def _capstone():
    gs = capstone.GrayScott(n=64, steps=48, feed_every=8, save_every=8, nframes=3)
    with ch.tracing() as t:
        snapshots = capstone.sequential_snapshots(gs)
    return {"snapshots": snapshots, "trace": _trace(t.trace)}


def _layer_cake():
    stack = ch.pinned_empty((6, 32, 32))
    compute, io = ch.create_streams(1, name="compute")[0], ch.create_streams(2, name="io")
    planes = [ch.device_empty((32, 32)) for _ in range(2)]
    baked, copied = ch.create_events(2), ch.create_events(2)
    with ch.tracing() as t:
        for k in range(6):
            b = k % 2
            compute.wait_event(copied[b])
            layer_cake.bake_layer(planes[b], k, compute)
            compute.record(baked[b])
            io[b].wait_event(baked[b])
            ch.copy_to_host_async(stack[k], planes[b], io[b], level=k)
            io[b].record(copied[b])
        ch.synchronize()
    return {"stack": np.array(stack), "trace": _trace(t.trace)}


CASES = {
    **{f"solve {s}": (lambda s=s: _solve(s)) for s in ch.STRATEGIES},
    **{f"solve {s} every 3": (lambda s=s: _solve(s, every=3)) for s in ("streams", "events", "staged", "graph")},
    "solve staged nstaging 2 batch 3": lambda: _solve("staged", every=2, nstaging=2, batch=3),
    "solve events nscratch 9": lambda: _solve("events", nscratch=9),
    **{f"sanitize {s}": (lambda s=s: _solve(s, sanitize=True)) for s in ch.STRATEGIES},
    "timing only": _timed_only,
    "suggested rings": _suggested,
    "physical limit": _limit,
    "bandwidth": _bandwidth,
    "bench point": _bench,
    **{f"rank {s}": (lambda s=s: _rank(s)) for s in distributed.STRATEGIES},
    **{f"halo {s}": (lambda s=s: _halo(s)) for s in distributed.STRATEGIES},
    "capstone": _capstone,
    "layer cake": _layer_cake,
}
STORE_CASES = [("sequential", None), ("events", None), ("staged", None), ("events", "zstd"),
               ("events", "gpu-zstd"), ("staged", "gpu-zstd"), ("staged", "blosc")]


def _digest(value):
    return hashlib.sha256(json.dumps(_canonical(value), sort_keys=True).encode()).hexdigest()


def _check(name, value):
    known = json.loads(FILE.read_text()) if FILE.exists() else {}
    digest = _digest(value)
    if WRITE:
        known[name] = digest
        FILE.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")
        return
    assert name in known, f"no fingerprint for {name!r}: write them with COURSE_FINGERPRINT_WRITE=1"
    assert digest == known[name], f"{name}: the modelled times or the stored bytes changed"


@pytest.mark.parametrize("name", list(CASES))
def test_modelled_times_are_as_they_were(cpu, name):
    _check(name, CASES[name]())


@pytest.mark.parametrize("strategy, compress", STORE_CASES)
def test_a_stored_run_keeps_its_times_and_its_bytes(cpu, tmp_path, strategy, compress):
    _check(f"store {strategy} {compress}", _stored(strategy, compress, tmp_path))


def test_the_disk_points_modelled_rows_are_as_they_were(cpu, tmp_path):
    _check("disk point", _disk(tmp_path))


def test_the_fingerprint_sees_one_tick(cpu, monkeypatch):
    """One tick more on one host call changes a case's digest: the check is fine enough to see it."""
    before = _digest(_solve("events"))
    rt = ch.runtime.get()
    monkeypatch.setitem(rt.profile["host_us"], "record", rt.profile["host_us"]["record"] + 2.0 ** -20 * 1e3)
    assert _digest(_solve("events")) != before


def test_every_case_has_a_fingerprint():
    known = json.loads(FILE.read_text())
    names = set(CASES) | {f"store {s} {c}" for s, c in STORE_CASES} | {"disk point"}
    assert names == set(known), f"missing: {sorted(names - set(known))}, stale: {sorted(set(known) - names)}"
