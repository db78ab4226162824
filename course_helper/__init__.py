"""course_helper: the helper package of the course *Overlapping GPU compute with IO*.

It runs on an NVIDIA GPU through CuPy, or - with no GPU - on a NumPy CPU
backend with the same API, the same semantics and the same results, whose
times are those of a modelled GPU (see :mod:`course_helper.model`).

The names a learner uses::

    backend_name, device_report            which backend, which device
    create_streams, create_events          streams and events
    pinned_empty, copy_to_host_async, ...  pinned memory and asynchronous copies
    WaveProblem, launch_wave2d             the running example
    solve, compare_strategies              the IO strategies, timed and traced
    plot_slices, compare_slices, animate   looking at the wavefield
"""
from .backend import (BackendUnavailable, backend_name, device_report, gpu_available,
                      print_device_report, set_backend)
from .compare import Comparison, compare_strategies
from .memory import (CpuDeviceArray, copy_on_device_async, copy_to_device_async, copy_to_host,
                     copy_to_host_async, device_empty, device_zeros, host_memory_available, zero_async,
                     is_device_array, is_pinned, measure_bandwidth, pinned_empty, pinned_zeros,
                     to_device, to_host)
from .solver import STRATEGIES, Result, plan_memory, solve
from .streams import (Event, Stream, create_events, create_streams, current_stream, default_stream,
                      elapsed_ms, stream_priority_range, synchronize)
from .timeline import Trace, TraceEvent
from .recording import tracing
from .viewer import SliceViewer, animate, compare_slices, plot_slices, show_code
from .graphs import Graph, GraphsUnsupported, capture_graph, graphs_supported
from .exercise import LayerCakeError, bake_layer, check_layer_cake, layer_values
from .wave import WaveProblem, kernel_source, launch_wave2d, reference_solution, ricker

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable", "backend_name", "device_report", "gpu_available", "print_device_report",
    "set_backend", "synchronize",
    "Stream", "Event", "create_streams", "create_events", "current_stream", "default_stream",
    "elapsed_ms", "stream_priority_range",
    "CpuDeviceArray", "device_empty", "device_zeros", "to_device", "to_host", "is_device_array",
    "pinned_empty", "pinned_zeros", "is_pinned", "copy_to_host_async", "copy_to_device_async",
    "copy_on_device_async", "copy_to_host", "zero_async", "measure_bandwidth", "host_memory_available",
    "capture_graph", "Graph", "GraphsUnsupported", "graphs_supported",
    "WaveProblem", "launch_wave2d", "reference_solution", "ricker", "kernel_source",
    "solve", "Result", "STRATEGIES", "plan_memory",
    "tracing", "Trace", "TraceEvent", "compare_strategies", "Comparison",
    "plot_slices", "compare_slices", "animate", "SliceViewer", "show_code",
    "bake_layer", "layer_values", "check_layer_cake", "LayerCakeError",
]
