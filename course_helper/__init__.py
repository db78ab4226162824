"""course_helper: the helper package of the course *Overlapping GPU compute with IO*.

It runs on an NVIDIA GPU through CuPy, or - with no GPU - on a NumPy CPU
backend with the same API, the same semantics and the same results, whose
times are those of a modelled GPU (see :mod:`course_helper.runtime.model`).

The names a learner uses (``__all__``)::

    backend_name, set_backend, device_report, synchronize   which backend, which device
    create_streams, create_events, default_stream, elapsed_ms
    device_empty, device_zeros, to_device, to_host          device arrays
    pinned_empty, is_pinned, copy_to_host_async, copy_to_device_async, measure_bandwidth
    WaveProblem, launch_wave2d, reference_solution, kernel_source   the running example
    plan, solve, prepare, STRATEGIES, compare_strategies, graphs_supported   the IO strategies
    timing_only                                              sweeps of modelled times, fast
    tracing                                                  timelines of your own loops
    doctor                                                   why your own code does (not) overlap
    plot_slices, compare_slices, animate, show_code          looking at results and code
    bake_layer, check_layer_cake, LayerCakeError             the exercise
    physical_limit, plot_bench                               the benchmark's limit B
    sanitize, RaceError                                      the race sanitizer
    open_store                                               a run streamed to disk

Everything else stays reachable through its module: ``ch.strategies`` (the
loops the notebooks show, and the registry), ``ch.memory``, ``ch.streams``,
``ch.graphs``, ``ch.solver``, ``ch.wave``, ``ch.raw_cupy``, ``ch.exercises`` (each exercise's kernel
and checker). Beneath them the layers, each a
subpackage that names its few public names: ``ch.runtime`` (the two backends and the modelled
device), ``ch.timelines`` (recording and drawing what ran when), ``ch.disk`` (runs streamed to a
Zarr store), ``ch.distributed`` (several GPUs and the halo exchange) and ``ch.measure`` (the
benchmark, comparisons and calibration).
"""
from . import raw_cupy, strategies  # noqa: F401 - reached as ch.raw_cupy, ch.strategies
from . import disk, distributed, measure, runtime, timelines  # noqa: F401 - the layers, reached as ch.disk, ...
from .disk import open_store
from .exercises import LayerCakeError, bake_layer, check_layer_cake
from .graphs import graphs_supported
from .measure import compare_strategies, physical_limit, plot_bench
from .memory import (copy_to_device_async, copy_to_host_async, device_empty, device_zeros, is_pinned,
                     measure_bandwidth, pinned_empty, to_device, to_host)
from .runtime import backend_name, device_report, set_backend
from .sanitizer import RaceError, sanitize
from .solver import STRATEGIES, plan, prepare, solve, timing_only
from .streams import create_events, create_streams, default_stream, elapsed_ms, synchronize
from .timelines import doctor, tracing
from .viewer import animate, compare_slices, plot_slices, show_code
from .wave import WaveProblem, kernel_source, launch_wave2d, reference_solution

__version__ = "0.1.0"

__all__ = [
    "backend_name", "set_backend", "device_report", "synchronize",
    "create_streams", "create_events", "default_stream", "elapsed_ms",
    "device_empty", "device_zeros", "to_device", "to_host",
    "pinned_empty", "is_pinned", "copy_to_host_async", "copy_to_device_async", "measure_bandwidth",
    "WaveProblem", "launch_wave2d", "reference_solution", "kernel_source",
    "plan", "solve", "prepare", "STRATEGIES", "compare_strategies", "graphs_supported", "timing_only",
    "tracing", "doctor",
    "plot_slices", "compare_slices", "animate", "show_code",
    "bake_layer", "check_layer_cake", "LayerCakeError",
    "physical_limit", "plot_bench",
    "sanitize", "RaceError",
    "open_store",
]
