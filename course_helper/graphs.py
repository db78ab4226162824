"""CUDA graphs: record a whole loop of device work once, replay it with one launch.

Launching a kernel from Python costs the host a few microseconds. When each
kernel runs for only a few microseconds too, the host, not the GPU, sets the
pace. Stream capture records the work queued on a stream (and on the streams
that join it through events) into a graph instead of running it; replaying
the graph launches all of it at once.

Graphs are a CUDA feature: on the CPU backend (and on CuPy built for ROCm)
:func:`capture_graph` raises :class:`GraphsUnsupported` naming the reason and
the alternative.
"""
from __future__ import annotations

import contextlib

from . import checks, observe, recording, streams
from .backend import backend_name, cupy_module

__all__ = ["GraphsUnsupported", "Graph", "capture_graph", "graphs_supported"]


class GraphsUnsupported(RuntimeError):
    """CUDA graphs cannot be used with the active backend."""


def graphs_supported():
    """``(True, "")`` when graphs work here, else ``(False, reason)``."""
    if backend_name() != "gpu":
        return False, ("CUDA graphs need the GPU backend (the CPU backend has no graphs); "
                       "use the 'staged' or 'events' strategy instead")
    if getattr(cupy_module().cuda.runtime, "is_hip", False):
        return False, "this CuPy is built for ROCm, where the course does not use graphs; use 'staged' or 'events'"
    return True, ""


class Graph:
    """A captured graph; :meth:`launch` replays it on a stream."""

    def __init__(self, raw, stream):
        self.raw = raw
        self.stream = stream

    def launch(self, stream=None):
        """Replay the whole captured loop on ``stream`` (default: the capture stream)."""
        stream = self.stream if stream is None else streams.resolve(stream)
        self.raw.launch(stream.raw)
        observe.notify("graph_launched", self, stream)


class _Capture:
    graph = None


def record_external(event_ptr, stream_ptr):
    """Record a raw event so that it becomes an event-record *node* of the graph being
    captured (``cudaEventRecordExternal``): it then timestamps every replay. A plain
    record during capture only marks a dependency and never completes."""
    rt = cupy_module().cuda.runtime
    if hasattr(rt, "eventRecordWithFlags"):
        rt.eventRecordWithFlags(event_ptr, stream_ptr, 1)
        return
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise GraphsUnsupported("recording a timeline inside a CUDA graph needs cuda-bindings "
                                "(pip install cuda-bindings), or run the graph with trace=False") from None
    err, = cudart.cudaEventRecordWithFlags(cudart.cudaEvent_t(event_ptr), cudart.cudaStream_t(stream_ptr),
                                           cudart.cudaEventRecordExternal)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaEventRecordWithFlags failed: {err}")


@contextlib.contextmanager
def capture_graph(stream):
    """Capture the work queued on ``stream`` inside the block into a :class:`Graph`.

    Other streams join the capture by waiting on an event recorded on a
    captured stream (a *fork*), and must be joined back before the block ends
    (``stream.wait_stream(other)``). Nothing runs during capture; host-side
    waits are not allowed in it.

    Examples
    --------
    >>> with capture_graph(compute) as cap:          # doctest: +SKIP
    ...     launch_wave2d(..., stream=compute)
    >>> cap.graph.launch()                            # doctest: +SKIP
    """
    ok, why = graphs_supported()
    if not ok:
        raise GraphsUnsupported(why)
    checks.instance("stream", stream, streams.Stream, "a Stream from create_streams()")
    if stream.is_default:
        raise ValueError("capture on a stream from create_streams(); the default stream cannot be captured")
    cap = _Capture()
    stream.raw.begin_capture()
    recording.capturing = True
    observe.notify("capture_started", stream)
    try:
        yield cap
    except BaseException:
        with contextlib.suppress(Exception):
            stream.raw.end_capture()
        raise
    finally:
        recording.capturing = False
    cap.graph = Graph(stream.raw.end_capture(), stream)
    observe.notify("capture_ended", stream, cap.graph)
