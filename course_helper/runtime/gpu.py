"""The GPU runtime: the course's operations queued on a CUDA device through CuPy.

Raw streams and events are ``cupy.cuda.Stream`` and ``cupy.cuda.Event``, a
raw graph is CuPy's ``Graph``. Only :func:`course_helper.runtime.get` imports
this module, and only on the GPU backend.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import cupy
import cupyx
import numpy as np

from .backend import gpu_name
from .base import GraphsUnsupported, Runtime
from .ops import D2D, D2H, H2D, CopyCost, Cost, OpKind

_clock = time.perf_counter
_MEMCPY_KIND = {D2H: 2, H2D: 1, D2D: 3}      # cudaMemcpyKind values


def _ptr(a):
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


class PackedLaunch:
    """One kernel's launch with its arguments packed into C memory once, for a loop that launches
    the same kernel on the same buffers level after level.

    A ``RawKernel`` call converts each argument to C on every launch: on an H100 machine's host
    a call of the stencil (twelve arguments) took 9.7 us, a launch of the helper packed this way
    6.5 us with its checks (``benchmarks/h100/host_cost.json``). Packed once, a launch only
    writes its last argument (the one that changes
    each level, e.g. the source amplitude) and calls ``cuLaunchKernel``: the CUDA driver copies
    the arguments when the launch is queued (or captured into a graph), so rewriting them for
    the next launch is safe. The packed pointers are the arrays' addresses: whoever keeps a
    PackedLaunch must drop it before any of its arrays is freed.
    """

    def __init__(self, stream: Any, kernel_for: Callable, grid: tuple, block: tuple, args: tuple) -> None:
        self.device = stream.device_id             # -1 for the legacy default stream: the current device's
        with cupy.cuda.Device(self.device if self.device >= 0 else None):   # CuPy loads a kernel for the current device
            self._function = kernel_for(stream).kernel.ptr
        # One C cell per argument (an array's address, or the scalar itself) and the array of the
        # cells' addresses that cuLaunchKernel reads. No reference to the arrays is kept.
        self._cells = [np.array([a.data.ptr], np.uintp) if isinstance(a, cupy.ndarray) else np.array([a])
                       for a in args]
        self._params = np.array([c.ctypes.data for c in self._cells], np.uintp)
        self._params_ptr = self._params.ctypes.data
        self._last = self._cells[-1]
        self._dims = (*grid, *(1,) * (3 - len(grid)), *block, *(1,) * (3 - len(block)))

    def serves(self, stream: Any) -> bool:
        """Whether this launch may be queued on the raw ``stream`` (one of the device it was packed for)."""
        return stream.device_id == self.device

    def __call__(self, stream: Any, last: Any) -> None:
        """Queue the launch on the raw ``stream`` (of this launch's device) with ``last`` as its last argument."""
        self._last[0] = last
        try:
            _launch_kernel(self._function, *self._dims, 0, stream.ptr, self._params_ptr, 0)
        except cupy.cuda.driver.CUDADriverError as e:
            if "CUDA_ERROR_INVALID_CONTEXT" not in str(e):
                raise
            # A thread that has not used the device yet has no current context, which the
            # driver's launch needs (CuPy's runtime calls make one current on first use).
            cupy.cuda.runtime.setDevice(self.device if self.device >= 0 else cupy.cuda.runtime.getDevice())
            _launch_kernel(self._function, *self._dims, 0, stream.ptr, self._params_ptr, 0)


_launch_kernel = cupy.cuda.driver.launchKernel


class GpuRuntime(Runtime):
    """CuPy on a CUDA device."""

    name = "gpu"
    runs_cuda = True
    needs_op = False     # CuPy queues from the cuda function, the cost or launch()/copy_async() alone
    device_array_type = cupy.ndarray

    def __init__(self) -> None:
        self.device_label = gpu_name()
        self._rt = cupy.cuda.runtime
        self._event_pool = []     # raw cudaEvent_t handles for timeline marks, reused between recordings
        self._capturing = 0       # captures in progress: marks then become graph nodes

    def host_ms(self) -> float:
        return _clock() * 1e3

    # -- streams and events --------------------------------------------------
    @functools.lru_cache(maxsize=None)   # noqa: B019 - a runtime lives as long as the process
    def priority_range(self) -> tuple[int, int]:
        if hasattr(self._rt, "deviceGetStreamPriorityRange"):
            return tuple(self._rt.deviceGetStreamPriorityRange())
        # CUDA clamps a requested priority into the device's range, so asking for
        # two extreme priorities and reading them back gives the range.
        lowest = cupy.cuda.Stream(non_blocking=True, priority=1 << 20).priority
        highest = cupy.cuda.Stream(non_blocking=True, priority=-(1 << 20)).priority
        return (int(lowest), int(highest))

    def new_stream(self, non_blocking: bool, priority: int | None, name: str) -> Any:
        if priority is None:
            return cupy.cuda.Stream(non_blocking=non_blocking)
        return cupy.cuda.Stream(non_blocking=non_blocking, priority=priority)

    def default_stream(self) -> Any:
        return cupy.cuda.Stream.null

    def enter_stream(self, raw: Any) -> None:
        raw.__enter__()

    def exit_stream(self, raw: Any, exc: BaseException | None) -> None:
        raw.__exit__(*exc)

    def new_event(self, timing: bool) -> Any:
        return cupy.cuda.Event(disable_timing=not timing)

    # CuPy's own methods, taking (event, stream) and (stream, event) as the Runtime's do: a record
    # or a wait is on every level of the loops, and this saves a Python call in each.
    record = staticmethod(cupy.cuda.Event.record)
    wait_event = staticmethod(cupy.cuda.Stream.wait_event)

    def stream_done(self, raw: Any) -> bool:
        return bool(raw.done)

    def event_done(self, raw: Any) -> bool:
        return bool(raw.done)

    def sync_stream(self, raw: Any) -> None:
        raw.synchronize()

    def sync_event(self, raw: Any) -> None:
        raw.synchronize()

    def sync_device(self) -> None:
        cupy.cuda.Device().synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(cupy.cuda.get_elapsed_time(start, end))

    # -- work ----------------------------------------------------------------
    def enqueue(self, stream: Any, op: Any, cuda: Callable | None, numpy: Callable | None,
                cost: Cost) -> None:
        if cuda is not None:
            cuda(stream)
        elif type(cost) is CopyCost:
            self.copy_async(stream, cost.kind, cost.dst, cost.src, cost.host_ptr)
        else:                                         # a FillCost
            self._rt.memsetAsync(_ptr(cost.dst), 0, cost.dst.nbytes, stream.ptr)

    def launch(self, stream: Any, kernel_for: Callable, grid: tuple, block: tuple, args: tuple) -> None:
        """Launch the ``RawKernel`` that ``kernel_for(stream)`` compiled for the raw ``stream``'s
        device, as the work of :meth:`enqueue` or directly where no Op is built."""
        # stream= queues on the stream without making it current (no ``with stream:``).
        kernel_for(stream)(grid, block, args, stream=stream)

    def pack_launch(self, stream: Any, kernel_for: Callable, grid: tuple, block: tuple, args: tuple) -> PackedLaunch:
        """The launch of ``kernel_for(stream)`` with ``args`` packed once (see :class:`PackedLaunch`)."""
        return PackedLaunch(stream, kernel_for, grid, block, args)

    def copy_async(self, stream: Any, kind: OpKind, dst: Any, src: Any, host_ptr: int | None = None) -> None:
        """Queue the copy ``src`` -> ``dst`` of ``kind`` (one of :data:`~.ops.COPY_KINDS`) on the raw
        ``stream``; ``host_ptr`` is the host side's address when the caller already read it.
        The copy path of :meth:`enqueue`, called directly where no Op is built."""
        if host_ptr is None:
            dst_ptr, src_ptr = _ptr(dst), _ptr(src)
        elif kind == D2H:
            dst_ptr, src_ptr = host_ptr, src.data.ptr
        else:
            dst_ptr, src_ptr = dst.data.ptr, host_ptr
        self._rt.memcpyAsync(dst_ptr, src_ptr, src.nbytes, _MEMCPY_KIND[kind], stream.ptr)

    def host_func(self, stream: Any, fn: Callable[[], Any]) -> None:
        stream.launch_host_func(lambda _arg: fn(), None)

    # -- graphs ----------------------------------------------------------------
    def graphs_supported(self) -> tuple[bool, str]:
        if getattr(self._rt, "is_hip", False):
            return False, "this CuPy is built for ROCm, where the course does not use graphs; use 'staged' or 'events'"
        return True, ""

    def capturing(self) -> bool:
        return self._capturing > 0

    def stream_capturing(self, stream: Any) -> bool:
        return self._capturing > 0 and stream.is_capturing()

    def begin_capture(self, stream: Any) -> None:
        stream.begin_capture()
        self._capturing += 1

    def end_capture(self, stream: Any) -> Any:
        self._capturing -= 1
        cudart = _cudart()
        if cudart is None:          # no cuda-bindings: CuPy's graph, every node at the launch stream's priority
            return stream.end_capture()
        graph = _checked(cudart, "cudaStreamEndCapture", cudart.cudaStreamEndCapture(stream.ptr))
        flags = cudart.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagUseNodePriority
        try:
            return NodePriorityGraph(_checked(cudart, "cudaGraphInstantiateWithFlags",
                                              cudart.cudaGraphInstantiateWithFlags(graph, flags)))
        finally:
            cudart.cudaGraphDestroy(graph)

    def abort_capture(self, stream: Any) -> None:
        self._capturing -= 1
        try:
            stream.end_capture()
        except Exception:  # noqa: BLE001 - the capture is being abandoned after an error
            pass

    def upload_graph(self, graph: Any, stream: Any) -> None:
        # cudaGraphUpload: the first launch of a fresh graph otherwise sets up its device
        # work itself, more so while CUPTI traces it.
        graph.upload(stream)

    def launch_graph(self, graph: Any, stream: Any) -> None:
        graph.launch(stream)

    # -- memory -----------------------------------------------------------------
    def device_array(self, shape: Any, dtype: Any, zero: bool) -> Any:
        return (cupy.zeros if zero else cupy.empty)(shape, dtype)

    def is_device_array(self, a: Any) -> bool:
        return isinstance(a, cupy.ndarray)

    def to_device(self, host: Any) -> Any:
        return cupy.asarray(host)

    def to_host(self, device_array: Any) -> np.ndarray:
        cupy.cuda.Device().synchronize()
        return cupy.asnumpy(device_array)

    def pinned_empty(self, shape: Any, dtype: Any) -> np.ndarray:
        return cupyx.empty_pinned(shape, dtype)

    def pinned_by_driver(self, array: np.ndarray) -> bool:
        # Pinned by other means (e.g. cupyx.empty_pinned called directly).
        try:
            attrs = self._rt.pointerGetAttributes(array.ctypes.data)
            return int(attrs.type) == 1          # cudaMemoryTypeHost
        except Exception:  # noqa: BLE001 - not known to the driver: pageable
            return False

    def device_free_bytes(self) -> int | None:
        free, _total = self._rt.memGetInfo()
        return free + cupy.get_default_memory_pool().free_bytes()

    # -- timing marks ----------------------------------------------------------
    # A CUDA event is recorded just before and just after each operation on its
    # stream; every timestamp is read relative to one reference event, so all
    # streams share the device clock. On an idle stream the "before" event fires
    # as soon as it is recorded, while the host is still preparing the launch, so
    # a start is never placed earlier than the moment the host queued the
    # operation (host clock mapped onto the device clock through the reference).
    # Checked against CUPTI in benchmarks/trace_check.py.
    def _new_mark(self, used):
        ev = self._event_pool.pop() if self._event_pool else self._rt.eventCreate()
        used.append(ev)
        return ev

    def _mark(self, stream, used):
        ev = self._new_mark(used)
        if self._capturing:
            record_external(ev, stream.ptr)            # a timestamp node of the graph
        else:
            self._rt.eventRecord(ev, stream.ptr)
        return ev

    def trace_begin(self) -> Any:
        used = []
        t0 = self._new_mark(used)
        self._rt.eventRecord(t0, 0)
        self._rt.eventSynchronize(t0)
        return {"t0": t0, "host_t0": _clock(), "used": used}

    def trace_start(self, stream: Any, origin: Any) -> Any:
        return (self._mark(stream, origin["used"]), None if self._capturing else _clock())

    def trace_end(self, stream: Any, start: Any, origin: Any) -> Any:
        return self._mark(stream, origin["used"])

    def trace_times(self, origin: Any, start: Any, end: Any) -> tuple[float, float] | None:
        ev, queued = start
        t = self._rt.eventElapsedTime(origin["t0"], ev)
        if queued is not None:
            t = max(t, (queued - origin["host_t0"]) * 1e3)
        stop = self._rt.eventElapsedTime(origin["t0"], end)
        return min(t, stop), stop

    def trace_host_ms(self, origin: Any, host_ms: float) -> float:
        """A host clock reading as ms from the recording's origin."""
        return host_ms - origin["host_t0"] * 1e3

    def trace_release(self, origin: Any) -> None:
        self._event_pool.extend(origin["used"])
        origin["used"] = []


class NodePriorityGraph:
    """A captured graph that runs each node at the priority of the stream it was captured from.

    CuPy instantiates a captured graph with no flags, and a replay then runs every node at the
    priority of the stream it is launched on: a kernel captured from a high-priority stream (the
    halo exchange of the distributed loops) queues behind the blocks of a large kernel on another
    branch and no longer runs beside it. ``cudaGraphInstantiateFlagUseNodePriority`` keeps each
    node's own priority (on two H100s it took the captured halo loop at 2048 x 2048 per GPU from
    12.7 to 9.2 ms, the exchange from 0.5% to about 70% hidden under the interior kernel:
    docs/two-gpus.md). Same ``launch``/``upload`` as CuPy's ``Graph``."""

    def __init__(self, graph_exec: Any) -> None:
        self._exec = graph_exec

    def launch(self, stream: Any) -> None:
        cudart = _cudart()
        _checked(cudart, "cudaGraphLaunch", cudart.cudaGraphLaunch(self._exec, stream.ptr))

    def upload(self, stream: Any) -> None:
        cudart = _cudart()
        _checked(cudart, "cudaGraphUpload", cudart.cudaGraphUpload(self._exec, stream.ptr))

    def __del__(self) -> None:
        cudart = _cudart()
        if cudart is not None and self._exec is not None:
            cudart.cudaGraphExecDestroy(self._exec)
            self._exec = None


@functools.lru_cache(maxsize=1)
def _cudart():
    """cuda-bindings' runtime module, or None where it is not installed."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    return cudart


def _checked(cudart, call, result):
    """The value of a cuda-bindings ``(error, value...)`` result; a failure raises a RuntimeError
    named as CuPy names it (e.g. ``cudaErrorStreamCaptureUnjoined: ...``)."""
    err, *value = result
    if err != cudart.cudaError_t.cudaSuccess:
        _, message = cudart.cudaGetErrorString(err)
        raise RuntimeError(f"{err.name}: {message.decode() if isinstance(message, bytes) else message} ({call})")
    return value[0] if len(value) == 1 else tuple(value)


def record_external(event_ptr: int, stream_ptr: int) -> None:
    """Record a raw event so that it becomes an event-record *node* of the graph being
    captured (``cudaEventRecordExternal``): it then timestamps every replay. A plain
    record during capture only marks a dependency and never completes."""
    rt = cupy.cuda.runtime
    if hasattr(rt, "eventRecordWithFlags"):
        rt.eventRecordWithFlags(event_ptr, stream_ptr, 1)
        return
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise GraphsUnsupported("recording a timeline inside a CUDA graph needs cuda-bindings "
                                "(pip install cuda-bindings), or run the graph with trace=False") from None
    err, = cudart.cudaEventRecordWithFlags(cudart.cudaEvent_t(event_ptr), cudart.cudaStream_t(stream_ptr),
                                           cudart.cudaEventRecordExternal)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaEventRecordWithFlags failed: {err}")
