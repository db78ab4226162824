"""Disk: the saved levels streamed to a Zarr store while the solver runs, and read back.

``ch.disk.open_store(path)`` reads a run back; ``solve(..., store=path)`` writes one through a
:class:`DiskSink`; :func:`measure_disk_bandwidth` and :func:`codec_speed` say how fast the disk and
a codec are.

Modules: :mod:`.layout` (the store's files: its arrays, run state, checksums, the errors it
raises), :mod:`.sink` (writing a run: the ring of host slots and the writer threads),
:mod:`.reading` (reading a run back), :mod:`.measuring` (the disk's and a codec's speed).
"""
from .layout import CODECS, THREAD_NAMES, StoreDamaged, StoreWriteError, check_target
from .measuring import codec_speed, measure_disk_bandwidth
from .reading import StoredImages, StoredRun, open_store
from .sink import DEFAULT_WRITERS, DiskSink, Ring, ring_slots

__all__ = ["CODECS", "DEFAULT_WRITERS", "THREAD_NAMES", "DiskSink", "Ring", "StoreDamaged", "StoredImages", "StoredRun",
           "StoreWriteError", "check_target", "codec_speed", "measure_disk_bandwidth", "open_store", "ring_slots"]
