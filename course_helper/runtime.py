"""The runtime layer: the one place where device work is queued, ordered and timed.

Every operation of the course - a kernel, a copy, a fill, an event record, a
stream waiting on an event, a host wait, a host function, a CUDA graph
capture or replay, reading the time between two events - goes through the
active :class:`Runtime`. There are two:

* :class:`course_helper.gpu_runtime.GpuRuntime` queues the work on a CUDA GPU
  through CuPy;
* :class:`course_helper.model.ModelRuntime` (the CPU backend) runs the same
  work in NumPy on a *modelled* GPU: a deterministic discrete-event model of
  the device's engines and links, calibrated on a real GPU, that keeps
  modelled time.

The modules above this one (streams, memory, the kernels, the solver) never
ask which backend is active; the observers of :mod:`course_helper.observe`
(the timeline recorder, the race sanitizer) watch what is queued here and
never dispatch it.

Objects that a runtime hands out (streams, events, graphs) are *raw* objects
of that runtime; :mod:`course_helper.streams` wraps them for learners.
"""
from __future__ import annotations

import os
import threading

from . import observe, profiles
from .backend import backend_name, generation, profile_name
from .model import ModelRuntime
from .runtime_base import CpuDeviceArray, GraphsUnsupported, Runtime

__all__ = ["Runtime", "GraphsUnsupported", "CpuDeviceArray", "get", "submit", "wants_op", "host_ms",
           "time_label"]

_lock = threading.Lock()
_runtimes = {}
_active = (None, None)          # (backend generation, runtime): the fast path of get()


def get() -> Runtime:
    """The runtime of the active backend (and, on the CPU, of the active profile)."""
    global _active
    gen, rt = _active
    if gen == generation() and rt is not None:
        return rt
    rt = _choose()
    _active = (generation(), rt)
    return rt


def _choose():
    name = backend_name()
    profile = profile_name() if name == "cpu" else None
    # A profile file rewritten since (a new calibration) is a new device: read it again.
    stamp = os.path.getmtime(profile) if profile and os.path.isfile(profile) else None
    key = (name, profile, stamp)
    rt = _runtimes.get(key)
    if rt is None:
        with _lock:
            rt = _runtimes.get(key)
            if rt is None:
                if name == "gpu":
                    from .gpu_runtime import GpuRuntime     # imported here so the CPU never imports CuPy
                    rt = GpuRuntime()
                else:
                    rt = ModelRuntime(profiles.load(key[1]))
                _runtimes[key] = rt
    return rt


def host_ms():
    """The active runtime's host clock in ms (modelled on the CPU backend)."""
    return get().host_ms()


def time_label():
    """How times of the active backend are to be read: ``""`` on a GPU, ``"modelled H200"`` on the model."""
    rt = get()
    return rt.device_label if rt.modelled else ""


def wants_op(stream):
    """Whether work queued on ``stream`` needs an :class:`~course_helper.observe.Op` description:
    the model runs from it and observers read it. CuPy on a GPU with nobody watching needs none,
    so callers may skip building one, queue the work directly and note what they queued in the
    thread's op journal (:func:`observe.note_op`, read by a CUPTI recording)."""
    return stream.runtime.needs_op or observe.wants_ops()


def submit(stream, op, *, cuda, numpy, cost):
    """Queue the checked operation ``op`` on the helper ``stream`` and tell the observers.

    ``op_queued`` is announced before the runtime queues it and ``op_issued``
    after, so that an observer can bracket it (the timeline recorder does).
    """
    observe.notify("op_queued", op)
    stream.runtime.enqueue(stream.raw, op, cuda, numpy, cost)
    observe.notify("op_issued", op)
    if observe.journals_open:
        observe.note_op(op.kind, op.name, stream, op.level, op.nbytes)
