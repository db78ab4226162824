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
from .shards import ALIGNMENT, ChunkFile, packed_shard, zstd_bound

__all__ = ["CompressionFallback", "NVCOMP_EXTRA", "DEVICE_CHUNK_BYTES", "device_batch", "nvcomp_module",
           "nvcomp_unusable", "engine_for", "NvcompCompressor"]

#: How to install nvCOMP's Python package for the course (an optional extra).
NVCOMP_EXTRA = "pip install -e '.[nvcomp]' (nvidia-nvcomp-cu13, for CUDA 13)"
#: Bytes of levels per chunk (one nvCOMP call). A call costs the device milliseconds however
#: small, so larger calls compress faster: on an H100, 1024² x 320 streamed with every level saved,
#: 16 levels of 4 MiB per call compressed at 16 GB/s, 32 at 27 GB/s and 64 at 42 GB/s
#: (benchmarks/gpu_compress.json). 128 MiB keeps the store's ring on the device under a GiB.
DEVICE_CHUNK_BYTES = 128 * 2**20


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


@functools.cache
def nvcomp_unusable() -> str | None:
    """Why nvCOMP cannot compress in this process, or None where it can: its Python package must
    import *and* its library load. The package can be there while its library is not (the
    ``nvidia-libnvcomp-cu13`` wheel missing or not found: "ImportError: libnvcomp.so.6: cannot
    open shared object file"), and the library is loaded by the import or by the first codec, so
    this makes one small codec. Tried once: the answer holds for the process."""
    try:
        nvcomp = nvcomp_module()
        nvcomp.Codec(algorithm="Zstd")
    except Exception as exc:  # noqa: BLE001 - a missing or broken nvCOMP: not usable, and the reason says why
        return f"nvCOMP cannot be loaded ({type(exc).__name__}: {exc}); install it with {NVCOMP_EXTRA}"
    return None


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
        unusable = nvcomp_unusable()
        if unusable is None:
            return "device", f"nvCOMP {getattr(nvcomp_module(), '__version__', '')} zstd on {rt.device_label}"
        why = f"{unusable}. Until then the writer threads compress the chunks on the host (the same store)"
    warnings.warn(f"compress='gpu-zstd': {why}", CompressionFallback, stacklevel=3)
    return "host", why


# The compressed inner chunks sit in nvCOMP's output buffer at a fixed stride. One block per inner
# chunk copies its used bytes to their place in the packed buffer and appends their CRC32C
# (Castagnoli, reflected, as Zarr's ``crc32c`` codec computes it), so that the packed buffer holds
# the shard's inner chunks exactly as the file holds them and the host touches no inner chunk.
_PACK_SOURCE = r"""
extern "C" __global__ void course_pack_crc32c(const unsigned char* src, unsigned char* dst,
                                              const unsigned long long* from, const unsigned long long* to,
                                              const unsigned long long* size, unsigned int* crcs) {
    __shared__ unsigned int table[256];
    for (unsigned int j = threadIdx.x; j < 256; j += blockDim.x) {
        unsigned int c = j;
        for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[j] = c;
    }
    const unsigned long long i = blockIdx.x, n = size[i];
    const unsigned char* s = src + from[i];
    unsigned char* d = dst + to[i];
    for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) d[j] = s[j];
    __syncthreads();
    if (threadIdx.x == 0) {            // an inner chunk is a few KiB: one thread walks it
        unsigned int c = 0xFFFFFFFFu;
        for (unsigned long long j = 0; j < n; ++j) c = table[(c ^ s[j]) & 0xFFu] ^ (c >> 8);
        c ^= 0xFFFFFFFFu;
        crcs[i] = c;
        d[n] = c & 0xFFu; d[n + 1] = (c >> 8) & 0xFFu; d[n + 2] = (c >> 16) & 0xFFu; d[n + 3] = c >> 24;
    }
}
"""
_kernels = {}


def _pack_kernel(cupy):
    if "pack" not in _kernels:
        _kernels["pack"] = cupy.RawKernel(_PACK_SOURCE, "course_pack_crc32c")
    return _kernels["pack"]


class NvcompCompressor:
    """The compression stage of a store's pipeline on a GPU (see the module's text).

    ``device`` is the ring's device buffer (slots, chunk levels, n0, n1), float32; ``rows`` the
    rows of an inner chunk. :meth:`put` hands it a chunk (its first level, its levels, its slot
    and the event after the copy into the slot); ``deliver(first, n, s, fetch)`` is called for
    each chunk, in order, with a function that returns its :class:`~.shards.ChunkFile` (or raises
    what compressing it raised). ``intervals`` collects each chunk's compression and copy, on
    the host clock, for the timeline.

    Two streams: nvCOMP compresses on :attr:`stream`, and the packing and the copy of the
    compressed bytes to the host run on :attr:`copy_stream`, so that one chunk's bytes travel to
    the host while the next chunk compresses (nvCOMP's output buffer is doubled for that).
    Everything the host does per chunk is a handful of calls, whatever the number of inner
    chunks: the writer threads share the interpreter with the loop that feeds the GPU, and
    Python work per inner chunk (a thousand per shard) held that loop back for milliseconds
    at a time.
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
        self.stream, self.copy_stream = _compression_streams(cupy)
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
        self.flat = flat
        # nvCOMP's output, one buffer of `cap` bytes per inner chunk; two, used in turn
        self.out = [cupy.empty(entries * self.cap, cupy.uint8) for _ in range(2)]
        self.packed = cupy.empty(entries * (self.cap + 4), cupy.uint8)   # the inner chunks and their CRC32C
        self.crcs = cupy.empty(entries, cupy.uint32)
        self.strides = cupy.arange(entries, dtype=cupy.uint64) * self.cap   # where each output buffer starts
        self.host = [pinned_empty(entries * (self.cap + 4), np.uint8) for _ in range(nslots)]
        self.host_crcs = [pinned_empty(entries, np.uint32) for _ in range(nslots)]
        self.packed_out = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]   # out[k] read by the packing
        self.turn = 0                                              # which of the two output buffers is next
        # The batches nvCOMP reads and writes, described once: a thousand inner chunks described
        # per call cost the host milliseconds.
        self.batches = {}
        # One inner chunk of zeros compressed now, so that an nvCOMP this code cannot drive fails
        # here (and the host compresses instead) rather than in the middle of a run.
        try:
            with self.stream:
                device[0, 0, :rows].fill(0)
            self._encode(0, 1, 0)()
        except BaseException:
            self.let_go()             # now, not whenever the collector runs
            raise
        self.intervals = []                  # (first level index, n, t0, t1, t2, compressed bytes)
        self.queue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="disk compressor", daemon=True)

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

    def _run(self) -> None:
        """The thread: one chunk at a time, in the order the loop handed them over. A chunk's
        compressed bytes are handed to the writers once they are on the host, which is checked
        after the next chunk's compression has been queued (they travel meanwhile)."""
        landing = None                       # (first, n, s, landed) of the chunk on its way to the host
        while True:
            if landing is not None and self.queue.empty():
                self._hand_over(*landing)    # nothing to compress meanwhile: the writers get it now
                landing = None
            item = self.queue.get()
            if item is None:
                break
            first, n, s, done = item
            try:
                compressing = self.compress(first, n, s, done)
            except BaseException as exc:  # noqa: BLE001 - handed to the writer, which stops the run
                compressing = _raiser(exc)
            if landing is not None:
                self._hand_over(*landing)
            try:
                landing = (first, n, s, compressing())     # its sizes, then its packing and copy queued
            except BaseException as exc:  # noqa: BLE001 - handed to the writer, which stops the run
                landing = (first, n, s, _raiser(exc))
        if landing is not None:
            self._hand_over(*landing)

    def _hand_over(self, first, n, s, landed):
        """Wait for a chunk's compressed bytes to land on the host; pass its file to the writers."""
        try:
            chunk = landed()
        except BaseException as exc:  # noqa: BLE001 - handed to the writer, which stops the run
            chunk = exc
        self.deliver(first, n, s, _raiser(chunk) if isinstance(chunk, BaseException) else lambda: chunk)

    def compress(self, first: int, n: int, s: int, done: Any) -> Callable[[], Callable[[], ChunkFile]]:
        """Queue the compression of slot ``s``'s ``n`` levels (once ``done``, the copy into the
        slot, has happened) and their peaks. Returns the next step: wait for the compressed sizes
        and queue the packing and the copy to the host, which returns the last: wait for the bytes
        on the host and put the chunk's :class:`~.shards.ChunkFile` together."""
        cupy, stream = self.cupy, self.stream
        done.synchronize()                                   # the copy into the slot has landed
        t0 = runtime.host_ms()
        count, k = n * self.per_level, self.turn
        self.turn = 1 - k
        stream.wait_event(self.packed_out[k])                # out[k]'s previous chunk has been packed
        with stream:
            levels = self.device[s, :n]
            peaks_d = cupy.maximum(levels.max(axis=(1, 2)), -levels.min(axis=(1, 2)))
        sizes_of = self._encode(s * self.chunk * self.level_bytes, count, k)
        return functools.partial(self._pack, first, n, s, k, t0, count, peaks_d, sizes_of)

    def _pack(self, first, n, s, k, t0, count, peaks_d, sizes_of):
        """Wait for the compressed sizes; queue the packing and the copy of the chunk's bytes and
        CRC32Cs to slot ``s``'s pinned buffers; return the wait for them (see :meth:`compress`)."""
        cupy, copy = self.cupy, self.copy_stream
        sizes = sizes_of()                                   # waits for the compression
        peaks = cupy.asnumpy(peaks_d, stream=self.stream)    # computed before it
        t1 = runtime.host_ms()
        stored = sizes + np.uint64(4)                        # each inner chunk and its CRC32C
        to = np.cumsum(stored) - stored
        total = int(stored.sum())
        with copy:
            meta = (self.strides[:count], cupy.asarray(to), cupy.asarray(sizes))
            _pack_kernel(cupy)((count,), (256,), (self.out[k], self.packed, *meta, self.crcs))
            self.packed_out[k].record(copy)
        host, crcs = self.host[s], self.host_crcs[s]
        rt = cupy.cuda.runtime
        rt.memcpyAsync(host.ctypes.data, self.packed.data.ptr, total, rt.memcpyDeviceToHost, copy.ptr)
        rt.memcpyAsync(crcs.ctypes.data, self.crcs.data.ptr, 4 * count, rt.memcpyDeviceToHost, copy.ptr)
        landed = cupy.cuda.Event(disable_timing=True)
        landed.record(copy)

        def on_the_host():
            landed.synchronize()
            self.intervals.append((first, n, t0, t1, runtime.host_ms(), total))
            return packed_shard(memoryview(host)[:total], stored, crcs[:count].tobytes(), self.chunk,
                                self.per_level, peaks)
        return on_the_host

    def _encode(self, start, count, k):
        """Queue the compression of ``count`` inner chunks of the ring, from its byte ``start`` on,
        into output buffer ``k`` in one nvCOMP call; returns the function that waits for their
        compressed sizes and returns them."""
        key = (start, count, k)
        if key not in self.batches:
            stream, nvcomp = self.stream, self.nvcomp
            self.batches[key] = (
                nvcomp.as_arrays(self.flat, [start + i * self.inner_bytes for i in range(count)],
                                 [self.inner_bytes] * count, cuda_stream=stream.ptr),
                nvcomp.as_arrays(self.out[k], [i * self.cap for i in range(count)], [self.cap] * count,
                                 cuda_stream=stream.ptr))
        inputs, outputs = self.batches[key]
        self.codec.encode(inputs, out=outputs)

        def sizes_of():
            sizes = outputs.buffer_sizes
            sizes = np.asarray(sizes() if callable(sizes) else sizes, np.uint64)   # waits for the compression
            if len(sizes) != count or (sizes > self.cap).any() or not sizes.all():
                raise RuntimeError(f"nvCOMP reported compressed sizes {sizes[:4].tolist()}... for {count} inner "
                                   f"chunks of {self.inner_bytes} bytes (each at most {self.cap}): not sizes of "
                                   "zstd frames")
            return sizes
        return sizes_of

    def let_go(self) -> None:
        """Drop the codec and the device and pinned buffers, once the streams have drained (the
        run is over): now rather than whenever the garbage collector gets to this object. The
        streams stay (see :func:`_compression_streams`)."""
        for stream in (self.stream, self.copy_stream):
            if stream is not None:
                stream.synchronize()
        self.codec, self.batches = None, {}
        self.host, self.host_crcs, self.out, self.packed, self.crcs = [], [], None, None, None
        self.flat, self.device, self.strides = None, None, None
        self.stream = self.copy_stream = None


_streams_lock = threading.Lock()
_STREAMS = {}


def _compression_streams(cupy):
    """The compression stage's two streams on the current device (nvCOMP's, and the packing's and
    copy's), made once and kept for every later run. nvCOMP's codec and the batches described for
    it use their stream when they are destroyed, which can be after the run (a traceback may hold
    them), and a stream destroyed before them crashed the process (seen on an H100 with nvCOMP 6.0)."""
    device = cupy.cuda.runtime.getDevice()
    with _streams_lock:
        if device not in _STREAMS:
            _STREAMS[device] = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True))
        return _STREAMS[device]


def _raiser(exc):
    def fetch():
        raise exc
    return fetch
