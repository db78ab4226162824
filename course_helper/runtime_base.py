"""The interface of a runtime (see :mod:`course_helper.runtime`), with the types
both runtimes share. Kept apart so that the runtimes can import it while
:mod:`course_helper.runtime` imports them."""
from __future__ import annotations

import contextlib

import numpy as np

__all__ = ["Runtime", "GraphsUnsupported", "CpuDeviceArray"]


class CpuDeviceArray(np.ndarray):
    """An array in the CPU backend's stand-in for device memory."""


class GraphsUnsupported(RuntimeError):
    """CUDA graphs cannot be used with the active backend."""


class Runtime:
    """The interface both runtimes implement (raw objects are the runtime's own).

    Times are in milliseconds. ``cost`` describes an operation for the model
    (``{"kernel": "wave2d_4o", "bytes": n}``, ``{"copy": "D2H", "pageable": False}``,
    ``{"fill": True}``). A copy or fill names its arrays in ``cost``
    (``"dst"``, ``"src"``) and needs no ``cuda``/``numpy`` function: each
    runtime does it its own way.
    """

    name = ""            #: "gpu" or "cpu"
    modelled = False     #: True when times are modelled, not measured
    device_label = ""    #: the device the times belong to, e.g. "NVIDIA H200" or "modelled H200"
    computes_data = True  #: False when a model predicts times only and skips the arithmetic
    needs_op = True      #: False when work can be queued without an ``op`` (see :meth:`launch`, :meth:`copy_async`)
    device_array_type = None   #: the exact type of this runtime's device arrays

    @contextlib.contextmanager
    def times_only(self, on=True):
        """Inside the block, model the times and skip the arithmetic (a modelled device only)."""
        if on:
            raise ValueError("only a modelled device can predict times without computing the results")
        yield

    # -- clocks -------------------------------------------------------------
    def host_ms(self):
        """The host clock in ms (wall clock on the GPU, modelled host time on the model)."""
        raise NotImplementedError

    # -- streams and events --------------------------------------------------
    def priority_range(self):
        raise NotImplementedError

    def new_stream(self, non_blocking, priority, name):
        raise NotImplementedError

    def default_stream(self):
        raise NotImplementedError

    def close_stream(self, raw):
        """Release a stream's resources once its queued work is done (idempotent)."""

    def enter_stream(self, raw):
        """``with stream:`` began (makes ``raw`` current for raw library calls)."""

    def exit_stream(self, raw, exc):
        """``with stream:`` ended."""

    def new_event(self, timing):
        raise NotImplementedError

    def record(self, event, stream):
        raise NotImplementedError

    def wait_event(self, stream, event):
        raise NotImplementedError

    def stream_done(self, raw):
        raise NotImplementedError

    def event_done(self, raw):
        raise NotImplementedError

    def sync_stream(self, raw):
        raise NotImplementedError

    def sync_event(self, raw):
        raise NotImplementedError

    def sync_device(self):
        raise NotImplementedError

    def elapsed_ms(self, start, end):
        raise NotImplementedError

    # -- work ----------------------------------------------------------------
    def enqueue(self, stream, op, cuda, numpy, cost):
        """Queue ``op`` on ``stream``: ``cuda(raw_stream)`` launches it on a GPU;
        ``numpy(*outs)`` computes it on the CPU, writing its results into
        ``outs`` (arrays shaped like ``op.writes``). A runtime whose
        :attr:`needs_op` is False may be given None for ``op`` and ``numpy``."""
        raise NotImplementedError

    def launch(self, stream, kernel_for, grid, block, args):
        """Launch the kernel ``kernel_for(stream)`` compiled for ``stream``'s device, directly:
        what callers do instead of :meth:`enqueue` where :attr:`needs_op` is False."""
        raise NotImplementedError

    def copy_async(self, stream, kind, dst, src, host_ptr=None):
        """Queue a copy ("D2H", "H2D" or "D2D") directly: what callers do instead of
        :meth:`enqueue` where :attr:`needs_op` is False."""
        raise NotImplementedError

    def host_func(self, stream, fn):
        raise NotImplementedError

    # -- graphs ----------------------------------------------------------------
    def graphs_supported(self):
        raise NotImplementedError

    def begin_capture(self, stream):
        raise NotImplementedError

    def end_capture(self, stream):
        raise NotImplementedError

    def abort_capture(self, stream):
        raise NotImplementedError

    def upload_graph(self, graph, stream):
        """Prepare ``graph``'s replay on ``stream`` ahead of its first launch; by default
        there is nothing to prepare."""

    def launch_graph(self, graph, stream):
        raise NotImplementedError

    # -- memory -----------------------------------------------------------------
    def device_array(self, shape, dtype, zero):
        raise NotImplementedError

    def is_device_array(self, a):
        raise NotImplementedError

    def to_device(self, host):
        raise NotImplementedError

    def to_host(self, device_array):
        raise NotImplementedError

    def pinned_empty(self, shape, dtype):
        raise NotImplementedError

    def pinned_by_driver(self, array):
        """True when the driver knows ``array`` as page-locked (memory pinned outside the helper)."""
        return False

    def device_free_bytes(self):
        """Free device memory in bytes (None when the runtime has no limit to report)."""
        return None

    # -- timing marks for the timeline recorder ----------------------------------
    def trace_begin(self):
        """Start a recording: returns its origin (the device is idle)."""
        raise NotImplementedError

    def trace_start(self, stream, origin):
        """Called just before an operation is queued on ``stream``; returns a handle."""
        raise NotImplementedError

    def trace_end(self, stream, start, origin):
        """Called just after; returns the handle of the operation's end."""
        raise NotImplementedError

    def trace_host_ms(self, origin, host_ms):
        """A reading of :meth:`host_ms` as ms from the recording's origin."""
        raise NotImplementedError

    def trace_times(self, origin, start, end):
        """``(start_ms, end_ms)`` of a recorded operation from the origin, or None if it never ran."""
        raise NotImplementedError

    def trace_release(self, origin):
        """The recording is finished: give back what it held."""
