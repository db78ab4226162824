"""Timelines: what ran when, recorded while it is queued, exported to Perfetto and drawn inline.

:mod:`.timeline` holds a recorded timeline (:class:`Trace`), its numbers (:class:`Overlap`) and its
pictures (``trace.plot()``, :func:`plot_compared` for runs side by side on one time axis);
:mod:`.recording` records one (``ch.tracing()``), with the driver's own times from
:mod:`.cupti_trace` on a GPU where CUPTI is available; :mod:`.doctor` (``ch.doctor()``) records a
block of any code and :mod:`.analysis` says why its copies did or did not run under its kernels.
"""
from .analysis import Finding, Hidden, Records, hidden_by_direction
from .doctor import Diagnosis, diagnose_records, doctor
from .recording import Recorder, tracing
from .timeline import Overlap, Trace, TraceEvent, plot_compared

__all__ = ["Recorder", "tracing", "Overlap", "Trace", "TraceEvent", "plot_compared", "doctor", "Diagnosis",
           "diagnose_records", "Finding", "Records", "Hidden", "hidden_by_direction"]
