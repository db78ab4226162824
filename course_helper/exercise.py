"""The layer-cake exercise: fill the planes of a 3D stack on the device, one
kernel per plane, and copy each plane to the host while the next is baked.

:func:`bake_layer` is the "kernel", :func:`check_layer_cake` the checker that
says what is wrong with a learner's result, and :func:`layer_values` the
expected content of a plane.
"""
from __future__ import annotations

import linecache
import os
import sys
import threading
from collections import Counter

import numpy as np

from . import checks, observe, runtime, streams
from .memory import is_device_array, is_pinned
from .sanitizer import RaceError, sanitize
from .streams import synchronize

__all__ = ["bake_layer", "layer_values", "check_layer_cake", "LayerCakeError"]

_SOURCE = r"""
extern "C" __global__ void bake_layer(float* plane, const int n0, const int n1, const int k) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int i = blockIdx.y * blockDim.y + threadIdx.y;
    if (i >= n0 || j >= n1) return;
    // Layer k holds k + a small pattern in [0, 0.5): the integer part says which layer it is.
    plane[(long long)i * n1 + j] = (float)k + 0.5f * (float)((i * 7 + j * 3) % 64) / 64.0f;
}
"""


class LayerCakeError(AssertionError):
    """The stack is not what the exercise expects; the message says why and what to try."""


def layer_values(k, shape):
    """The expected content of plane ``k`` (float32), computed on the host."""
    n0, n1 = shape
    i = np.arange(n0)[:, None]
    j = np.arange(n1)[None, :]
    pattern = ((i * 7 + j * 3) % 64).astype(np.float32)
    return np.float32(k) + np.float32(0.5) * pattern / np.float32(64.0)


def _kernel():
    import cupy          # called by the GPU runtime only; the CPU backend never imports CuPy
    return cupy.RawKernel(_SOURCE, "bake_layer")


def bake_layer(plane, k, stream=None):
    """Queue the kernel that fills the device array ``plane`` with layer ``k``."""
    if not is_device_array(plane):
        raise TypeError("plane must be a device array (device_empty/device_zeros)")
    if plane.ndim != 2 or plane.dtype != np.float32 or not plane.flags.c_contiguous:
        raise ValueError(f"plane must be a C-contiguous 2D float32 array, got {plane.dtype} {plane.shape}")
    k = checks.positive_int("k (layer number)", k, minimum=0)
    stream = streams.resolve(stream)
    n0, n1 = plane.shape

    def cuda(raw_stream):
        with raw_stream:
            _kernel()(((n1 + 31) // 32, (n0 + 7) // 8), (32, 8), (plane, np.int32(n0), np.int32(n1), np.int32(k)))

    def numpy(out):
        np.copyto(out, layer_values(k, (n0, n1)))

    op = observe.Op("kernel", f"bake layer {k}", stream, k, 0, (), (plane,))
    runtime.submit(stream, op, cuda=cuda, numpy=numpy, cost={"kernel": "bake", "bytes": plane.nbytes})


def check_layer_cake(stack, nplanes=None, loop=None, buffers=None):
    """Check a layer cake; raise :class:`LayerCakeError` saying what is wrong.

    With ``loop`` (a function of no arguments that queues the whole cake into
    ``stack``), the checker first runs it under the race sanitizer: a missing
    or misplaced dependency fails every time, whatever the timing, with the
    dependency to add. It also reports host waits inside the loop (rule 3).
    ``buffers`` (the device plane buffers) lets messages name them.
    Returns a one-line success message when every plane holds its own layer.
    """
    __tracebackhide__ = True       # a failure shows the learner's cell, not this file
    if is_device_array(stack):
        raise LayerCakeError("the stack is still on the device: the exercise copies every plane to a "
                             "host array made with pinned_empty((nplanes, n0, n1))")
    stack = np.asarray(stack)
    if stack.ndim != 3:
        raise LayerCakeError(f"the stack should be 3D (nplanes, n0, n1), got shape {stack.shape}")
    nplanes = stack.shape[0] if nplanes is None else checks.positive_int("nplanes", nplanes)
    if stack.shape[0] != nplanes:
        raise LayerCakeError(f"the stack has {stack.shape[0]} planes but the cake has {nplanes}")
    waits = _run_checked(loop, stack, buffers) if loop is not None else []
    observe.notify("host_access", stack, "r", "check_layer_cake")
    problems = []
    for k in range(nplanes):
        plane = stack[k]
        if np.isnan(plane).any():
            problems.append(f"plane {k} was never (fully) written - is every plane copied, and did you "
                            "synchronise before checking?")
            continue
        if not np.isfinite(plane).all():
            problems.append(f"plane {k} holds non-finite values (inf): it was never a layer - check what "
                            "filled the host stack")
            continue
        expected = layer_values(k, plane.shape)
        if np.array_equal(plane, expected):
            continue
        layers = np.unique(np.floor(plane).astype(np.int64))
        if len(layers) == 1 and layers[0] != k:
            problems.append(f"plane {k} holds layer {int(layers[0])}: its buffer was refilled before the copy "
                            "read it (a race) - make the bake of a buffer wait for the copy out of it "
                            "(record an event after the copy; compute_stream.wait_event(it))")
        elif len(layers) > 1:
            problems.append(f"plane {k} mixes layers {[int(x) for x in layers]}: the copy overlapped the bake of the "
                            "same buffer - the IO stream must wait for the event recorded after the bake")
        else:
            problems.append(f"plane {k} has the right layer number but wrong values")
    if problems:
        head = f"{len(problems)} of {nplanes} planes are wrong:\n  - "
        raise LayerCakeError(head + "\n  - ".join(problems[:6]) + ("\n  ..." if len(problems) > 6 else ""))
    if waits:
        counts = ", ".join(f"{what} x{n}" for what, n in Counter(waits).items())
        raise LayerCakeError(f"all {nplanes} layers are correct, but the host waited inside the loop "
                             f"{len(waits)} times ({counts}); rule 3: the host never waits in the loop - "
                             "let the streams wait for events instead (stream.wait_event(event))")
    pinned = "" if is_pinned(stack) else " (note: the host stack is not pinned, so copies could not overlap)"
    return f"all {nplanes} layers are correct{pinned}"


class _HostWaits:
    """Observer (of every thread): host waits followed by more queued work happened inside the loop.

    A host wait is anything after which the host knows device work to be finished: a
    synchronize of the device, a stream or an event, a blocking copy, ``ch.to_host()``, a
    ``query()`` polled until it answered True. Each is named by the learner's line that waited."""

    def __init__(self):
        self.pending, self.inside = [], []
        self.lock = threading.Lock()

    def host_synced(self, target):
        line = _caller_line()
        if line is None:
            line = ("ch.synchronize()" if target is None else
                    f"{target.name}.synchronize()" if hasattr(target, "wait_event") else "event.synchronize()")
        with self.lock:
            self.pending.append(line)

    def _more_work(self, *args):
        with self.lock:
            self.inside += self.pending
            self.pending = []

    op_queued = event_recorded = event_waited = _more_work


def _caller_line():
    """The source line outside this package that made the current call, e.g.
    ``stack[k] = ch.to_host(buf)`` (None when its source cannot be read)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == package:
        frame = frame.f_back
    if frame is None:
        return None
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno, frame.f_globals).strip()
    return f"`{line}`" if line else None


def _run_checked(loop, stack, buffers):
    """Run the learner's loop into a fresh (NaN) stack under the sanitizer; the host waits in it."""
    __tracebackhide__ = True
    if not callable(loop):
        raise TypeError(f"loop must be a function that queues the whole cake, got {type(loop).__name__}")
    synchronize()                                  # nothing earlier still writes the stack
    observe.notify("host_access", stack, "w", "check_layer_cake")
    stack.fill(np.nan)
    waits = observe.add(_HostWaits(), every_thread=True)   # a loop may queue its body from a thread
    try:
        with sanitize(names={"stack": stack, "buffers": list(buffers or [])}):
            loop()
    except RaceError as err:
        raise LayerCakeError(f"your loop has a race: it can bake a wrong cake on any run, "
                             f"whatever the timing.\n{err}") from None
    finally:
        observe.remove(waits)
    synchronize()
    return waits.inside
