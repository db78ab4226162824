"""Device arrays, pinned host memory and copies between them.

The rule the course is built around: a copy between device and host can only
run *asynchronously* (return at once and overlap with kernels) when the host
buffer is **pinned** (page-locked). From ordinary pageable memory the driver
first stages the data through a pinned buffer of its own, and the "async"
call returns only after the copy has finished. :func:`copy_to_host_async` and
:func:`copy_to_device_async` therefore refuse pageable buffers (``copy_to_host_async``
takes one on request, ``allow_pageable=True``, to show what such a copy does).

On the CPU backend "device" arrays are NumPy arrays of the type
:class:`CpuDeviceArray`, and pinned arrays are ordinary arrays registered as
pinned, so the same checks and the same code work everywhere; the modelled
GPU gives pinned and pageable copies the speeds and the blocking behaviour
the profiled GPU has. On both backends a pinned array is a :class:`PinnedArray`
(a NumPy array whose type lets the race sanitizer see the host's reads and writes of it).
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from . import checks, runtime, streams, timing
from .runtime import observe
from .runtime.backend import backend_name
from .checks import host_memory_available
from .runtime.base import CpuDeviceArray, PinnedArray, shares_memory
from .runtime.ops import D2D, D2H, H2D, CopyCost, FillCost, OpKind, label

__all__ = ["CpuDeviceArray", "PinnedArray", "device_empty", "device_zeros", "to_device", "to_host",
           "is_device_array", "pinned_empty", "pinned_zeros", "is_pinned",
           "copy_to_host_async", "copy_to_device_async", "copy_on_device_async",
           "copy_to_host", "zero_async", "measure_bandwidth", "was_measured", "host_memory_available", "InputRing"]

# --------------------------------------------------------------------------
# Device arrays
# --------------------------------------------------------------------------
def _device_array(shape, dtype, make):
    shape = checks.shape_tuple("shape", shape)
    dtype = np.dtype(dtype)
    return _allocated(runtime.get().device_array(shape, dtype, zero=make == "zeros"))


def _allocated(array):
    """A new device array: a sanitizer is told which stream's memory pool it came from (CuPy's
    pool gives memory to the stream current at allocation, and takes it back for that stream)."""
    if observe.hears("device_allocated"):
        observe.notify("device_allocated", array, streams.current_stream())
    return array


def device_empty(shape: int | tuple[int, ...], dtype: DTypeLike = np.float32) -> Any:
    """An uninitialised array in device memory (``cupy.ndarray`` on the GPU)."""
    return _device_array(shape, dtype, "empty")


def device_zeros(shape: int | tuple[int, ...], dtype: DTypeLike = np.float32) -> Any:
    """A zero-filled array in device memory."""
    return _device_array(shape, dtype, "zeros")


def is_device_array(a: object) -> bool:
    """True for an array in device memory of the active backend."""
    return runtime.get().is_device_array(a)


def to_device(host: np.ndarray) -> Any:
    """A new device array holding a copy of the host array ``host`` (blocking)."""
    _require_host("host", host)
    observe.notify("host_access", host, "r", "to_device")
    return _allocated(runtime.get().to_device(host))


def to_host(device_array: Any) -> np.ndarray:
    """A new NumPy array holding a copy of ``device_array`` (waits for the device).

    It synchronises the whole device first, so it is a host wait like ``synchronize()``."""
    _require_device("device_array", device_array)
    out = runtime.get().to_host(device_array)
    observe.notify("host_synced", None)      # both runtimes synchronise the device before copying
    return out


# --------------------------------------------------------------------------
# Pinned host memory
# --------------------------------------------------------------------------
_pinned_ranges = {}          # id(owner) -> (first byte, one past last byte)
_pinned_lock = threading.Lock()
# The range the last lookup found: the loops copy into slots of one output array, so looking
# there first skips the search (reset whenever a range is unregistered).
_last_pinned = None


def _register_pinned(arr):
    start = arr.ctypes.data
    key = id(arr)
    with _pinned_lock:
        _pinned_ranges[key] = (start, start + arr.nbytes)
    weakref.finalize(arr, _unregister_pinned, key)


def _unregister_pinned(key):
    global _last_pinned
    with _pinned_lock:
        _pinned_ranges.pop(key, None)
        _last_pinned = None          # its addresses may now belong to pageable memory


def pinned_empty(shape: int | tuple[int, ...], dtype: DTypeLike = np.float32) -> np.ndarray:
    """An uninitialised page-locked (pinned) host array.

    On the GPU backend this is CuPy's pinned allocator (``cupyx.empty_pinned``);
    on the CPU backend an ordinary array registered as pinned. Either way it is a
    :class:`PinnedArray`, a NumPy array the race sanitizer can watch.
    """
    shape = checks.shape_tuple("shape", shape)
    dtype = np.dtype(dtype)
    arr = runtime.get().pinned_empty(shape, dtype).view(PinnedArray)
    _register_pinned(arr)
    return arr


def pinned_zeros(shape: int | tuple[int, ...], dtype: DTypeLike = np.float32) -> np.ndarray:
    """A zero-filled page-locked (pinned) host array."""
    arr = pinned_empty(shape, dtype)
    arr[...] = 0
    return arr


def is_pinned(array: object) -> bool:
    """True when ``array`` (or the allocation it is a view into) is pinned host memory."""
    if not isinstance(array, np.ndarray) or isinstance(array, CpuDeviceArray):
        return False
    return _pinned_at(array, array.ctypes.data)


def pinned_allocations() -> frozenset[tuple[int, int]]:
    """The byte ranges ``(first, one past last)`` of the pinned allocations alive now. A checker
    takes them before running a learner's function to tell a buffer made before it (one of these)
    from one the function allocated itself."""
    with _pinned_lock:
        return frozenset(_pinned_ranges.values())


def allocated_since(array: np.ndarray, before: frozenset[tuple[int, int]]) -> bool:
    """True when the pinned host ``array`` lies in none of the allocations ``before``
    (:func:`pinned_allocations` taken earlier): it was allocated after they were taken."""
    start = array.ctypes.data
    end = start + max(array.nbytes, 1)
    return not any(lo <= start and end <= max(hi, lo + 1) for lo, hi in before)


def _pinned_at(array, start):
    """:func:`is_pinned` for a host array whose first byte is at ``start`` (read once by the caller)."""
    global _last_pinned
    end = start + max(array.nbytes, 1)
    last = _last_pinned
    if last is not None and last[0] <= start and end <= last[1]:
        return True
    with _pinned_lock:
        for lo, hi in _pinned_ranges.values():
            if lo <= start and end <= max(hi, lo + 1):
                _last_pinned = (lo, max(hi, lo + 1))
                return True
    return bool(array.nbytes) and runtime.get().pinned_by_driver(array)


# --------------------------------------------------------------------------
# Copies
# --------------------------------------------------------------------------
def _require_host(label, a):
    if type(a) is np.ndarray or type(a) is PinnedArray:   # the usual cases: a host array for sure
        return
    if isinstance(a, CpuDeviceArray) or type(a).__module__.startswith("cupy"):
        raise TypeError(f"{label} is a device array but a host (NumPy) array is expected here; "
                        "use to_host() to bring it to the host first")
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{label} must be a host NumPy array, got {type(a).__name__}")


def _require_device(label, a):
    if is_device_array(a):
        return
    if isinstance(a, np.ndarray):
        raise TypeError(f"{label} is a host (NumPy) array but a device array is expected here; "
                        "allocate it with device_empty()/device_zeros() or copy it with to_device()")
    raise TypeError(f"{label} must be a device array of the {backend_name()} backend, got {type(a).__name__}")


def _require_pinned(label, a, direction):
    """Refuse pageable ``a``; returns the address of its first byte (read once: it is not free)."""
    ptr = a.ctypes.data
    if not _pinned_at(a, ptr):
        raise ValueError(
            f"{label} is pageable host memory: an asynchronous {direction} copy from pageable memory "
            "is silently staged by the driver and returns only when the copy has finished, so "
            "nothing overlaps. Allocate the host buffer with pinned_empty()/pinned_zeros(), or use "
            "copy_to_host() for a deliberate blocking copy.")
    return ptr


def _require_writable(label, a):
    # A read-only target would fail only when the queued copy runs, far from the call.
    if not getattr(a.flags, "writeable", True):
        raise ValueError(f"{label} is read-only, so the copy could not write into it; pass a writable "
                         "array (a new pinned_empty() buffer, or one whose flags.writeable is True)")


def queue_copy(kind: OpKind, dst: Any, src: Any, stream: streams.Stream, level: int | None,
               pageable: bool | None = False, host_ptr: int | None = None) -> streams.Stream:
    """Queue one checked copy of ``kind`` (one of :data:`~.runtime.ops.COPY_KINDS`) on the resolved
    ``stream``
    (see :func:`streams.resolve`); returns the stream.

    Package-internal: the path every copy function above ends in, once its arguments are
    checked; :mod:`course_helper.measure.calibrate` times it directly (the copy engine, not the checks).

    A copy from or to pageable host memory is staged by the driver and
    returns only when it has finished. ``pageable=None`` means "pageable unless
    ``dst`` is pinned". ``host_ptr``, when known, is the host array's address (saves reading it again)."""
    if not runtime.wants_op(stream):
        return _copy_unobserved(kind, dst, src, stream, level, host_ptr)
    if pageable is None:
        pageable = not is_pinned(dst)
    cost = CopyCost(kind, dst, src, pageable, host_ptr)
    op = observe.Op(kind, label(kind, level), stream, level, src.nbytes, (src,), (dst,))
    runtime.submit(stream, op, cuda=None, numpy=None, cost=cost)
    return stream


def _copy_unobserved(kind, dst, src, stream, level, host_ptr):
    """:func:`queue_copy` where nothing reads an Op or a cost (CuPy on a GPU, nobody watching):
    the copy goes straight to the runtime, and only the thread's op journal hears of it. A loop
    queues a copy per level, and building what nobody reads would cost about as much as the copy's
    own host time."""
    stream.runtime.copy_async(stream.raw, kind, dst, src, host_ptr)
    if observe.journaling():
        observe.note_op(kind, label(kind, level), stream, level, src.nbytes)
    return stream


def copy_to_host_async(dst: np.ndarray, src: Any, stream: streams.Stream | None = None, *, level: int | None = None,
                       allow_pageable: bool = False) -> None:
    """Queue a device-to-host copy of ``src`` into the pinned host array ``dst``.

    Returns at once; the data is in ``dst`` only after the stream (or an event
    recorded after the copy) has been synchronised. ``dst`` may be a slice of
    a larger pinned allocation, e.g. ``images[k]``. ``level`` labels the copy
    on timelines.

    Parameters
    ----------
    allow_pageable : bool
        Accept a pageable ``dst`` (by default it is refused with a ValueError).
        CUDA then copies synchronously: the host waits. The call queues the copy
        as ``cudaMemcpyAsync`` does and returns only when it, and everything queued
        before it on ``stream``, has finished; timelines show that wait on the host
        lane as "pageable copy". Notebook 3 uses it to show the pitfall.
    """
    stream = streams.resolve(stream)
    ptr = _usual_host_target(dst, src, stream)   # the loops' copy, every level: checked in a few operations
    if ptr is None:
        if _kept_on_device(dst):
            dst.take(src, stream, level)         # a store's slot on the device: the copy stays there
            return
        _require_host("dst", dst)
        _require_device("src", src)
        checks.same_layout(dst, src)
        if allow_pageable and not is_pinned(dst):
            _require_writable("dst", dst)
            _pageable_copy(dst, src, stream, level)
            return
        ptr = _require_pinned("dst", dst, "device-to-host")
        _require_writable("dst", dst)
    queue_copy(D2H, dst, src, stream, level, host_ptr=ptr)
    _hand_on(dst, stream)


def _pageable_copy(dst, src, stream, level):
    """An "asynchronous" copy into pageable ``dst``, as the driver runs it: staged through a
    pinned buffer of its own, the last leg written by the host, and the call returns only when
    the copy has finished. The host's wait goes to the timelines; afterwards the host knows the
    stream's work done (the sanitizer hears it as a synchronise of ``stream``)."""
    observe.notify("host_access", dst, "w", "copy_to_host_async(allow_pageable=True)")
    with streams.host_wait("pageable copy"):
        queue_copy(D2H, dst, src, stream, level, pageable=True)
    observe.notify("host_synced", stream)


def _usual_host_target(dst, src, stream):
    """The address of ``dst`` when the copy ``src`` -> ``dst`` is the usual, valid one (a
    :class:`PinnedArray` or a plain NumPy array, pinned, writable and C-contiguous, of the shape
    and dtype of a C-contiguous device array of ``stream``'s backend), else None, and the caller
    runs the full checks. It accepts nothing they refuse (``tests/test_memory.py`` holds it to
    that); it exists because it costs about half of what the full checks cost, on every level of
    a loop."""
    if ((type(dst) is PinnedArray or type(dst) is np.ndarray) and type(src) is stream.runtime.device_array_type
            and dst.shape == src.shape and dst.dtype == src.dtype and src.strides == dst.strides):
        try:
            # ctypes exports a buffer only from a writable, C-contiguous, non-empty array, so one
            # call checks all three and gives the address, for a third of what ndarray.ctypes
            # costs. Equal strides to that dst then make src C-contiguous too.
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
        except (TypeError, ValueError):
            return None
        if _pinned_at(dst, ptr):
            return ptr
    return None


def copy_to_device_async(dst: Any, src: np.ndarray, stream: streams.Stream | None = None, *,
                         level: int | None = None) -> None:
    """Queue a host-to-device copy of the pinned host array ``src`` into ``dst``."""
    _require_device("dst", dst)
    _require_host("src", src)
    checks.same_layout(dst, src)
    ptr = _require_pinned("src", src, "host-to-device")
    _require_writable("dst", dst)
    queue_copy(H2D, dst, src, streams.resolve(stream), level, host_ptr=ptr)


class InputRing:
    """Input frames in pinned host memory, which host-to-device copies read round and round: a
    forcing or boundary field that a run streams to the device every few steps.

    ``InputRing(frames)`` copies ``frames`` (shape ``(nframes, ...)``) into pinned memory once,
    before any loop, and makes the copy read-only, so that no host write can change a frame
    while a copy may still read it. ``ring[j]`` is the frame block ``j`` reads, frame
    ``j % len(ring)``; :meth:`copy_to_device_async` queues its copy, labelled as level ``j`` on
    timelines ("H2D level j"), as the loops label their copies to the host.

    >>> ring = InputRing(np.arange(8, dtype=np.float32).reshape(2, 2, 2))
    >>> len(ring), float(ring[3][0, 0]), ring[3].flags.writeable
    (2, 4.0, False)
    """

    def __init__(self, frames: np.ndarray) -> None:
        _require_host("frames", frames)
        if frames.ndim < 2 or len(frames) == 0:
            raise ValueError(f"frames must hold at least one frame along its first axis, got shape {frames.shape}")
        self.frames = pinned_empty(frames.shape, frames.dtype)
        observe.notify("host_access", self.frames, "w", "InputRing")
        np.copyto(self.frames, frames)
        self.frames.flags.writeable = False

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, j: int) -> np.ndarray:
        j = checks.positive_int("j (the block)", j, minimum=0)
        return self.frames[j % len(self.frames)]

    def copy_to_device_async(self, dst: Any, j: int, stream: streams.Stream | None = None) -> None:
        """Queue the host-to-device copy of block ``j``'s frame into the device array ``dst``."""
        copy_to_device_async(dst, self[j], stream, level=j)


def copy_on_device_async(dst: Any, src: Any, stream: streams.Stream | None = None, *,
                         level: int | None = None) -> None:
    """Queue a device-to-device copy (fast: it never leaves the GPU's memory)."""
    _require_device("dst", dst)
    _require_device("src", src)
    checks.same_layout(dst, src)
    _require_writable("dst", dst)
    _require_apart(dst, src)
    queue_copy(D2D, dst, src, streams.resolve(stream), level)


def _require_apart(dst, src):
    # An async copy between overlapping ranges has no defined result on a GPU (it may read bytes
    # it has already overwritten), so it is refused here rather than giving a different answer.
    if shares_memory(dst, src):
        raise ValueError("dst and src overlap in device memory, and a copy between overlapping ranges "
                         "has no defined result (it may read what it has already overwritten); copy "
                         "through a separate buffer, or between slices that do not overlap")


def zero_async(dst: Any, stream: streams.Stream | None = None) -> None:
    """Queue filling the device array ``dst`` with zeros (a memset on the stream)."""
    _require_device("dst", dst)
    if not dst.flags.c_contiguous:
        raise ValueError("dst must be C-contiguous")
    _require_writable("dst", dst)
    stream = streams.resolve(stream)
    op = observe.Op(OpKind.MEMSET, "zero", stream, None, dst.nbytes, (), (dst,))
    runtime.submit(stream, op, cuda=None, numpy=None, cost=FillCost(dst))


def copy_to_host(dst: np.ndarray, src: Any, stream: streams.Stream | None = None, *,
                 level: int | None = None) -> None:
    """Copy ``src`` (device) into ``dst`` (host, pinned or pageable) and wait for it.

    This is the blocking copy of the sequential strategy: the host does not
    return until the data has arrived.
    """
    if _kept_on_device(dst):                     # a store's slot on the device: the copy stays there
        stream = streams.resolve(stream)
        dst.take(src, stream, level)
        stream.wait_for_host("blocking copy")
        return
    _require_host("dst", dst)
    _require_device("src", src)
    checks.same_layout(dst, src)
    _require_writable("dst", dst)
    observe.notify("host_access", dst, "w", "copy_to_host")
    stream = queue_copy(D2H, dst, src, streams.resolve(stream), level, pageable=None)
    _hand_on(dst, stream)
    stream.wait_for_host("blocking copy")


# --------------------------------------------------------------------------
# Destinations that take a copy on (a store's ring slots)
# --------------------------------------------------------------------------
# The copy functions test for these two classes with isinstance, and a store's slots
# (course_helper.disk.sink, a layer above) derive from them: the dependency shows as an import
# there. Plain classes, not runtime-checkable Protocols: a copy to the host tests its
# destination on every level, and isinstance against such a Protocol costs about 20 µs there.
class HandsOnCopies:
    """A host array (a :class:`numpy.ndarray` subclass deriving from this too) that takes its data
    on once a copy into it is queued: the copy functions call :meth:`copy_queued` then (a store's
    ring slot, :class:`course_helper.disk.sink.Slot`, hands itself to the store's writers)."""

    def copy_queued(self, stream: streams.Stream) -> None:
        """The copy into this array is queued on ``stream``."""
        raise NotImplementedError(f"{type(self).__name__} must say what it does once a copy into it is queued")


class TakesCopiesOnDevice:
    """A slot on the device that takes a copy meant for the host (a store's ring slot when its
    chunks are compressed on the device, :class:`course_helper.disk.sink.DeviceSlot`): the copy
    functions hand it the copy, and it queues the copy on the device and hands itself on."""

    def take(self, src: Any, stream: streams.Stream, level: int | None) -> None:
        """Queue the copy of the device array ``src`` into this slot on ``stream``, then hand it on."""
        raise NotImplementedError(f"{type(self).__name__} must say how it takes a copy")


def _kept_on_device(dst):
    """Whether ``dst`` takes a copy meant for the host on the device (:class:`TakesCopiesOnDevice`)."""
    return isinstance(dst, TakesCopiesOnDevice)


def _hand_on(dst, stream):
    """The copy into ``dst`` is queued on ``stream``: a :class:`HandsOnCopies` is told so."""
    if isinstance(dst, HandsOnCopies):
        dst.copy_queued(stream)


# --------------------------------------------------------------------------
# Bandwidth
# --------------------------------------------------------------------------
def measure_bandwidth(sizes_mib: Iterable[float] = (1, 4, 16, 64), repeats: int = 3,
                      stream: streams.Stream | None = None) -> list[dict]:
    """Measure device-to-host copy speed from pinned and from pageable host memory.

    For each size and memory kind, copies ``repeats`` times, timed with events
    on the stream, and checks after each call whether it returned *before* the
    copy had finished (the sign of a truly asynchronous copy).

    Returns
    -------
    list of dict
        One row per (size, memory): ``size_mib``, ``memory`` ("pinned" or
        "pageable"), ``gb_per_s`` (median, 1 GB = 1e9 bytes),
        ``returned_early`` (fraction of calls that returned before the copy
        finished) and ``correct`` (the data arrived intact). On the CPU
        backend the speeds are those of the modelled GPU.
    """
    try:
        sizes = [float(s) for s in sizes_mib]
    except TypeError:
        raise TypeError("sizes_mib must be a list of sizes in MiB, e.g. (1, 4, 16)") from None
    if not sizes or any(not np.isfinite(s) or s <= 0 for s in sizes):
        raise ValueError(f"sizes_mib must be a non-empty list of positive sizes in MiB, got {sizes_mib!r}")
    repeats = checks.positive_int("repeats", repeats)
    checks.host_memory(max(sizes) * 2**20 * 3, f"measuring {max(sizes)} MiB",   # source + two host buffers
                       advice="use smaller sizes")
    stream = streams.resolve(stream) if stream is not None else streams.create_streams(1, name="copy")[0]
    rows = []
    for size in sizes:
        n = max(1, int(size * 2**20) // 4)
        src_host = np.arange(n, dtype=np.float32)
        src = to_device(src_host)
        for memory in ("pinned", "pageable"):
            dst = pinned_empty(n) if memory == "pinned" else np.empty(n, np.float32)
            rows.append({"size_mib": size, "memory": memory, **_timed_copies(dst, src, src_host, stream, repeats)})
            del dst
    _measured.update(_row_key(r) for r in rows)
    return rows


#: What measure_bandwidth has returned in this process, by (size, memory, exact speed): notebook 3's
#: check takes rows the learner measured, not rows typed in.
_measured: set[tuple] = set()


def _row_key(row: dict) -> tuple:
    return (float(row["size_mib"]), row["memory"], float(row["gb_per_s"]))


def was_measured(row: dict) -> bool:
    """Whether ``row`` is one that :func:`measure_bandwidth` returned in this process, as it returned
    it (its size, memory and speed, to the last bit)."""
    try:
        return _row_key(row) in _measured
    except (KeyError, TypeError, ValueError):
        return False


def _timed_copies(dst, src, expected, stream, repeats):
    """:func:`measure_bandwidth`'s row for one destination: ``repeats + 1`` copies of ``src`` into
    ``dst``, each from an idle stream into a reset buffer (the first warms up: timed and checked
    like the others, left out of the median)."""
    early, intact = [], []

    def reset():
        dst[...] = -1
        stream.synchronize()

    def copy():
        copy_to_host_async(dst, src, stream, allow_pageable=True)
        early.append(not stream.done)          # returned before the copy had finished

    t = timing.benchmark(copy, stream, n_repeat=repeats + 1, before=reset,
                         after=lambda: intact.append(bool(np.array_equal(dst, expected))))
    med = float(np.median(t.device_ms[1:]))
    return {"gb_per_s": dst.nbytes / (med * 1e-3) / 1e9 if med > 0 else float("inf"),
            "returned_early": sum(early) / (repeats + 1), "correct": all(intact)}
