"""Disk: the saved levels streamed to a Zarr store while the solver runs, and read back.

``ch.disk.open_store(path)`` reads a run back; ``solve(..., store=path)`` writes one through a
:class:`DiskSink`; :func:`measure_disk_bandwidth` and :func:`codec_speed` say how fast the disk and
a codec are.
"""
from .store import (CODECS, DEFAULT_WRITERS, THREAD_NAMES, DiskSink, Ring, StoreDamaged, StoredImages, StoredRun,
                    StoreWriteError, codec_speed, measure_disk_bandwidth, open_store, ring_slots)

__all__ = ["CODECS", "DEFAULT_WRITERS", "THREAD_NAMES", "DiskSink", "Ring", "StoreDamaged", "StoredImages", "StoredRun",
           "StoreWriteError", "codec_speed", "measure_disk_bandwidth", "open_store", "ring_slots"]
