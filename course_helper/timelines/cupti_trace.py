"""Timelines from CUPTI: the driver's own record of every kernel, copy and fill.

On an NVIDIA GPU with ``cupti-python`` installed, a traced run
(``solve(trace=True)`` or ``with tracing():``) is timed by CUPTI's activity
records: hardware start and end timestamps of each kernel, copy and memset,
with the stream (or graph node) it ran on and the bytes it moved. The helper
then queues nothing extra, so the traced run does the same device work as an
untraced one (graphs included: no timing nodes are captured).

Each record is matched with the operation the helper queued, which carries
the course's names: the stream ("compute", "io 2"), the time level and the
label. The matching is **by order**: work on one stream runs in the order it
was queued, so the k-th kernel record of a stream belongs to the k-th kernel
queued on that stream (copies and fills likewise, each kind on its own). A
replayed CUDA graph runs on streams of its own, so there the k-th kernel (or
copy) to *start* is the k-th captured: in the course's captured loops each
kind of work forms one chain. Host waits stay on the host clock.

CUPTI sets up its kernel tracing at the first kernel launch of a recording
session, which takes far longer than a launch (docs/tracing.md says how long). A
recording therefore starts with one tiny launch of a kernel of its own
(:func:`warm_up`), before the work it records; that launch is left out of the trace.

CUPTI's timestamps run on CUPTI's own clock, host waits on the runtime's host
clock (:func:`course_helper.runtime.host_ms`). A session reads the two clocks
together when it begins and when it stops (:func:`read_clocks_together`), and
maps every record onto the host clock through those two readings, so that host
and device lanes share one origin: a host wait that ends when a kernel ends is
drawn ending where the kernel does, however long CUPTI's set-up took.

Without CUPTI (the CPU backend, ROCm, or ``cupti-python`` not installed) the
recorder falls back to CUDA events around each operation. Every trace says
which one timed it in ``trace.meta["timing"]``. Set the environment variable
``COURSE_HELPER_TIMING=events`` to ask for the event timing even where CUPTI
works (to compare the two), or ``=cupti`` to fail when CUPTI is missing.
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

from ..runtime import observe
from .. import runtime
from ..runtime.backend import cupy_module
from ..runtime.ops import OpKind
from .timeline import TraceEvent

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..graphs import Graph
    from ..streams import Stream

__all__ = ["available", "wanted", "ActivitySession", "CuptiTimer", "TIMING_ENV", "read_clocks_together",
           "call_role"]

TIMING_ENV = "COURSE_HELPER_TIMING"
_CHOICES = ("auto", "cupti", "events")
_BUFFER_BYTES = 8 * 2**20

# The helper's operation kinds and the CUPTI record class each is matched with (a halo
# exchange, NCCL's send/recv, runs as a kernel on the halo stream).
_OP_CLASS = {OpKind.KERNEL: "kernel", OpKind.D2H: "DTOH", OpKind.H2D: "HTOD", OpKind.D2D: "DTOD",
             OpKind.MEMSET: "memset", OpKind.HALO: "kernel"}
# Where a graph capture began and ended, among the op journal's entries.
_CAPTURE_BEGINS, _CAPTURE_ENDS = ("capture begins",), ("capture ends",)


_WARM_UP = r"""
extern "C" __global__ void course_helper_cupti_warm_up(int* x) { x[0] = 1; }
"""


def warm_up() -> None:
    """Launch one tiny kernel on a stream of its own and wait for it, telling no observer
    (GPU backend).

    A CUPTI recording calls this right after it starts: the first kernel launch under a new
    CUPTI session sets up CUPTI's kernel tracing, which would otherwise land inside the
    recorded loop and count as tracing overhead."""
    if not runtime.get().runs_cuda:
        raise RuntimeError("warm_up launches a CUDA kernel itself, so it needs the GPU backend; "
                           "the CPU backend has no CUPTI to warm up")
    cupy = cupy_module()
    kernel = cupy.RawKernel(_WARM_UP, "course_helper_cupti_warm_up")   # compiled once, then cached by CuPy
    target = cupy.zeros(1, cupy.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        kernel((1,), (1,), (target,))
    stream.synchronize()


def available() -> tuple[bool, str]:
    """``(True, "")`` when CUPTI can time traces here, else ``(False, reason)``."""
    if not runtime.get().runs_cuda:
        return False, "CUPTI needs the GPU backend"
    if getattr(cupy_module().cuda.runtime, "is_hip", False):
        return False, "CUPTI is NVIDIA's; this CuPy is built for ROCm"
    try:
        from cupti import cupti  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no CUPTI
        return False, f"cupti-python is not importable ({exc}); install the 'cuda13' extra"
    return True, ""


def wanted() -> bool:
    """True when new traces should be timed by CUPTI.

    That is: CUPTI is :func:`available`, no other CUPTI recording is running
    in this process (e.g. ``cupti_check.run_with_cupti`` around the run), and
    ``COURSE_HELPER_TIMING`` is unset or ``auto``. ``events`` always gives the
    event timing; ``cupti`` raises when CUPTI cannot be used.
    """
    choice = os.environ.get(TIMING_ENV, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{TIMING_ENV}={choice!r} is not one of {_CHOICES}")
    if choice == "events":
        return False
    ok, why = available()
    if ok and _receiver is not None:
        ok, why = False, "another CUPTI recording is running in this process"
    if choice == "cupti" and not ok:
        raise RuntimeError(f"{TIMING_ENV}=cupti, but CUPTI cannot be used: {why}")
    return ok


# --------------------------------------------------------------------------
# The raw activity records
# --------------------------------------------------------------------------
_receiver = None          # the ActivitySession that CUPTI's buffers go to
_callbacks_registered = False


def _buffer_requested():
    return _BUFFER_BYTES, 0


def _buffer_completed(activities):
    # Runs on a CUPTI thread or inside a flush. The activity objects point into
    # CUPTI's buffer, which is reused after this returns: copy the fields now.
    if _receiver is not None:
        _receiver._take(activities)


class ActivitySession:
    """CUPTI activity recording of kernels, copies and memsets between
    :meth:`start` and :meth:`stop`; ``records`` then holds one dict per
    operation: ``cls`` ("kernel", "DTOH", "HTOD", "DTOD", "memset", ...),
    ``start_ns``, ``end_ns``, ``stream_id``, ``bytes``, ``name``,
    ``graph_id`` (0 outside graphs), ``channel`` (the hardware channel the work was queued on: a channel
    feeds an engine, it is not one) and
    ``dst_kind`` (copies: "PINNED", "PAGEABLE", "DEVICE").

    ``kinds`` picks what is recorded, among ``"kernel"``, ``"memcpy"`` and ``"memset"`` (default:
    all three; fewer is for measuring what CUPTI's tracing of each costs, as
    ``benchmarks/trace_check.py`` does), and, for the overlap doctor (:mod:`.doctor`), the host's
    side: ``"runtime"`` and ``"driver"`` (the API calls that copy, launch, fill or synchronise:
    ``cls`` "api", with ``call`` the call's name) and ``"synchronization"`` (``cls`` "sync", with
    ``sync_type`` such as "STREAM_SYNCHRONIZE"). Kernels and copies then carry ``corr``, the
    correlation id of the call that queued them, and copies ``src_kind`` too.

    Only one session records at a time (CUPTI's activity buffers are global).
    """

    def __init__(self, kinds: Sequence[str] = ("kernel", "memcpy", "memset")):
        from cupti import cupti
        self._cupti = cupti
        a = cupti.ActivityKind
        by_name = {"kernel": a.CONCURRENT_KERNEL, "memcpy": a.MEMCPY, "memset": a.MEMSET,
                   "runtime": a.RUNTIME, "driver": a.DRIVER, "synchronization": a.SYNCHRONIZATION}
        unknown = [k for k in kinds if k not in by_name]
        if unknown or not kinds:
            raise ValueError(f"kinds must be some of {tuple(by_name)}, got {tuple(kinds)!r}")
        self._kinds = tuple(by_name[k] for k in kinds)
        self._kernel, self._memcpy, self._memset = a.CONCURRENT_KERNEL, a.MEMCPY, a.MEMSET
        self._api = {int(a.RUNTIME): "runtime", int(a.DRIVER): "driver"}
        self._sync = a.SYNCHRONIZATION
        self._call_names = {}        # (domain, cbid) -> the call's name, or None for calls not kept
        self.records = []
        self.t0_ns = None
        # (host ms, CUPTI ns) read together at begin_here() and at stop(): how CUPTI's clock
        # maps onto the host clock (see host_ms_of)
        self.clock_pairs = []

    def start(self) -> ActivitySession:
        """Start recording (and :meth:`begin_here`); returns the session."""
        global _receiver, _callbacks_registered
        if _receiver is not None:
            raise RuntimeError("a CUPTI recording is already running in this process")
        cupti = self._cupti
        if not _callbacks_registered:
            cupti.activity_register_callbacks(_buffer_requested, _buffer_completed)
            _callbacks_registered = True
        _receiver = self
        try:
            for kind in self._kinds:
                cupti.activity_enable(kind)
        except BaseException:
            _receiver = None
            raise
        self.begin_here()
        return self

    @property
    def running(self) -> bool:
        """Whether this session is recording now."""
        return _receiver is self

    @property
    def cupti(self) -> object:
        """The ``cupti`` module of cupti-python this session records with."""
        return self._cupti

    def stop(self) -> None:
        """Flush every completed record into ``records`` and stop recording."""
        global _receiver
        if _receiver is not self:
            return
        cupti = self._cupti
        self.clock_pairs.append(read_clocks_together(runtime.get().host_ms, cupti.get_timestamp))
        try:
            cupti.activity_flush_all(1)
        finally:
            for kind in self._kinds:
                cupti.activity_disable(kind)
            _receiver = None

    def begin_here(self) -> None:
        """Keep only the records of work that starts from now on (what ran before, since
        :meth:`start`, was set-up work of the recorder's own), and read CUPTI's clock
        together with the host clock (see :meth:`host_ms_of`)."""
        host, self.t0_ns = read_clocks_together(runtime.get().host_ms, self._cupti.get_timestamp)
        self.clock_pairs = [(host, self.t0_ns)]

    def host_ms_of(self, ns: int) -> float:
        """A CUPTI timestamp (ns) as a reading of the host clock (:func:`runtime.host_ms`, ms).

        The map is the straight line through the two clocks' joint readings at
        :meth:`begin_here` and at :meth:`stop` (only the first one's offset before
        :meth:`stop`): it corrects a difference in the clocks' rates too, where that is
        plausible (under 0.1%; a larger one means a reading was interrupted, and the
        rates are taken as equal)."""
        if not self.clock_pairs:
            raise RuntimeError("the session has not begun: call start() first")
        h0, c0 = self.clock_pairs[0]
        rate = 1.0
        if len(self.clock_pairs) > 1:
            h1, c1 = self.clock_pairs[-1]
            if c1 > c0 and abs((h1 - h0) / ((c1 - c0) / 1e6) - 1.0) < 1e-3:
                rate = (h1 - h0) / ((c1 - c0) / 1e6)
        return h0 + (ns - c0) / 1e6 * rate

    def _take(self, activities):
        cupti = self._cupti
        for a in activities:
            if a.start < self.t0_ns:
                continue                  # set-up work before begin_here()
            if int(a.kind) in self._api:
                self._take_call(a)
                continue
            if a.kind == self._sync:
                self.records.append({
                    "cls": "sync", "start_ns": int(a.start), "end_ns": int(a.end), "stream_id": int(a.stream_id),
                    "sync_type": cupti.ActivitySynchronizationType(a.type).name, "corr": int(a.correlation_id)})
                continue
            src = None
            if a.kind == self._kernel:
                cls, name, nbytes, dst = "kernel", str(a.name), 0, None
            elif a.kind == self._memcpy:
                cls = cupti.ActivityMemcpyKind(a.copy_kind).name
                name, nbytes = cls, int(a.bytes)
                dst = cupti.ActivityMemoryKind(a.dst_kind).name
                src = cupti.ActivityMemoryKind(a.src_kind).name
            else:
                cls, name, nbytes, dst = "memset", "memset", int(a.bytes), None
            self.records.append({
                "cls": cls, "start_ns": int(a.start), "end_ns": int(a.end), "stream_id": int(a.stream_id),
                "bytes": nbytes, "name": name, "graph_id": int(getattr(a, "graph_id", 0)),
                "channel": int(getattr(a, "channel_id", -1)), "dst_kind": dst, "src_kind": src,
                "corr": int(getattr(a, "correlation_id", 0))})

    def _take_call(self, a):
        """Keep a runtime or driver API record of a call that copies, launches, fills or synchronises
        (:func:`call_role`); CuPy makes many other calls (``cudaGetDevice``, ...) that say nothing
        about overlap."""
        domain = self._api[int(a.kind)]
        key = (domain, int(a.cbid))
        if key not in self._call_names:
            self._call_names[key] = _call_name(self._cupti, domain, int(a.cbid))
        name = self._call_names[key]
        if name is not None:
            self.records.append({"cls": "api", "call": name, "domain": domain, "start_ns": int(a.start),
                                 "end_ns": int(a.end), "corr": int(a.correlation_id),
                                 "thread": int(a.thread_id)})


#: What the doctor keeps of the host's API calls: a call's role, by the start of its name.
_CALL_ROLES = (("cudaMemcpy", "copy"), ("cuMemcpy", "copy"), ("cudaMemset", "memset"), ("cuMemset", "memset"),
               ("cuLaunch", "launch"), ("cudaLaunch", "launch"), ("cuGraphLaunch", "launch"),
               ("cudaGraphLaunch", "launch"), ("cudaStreamSynchronize", "sync"), ("cuStreamSynchronize", "sync"),
               ("cudaEventSynchronize", "sync"), ("cuEventSynchronize", "sync"), ("cudaDeviceSynchronize", "sync"),
               ("cuCtxSynchronize", "sync"))


def call_role(name: str) -> str | None:
    """"copy", "memset", "launch" or "sync" for an API call's name (``cudaMemcpyAsync``), else None.

    >>> call_role("cudaMemcpyAsync"), call_role("cuLaunchKernel"), call_role("cudaGetDevice")
    ('copy', 'launch', None)
    """
    return next((role for prefix, role in _CALL_ROLES if name.startswith(prefix)), None)


def _call_name(cupti, domain, cbid):
    """The plain name of an API call (``cudaMemcpyAsync``, without CUPTI's ``_v3020`` or ``_ptsz``),
    if the doctor keeps such calls (:func:`call_role`), else None."""
    dom = cupti.CallbackDomain.RUNTIME_API if domain == "runtime" else cupti.CallbackDomain.DRIVER_API
    try:
        name = cupti.get_callback_name(dom, cbid)
    except Exception:  # noqa: BLE001 - an id CUPTI cannot name is not one we look for
        return None
    if isinstance(name, bytes):
        name = name.decode()
    name = str(name).split("_v")[0].split("_ptsz")[0]
    return name if call_role(name) else None


def read_clocks_together(host_ms: Callable[[], float], cupti_ns: Callable[[], int],
                         tries: int = 5) -> tuple[float, int]:
    """``(host ms, CUPTI ns)`` read at one moment: CUPTI's clock is read between two readings
    of the host clock, and the host time is the middle of that bracket. Of ``tries`` attempts
    the tightest bracket is kept (a thread switch inside one would widen it)."""
    best = None
    for _ in range(tries):
        before = host_ms()
        ns = int(cupti_ns())
        after = host_ms()
        if best is None or after - before < best[0]:
            best = (after - before, (before + after) / 2, ns)
    return best[1], best[2]


# --------------------------------------------------------------------------
# The recorder's CUPTI timing: the op journal, matched with the records
# --------------------------------------------------------------------------
class CuptiTimer:
    """Times a recording with CUPTI: keeps the thread's op journal (every operation the helper
    queues, see :mod:`course_helper.runtime.observe`) and, at the end, matches CUPTI's records with
    those operations (see the module text for how). It also observes graph captures, to know
    which operations a graph replays."""

    def __init__(self):
        self.session = ActivitySession()
        # The op journal: (kind, name, stream, level, nbytes) of each queued operation, in queue
        # order, with _CAPTURE_BEGINS / _CAPTURE_ENDS where a graph capture began and ended.
        self.journal = []

    # -- observer calls (from the recording thread, so in order with the journal's entries) -----
    def capture_started(self, stream: Stream) -> None:
        """A graph capture began: the operations queued from now on go into a graph."""
        self.journal.append(_CAPTURE_BEGINS)

    def capture_ended(self, stream: Stream, graph: Graph | None) -> None:
        """The graph capture ended (``graph`` None: it failed)."""
        self.journal.append(_CAPTURE_ENDS)

    def queued_ops(self) -> list[tuple]:
        """The journal's operations that CUPTI times, each as ``(kind, name, stream, level, nbytes,
        captured)``, ``captured`` telling whether it went into a graph rather than a stream."""
        ops, depth = [], 0
        for entry in self.journal:
            if entry is _CAPTURE_BEGINS:
                depth += 1
            elif entry is _CAPTURE_ENDS:
                depth = max(0, depth - 1)
            elif entry[0] in _OP_CLASS:
                ops.append((*entry, depth > 0))
        return ops

    # -- life cycle --------------------------------------------------------------
    def start(self) -> CuptiTimer:
        """Open the op journal and start CUPTI (its set-up launch made, see :func:`warm_up`);
        returns the timer."""
        # All it needs of an operation is a journal entry: it asks for no Op, so none is built
        # unless an observer (a sanitizer, say) reads one.
        self.journal = observe.open_journal()
        observe.add(self)
        try:
            self.session.start()
            # CUPTI sets up its kernel tracing at the first launch of a session: let that be a
            # launch of our own, now, rather than the loop's first.
            warm_up()
            self.session.begin_here()
        except BaseException:
            self.session.stop()
            observe.remove(self)
            observe.close_journal()
            raise
        return self

    @property
    def running(self) -> bool:
        """Whether CUPTI is recording for this timer now."""
        return self.session.running

    def stop(self) -> None:
        """Stop CUPTI and close the op journal (the records are kept for :meth:`events`)."""
        observe.remove(self)
        observe.close_journal()
        self.session.stop()

    # -- matching ---------------------------------------------------------------
    def events(self) -> tuple[list[TraceEvent], list[str], dict[str, int]]:
        """``(events, tracks, info)``: TraceEvents timed on the host clock (ms readings of
        :func:`runtime.host_ms`, as host waits are), the lanes in the order they were first used,
        and counts for the trace's meta."""
        ops_by_key, recs_by_key, tracks = {}, {}, []
        stream_ids = {}
        queued = self.queued_ops()
        for op in queued:
            kind, _name, stream, _level, _nbytes, captured = op
            if stream.name not in tracks:
                tracks.append(stream.name)
            if captured:
                key = ("graph", _OP_CLASS[kind])
            else:
                ptr = stream.raw.ptr
                if ptr not in stream_ids:
                    stream_ids[ptr] = _cupti_stream_id(self.session._cupti, ptr)
                key = (stream_ids[ptr], _OP_CLASS[kind])
            ops_by_key.setdefault(key, []).append(op)
        for r in self.session.records:
            key = ("graph", r["cls"]) if r["graph_id"] else (r["stream_id"], r["cls"])
            recs_by_key.setdefault(key, []).append(r)
        on_host = self.session.host_ms_of
        events, unmatched_ops, foreign = [], 0, 0
        for key, ops in ops_by_key.items():
            recs = recs_by_key.pop(key, [])
            if key[0] == "graph":
                pairs = _match_graph(ops, recs)
            else:
                pairs = _match_stream(ops, sorted(recs, key=lambda r: r["start_ns"]))
            used = sum(len(rs) for _, rs in pairs)
            foreign += len(recs) - used
            for (kind, name, stream, level, nbytes, _), rs in pairs:
                if not rs:
                    unmatched_ops += 1
                for r in rs:
                    events.append(TraceEvent(stream.name, kind, name, on_host(r["start_ns"]),
                                             on_host(r["end_ns"]), nbytes, level))
        foreign += sum(len(v) for v in recs_by_key.values())
        if unmatched_ops:
            warnings.warn(f"CUPTI delivered no record for {unmatched_ops} of {len(queued)} traced "
                          "operations; they are missing from the timeline", RuntimeWarning, stacklevel=3)
        info = {"cupti_records": len(self.session.records), "cupti_unmatched_ops": unmatched_ops,
                "cupti_other_records": foreign}
        return events, tracks, info


def _match_stream(ops, recs):
    """Pair the ops of one stream and kind with its records, both in queue order.
    Work the helper did not queue (plain CuPy calls inside the block) also
    leaves records; where kernels are in excess, keep those named like the op."""
    kind, name = (ops[0][0], ops[0][1]) if ops else (None, "")
    if len(recs) > len(ops) and kind == OpKind.KERNEL:
        recs = [r for r in recs if name.split()[0] in r["name"]] or recs
    return [(op, [recs[i]] if i < len(recs) else []) for i, op in enumerate(ops)]


def _match_graph(ops, recs):
    """Pair the ops captured into a graph with the records of its replays.

    A replayed graph runs its nodes on streams of its own, so the stream does
    not tell which op a record belongs to, and the records' graph node ids are
    not used (docs/tracing.md says why). Records are matched in start order: in the course's
    captured loops each kind of work forms one chain (the kernels and the
    device copies on the compute stream, the copies to the host on one IO
    stream), so it starts in the order it was queued, and every replay repeats
    the pattern."""
    recs = sorted(recs, key=lambda r: r["start_ns"])
    if not ops:
        return []
    replays = max(1, len(recs) // len(ops)) if len(recs) % len(ops) == 0 else 1
    return [(op, recs[i::len(ops)][:replays] if i < len(recs) else []) for i, op in enumerate(ops)]


def _cupti_stream_id(cupti, stream_ptr):
    """CUPTI's id of the CUDA stream ``stream_ptr`` (0: the legacy default stream)."""
    try:
        ctx = int(cupy_module().cuda.driver.ctxGetCurrent())
        return int(cupti.get_stream_id_ex(ctx, int(stream_ptr), 0))
    except Exception as exc:  # noqa: BLE001 - then this stream's work cannot be matched
        warnings.warn(f"CUPTI could not name the stream {stream_ptr:#x} ({exc}); its work is missing "
                      "from the timeline", RuntimeWarning, stacklevel=4)
        return ("unknown stream", stream_ptr)
