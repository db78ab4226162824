"""The runtime layer: the one place where device work is queued, ordered and timed.

Every operation of the course - a kernel, a copy, a fill, an event record, a
stream waiting on an event, a host wait, a host function, a CUDA graph
capture or replay, reading the time between two events - goes through the
active :class:`Runtime`. There are two:

* :class:`course_helper.runtime.gpu.GpuRuntime` queues the work on a CUDA GPU
  through CuPy;
* :class:`course_helper.runtime.model.ModelRuntime` (the CPU backend) runs the same
  work in NumPy on a *modelled* GPU: a deterministic discrete-event model of
  the device's engines and links, calibrated on a real GPU, that keeps
  modelled time.

The modules above this one (streams, memory, the kernels, the solver) never
ask which backend is active; the observers of :mod:`course_helper.runtime.observe`
(the timeline recorder, the race sanitizer) watch what is queued here and
never dispatch it.

Objects that a runtime hands out (streams, events, graphs) are *raw* objects
of that runtime; :mod:`course_helper.streams` wraps them for learners.

Its modules, from the bottom up: :mod:`.ops` (what an operation is: its kind, one of
:class:`~.ops.OpKind`, and its cost as a type), :mod:`.base` (the :class:`Runtime` interface), :mod:`.profiles`
(the modelled device's measured figures), :mod:`.observe` (who watches the queued work),
:mod:`.backend` (which backend is active), :mod:`.model` and :mod:`.gpu` (the two runtimes) and
:mod:`.active` (the one in use, and :func:`submit`, the one door every operation goes through);
:mod:`.nvtx_ranges` names the queued work in Nsight Systems when a profiler runs the program
(decided once, here, at import).
"""
from .active import get, host_ms, submit, time_label, wants_op
from .backend import BackendUnavailable, backend_name, device_report, gpu_available, set_backend
from .base import CpuDeviceArray, GraphsUnsupported, PinnedArray, Runtime
from . import nvtx_ranges

nvtx_ranges.start()         # a no-op unless a profiler runs the program and nvtx is installed

__all__ = ["get", "host_ms", "submit", "time_label", "wants_op",
           "BackendUnavailable", "backend_name", "device_report", "gpu_available", "set_backend",
           "CpuDeviceArray", "PinnedArray", "GraphsUnsupported", "Runtime"]
