"""The overlap doctor: why a block of the learner's own code does not overlap, measured.

``with ch.doctor() as dx: ...`` records what the block did and :func:`.analysis.diagnose` says what
kept its copies from running under its kernels, each finding with the time it cost, the fix in the
course's words, the notebook that teaches it and the learner's line (docs/doctor.md).

* On a GPU with CUPTI (``cupti-python``) it works for *any* code in the block, plain CuPy included:
  the course's CUPTI session (:class:`.cupti_trace.ActivitySession`) records the device's kernels,
  copies (with the kind of host memory on each side) and fills, the host's API calls that queued
  them (runtime and driver records: CuPy launches kernels through ``cuLaunchKernel``) and its
  synchronisations. Where in the learner's Python each copy, fill and synchronisation was called
  comes from a CUPTI callback on those calls only, at their entry: it walks the Python stack to
  the first frame outside CuPy, NumPy, the standard library and the course's machinery
  (:func:`learner_line`), and keeps "file:line" under the call's correlation id, which joins it
  with the activity records. Kernel launches get no callback: a loop launches many, and the
  findings about launches (``launch-bound``) name no line.
* On the CPU backend it diagnoses loops written with the helper's API: the modelled GPU's
  recorder (:func:`.recording.tracing`) times the work, and an observer of the runtime notes each
  call's host time, host memory kind and line. Same records, same findings, same words; the
  report says the times are modelled.
"""
from __future__ import annotations

import contextlib
import html
import os
import sys
import sysconfig
import threading
from typing import TYPE_CHECKING, Any

from .. import runtime
from ..memory import is_pinned
from ..runtime import observe
from ..runtime.backend import cupy_module
from ..runtime.ops import OpKind
from . import cupti_trace
from .analysis import (DeviceOp, Finding, HostCall, HostSync, Records, diagnose, hidden_by_direction,
                       records_trace, threshold_ms)
from .recording import Recorder

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import FrameType

    from ..runtime.observe import Op
    from ..streams import Event, Stream
    from .timeline import Trace

__all__ = ["doctor", "Diagnosis", "learner_line", "diagnose_records"]

_KINDS = (OpKind.KERNEL, OpKind.D2H, OpKind.H2D, OpKind.D2D, OpKind.MEMSET)
_COPY_CLASS = {"kernel": OpKind.KERNEL, "DTOH": OpKind.D2H, "HTOD": OpKind.H2D, "DTOD": OpKind.D2D,
               "memset": OpKind.MEMSET}
_SYNC_TYPES = ("STREAM_SYNCHRONIZE", "EVENT_SYNCHRONIZE", "CONTEXT_SYNCHRONIZE")


# --------------------------------------------------------------------------
# The learner's line
# --------------------------------------------------------------------------
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The course's machinery: what a learner calls, never what a learner writes. The strategies' loops
# (strategies.py) and the exercises count as the learner's: the notebooks show them as loops to read.
_MACHINERY = tuple(os.path.join(_PACKAGE, p) for p in (
    "runtime" + os.sep, "timelines" + os.sep, "kernels" + os.sep, "streams.py", "memory.py", "graphs.py",
    "sanitizer.py", "host_watch.py", "checks.py", "wave.py", "raw_cupy.py", "solver.py", "files.py"))
_LIBRARIES = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_is_theirs: dict[str, bool] = {}


def _library(filename):
    """True for code that is not the learner's: CuPy, NumPy, CUPTI, the standard library, the
    course's machinery (cached by file name: a loop asks for the same few files again and again)."""
    found = _is_theirs.get(filename)
    if found is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        found = (path.startswith(_MACHINERY) or path.startswith(_LIBRARIES)
                 or any(part in path for part in ("/cupy/", "/cupyx/", "/cupy_backends/", "/cupti/", "/numpy/"))
                 or filename in ("<frozen runpy>", "<string>"))
        _is_theirs[filename] = found
    return found


def learner_line(frame: FrameType | None) -> str | None:
    """"file:line" of the first frame, from ``frame`` outwards, that is the learner's code (not
    CuPy, NumPy, CUPTI, the standard library or the course's machinery), or None.

    >>> import sys; learner_line(sys._getframe()).endswith(":1")    # a doctest's own line
    True
    """
    while frame is not None:
        code = frame.f_code
        if not _library(code.co_filename):
            return f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


# --------------------------------------------------------------------------
# The GPU: CUPTI's records, and the lines from callbacks
# --------------------------------------------------------------------------
#: The calls whose line the doctor takes at their entry: copies, fills and synchronisations.
_RUNTIME_CALLS = ("cudaMemcpyAsync_v3020", "cudaMemcpyAsync_ptsz_v7000", "cudaMemcpy_v3020",
                  "cudaMemcpy2DAsync_v3020", "cudaMemsetAsync_v3020", "cudaMemsetAsync_ptsz_v7000",
                  "cudaStreamSynchronize_v3020", "cudaStreamSynchronize_ptsz_v7000", "cudaDeviceSynchronize_v3020",
                  "cudaEventSynchronize_v3020")
_DRIVER_CALLS = ("cuMemcpyAsync", "cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoH_v2",
                 "cuMemcpyHtoD_v2", "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")


class CallSites:
    """A CUPTI callback subscriber that keeps, for each copy, fill and synchronisation call made
    while it runs, the learner's "file:line" under the call's correlation id (``sites``)."""

    def __init__(self):
        from cupti import cupti
        self._cupti = cupti
        self._enter = int(cupti.ApiCallbackSite.API_ENTER)
        self.sites: dict[int, str | None] = {}
        self.errors: list[str] = []
        self._subscriber = None
        self._local = threading.local()

    def start(self) -> CallSites:
        """Subscribe, and enable the callbacks of :data:`_RUNTIME_CALLS` and :data:`_DRIVER_CALLS`."""
        cupti = self._cupti
        self._subscriber = cupti.subscribe(self._callback, None)
        try:
            for domain, ids, names in ((cupti.CallbackDomain.RUNTIME_API, cupti.RuntimeApiTraceCbid, _RUNTIME_CALLS),
                                       (cupti.CallbackDomain.DRIVER_API, cupti.DriverApiTraceCbid, _DRIVER_CALLS)):
                for name in names:
                    cbid = getattr(ids, name, None)
                    if cbid is not None:             # a call this CUPTI does not know: no line for it
                        cupti.enable_callback(1, self._subscriber, domain, int(cbid))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Unsubscribe (safe to call more than once)."""
        if self._subscriber is not None:
            self._cupti.unsubscribe(self._subscriber)
            self._subscriber = None

    def _callback(self, userdata, domain, cbid, data):
        # Runs on the thread making the call, inside it: keep it short, and never raise into CUDA.
        if getattr(self._local, "inside", False):
            return
        self._local.inside = True
        try:
            if not hasattr(data, "callback_site"):
                data = self._cupti.CallbackData.from_ptr(int(data))
            if int(data.callback_site) == self._enter:
                self.sites[int(data.correlation_id)] = learner_line(sys._getframe(1))
        except Exception as exc:  # noqa: BLE001 - a missing line is better than a failed call
            if len(self.errors) < 3:
                self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self._local.inside = False


class _GpuBlock:
    """The doctor on a GPU: a CUPTI session of device work and host calls, and the callbacks'
    lines, turned into :class:`~.analysis.Records`."""

    def __init__(self, where: bool = True):
        ok, why = cupti_trace.available()
        if not ok:
            raise RuntimeError(f"the overlap doctor measures with CUPTI on a GPU, and CUPTI cannot be used here: "
                               f"{why}")
        self.session = cupti_trace.ActivitySession(
            kinds=("kernel", "memcpy", "memset", "runtime", "driver", "synchronization"))
        self.sites = CallSites() if where else None
        self.t_end_ns = None

    def start(self) -> None:
        self.session.start()
        try:
            cupti_trace.warm_up()            # CUPTI's kernel set-up, outside the block
            if self.sites is not None:
                self.sites.start()
            self.session.begin_here()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        cupti = self.session.cupti
        if self.t_end_ns is None:
            self.t_end_ns = int(cupti.get_timestamp())
        if self.sites is not None:
            self.sites.stop()
        with contextlib.suppress(Exception):   # a device error resurfaces at the learner's next call
            cupy_module().cuda.runtime.deviceSynchronize()
        self.session.stop()

    def _legacy_stream_id(self):
        """CUPTI's id of the legacy default stream (the NULL stream) of the current context, or None."""
        try:
            ctx = int(cupy_module().cuda.driver.ctxGetCurrent())
            return int(self.session.cupti.get_stream_id_ex(ctx, 0, 0))
        except Exception:  # noqa: BLE001 - then no stream is taken for the legacy default one
            return None

    def records(self) -> Records:
        cupy = cupy_module()
        legacy = self._legacy_stream_id()
        t0, t_end = self.session.t0_ns, self.t_end_ns
        sites = self.sites.sites if self.sites is not None else {}

        def ms(ns):
            return (ns - t0) / 1e6

        ops, calls, syncs, streams, call_names = [], [], [], {}, {}
        for r in self.session.records:
            if r["cls"] == "api":
                call_names[r["corr"]] = r["call"]
        for r in sorted(self.session.records, key=lambda r: r["start_ns"]):
            cls = r["cls"]
            if cls == "api":
                role = cupti_trace.call_role(r["call"])
                if role != "sync" and r["start_ns"] <= t_end:
                    calls.append(HostCall(role, r["call"], ms(r["start_ns"]), ms(r["end_ns"]), r["corr"],
                                          sites.get(r["corr"])))
            elif cls == "sync":
                if r["sync_type"] in _SYNC_TYPES and r["start_ns"] <= t_end:
                    stream = str(r["stream_id"]) if r["sync_type"] == "STREAM_SYNCHRONIZE" else None
                    syncs.append(HostSync(r["sync_type"], stream, ms(r["start_ns"]), ms(r["end_ns"]),
                                          call_names.get(r["corr"], ""), sites.get(r["corr"])))
            elif cls in _COPY_CLASS:
                kind, key = _COPY_CLASS[cls], str(r["stream_id"])
                if key not in streams:
                    is_legacy = r["stream_id"] == legacy
                    streams[key] = {"name": "default stream (legacy)" if is_legacy else f"stream {key}",
                                    "legacy_default": is_legacy}
                host = r["dst_kind"] if kind == OpKind.D2H else r["src_kind"] if kind == OpKind.H2D else None
                name = r["name"] if cls == "kernel" else str(kind)
                ops.append(DeviceOp(str(kind), key, ms(r["start_ns"]), ms(r["end_ns"]), int(r["bytes"]), host,
                                    r["corr"], name[:60]))
        meta = {"callback_errors": self.sites.errors} if self.sites is not None and self.sites.errors else {}
        device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return Records(ops, calls, syncs, streams, timing="CUPTI",
                       device=device.decode() if isinstance(device, bytes) else str(device), meta=meta)


# --------------------------------------------------------------------------
# The CPU backend: the modelled GPU's recorder, and an observer of the helper's calls
# --------------------------------------------------------------------------
_CALLS, _SYNCS = "doctor: calls", "doctor: syncs"      # the observer's lanes, taken out of the trace
_OWN_WAIT = object()          # the wait just heard was a copy call's own (see _Watch.host_waited)
_CPU_CALL = {OpKind.KERNEL: ("launch", "cuLaunchKernel"), OpKind.MEMSET: ("memset", "cudaMemsetAsync")}
_CPU_SYNC = {"Stream": ("STREAM_SYNCHRONIZE", "cudaStreamSynchronize"),
             "Event": ("EVENT_SYNCHRONIZE", "cudaEventSynchronize"),
             None: ("CONTEXT_SYNCHRONIZE", "cudaDeviceSynchronize")}


class _Watch:
    """An observer of the helper's calls on the CPU backend: each operation's host call (its time on
    the modelled host clock, handed to the recorder as an interval), the host memory a copy touched,
    the host's waits, and the learner's line of each."""

    def __init__(self, rt, recorder, where=True):
        self.runtime, self.recorder = rt, recorder
        self.line = learner_line if where else (lambda frame: None)
        self.ops, self.syncs = [], []
        self._open, self._pending = {}, None
        self._last = rt.host_ms()
        self._last_call_start = float("-inf")

    def track_of(self, stream: Stream) -> str:
        """The stream's lane on the recorder's timeline (two streams of one name get two lanes)."""
        marks = self.recorder.marks
        return marks.track_of(stream) if marks is not None else stream.name

    def op_queued(self, op: Op) -> None:
        if op.stream.runtime is self.runtime and op.kind in _KINDS:
            self._open[id(op)] = (self.runtime.host_ms(), self.line(sys._getframe(1)))

    def op_issued(self, op: Op) -> None:
        opened = self._open.pop(id(op), None)
        if opened is None:
            return
        t1 = self.runtime.host_ms()
        host = None
        if op.kind in (OpKind.D2H, OpKind.H2D):
            side = op.writes if op.kind == OpKind.D2H else op.reads
            host = "PINNED" if side and is_pinned(side[0]) else "PAGEABLE"
        self.recorder.add_interval(_CALLS, "host call", str(len(self.ops)), opened[0], t1)
        self.ops.append((op.kind, op.stream, host, opened[1], self.track_of(op.stream)))
        self._last_call_start = opened[0]
        self._last = t1

    def host_waited(self, name: str, t_start_ms: float, t_end_ms: float) -> None:
        if self.ops and self._last_call_start >= t_start_ms:
            # A wait around a copy call (a copy to pageable memory: the call returns when the copy is
            # done) is that call's own time, as CUPTI records it on a GPU: no synchronisation.
            self._pending = _OWN_WAIT
            return
        self.recorder.add_interval(_SYNCS, "host sync", str(len(self.syncs)), t_start_ms, t_end_ms)
        self.syncs.append([name, None, self.line(sys._getframe(1))])
        self._pending = len(self.syncs) - 1
        self._last = t_end_ms

    def host_synced(self, target: Stream | Event | None) -> None:
        if self._pending is _OWN_WAIT:
            self._pending = None
            return
        if self._pending is None:          # a wait for the whole device: timed since the last call
            now = self.runtime.host_ms()
            self.recorder.add_interval(_SYNCS, "host sync", str(len(self.syncs)), self._last, now)
            self.syncs.append(["synchronize", None, self.line(sys._getframe(1))])
            self._pending = len(self.syncs) - 1
            self._last = now
        self.syncs[self._pending][1] = target
        self._pending = None


class _CpuBlock:
    """The doctor on the CPU backend: the recorder's modelled times, joined with the observer's
    notes into :class:`~.analysis.Records`."""

    def __init__(self, where: bool = True):
        self.recorder = Recorder({"strategy": "doctor"})
        self.watch = _Watch(self.recorder.runtime, self.recorder, where)

    def start(self) -> None:
        self.recorder.activate()
        observe.add(self.watch)

    def stop(self) -> None:
        observe.remove(self.watch)
        self.trace = self.recorder.finish()

    def records(self) -> Records:
        trace, watch = self.trace, self.watch
        mine = {_CALLS: {}, _SYNCS: {}}
        device = {}
        for e in trace.events:
            if e.track in mine:
                mine[e.track][int(e.name)] = e
            elif e.kind in _KINDS:
                device.setdefault((e.track, str(e.kind)), []).append(e)      # in start order: queue order
        queued = {}
        for i, (kind, _stream, _host, _where, track) in enumerate(watch.ops):
            queued.setdefault((track, str(kind)), []).append(i)
        ops, calls, streams = [], [], {}
        for i, (kind, stream, _host, where, track) in enumerate(watch.ops):
            what, name = _CPU_CALL.get(kind, ("copy", "cudaMemcpyAsync"))
            call = mine[_CALLS].get(i)
            if call is not None:
                calls.append(HostCall(what, name, call.start_ms, call.end_ms, i, where))
            streams.setdefault(track, {"name": track, "legacy_default": bool(stream.is_default),
                                       "blocking": bool(stream.blocking)})
        for key, indices in queued.items():
            for i, e in zip(indices, device.get(key, [])):
                kind, _stream, host, _, track = watch.ops[i]
                ops.append(DeviceOp(str(kind), track, e.start_ms, e.end_ms, int(e.bytes), host, i, e.name))
        syncs = []
        for j, (_label, target, where) in enumerate(watch.syncs):
            e = mine[_SYNCS].get(j)
            if e is None:
                continue
            what, call = _CPU_SYNC.get(type(target).__name__ if target is not None else None, _CPU_SYNC[None])
            stream = watch.track_of(target) if type(target).__name__ == "Stream" else None
            syncs.append(HostSync(what, stream, e.start_ms, e.end_ms, call, where))
        ops.sort(key=lambda o: o.start)
        return Records(ops, calls, syncs, streams, timing=trace.timing, device=trace.meta.get("device", ""),
                       modelled=True, meta={"wait labels": sorted({s[0] for s in watch.syncs})})


# --------------------------------------------------------------------------
# The result
# --------------------------------------------------------------------------
class Diagnosis:
    """What the doctor found in one block (:func:`doctor`), or in saved records (:func:`diagnose_records`).

    Attributes
    ----------
    findings : list of Finding
        Root cause first; empty for a loop that overlaps well. Each has ``code``, ``message``,
        ``where`` (the learner's "file:line"), ``cost_ms`` and ``numbers``.
    hidden : float
        The share of the copy time (to and from the host) during which a kernel ran too
        (:func:`~.analysis.hidden_by_direction`'s rule, both directions together): the trace's
        :attr:`~.timeline.Overlap.copy_fraction`; 0.0 without copies.
    by_direction : dict of str to Hidden
        The same per direction.
    trace : Trace
        The course's timeline of the block: ``dx.trace.plot()``, ``dx.trace.to_chrome_json(path)``.
    records : Records
        What was recorded (``dx.records.save(path)`` keeps it for later).
    modelled : bool
        True on the CPU backend: the times are the modelled GPU's.
    """

    def __init__(self, records: Records):
        self.records = records
        self.modelled = records.modelled
        self.findings: list[Finding] = diagnose(records)
        self.trace: Trace = records_trace(records)
        self.by_direction = hidden_by_direction(self.trace)
        overlap = self.trace.overlap((OpKind.D2H, OpKind.H2D))
        self.hidden: float = overlap.copy_fraction
        s = self.trace.summary()
        self.numbers: dict[str, float] = {
            "span_ms": s["total_ms"], "compute_ms": s["compute_ms"], "copy_ms": s["copy_ms"],
            "hidden": self.hidden, "host_sync_ms": sum(x.end - x.start for x in records.syncs),
            "host_in_copy_calls_ms": sum(c.end - c.start for c in records.calls if c.what == "copy"),
            "threshold_ms": threshold_ms(s["total_ms"])}

    @property
    def codes(self) -> list[str]:
        """The findings' codes, root cause first."""
        return [f.code for f in self.findings]

    def headline(self) -> str:
        """One line: what ran, how long, how much of the copying was hidden, and on what clock."""
        n = self.numbers
        kernels, copies = len(self.trace.kernels), len(self.trace.of_kind(OpKind.D2H, OpKind.H2D))
        clock = (f"{self.records.timing}: times predicted by the CPU backend's model" if self.modelled
                 else f"{self.records.timing} on {self.records.device}")
        return (f"{kernels} kernels and {copies} host copies in {n['span_ms']:.2f} ms ({clock}); "
                f"{100 * self.hidden:.0f}% of the copy time ran under kernels; compute busy {n['compute_ms']:.2f} "
                f"ms, copies busy {n['copy_ms']:.2f} ms, the host waited {n['host_sync_ms']:.2f} ms in "
                f"synchronisations and {n['host_in_copy_calls_ms']:.2f} ms inside copy calls")

    def report(self) -> str:
        """The short report ``print(dx)`` shows."""
        lines = ["Overlap doctor" + (" (modelled)" if self.modelled else "") + ": " + self.headline()]
        if not self.records.ops:
            lines.append(self._nothing_recorded())
        elif not self.findings:
            lines.append(f"No findings: nothing cost {self.numbers['threshold_ms']:.2f} ms or more "
                         "(docs/doctor.md says how each finding is measured).")
        for i, f in enumerate(self.findings, 1):
            lines.append(f"{i}. {f.message}")
        return "\n".join(lines)

    def _nothing_recorded(self) -> str:
        """What to say of a block that queued no device work the doctor could see."""
        text = "No device work was recorded in the block: nothing to diagnose."
        if self.modelled:
            text += (" On the CPU backend the doctor sees the work queued with the helper's API (ch.launch_wave2d, "
                     "ch.copy_to_host_async, streams of ch.create_streams, ...); plain CuPy code needs a GPU.")
        return text

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        return f"<Diagnosis {self.codes or 'no findings'}, hidden {100 * self.hidden:.0f}%>"

    def _repr_html_(self) -> str:
        e = html.escape
        rows = "".join(
            f"<tr><td><code>{e(f.code)}</code></td><td>{f.cost_ms:.2f}</td><td>{e(f.where or '')}</td>"
            f"<td>{e(f.message.split(': ', 1)[1])}</td></tr>" for f in self.findings)
        body = (f"<table><tr><th>code</th><th>cost (ms)</th><th>where</th><th>what, and the fix</th></tr>{rows}</table>"
                if rows else f"<p>{e(self._nothing_recorded())}</p>" if not self.records.ops
                else f"<p>No findings: nothing cost {self.numbers['threshold_ms']:.2f} ms or more.</p>")
        title = "Overlap doctor" + (" (modelled)" if self.modelled else "")
        return f"<div><b>{e(title)}</b>: {e(self.headline())}{body}</div>"


def diagnose_records(records: Records | dict | str | os.PathLike) -> Diagnosis:
    """The :class:`Diagnosis` of saved records (a :class:`Records`, its dict, or the path of its JSON)."""
    if isinstance(records, dict):
        records = Records.from_dict(records)
    elif not isinstance(records, Records):
        records = Records.load(records)
    return Diagnosis(records)


class _Handle:
    """What ``with doctor() as dx`` gives: the :class:`Diagnosis`, once the block ends."""

    def __init__(self):
        self.diagnosis = None

    def __getattr__(self, attr):
        if attr.startswith("__") or self.__dict__.get("diagnosis") is None:
            if attr.startswith("_repr"):
                raise AttributeError(attr)
            raise RuntimeError("the diagnosis is ready only after the `with doctor()` block ends")
        return getattr(self.diagnosis, attr)

    def __str__(self) -> str:
        return str(self.diagnosis) if self.diagnosis is not None else "<doctor: the block has not ended>"

    def __repr__(self) -> str:
        return repr(self.diagnosis) if self.diagnosis is not None else "<doctor: the block has not ended>"

    def _repr_html_(self) -> str | None:
        return self.diagnosis._repr_html_() if self.diagnosis is not None else None


@contextlib.contextmanager
def doctor(where: bool = True) -> Iterator[Any]:
    """Record the block, then say why its copies did or did not run under its kernels.

    On a GPU it measures any code with CUPTI (plain CuPy included); on the CPU backend it diagnoses
    the helper's API on the modelled GPU. ``where=False`` skips finding the learner's lines (on a
    GPU: no CUPTI callbacks at all). One recording at a time: not inside ``ch.tracing()`` or a
    traced ``solve`` (pass ``trace=False`` to a ``solve`` inside the block).

    Examples
    --------
    >>> with ch.doctor() as dx:                      # doctest: +SKIP
    ...     for step in range(8):
    ...         y = step_kernels(x)
    ...         host = y.get()
    >>> print(dx)                                    # doctest: +SKIP
    >>> dx.findings[0].code, dx.findings[0].where    # doctest: +SKIP
    ('pageable-copy', 'my_loop.py:12')
    """
    where = bool(where)
    block = _CpuBlock(where) if runtime.get().clock_label else _GpuBlock(where)
    handle = _Handle()
    block.start()
    try:
        yield handle
    finally:
        block.stop()
    handle.diagnosis = Diagnosis(block.records())

