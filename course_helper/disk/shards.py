"""The files of a chunk of ``u``: raw or host-compressed bytes, or a Zarr v3 shard of small
zstd chunks (``compress="gpu-zstd"``), and what the store's checksums fold in for each.

**A shard** (Zarr's ``sharding_indexed`` codec) is one file holding many small inner chunks and
an index of where each one is, so that a reader takes only the inner chunks it needs. A store
written with ``compress="gpu-zstd"`` keeps one shard per chunk of levels (one copy's levels, as
the other layouts keep one file), and cuts each level into inner chunks of whole rows of about
:data:`INNER_CHUNK_BYTES` (:func:`inner_rows`). A shard's file is:

* every inner chunk of its levels, in C order (level by level, then rows): its zstd frame,
  compressed alone, then that frame's CRC32C (Zarr's ``crc32c`` codec, which readers check);
* the index: one ``(offset, nbytes)`` pair of little-endian uint64 per inner chunk, both
  ``2**64 - 1`` for an inner chunk not written (a level past the end of the array, which reads
  as the fill value), then the index's own CRC32C.

Any Zarr v3 reader (zarr-python, xarray) reads it with no course code. The zstd frames may come
from nvCOMP on the GPU or from numcodecs on the host: one format, decoded by the same codec.

**What the store's checksums fold in** (:class:`~.layout.Checksums`): for an unsharded chunk,
the CRC32C at the end of its file; for a shard, :func:`shard_tag`, the CRC32C of its index (with
the index's CRC32C) and of every inner chunk's CRC32C, so that the record ties each inner
chunk's bytes, not only the index, to the shard's place. :func:`file_tag` reads a file's tag
back (a shard's: its index, then the last 4 bytes of each inner chunk).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import google_crc32c
import numpy as np

from .. import files

__all__ = ["INNER_CHUNK_BYTES", "ALIGNMENT", "EMPTY", "ChunkFile", "inner_rows", "inner_chunks", "checksum",
           "raw_file", "shard_file", "packed_shard", "compress_on_host", "shard_tag", "file_tag", "zstd_bound"]

#: Bytes of an inner chunk of a shard (at most; whole rows). nvCOMP's zstd on an H200, 16 late
#: levels of a 1024² run per call, raw bitstream: 64 KiB inner chunks, ratio 12.4 at 20.6 GB/s;
#: 256 KiB, ratio 12.6 at 7.0 GB/s. The smaller chunks compress about as well, three times faster.
INNER_CHUNK_BYTES = 64 * 2**10
#: Inner chunks of this many bytes line up with what nvCOMP asks of its buffers (16 bytes, the
#: largest alignment it asks for), so a level's inner chunks can be compressed in place.
ALIGNMENT = 16
#: An index entry of an inner chunk that was not written (Zarr's sharding codec).
EMPTY = 2**64 - 1


class ChunkFile(NamedTuple):
    """One chunk's file, ready to write: ``parts`` (buffers written one after the other),
    ``tag`` (the 4 bytes the store's record of the chunk folds in), ``nbytes`` (the file's
    size) and, where the chunk's levels were read on the device, their ``peaks`` (largest
    |u| of each level)."""
    parts: tuple
    tag: bytes
    nbytes: int
    peaks: np.ndarray | None = None


def checksum(payload: files.BytesLike) -> bytes:
    """The 4 bytes Zarr's ``crc32c`` codec appends to a chunk: the CRC32C of ``payload``
    (computed by google-crc32c, the library that codec uses), little-endian."""
    view = np.frombuffer(payload, np.uint8)
    view.flags.writeable = False           # google-crc32c takes read-only buffers (no copy made)
    return int(google_crc32c.value(view)).to_bytes(4, "little")


def inner_rows(n0: int, n1: int) -> int:
    """Rows of a level in one inner chunk of a shard: the most rows, dividing ``n0``, whose bytes
    are at most :data:`INNER_CHUNK_BYTES`, preferring a multiple of :data:`ALIGNMENT` bytes (what
    the GPU's compression needs of its inputs); one row where even one row is larger."""
    row = 4 * n1
    fits = [r for r in range(1, n0 + 1) if n0 % r == 0 and r * row <= INNER_CHUNK_BYTES]
    aligned = [r for r in fits if r * row % ALIGNMENT == 0]
    return max(aligned or fits or [1])


def inner_chunks(shape: tuple[int, int]) -> tuple[int, int]:
    """``(rows, count)``: rows per inner chunk of a level of ``shape``, and inner chunks per level."""
    rows = inner_rows(*shape)
    return rows, shape[0] // rows


def zstd_bound(nbytes: int) -> int:
    """The most bytes zstd makes of ``nbytes`` (``ZSTD_COMPRESSBOUND``): incompressible data are
    stored in raw blocks, a few bytes more than they hold."""
    return nbytes + (nbytes >> 8) + ((128 * 2**10 - nbytes) >> 11 if nbytes < 128 * 2**10 else 0)


def raw_file(payload: files.BytesLike) -> ChunkFile:
    """An unsharded chunk's file: its bytes (raw, or one zstd or blosc frame) and their CRC32C."""
    crc = checksum(payload)
    return ChunkFile((payload, crc), crc, memoryview(payload).nbytes + 4)


def _index(sizes, chunk_levels, per_level):
    """The shard index (bytes, with its CRC32C appended as the last 4) of inner chunks of
    ``sizes`` bytes each (their CRC32C included), in C order, for a shard of ``chunk_levels``
    levels of ``per_level`` inner chunks; entries past ``len(sizes)`` are empty."""
    table = np.full((chunk_levels * per_level, 2), EMPTY, "<u8")
    sizes = np.asarray(sizes, "<u8")
    table[:len(sizes), 1] = sizes
    table[:len(sizes), 0] = np.cumsum(sizes) - sizes
    raw = table.tobytes()
    return raw + checksum(raw)


def shard_tag(index: bytes, inner_crcs: Sequence[bytes]) -> bytes:
    """What the store's record of a shard folds in: the CRC32C of its index (its CRC32C
    included) followed by the CRC32C of every inner chunk, in the index's order."""
    return int(google_crc32c.value(bytes(index) + b"".join(inner_crcs))).to_bytes(4, "little")


def shard_file(pieces: Sequence[files.BytesLike], chunk_levels: int, per_level: int,
               peaks: np.ndarray | None = None) -> ChunkFile:
    """A shard's file from the compressed inner chunks ``pieces`` of its first
    ``len(pieces) // per_level`` levels (C order), for a shard of ``chunk_levels`` levels."""
    crcs = [checksum(piece) for piece in pieces]
    # One buffer, written in one call: a shard has a thousand inner chunks or more, and writing
    # them one by one from Python holds the interpreter lock that the other writer threads need.
    payload = b"".join([part for piece, crc in zip(pieces, crcs) for part in (piece, crc)])
    return packed_shard(payload, [memoryview(p).nbytes + 4 for p in pieces], b"".join(crcs), chunk_levels,
                        per_level, peaks)


def packed_shard(payload: files.BytesLike, stored: Sequence[int] | np.ndarray, crcs: files.BytesLike,
                 chunk_levels: int, per_level: int, peaks: np.ndarray | None = None) -> ChunkFile:
    """A shard's file from its inner chunks already laid out one after the other, each followed
    by its CRC32C (``payload``; the GPU packs them so), the bytes each of them takes there
    (``stored``, its CRC32C included) and their CRC32Cs (``crcs``, 4 little-endian bytes each, in
    order), for a shard of ``chunk_levels`` levels of ``per_level`` inner chunks."""
    index = _index(stored, chunk_levels, per_level)
    return ChunkFile((payload, index), shard_tag(index, [bytes(crcs)]), memoryview(payload).nbytes + len(index),
                     peaks)


def compress_on_host(block: np.ndarray, rows: int, codec: Any) -> list[bytes]:
    """The inner chunks of ``block`` (levels, n0, n1; float32), ``rows`` rows each, compressed
    one by one with ``codec`` (numcodecs' zstd, as Zarr's zstd codec encodes), in C order."""
    return [codec.encode(np.ascontiguousarray(level[r:r + rows])) for level in block
            for r in range(0, block.shape[1], rows)]


def file_tag(path: str | os.PathLike, inner: int | None = None) -> bytes | None:
    """The tag of the chunk file ``path`` as its bytes now give it (see the module's text), or
    None if it cannot be read as such a file: for an unsharded chunk (``inner`` None) its last
    4 bytes; for a shard of ``inner`` inner chunks, :func:`shard_tag` of its index and of the
    CRC32C at the end of each inner chunk the index names."""
    try:
        with open(Path(path), "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if inner is None:
                f.seek(-4, os.SEEK_END)
                tail = f.read(4)
                return tail if len(tail) == 4 else None
            index_bytes = 16 * inner + 4
            if size < index_bytes:
                return None
            f.seek(size - index_bytes)
            index = f.read(index_bytes)
            table = np.frombuffer(index[:-4], "<u8").reshape(inner, 2).tolist()    # Python ints: no overflow
            crcs = []
            for offset, nbytes in table:
                if offset == EMPTY:
                    continue
                if nbytes < 4 or offset + nbytes > size - index_bytes:
                    return None
                f.seek(int(offset + nbytes - 4))
                crcs.append(f.read(4))
    except OSError:
        return None
    return shard_tag(index, crcs)
