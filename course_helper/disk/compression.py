"""Where a store's chunks are compressed, and nvCOMP's zstd on the GPU for ``compress="gpu-zstd"``.

:func:`engine_for` picks the engine of a run: with ``"gpu-zstd"``, nvCOMP on the GPU (the
``nvcomp`` extra), the modelled device's compression engine on the CPU backend (where the
profile has measured one), or else the writer threads on the host, with a
:class:`CompressionFallback` warning saying why. All three write the same store (:mod:`.shards`).

On the GPU, :class:`NvcompCompressor` is a thread of its own with a CUDA stream of its own. For
each chunk of levels the loop has copied into a device slot of the ring it waits for that copy,
compresses the chunk's inner chunks in one nvCOMP call (zstd, raw bitstream, each inner chunk
compressed alone, into output buffers allocated once), reads each level's peak, packs the
compressed inner chunks together with one small kernel, and copies only those bytes to the
chunk's pinned host slot; a writer thread then writes the shard. The wave kernels go on meanwhile
on the compute stream: the compression runs on the device beside them.
"""
from __future__ import annotations

import functools
import queue
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from .. import runtime
from ..memory import pinned_empty
from .layout import SHARDED
from .shards import ALIGNMENT, ChunkFile, shard_file, zstd_bound

__all__ = ["CompressionFallback", "NVCOMP_EXTRA", "DEVICE_CHUNK_BYTES", "device_batch", "nvcomp_module", "engine_for",
           "NvcompCompressor"]

#: How to install nvCOMP's Python package for the course (an optional extra).
NVCOMP_EXTRA = "pip install -e '.[nvcomp]' (nvidia-nvcomp-cu13, for CUDA 13)"
#: Bytes of levels per chunk (one nvCOMP call) the compression on the device was measured fast
#: with: 16 levels of 4 MiB per call, 24 GB/s on the H200, where one 4 MiB level per call ran at
#: 1.8 GB/s (benchmarks/nvcomp.json). A call costs about 2 ms however small.
DEVICE_CHUNK_BYTES = 64 * 2**20


def device_batch(level_bytes: int) -> int:
    """Levels per chunk (the staged loop's ``batch``) for compression on the device: about
    :data:`DEVICE_CHUNK_BYTES` of levels of ``level_bytes`` each, at least one."""
    return max(1, DEVICE_CHUNK_BYTES // level_bytes)


class CompressionFallback(UserWarning):
    """``compress="gpu-zstd"`` cannot compress on the device here; the writer threads compress
    on the host instead (the store is the same)."""


def nvcomp_module() -> ModuleType:
    """nvCOMP's Python package (``nvidia.nvcomp``), imported on first use."""
    from nvidia import nvcomp
    return nvcomp


def engine_for(compress: str | None) -> tuple[str, str]:
    """``(where, why)``: where a run's chunks are compressed. ``"device"``: nvCOMP on this GPU;
    ``"modelled"``: the modelled device's compression engine (CPU backend, a profile that
    measured one); ``"host"``: the writer threads (raw bytes, the host codecs, or
    ``"gpu-zstd"`` where neither device engine is here; ``why`` then says why, and a
    :class:`CompressionFallback` warning says it too)."""
    if compress not in SHARDED:
        return "host", ""
    rt = runtime.get()
    modelled = rt.compresses_on_device("zstd")       # a model's own engine, or None: nvCOMP decides
    if modelled is not None:
        on_device, why = modelled
        if on_device:
            return "modelled", why
        why += ("; the writer threads compress the chunks on the host (the same store), and the modelled time "
                "has no compression stage")
    else:
        try:
            nvcomp = nvcomp_module()
            return "device", f"nvCOMP {getattr(nvcomp, '__version__', '')} zstd on {rt.device_label}"
        except Exception as exc:  # noqa: BLE001 - a missing or broken nvCOMP: the host compresses, and says why
            why = (f"nvCOMP cannot be imported ({type(exc).__name__}: {exc}); install it with {NVCOMP_EXTRA}. "
                   "Until then the writer threads compress the chunks on the host (the same store)")
    warnings.warn(f"compress='gpu-zstd': {why}", CompressionFallback, stacklevel=3)
    return "host", why


# The compressed inner chunks sit in the output buffer at a fixed stride; one block per inner chunk
# copies its used bytes to their place in the packed buffer (one launch per chunk of levels).
_PACK_SOURCE = r"""
extern "C" __global__ void course_pack(const unsigned char* src, unsigned char* dst,
                                       const unsigned long long* from, const unsigned long long* to,
                                       const unsigned long long* size) {
    const unsigned long long i = blockIdx.x;
    const unsigned char* s = src + from[i];
    unsigned char* d = dst + to[i];
    for (unsigned long long j = threadIdx.x; j < size[i]; j += blockDim.x) d[j] = s[j];
}
"""
_kernels = {}


def _pack_kernel(cupy):
    if "pack" not in _kernels:
        _kernels["pack"] = cupy.RawKernel(_PACK_SOURCE, "course_pack")
    return _kernels["pack"]


class NvcompCompressor:
    """The compression stage of a store's pipeline on a GPU (see the module's text).

    ``device`` is the ring's device buffer (slots, chunk levels, n0, n1), float32; ``rows`` the
    rows of an inner chunk. :meth:`put` hands it a chunk (its first level, its levels, its slot
    and the event after the copy into the slot); ``deliver(first, n, s, fetch)`` is called for
    each chunk, in order, with a function that returns its :class:`~.shards.ChunkFile` (or raises
    what compressing it raised). ``intervals`` collects each chunk's compression and copy, on
    the host clock, for the timeline.
    """

    def __init__(self, device: Any, rows: int,
                 deliver: Callable[[int, int, int, Callable[[], ChunkFile]], None]) -> None:
        from ..runtime.backend import cupy_module
        self.cupy = cupy = cupy_module()
        nvcomp = self.nvcomp = nvcomp_module()
        nslots, self.chunk, n0, n1 = device.shape
        self.device, self.rows, self.deliver = device, rows, deliver
        self.level_bytes = n0 * n1 * 4
        self.inner_bytes = rows * n1 * 4
        self.per_level = n0 // rows
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # The codec is used by this object's thread alone once the run starts (nvCOMP's rule).
        self.codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW,
                                  uncomp_chunk_size=self.inner_bytes, cuda_stream=self.stream.ptr)
        alignment = getattr(self.codec, "get_required_compression_alignment", lambda: ALIGNMENT)
        align = max(ALIGNMENT, int(alignment()))
        if self.inner_bytes % align:
            raise ValueError(f"nvCOMP's zstd needs inner chunks of a multiple of {align} bytes, and this grid's "
                             f"are {self.inner_bytes} ({rows} rows of {n1} float32)")
        flat = device.reshape(-1).view(cupy.uint8)
        try:      # nvCOMP's bound for one inner chunk; zstd's own where this nvCOMP has no such call
            bound = int(self.codec.get_max_comp_buffer_size(nvcomp.as_array(flat[:self.inner_bytes])))
        except Exception:  # noqa: BLE001 - no such call in this nvCOMP, or it refused the probe: zstd's bound
            bound = zstd_bound(self.inner_bytes) + 64
        self.cap = -(-bound // align) * align                      # each output buffer's capacity
        entries = self.chunk * self.per_level
        self.out = cupy.empty(entries * self.cap, cupy.uint8)      # nvCOMP's output, one buffer per inner chunk
        self.packed = cupy.empty(entries * self.cap, cupy.uint8)   # the same bytes, packed
        self.host = [pinned_empty(entries * self.cap, np.uint8) for _ in range(nslots)]   # compressed bytes
        self.flat = flat
        # One inner chunk of zeros compressed now, so that an nvCOMP this code cannot drive fails
        # here (and the host compresses instead) rather than in the middle of a run.
        try:
            with self.stream:
                device[0, 0, :rows].fill(0)
            self._encode(0, 1)
        except BaseException:
            self.let_go()             # the codec goes before its stream, not whenever the collector runs
            raise
        self.intervals = []                  # (first level index, n, t0, t1, t2, compressed bytes)
        self.queue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.run, name="disk compressor", daemon=True)

    def start(self) -> None:
        """Start the compressing thread."""
        self.thread.start()

    def put(self, first: int, n: int, s: int, done: Any) -> None:
        """Compress the ``n`` levels in slot ``s`` once ``done`` (an event after their copy) has happened."""
        self.queue.put((first, n, s, done))

    def stop(self) -> None:
        """Let the thread end once it has compressed every chunk handed to it."""
        self.queue.put(None)
        if self.thread.ident is not None:
            self.thread.join()

    def run(self) -> None:
        """The thread: one chunk at a time, in the order the loop handed them over."""
        while True:
            item = self.queue.get()
            if item is None:
                return
            first, n, s, done = item
            try:
                fetch = self.compress(first, n, s, done)   # the shard is put together by the writer that calls it
            except BaseException as exc:  # noqa: BLE001 - handed to the writer, which stops the run
                fetch = _raiser(exc)
            self.deliver(first, n, s, fetch)

    def compress(self, first: int, n: int, s: int, done: Any) -> Callable[[], ChunkFile]:
        """Compress slot ``s``'s ``n`` levels; returns the function that puts the chunk's file
        together from the compressed bytes (see the module's text). A writer thread calls it, so
        that this thread goes on to the next chunk meanwhile."""
        cupy, stream = self.cupy, self.stream
        done.synchronize()                                   # the copy into the slot has landed
        t0 = runtime.host_ms()
        count = n * self.per_level
        with stream:
            levels = self.device[s, :n]
            peaks_d = cupy.maximum(levels.max(axis=(1, 2)), -levels.min(axis=(1, 2)))
        sizes = self._encode(s * self.chunk * self.level_bytes, count)
        t1 = runtime.host_ms()
        to = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
        total = int(sizes.sum())
        with stream:
            meta = [cupy.asarray(a) for a in (np.arange(count, dtype=np.uint64) * np.uint64(self.cap), to, sizes)]
            _pack_kernel(cupy)((count,), (256,), (self.out, self.packed, *meta))
        host = self.host[s]
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, self.packed.data.ptr, total, 2, stream.ptr)   # D2H
        peaks = cupy.asnumpy(peaks_d, stream=stream)
        stream.synchronize()
        t2 = runtime.host_ms()
        self.intervals.append((first, n, t0, t1, t2, total))
        view = memoryview(host)
        pieces = [view[int(o):int(o) + int(z)] for o, z in zip(to, sizes)]
        return functools.partial(shard_file, pieces, self.chunk, self.per_level, peaks)

    def _encode(self, start, count):
        """Compress ``count`` inner chunks of the ring, from its byte ``start`` on, into the output
        buffers in one nvCOMP call; returns their compressed sizes (waiting for them)."""
        stream = self.stream
        inputs = self.nvcomp.as_arrays(self.flat, [start + i * self.inner_bytes for i in range(count)],
                                       [self.inner_bytes] * count, cuda_stream=stream.ptr)
        outputs = self.nvcomp.as_arrays(self.out, [i * self.cap for i in range(count)], [self.cap] * count,
                                        cuda_stream=stream.ptr)
        self.codec.encode(inputs, out=outputs)
        sizes = outputs.buffer_sizes
        sizes = np.asarray(sizes() if callable(sizes) else sizes, np.uint64)   # waits for the compression
        if len(sizes) != count or (sizes > self.cap).any() or not sizes.all():
            raise RuntimeError(f"nvCOMP reported compressed sizes {sizes[:4].tolist()}... for {count} inner chunks "
                               f"of {self.inner_bytes} bytes (each at most {self.cap}): not sizes of zstd frames")
        return sizes

    def let_go(self) -> None:
        """Drop the codec, then the device and pinned buffers, then the stream (the run is over).

        In this order, and now rather than whenever the garbage collector gets to this object:
        nvCOMP's codec uses its stream when it is destroyed, and a codec destroyed after its
        stream crashed the process (seen on an H100 with nvCOMP 6.0)."""
        if self.stream is not None:
            self.stream.synchronize()
        self.codec = None
        self.host, self.out, self.packed, self.flat, self.device = [], None, None, None, None
        self.stream = None


def _raiser(exc):
    def fetch():
        raise exc
    return fetch
