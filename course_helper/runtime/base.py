"""The interface of a runtime (see :mod:`course_helper.runtime`), with the types both runtimes
share and :func:`byte_span`, the memory an array covers. Kept apart so that the runtimes can
import it while :mod:`course_helper.runtime` imports them."""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator

import numpy as np

from .ops import Cost, OpKind

__all__ = ["Runtime", "GraphsUnsupported", "HostWaitInCapture", "refuse_host_wait_in_capture", "UncapturedDependency",
           "CpuDeviceArray", "PinnedArray", "byte_span", "spans_overlap", "shares_memory", "plain_view"]


class CpuDeviceArray(np.ndarray):
    """An array in the CPU backend's stand-in for device memory."""


class PinnedArray(np.ndarray):
    """Host memory the helper pinned (``pinned_empty``), and the views of it: a NumPy array in
    all but its type. The type lets the race sanitizer watch the host's own reads and writes of
    that memory (:mod:`course_helper.host_watch`): while a sanitizer is on, the class gets hooks;
    outside one it has none, so a timed loop pays nothing for them.

    Arrays computed from it (``a + 1``, ``a.max(axis=0)``) are plain arrays: their memory is not
    pinned."""

    def __array_wrap__(self, array, context=None, return_scalar=False):
        # A ufunc's result: given back as NumPy made it (plain, unless it is an ``out=`` array).
        return array[()] if return_scalar else array


def plain_view(a: np.ndarray) -> np.ndarray:
    """The memory of ``a`` as a plain ``np.ndarray`` view, even while a race sanitizer watches
    (then ``a.view(np.ndarray)`` of a pinned array stays a PinnedArray, so that the host's use
    of it is heard). For the helper's own work on the memory, which is announced as that work."""
    return np.ndarray.view(a, np.ndarray)


def byte_span(a: Any) -> tuple[str, int, int] | None:
    """``(space, first byte, one past the last byte)`` of array ``a``, or None if empty.

    Host and device memory are separate address spaces. A strided view gets
    the conservative span from its lowest to its highest byte. (The race sanitizer compares
    these spans; device-to-device copies refuse overlapping ones.)
    """
    if isinstance(a, np.ndarray):
        ptr = a.__array_interface__["data"][0]
        space = "device" if isinstance(a, CpuDeviceArray) else "host"
    else:                                    # a CuPy array
        ptr = a.data.ptr
        space = "device"
    if a.size == 0:
        return None
    if a.flags.c_contiguous:
        return space, ptr, ptr + a.nbytes
    lo = hi = ptr
    for n, st in zip(a.shape, a.strides):
        if st > 0:
            hi += (n - 1) * st
        else:
            lo += (n - 1) * st
    return space, lo, hi + a.itemsize


def spans_overlap(a: tuple[str, int, int] | None, b: tuple[str, int, int] | None) -> bool:
    """Whether two byte spans (:func:`byte_span`; None for an empty array) overlap: the same
    address space, and ranges that meet."""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def shares_memory(a: Any, b: Any) -> bool:
    """Whether the arrays ``a`` and ``b`` share any memory (a view of a buffer counts): the one
    test the helper uses, on both backends.

    Host and device memory never share (separate address spaces). Within a space the arrays'
    byte spans are compared: exact for C-contiguous arrays, conservative for strided views (two
    interleaved views of one buffer count as sharing, as a GPU's addresses cannot tell them apart).
    """
    return spans_overlap(byte_span(a), byte_span(b))


class GraphsUnsupported(RuntimeError):
    """CUDA graphs cannot be used with the active backend."""


class HostWaitInCapture(RuntimeError):
    """The host tried to wait (synchronise a stream, an event or the device) while a graph was
    being captured. Nothing runs during a capture, so such a wait could never end: a loop whose
    host waits (the streams loop) cannot be captured; one whose waits are events can."""


def refuse_host_wait_in_capture(what: str) -> None:
    """Raise :class:`HostWaitInCapture` for the host wait ``what`` ("synchronising stream 'io 0'"):
    the one message both runtimes give, as CUDA refuses the wait in its default capture mode."""
    raise HostWaitInCapture(f"{what} during a graph capture: nothing runs while a graph is "
                            "captured, so the host cannot wait for it. Wait after the capture "
                            "block, or order the work with events (wait_event) instead of a host wait")


class UncapturedDependency(RuntimeError):
    """A stream being captured was made to wait on an event recorded outside the capture: before it
    began, or on a stream that is not part of it (never forked into it). A graph can only wait on
    work it captured itself (CUDA refuses it as
    ``cudaErrorStreamCaptureIsolation``); both runtimes raise this instead."""


class Runtime(ABC):
    """The interface both runtimes implement (raw objects are the runtime's own): each
    abstract method here, the rest have a default.

    Times are in milliseconds. ``cost`` describes an operation for the model, as one of the
    types of :mod:`course_helper.runtime.ops` (``KernelCost("wave2d_4o", n)``,
    ``CopyCost(OpKind.D2H, dst, src)``, ``FillCost(dst)``, ``LinkCost("peer", n)``). A copy or
    fill names its arrays in its cost and needs no ``cuda``/``numpy`` function: each runtime
    does it its own way.
    """

    name = ""            #: "gpu" or "cpu": for display only; ask the capabilities below instead
    device_label = ""    #: the device the times belong to, e.g. "NVIDIA H200" or "modelled H200"
    computes_data = True  #: False where a model predicts times only and skips the arithmetic (its times_only)
    needs_op = True      #: False when work can be queued without an ``op`` (see :meth:`launch`, :meth:`copy_async`)
    device_array_type = None   #: the exact type of this runtime's device arrays

    # -- capabilities: what callers ask instead of which backend this is ------------
    #: True where a model of the device gives the times without running the work: then
    #: :meth:`predicted_ms` answers, :meth:`times_only` can skip the arithmetic, and a run
    #: takes the same time every time it runs. False where times are measured (a GPU).
    predicts_times = False
    #: What keeps the times where the device does not measure them, as printed beside them
    #: (``"modelled H200"``); ``""`` where they are measured.
    clock_label = ""
    #: True where the work runs on a CUDA device through CuPy, so that code calling CuPy or
    #: CUDA itself (the raw CuPy loops, CUPTI, NCCL) can run beside the helper's work.
    runs_cuda = False
    #: Where a model's figures come from (its profile's ``provenance``: device, date, versions);
    #: None where times are measured.
    provenance: dict | None = None

    @property
    def modelled(self) -> bool:
        """The same as :attr:`predicts_times` (the name the notebooks read)."""
        return self.predicts_times

    def predicted_disk_gbps(self) -> float | None:
        """The disk's sustained write bandwidth in GB/s as the model predicts it; None where the
        disk is measured (time a write instead: :func:`course_helper.disk.measure_disk_bandwidth`)."""
        return None

    def predicted_ms(self, cost: Cost) -> float | None:
        """How long the operation ``cost`` takes the device alone, in ms, predicted without
        running it; None where this runtime cannot predict it: a device that measures its
        times (time the operation instead), or a model with no figure for it (a link its
        profile never measured)."""
        return None

    def compresses_on_device(self, codec: str) -> tuple[bool, str] | None:
        """Whether this runtime compresses chunks with ``codec`` on the device itself:
        ``(True, what does it)`` or ``(False, why not)``; None where the device's own
        compression library decides (nvCOMP on a GPU: see :mod:`course_helper.disk.compression`)."""
        return None

    @contextlib.contextmanager
    def times_only(self, on: bool = True) -> Iterator[None]:
        """Inside the block (when ``on``), model the times and skip the arithmetic: a modelled
        device only (``on=False``, compute, is what any other device does anyway)."""
        if on:
            raise ValueError("only a modelled device can predict times without computing the results")
        yield

    # -- clocks -------------------------------------------------------------
    @abstractmethod
    def host_ms(self) -> float:
        """The host clock in ms (wall clock on the GPU, modelled host time on the model)."""

    # -- streams and events --------------------------------------------------
    @abstractmethod
    def priority_range(self) -> tuple[int, int]:
        """``(least, greatest)`` stream priorities the device offers."""

    @abstractmethod
    def new_stream(self, non_blocking: bool, priority: int | None, name: str) -> Any:
        """A new raw stream (``non_blocking``: not ordered with the legacy default stream)."""

    @abstractmethod
    def default_stream(self) -> Any:
        """The raw legacy default stream."""

    def close_stream(self, raw: Any) -> None:
        """Release a stream's resources once its queued work is done (idempotent)."""

    def enter_stream(self, raw: Any) -> None:
        """``with stream:`` began (makes ``raw`` current for raw library calls)."""

    def exit_stream(self, raw: Any, exc: BaseException | None) -> None:
        """``with stream:`` ended."""

    @abstractmethod
    def new_event(self, timing: bool) -> Any:
        """A new raw event (``timing``: it records a time for :meth:`elapsed_ms`)."""

    @abstractmethod
    def record(self, event: Any, stream: Any) -> None:
        """Record the raw ``event`` on the raw ``stream``."""

    @abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Make later work on the raw ``stream`` wait for the raw ``event``."""

    @abstractmethod
    def stream_done(self, raw: Any) -> bool:
        """Whether all work queued on the raw stream has finished."""

    @abstractmethod
    def event_done(self, raw: Any) -> bool:
        """Whether the work before the raw event's latest record has finished."""

    @abstractmethod
    def sync_stream(self, raw: Any) -> None:
        """Wait until the raw stream's queued work has finished."""

    @abstractmethod
    def sync_event(self, raw: Any) -> None:
        """Wait until the raw event has happened."""

    @abstractmethod
    def sync_device(self) -> None:
        """Wait until all queued work on the device has finished."""

    @abstractmethod
    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded timing events."""

    # -- work ----------------------------------------------------------------
    @abstractmethod
    def enqueue(self, stream: Any, op: Any, cuda: Callable | None, numpy: Callable | None,
                cost: Cost) -> None:
        """Queue ``op`` on ``stream``: ``cuda(raw_stream)`` launches it on a GPU;
        ``numpy(*outs)`` computes it on the CPU, writing its results into
        ``outs`` (arrays shaped like ``op.writes``). A runtime whose
        :attr:`needs_op` is False may be given None for ``op`` and ``numpy``."""

    def launch(self, stream: Any, kernel_for: Callable, grid: tuple, block: tuple, args: tuple) -> None:
        """Launch the kernel ``kernel_for(stream)`` compiled for ``stream``'s device, directly:
        what callers do instead of :meth:`enqueue` where :attr:`needs_op` is False (only such a
        runtime has it)."""
        raise NotImplementedError(f"the {self.name} runtime queues work through enqueue() only (needs_op)")

    def pack_launch(self, stream: Any, kernel_for: Callable, grid: tuple, block: tuple, args: tuple) -> Callable:
        """The launch of ``kernel_for(stream)`` with ``args`` packed once for the raw ``stream``'s
        device: a callable ``(raw stream, last argument)`` that queues it, rewriting only the last
        argument, with a method ``serves(raw stream)`` telling whether it may be queued on that
        stream. What a loop launching the same kernel on the same buffers calls where
        :attr:`needs_op` is False (only such a runtime has it)."""
        raise NotImplementedError(f"the {self.name} runtime queues work through enqueue() only (needs_op)")

    def copy_async(self, stream: Any, kind: OpKind, dst: Any, src: Any, host_ptr: int | None = None) -> None:
        """Queue a copy (one of :data:`~.ops.COPY_KINDS`) directly: what callers do instead of
        :meth:`enqueue` where :attr:`needs_op` is False (only such a runtime has it)."""
        raise NotImplementedError(f"the {self.name} runtime queues work through enqueue() only (needs_op)")

    @abstractmethod
    def host_func(self, stream: Any, fn: Callable[[], Any]) -> None:
        """Queue the host function ``fn()`` on the raw ``stream``."""

    # -- graphs ----------------------------------------------------------------
    @abstractmethod
    def graphs_supported(self) -> tuple[bool, str]:
        """``(True, "")`` when CUDA graphs work here, else ``(False, reason)``."""

    def capturing(self) -> bool:
        """Whether a graph capture is in progress on this runtime (the host may not wait then)."""
        return False

    def stream_capturing(self, stream: Any) -> bool:
        """Whether the raw ``stream`` is part of a graph capture in progress."""
        return False

    @abstractmethod
    def begin_capture(self, stream: Any) -> None:
        """Start capturing the raw ``stream``'s work into a graph."""

    @abstractmethod
    def end_capture(self, stream: Any) -> Any:
        """End the capture on the raw ``stream``; returns the graph."""

    @abstractmethod
    def abort_capture(self, stream: Any) -> None:
        """End a failed capture on the raw ``stream``, discarding what it captured."""

    def upload_graph(self, graph: Any, stream: Any) -> None:
        """Prepare ``graph``'s replay on ``stream`` ahead of its first launch; by default
        there is nothing to prepare."""

    @abstractmethod
    def launch_graph(self, graph: Any, stream: Any) -> None:
        """Queue one replay of ``graph`` on the raw ``stream``."""

    # -- memory -----------------------------------------------------------------
    @abstractmethod
    def device_array(self, shape: Any, dtype: Any, zero: bool) -> Any:
        """A new device array (zeroed when ``zero``)."""

    @abstractmethod
    def is_device_array(self, a: Any) -> bool:
        """Whether ``a`` is this runtime's device array."""

    @abstractmethod
    def to_device(self, host: Any) -> Any:
        """A new device array holding a copy of the host array (blocking)."""

    @abstractmethod
    def to_host(self, device_array: Any) -> np.ndarray:
        """A new NumPy array holding a copy of the device array (synchronises the device)."""

    @abstractmethod
    def pinned_empty(self, shape: Any, dtype: Any) -> np.ndarray:
        """A new page-locked host array (uninitialised)."""

    def pinned_by_driver(self, array: np.ndarray) -> bool:
        """True when the driver knows ``array`` as page-locked (memory pinned outside the helper)."""
        return False

    def device_free_bytes(self) -> int | None:
        """Free device memory in bytes (None when the runtime has no limit to report)."""
        return None

    # -- the modelled disk and compression engine (a runtime that predicts times only) --------
    def disk_write(self, lane: str, after: Any, encode: Callable[[], Any]) -> Any:
        """Queue one chunk's write to the modelled disk on the writer lane ``lane`` after
        ``after`` (an event, or a compressed chunk); ``encode()`` makes the chunk's bytes. Only a
        runtime that :attr:`predicts_times` models the disk; elsewhere writers time it themselves."""
        raise NotImplementedError(f"the {self.name} runtime does not model the disk (predicts_times)")

    def compress_chunk(self, codec: str, after: Any, nbytes: int, work: Callable[[], Any]) -> Any:
        """Queue one chunk's compression with ``codec`` on the modelled compression engine after
        the event ``after`` (a runtime that :attr:`predicts_times` only)."""
        raise NotImplementedError(f"the {self.name} runtime does not model compression (predicts_times)")

    def disk_wait(self, write: Any) -> None:
        """The host waits until the modelled ``write`` is on the disk (a runtime that
        :attr:`predicts_times` only)."""
        raise NotImplementedError(f"the {self.name} runtime does not model the disk (predicts_times)")

    # -- timing marks for the timeline recorder ----------------------------------
    @abstractmethod
    def trace_begin(self) -> Any:
        """Start a recording: returns its origin (the device is idle)."""

    @abstractmethod
    def trace_start(self, stream: Any, origin: Any) -> Any:
        """Called just before an operation is queued on ``stream``; returns a handle."""

    @abstractmethod
    def trace_end(self, stream: Any, start: Any, origin: Any) -> Any:
        """Called just after; returns the handle of the operation's end."""

    @abstractmethod
    def trace_host_ms(self, origin: Any, host_ms: float) -> float:
        """A reading of :meth:`host_ms` as ms from the recording's origin."""

    @abstractmethod
    def trace_times(self, origin: Any, start: Any, end: Any) -> tuple[float, float] | None:
        """``(start_ms, end_ms)`` of a recorded operation from the origin, or None if it never ran."""

    def trace_release(self, origin: Any) -> None:
        """The recording is finished: give back what it held."""
