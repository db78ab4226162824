"""A stopwatch for work on a GPU: device time of queued work and host time of a call."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..streams import create_streams, synchronize
from ..timing import benchmark, host_times

if TYPE_CHECKING:
    from collections.abc import Callable

_SPIN = r"""
extern "C" __global__ void course_helper_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


class Stopwatch:
    """Times on the GPU: device time of queued work (CUDA events behind a spinning kernel, so the
    host's queueing is not timed) and the host's time of a call. Used by
    :func:`course_helper.measure.calibrate` and :func:`course_helper.strategies.level_times`."""

    def __init__(self):
        import cupy          # a GPU tool: the CPU backend never imports CuPy
        self.cupy = cupy
        self.spin = cupy.RawKernel(_SPIN, "course_helper_spin")
        (self.s,) = create_streams(1, name="calibrate")

    def hold(self, ms: float = 4.0) -> None:
        """Keep the stream busy for about ``ms`` (clock rate ~1.7 GHz; only needs to outlast the queueing)."""
        with self.s.raw:
            self.spin((1,), (1,), (np.int64(ms * 2e6),))

    def device_ms(self, queue: Callable[[], object], repeat: int = 20) -> float:
        """Device time of one ``queue()``: ``repeat`` of them queued behind a spin, timed by events
        (after one untimed call: module loads, pool allocations)."""
        return benchmark(queue, self.s, n_warmup=1, n_repeat=1, calls=repeat, before=self.idle_then_hold).per_call_ms

    def idle_then_hold(self, ms: float = 4.0) -> None:
        """Wait for the device to be idle, then :meth:`hold` the stream: what a device time starts from."""
        synchronize()
        self.hold(ms)

    def host_us(self, call: Callable[[], object], n: int = 200, busy: bool = True) -> float:
        """Median wall time (µs) of one ``call()`` by the host, over ``n`` calls (with ``busy``: queued
        behind a 20 ms spin on the stream, so that the device is busy while the calls are timed)."""
        call()
        synchronize()
        if busy:
            self.hold(ms=20.0)
        times = host_times(call, n)
        synchronize()
        return float(np.median(times)) * 1e3
