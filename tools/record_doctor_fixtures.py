"""Record the overlap doctor's fixtures on a GPU: plain CuPy loops, the classic faults and one
correct loop, each run under ``ch.doctor()``, their records saved to tests/doctor_fixtures/NAME.json.

Run it on a GPU machine with CuPy and cupti-python (the ``cuda13`` extra), from the repository root::

    python3 tools/record_doctor_fixtures.py            # all loops (about 20 s on an H200)
    python3 tools/record_doctor_fixtures.py ring_of_one --print

tests/test_doctor.py then checks, with no GPU, that the doctor's engine names each loop's
expected root cause (:data:`LOOPS`) and finds nothing in the correct loop. The GPU tests there run
these same loops live. The loops are written as people write CuPy, with no helper: ``.get()``,
``cp.asnumpy``, streams, events, ``synchronize()``. Each step runs :data:`KERNELS` in-place kernels
over a 64 MiB array and copies its first 16 MiB to the host, so that a step computes longer than
its copy takes and a good loop can hide every copy. Lines marked ``# doctor: copy`` and
``# doctor: wait`` are the ones the doctor's findings should name.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "doctor_fixtures"
#: Rows x columns of float32 each step works on (64 MiB) and copies (the first ROWS rows: 16 MiB).
SHAPE, ROWS = (4096, 4096), 1024
#: In-place kernels per step, and steps per loop.
KERNELS, STEPS = 20, 8
#: A fixture bigger than this (bytes) is refused: keep the tests' input small.
MAX_BYTES = 200_000


def _cupy():
    import cupy as cp
    import cupyx
    return cp, cupyx


def _kernels(a):
    """One step's compute: KERNELS in-place kernels over ``a``, on the current stream."""
    cp, _ = _cupy()
    for _ in range(KERNELS):
        cp.multiply(a, 1.0000001, out=a)


def _work(depth=1):
    cp, _ = _cupy()
    return [cp.random.random(SHAPE, dtype=cp.float32) for _ in range(depth)]


def pageable_get(steps=STEPS):
    """The first loop everyone writes: kernels, then ``.get()`` into a new (pageable) array."""
    cp, _ = _cupy()
    a, = _work()
    for _ in range(steps):
        _kernels(a)
        host = a[:ROWS].get()                                              # doctor: copy
    return host


def asnumpy_pageable(steps=STEPS):
    """Copies on a stream of their own, non-blocking, but into a pageable NumPy array."""
    import numpy as np
    cp, _ = _cupy()
    a, = _work()
    compute, io = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    out = np.empty((ROWS, SHAPE[1]), np.float32)
    for _ in range(steps):
        with compute:
            _kernels(a)
        io.wait_event(compute.record())
        cp.asnumpy(a[:ROWS], stream=io, out=out, blocking=False)           # doctor: copy
    io.synchronize()
    return out


def pinned_on_compute_stream(steps=STEPS):
    """Pinned and asynchronous, but queued on the kernels' own stream."""
    cp, cupyx = _cupy()
    a, = _work()
    out = cupyx.empty_pinned((ROWS, SHAPE[1]), dtype=cp.float32)
    compute = cp.cuda.Stream(non_blocking=True)
    with compute:
        for _ in range(steps):
            _kernels(a)
            a[:ROWS].get(out=out, blocking=False)                          # doctor: copy
    cp.cuda.Device().synchronize()
    return out


def ring(depth, steps=STEPS, legacy=False, wait_each=False):
    """A ring of ``depth`` device buffers: the kernels of step i write buffer i % depth on the
    compute stream, an IO stream copies it into its own pinned buffer after an event, and the
    compute stream waits for that copy (an event) before it writes the buffer again.
    ``legacy``: the kernels on the legacy default stream, the copies on a blocking stream
    (``cp.cuda.Stream()``). ``wait_each``: the host waits for each copy (``io.synchronize()``)."""
    cp, cupyx = _cupy()
    bufs = _work(depth)
    host = [cupyx.empty_pinned((ROWS, SHAPE[1]), dtype=cp.float32) for _ in range(depth)]
    if legacy:
        compute, io = cp.cuda.Stream.null, cp.cuda.Stream()
    else:
        compute, io = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    copied = [None] * depth
    for i in range(steps):
        s = i % depth
        with compute:
            if copied[s] is not None:
                compute.wait_event(copied[s])          # buffer s is free once its copy is done
            _kernels(bufs[s])
            ready = compute.record()
        io.wait_event(ready)
        with io:
            bufs[s][:ROWS].get(out=host[s], blocking=False)                # doctor: copy
            copied[s] = io.record()
        if wait_each:
            io.synchronize()                                               # doctor: wait
    cp.cuda.Device().synchronize()
    return host


def host_sync_in_loop(steps=STEPS):
    """The pinned ring of two with events, but the host waits for every copy."""
    return ring(2, steps, wait_each=True)


def legacy_default_stream(steps=STEPS):
    """The pinned ring of two with events, the kernels on the legacy default stream."""
    return ring(2, steps, legacy=True)


def ring_of_one(steps=STEPS):
    """One device buffer: the next step's kernels must wait for its copy."""
    return ring(1, steps)


def pinned_ring_events(steps=STEPS):
    """The correct loop: a pinned ring of two, an IO stream, events."""
    return ring(2, steps)


def tiny_kernels(steps=400):
    """Many tiny kernels, one after another: the host cannot launch them as fast as they run."""
    cp, _ = _cupy()
    b = cp.zeros(256, dtype=cp.float32)
    for _ in range(steps):
        b += 1.0
    cp.cuda.Device().synchronize()
    return b


#: Each loop and the root cause the doctor must name first (None: no finding at all).
LOOPS = {
    "pageable_get": (pageable_get, "pageable-copy"),
    "asnumpy_pageable": (asnumpy_pageable, "pageable-copy"),
    "pinned_on_compute_stream": (pinned_on_compute_stream, "copy-on-compute-stream"),
    "host_sync_in_loop": (host_sync_in_loop, "host-wait-in-loop"),
    "legacy_default_stream": (legacy_default_stream, "default-stream"),
    "ring_of_one": (ring_of_one, "copies-not-hidden"),
    "tiny_kernels": (tiny_kernels, "launch-bound"),
    "pinned_ring_events": (pinned_ring_events, None),
}


def diagnosed(name):
    """Run the loop ``name`` once to warm up (CuPy compiles its kernels on first use), then under
    the doctor; returns the diagnosis."""
    import course_helper as ch
    loop = LOOPS[name][0]
    loop()
    with ch.doctor() as dx:
        loop()
    return dx.diagnosis


def relative_lines(records):
    """The records with each "file:line" inside the repository made relative to it (a fixture
    does not carry the recording machine's paths)."""
    def rel(where):
        if not where:
            return where
        path, _, line = where.rpartition(":")
        try:
            return f"{pathlib.Path(path).resolve().relative_to(ROOT).as_posix()}:{line}"
        except ValueError:
            return where
    records.calls = [c._replace(where=rel(c.where)) for c in records.calls]
    records.syncs = [s._replace(where=rel(s.where)) for s in records.syncs]
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help=f"loops to record (default: all of {', '.join(LOOPS)})")
    p.add_argument("--print", action="store_true", help="also print each report")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in LOOPS]
    if unknown:
        p.error(f"unknown loop(s) {unknown}; choose from {', '.join(LOOPS)}")
    import course_helper as ch
    if ch.backend_name() != "gpu":
        p.error("the fixtures are GPU recordings: run this on a GPU machine with CuPy and cupti-python")
    FIXTURES.mkdir(parents=True, exist_ok=True)
    status = 0
    for name in args.names or LOOPS:
        dx = diagnosed(name)
        records = relative_lines(dx.records)
        records.meta["loop"] = name
        path = FIXTURES / f"{name}.json"
        records.save(path)
        size = os.path.getsize(path)
        expected = LOOPS[name][1]
        got = dx.codes[0] if dx.codes else None
        verdict = "ok" if got == expected else f"UNEXPECTED (expected {expected})"
        print(f"{name}: {size / 1e3:.0f} kB, findings {dx.codes}, hidden {100 * dx.hidden:.0f}%, "
              f"span {dx.numbers['span_ms']:.2f} ms: {verdict}")
        if args.print:
            print(dx.report())
        if size > MAX_BYTES:
            print(f"  {path} is {size} bytes, over {MAX_BYTES}: fewer steps or kernels, please", file=sys.stderr)
            status = 1
        if got != expected:
            status = 1
    print(json.dumps({"fixtures": str(FIXTURES.relative_to(ROOT))}))
    return status


if __name__ == "__main__":
    sys.exit(main())
