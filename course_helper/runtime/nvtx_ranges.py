"""NVTX ranges: the helper's operations named in Nsight Systems as on the course's timelines.

When a profiler that reads NVTX runs the program (Nsight Systems, Nsight Compute: they set
``NVTX_INJECTION64_PATH`` for the program they start) and the ``nvtx`` package is installed
(``pip install nvtx``, the ``nvtx`` extra), every kernel, copy and fill the helper queues is
wrapped in an NVTX range of the domain ``course_helper``, named as the course's timelines name
it ("wave2d_4o level 12", "D2H level 3"), and each host wait leaves a mark ("wait for io 2").
Nsight Systems draws the ranges on the host thread and projects them onto the GPU work each one
queued, so a learner's own loop reads there with the course's names.

Whether the ranges are on is decided once, when the package is imported: then an observer
(:mod:`.observe`) is added that pushes a range as each operation is queued and pops it once it
is. Without a profiler, or without ``nvtx``, nothing is added, and queueing work costs
exactly what it costs without this module. ``COURSE_HELPER_NVTX=1`` turns the ranges on
without a profiler (for a test), ``COURSE_HELPER_NVTX=0`` keeps them off under one.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from . import observe
from .ops import COLOURS

if TYPE_CHECKING:
    from types import ModuleType

    from .observe import Op

__all__ = ["DOMAIN", "wanted", "NvtxRanges", "start", "active", "stop"]

DOMAIN = "course_helper"

_active = None          # the observer once started


def wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether ranges are wanted: ``COURSE_HELPER_NVTX`` when set to 0 or 1, else whether a
    profiler injects an NVTX tool into this process (``NVTX_INJECTION64_PATH``)."""
    environ = os.environ if environ is None else environ
    setting = environ.get("COURSE_HELPER_NVTX", "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return bool(environ.get("NVTX_INJECTION64_PATH"))


class NvtxRanges:
    """Observer: an NVTX range around the queueing of each operation, named as on timelines;
    a mark at each host wait."""

    def __init__(self, nvtx: ModuleType) -> None:
        self.nvtx = nvtx

    def op_queued(self, op: Op) -> None:
        self.nvtx.push_range(message=op.name, color=COLOURS.get(op.kind, "#7f7f7f"), domain=DOMAIN)

    def op_issued(self, op: Op) -> None:
        self.nvtx.pop_range(domain=DOMAIN)

    def host_waited(self, name: str, t_start_ms: float, t_end_ms: float) -> None:
        self.nvtx.mark(message=name, color="#7f7f7f", domain=DOMAIN)


def start(environ: dict[str, str] | None = None) -> NvtxRanges | None:
    """Add the NVTX observer (for every thread) when :func:`wanted` and ``nvtx`` imports;
    returns it, or None when the ranges stay off. Called once, when the package is imported."""
    global _active
    if _active is not None or not wanted(environ):
        return _active
    try:
        nvtx = importlib.import_module("nvtx")
    except ImportError:
        return None
    _active = observe.add(NvtxRanges(nvtx), every_thread=True)
    return _active


def active() -> NvtxRanges | None:
    """The NVTX observer when the ranges are on, else None."""
    return _active


def stop() -> None:
    """Remove the NVTX observer (a test's clean-up)."""
    global _active
    if _active is not None:
        observe.remove(_active)
        _active = None
