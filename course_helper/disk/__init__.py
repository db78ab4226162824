"""Disk: the saved levels streamed to a Zarr store while the solver runs, and read back.

``ch.disk.open_store(path)`` reads a run back; ``solve(..., store=path)`` writes one through a
:class:`DiskSink`; :func:`measure_disk_bandwidth` and :func:`codec_speed` say how fast the disk and
a codec are.

Modules: :mod:`.layout` (the store's files: its arrays, run state, checksums, the errors it
raises), :mod:`.shards` (a chunk's file: raw, host-compressed, or a Zarr shard of small zstd
chunks), :mod:`.compression` (where the chunks are compressed; nvCOMP on the GPU),
:mod:`.sink` (writing a run: the ring of slots, the compression stage and the writer threads),
:mod:`.reading` (reading a run back), :mod:`.measuring` (the disk's and a codec's speed).
"""
from .compression import CompressionFallback, device_batch, engine_for
from .layout import CODECS, SHARDED, THREAD_NAMES, StoreDamaged, StoreWriteError, check_target
from .measuring import codec_speed, measure_disk_bandwidth
from .reading import StoredImages, StoredRun, open_store
from .sink import DEFAULT_WRITERS, DiskSink, Ring, ring_slots

__all__ = ["CODECS", "DEFAULT_WRITERS", "SHARDED", "THREAD_NAMES", "CompressionFallback", "DiskSink", "Ring",
           "StoreDamaged", "StoredImages", "StoredRun", "StoreWriteError", "check_target", "codec_speed",
           "device_batch", "engine_for", "measure_disk_bandwidth", "open_store", "ring_slots"]
