"""Timelines: what ran when, recorded while it is queued, exported to Perfetto and drawn inline.

:mod:`.timeline` holds a recorded timeline (:class:`Trace`) and its numbers (:class:`Overlap`);
:mod:`.recording` records one (``ch.tracing()``), with the driver's own times from
:mod:`.cupti_trace` on a GPU where CUPTI is available.
"""
from .recording import Recorder, tracing
from .timeline import Overlap, Trace, TraceEvent

__all__ = ["Recorder", "tracing", "Overlap", "Trace", "TraceEvent"]
