"""The active runtime: which one runs the work now, its clock, and :func:`submit`, the one door
every operation of the course goes through (see :mod:`course_helper.runtime`)."""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from . import observe, profiles
from .backend import backend_name, generation, profile_name
from .model import ModelRuntime
from .ops import Cost
from .base import CpuDeviceArray, GraphsUnsupported, Runtime

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
                    from .gpu import GpuRuntime  # imported here so the CPU never imports CuPy
                    rt = GpuRuntime()
                else:
                    rt = ModelRuntime(profiles.load(key[1]))
                _runtimes[key] = rt
    return rt


def host_ms() -> float:
    """The active runtime's host clock in ms (modelled on the CPU backend)."""
    return get().host_ms()


def time_label() -> str:
    """How times of the active backend are to be read: ``""`` on a GPU, ``"modelled H200"`` on the model."""
    return get().clock_label


def wants_op(stream: Any) -> bool:
    """Whether work queued on ``stream`` needs an :class:`~course_helper.runtime.observe.Op` description:
    the model runs from it and observers read it. CuPy on a GPU with nobody watching needs none,
    so callers may skip building one, queue the work directly and note what they queued in the
    thread's op journal (:func:`observe.note_op`, read by a CUPTI recording)."""
    return stream.runtime.needs_op or observe.wants_ops()


def submit(stream: Any, op: observe.Op, *, cuda: Callable | None, numpy: Callable | None,
           cost: Cost) -> None:
    """Queue the checked operation ``op`` on the helper ``stream`` and tell the observers.

    ``op_queued`` is announced before the runtime queues it and ``op_issued``
    after, so that an observer can bracket it (the timeline recorder does).
    """
    observe.notify("op_queued", op)
    stream.runtime.enqueue(stream.raw, op, cuda, numpy, cost)
    observe.notify("op_issued", op)
    observe.note_op(op.kind, op.name, stream, op.level, op.nbytes)
