"""Run every solver strategy at a small size, for compute-sanitizer.

On a GPU machine (compute-sanitizer ships with the CUDA toolkit, in its bin/):

    compute-sanitizer --tool memcheck  --leak-check full python tools/sanitizer_check.py
    compute-sanitizer --tool racecheck python tools/sanitizer_check.py
    compute-sanitizer --tool synccheck python tools/sanitizer_check.py

Traced runs are timed with CUDA events (CUPTI cannot attach beside the
sanitizer). CuPy's memory pool is switched off first: with the pool on, a small overrun
lands inside a larger pooled block and memcheck cannot see it.
"""
import os
import sys

# compute-sanitizer and CUPTI both attach to the driver's profiling interface: traced runs here are
# timed with CUDA events instead.
os.environ["COURSE_HELPER_TIMING"] = "events"

import cupy  # noqa: E402
import numpy as np

cupy.cuda.set_allocator(None)
cupy.cuda.set_pinned_memory_allocator(None)

import course_helper as ch  # noqa: E402

ch.set_backend("gpu")
problem = ch.WaveProblem(n0=37, n1=53, nt=24, source=(20, 30))   # odd sizes: partial blocks at the edges
reference = ch.reference_solution(problem)
failures = 0
for strategy in ch.STRATEGIES:
    for every in (1, 5):
        r = ch.solve(problem, strategy, every=every, trace=(every == 1))
        ok = np.allclose(r.images, reference[::every], atol=1e-6 * np.abs(reference).max())
        failures += not ok
        print(f"{strategy:<13} every {every}: {'ok' if ok else 'WRONG'}", flush=True)
stack = ch.pinned_empty((6, 40, 24))
buf = [ch.device_empty((40, 24)) for _ in range(2)]
(s,) = ch.create_streams(1)
for k in range(6):
    ch.bake_layer(buf[k % 2], k, s)
    ch.copy_to_host_async(stack[k], buf[k % 2], s)
s.synchronize()
print(ch.check_layer_cake(stack))
sys.exit(1 if failures else 0)
