"""Reading a store back: :func:`open_store` opens it lazily, whatever moment its run ended at.

A chunk of ``u`` whose bytes fail their checksum raises :class:`~.layout.StoreDamaged` naming
its file and levels, instead of being read as data (any Zarr reader, xarray included, checks
the same checksum), and so does a chunk file that fails the record of its place (moved, or
copied in from another run: the store's ``.checksums``, which only the course reads; a plain
``xarray.open_zarr`` reads such a file as data: :meth:`StoredRun.to_xarray` is the checked way
into xarray); bad
metadata, or a store that disagrees with itself (its arrays, attributes, coordinates and the
record of what its run wrote: :func:`~.layout.check_layout`), raises StoreDamaged naming what
disagrees, when the store is opened. A store whose run was
killed opens too: the temporary files of the chunks being written are removed, and every level
whose chunk file is there counts as complete (a chunk file appears only whole, after its data
were produced without error), so nothing intact is lost to the flags thread's lag.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .layout import (DATA, StoreDamaged, check_layout, chunk_verified, durable_store, read_state, remove_partials,
                     remove_stale_creations, sharded_inner, zarr_module)

__all__ = ["open_store", "StoredRun", "StoredImages"]


def _damaged(path, what, exc):
    """The StoreDamaged error for ``what`` (words) of the store ``path`` that could not be read:
    a metadata file that is not valid JSON is named first, since every read goes through it."""
    for meta in sorted(Path(path).rglob("zarr.json")):
        try:
            json.loads(meta.read_bytes())
        except (ValueError, OSError) as bad:
            return StoreDamaged(f"the metadata file {meta} of the store {path} is damaged ({bad}); the "
                                "store cannot be read")
    if isinstance(exc, KeyError):
        return StoreDamaged(f"the store {path} has no array {exc.args[0]!r}: it was not written by "
                            "solve(..., store=PATH), or it is damaged")
    return StoreDamaged(f"cannot read {what} of the store {path}: {type(exc).__name__}: {exc}")


def _key_text(key):
    """An index as it was written between brackets, e.g. ``::-1`` or ``5, 70, 70``."""
    def one(k):
        if isinstance(k, slice):
            text = lambda v: "" if v is None else str(v)      # noqa: E731
            return f"{text(k.start)}:{text(k.stop)}" + (f":{k.step}" if k.step is not None else "")
        return "..." if k is Ellipsis else repr(k)
    return ", ".join(one(k) for k in key) if isinstance(key, tuple) else one(key)


class StoredImages:
    """A store's wavefield ``(nsaved, n0, n1)``, read lazily: indexing reads only the chunks it
    needs (a Zarr array underneath). A chunk whose bytes fail their checksum (or cannot be
    decoded) raises :class:`StoreDamaged` naming the chunk's file and levels, instead of being
    read as data."""

    def __init__(self, array: Any, path: str | os.PathLike, levels: np.ndarray) -> None:
        self.array = array                   # the zarr.Array
        self.path = Path(path)
        self.levels = levels
        self.damaged = np.zeros(len(levels), bool)   # levels whose chunk file fails its record (StoredRun)

    shape = property(lambda self: self.array.shape)
    dtype = property(lambda self: self.array.dtype)
    ndim = property(lambda self: self.array.ndim)
    chunks = property(lambda self: self.array.chunks)      # Zarr's chunks (a shard's inner chunks, if sharded)
    shards = property(lambda self: self.array.shards)      # Zarr's shards (None if not sharded)
    nbytes = property(lambda self: self.array.nbytes)

    @property
    def file_levels(self) -> int:
        """Levels per chunk file: a chunk's, or a shard's if the array is sharded."""
        return (self.array.shards or self.array.chunks)[0]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        if self.damaged.any():
            self._refuse_damaged(key)
        try:
            return self.array[key]
        except IndexError as exc:        # Zarr's word for a selection it cannot make: the key, not the store
            raise IndexError(f"cannot read images[{_key_text(key)}] of the store {self.path} (shape {self.shape}): "
                             f"{exc}. Index with integers and slices of step 1 inside the shape, or read the "
                             "levels you need into memory first (e.g. images[:]) and index that array") from None
        except Exception as exc:  # noqa: BLE001 - told apart below, by reading chunk by chunk
            raise self._damaged(key, exc) from exc

    def _refuse_damaged(self, key):
        """Raise StoreDamaged if ``key`` reads a level whose chunk file fails its record."""
        try:
            wanted = np.atleast_1d(np.arange(len(self))[key[0] if isinstance(key, tuple) else key])
        except (IndexError, TypeError, ValueError):
            return                                      # Zarr says what is wrong with the key
        bad = wanted[self.damaged[wanted]]
        if bad.size:
            raise self.not_the_runs(int(bad[0]) // self.file_levels)

    def chunk_file(self, k: int) -> Path:
        """The path of the ``k``-th chunk file (a shard, if sharded) of the wavefield."""
        return self.path / DATA / self.array.metadata.encode_chunk_key((k, 0, 0))

    def chunk_text(self, k: int) -> str:
        """The ``k``-th chunk file and its levels, for messages."""
        first, stop = k * self.file_levels, min((k + 1) * self.file_levels, len(self))
        return f"the chunk file {self.chunk_file(k)} (levels {self.levels[first]}..{self.levels[stop - 1]})"

    def not_the_runs(self, k: int) -> StoreDamaged:
        """The error for the ``k``-th chunk file when it fails its record."""
        return StoreDamaged(f"{self.chunk_text(k)} is not the one this run wrote there (it fails the record of "
                            "its place in the store's checksums: moved from another place, copied from another "
                            "run, or emptied), and is not read as data; these levels are lost: run the solve again "
                            "to get them")

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self[:], dtype)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[k] for k in range(len(self)))

    def __repr__(self) -> str:
        return f"<StoredImages {str(self.path)!r} {self.shape} float32>"

    def _damaged(self, key, exc):
        """Find which chunk of those ``key`` reads is damaged, and say so."""
        chunk = self.file_levels
        try:
            wanted = np.atleast_1d(np.arange(len(self))[key[0] if isinstance(key, tuple) else key])
        except (IndexError, TypeError, ValueError):
            return exc if isinstance(exc, (IndexError, TypeError)) else _damaged(self.path, "the wavefield", exc)
        for k in sorted({int(i) // chunk for i in wanted}):
            first, stop = k * chunk, min((k + 1) * chunk, len(self))
            try:
                self.array[first:stop]
            except Exception as bad:  # noqa: BLE001 - this chunk is the damaged one
                file = self.path / DATA / self.array.metadata.encode_chunk_key((k, 0, 0))
                return StoreDamaged(f"the chunk file {file} (levels {self.levels[first]}..{self.levels[stop - 1]}) "
                                    f"is damaged and is not read as data ({bad}); these levels are lost: run the "
                                    "solve again to get them")
        return _damaged(self.path, "the wavefield", exc)


class StoredRun:
    """A store opened lazily: nothing is read until a slice is indexed.

    Attributes
    ----------
    images : StoredImages
        (nsaved, n0, n1); ``images[k]`` reads one level (NaN where it was never written; a
        damaged chunk raises :class:`StoreDamaged`).
    levels, times_ms : numpy.ndarray
        Time level and simulated time of each slice.
    complete : numpy.ndarray of bool
        Which levels are complete: flagged in the store's ``complete`` array and their chunk
        file is there. For a run that was killed, every level whose chunk file is there (a chunk
        file appears only whole, after its data were produced without error and fsync'ed).
    missing : numpy.ndarray of bool
        Levels flagged complete whose chunk file has gone (deleted after the run).
    damaged : numpy.ndarray of bool
        Levels whose chunk file is there but is not the one the run wrote at that place (it fails
        its record in the store's checksums: moved, or copied in from another run); reading them
        raises :class:`StoreDamaged`, and they are not complete.
    state : str
        "finished", "failed" (``reason`` says why), "interrupted" (killed before it ended) or
        "writing" (a live process is writing it now).
    attrs : dict
        The problem's parameters.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        zarr = zarr_module()
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"open_store takes the path of a store written by solve(..., store=PATH) (a str or "
                            f"pathlib.Path), got {path!r} ({type(path).__name__})")
        if not os.fspath(path):
            raise ValueError("open_store was given an empty path; give the path of a store written by "
                             "solve(..., store=PATH)")
        path = Path(path)
        if not path.exists():
            remove_stale_creations(path)
            raise FileNotFoundError(f"there is no store at {path}")
        if not (path / "zarr.json").is_file():
            raise FileNotFoundError(f"{path} is not a course store (no zarr.json inside)")
        self.path = path
        self.state, self.reason = read_state(path)
        if self.state == "interrupted":
            remove_partials(path)            # temporary files of the chunks being written when killed

        def read(what, get):
            try:
                return get()
            except StoreDamaged:
                raise
            except Exception as exc:  # noqa: BLE001 - reported with the file's name
                raise _damaged(path, what, exc) from exc

        self.group = read("the metadata", lambda: zarr.open_group(store=durable_store(path, read_only=True),
                                                                   mode="r"))
        record = read("the metadata", lambda: check_layout(self.group, path))     # the store against itself
        self.levels = read("the array 'level'", lambda: self.group["level"][:])
        self.images = StoredImages(read("the array 'u'", lambda: self.group[DATA]), path, self.levels)
        self.times_ms = read("the array 'time'", lambda: self.group["time"][:]) * 1e3
        flagged = read("the array 'complete'", lambda: self.group["complete"][:])
        self.attrs = dict(self.group.attrs)
        self._record, self._flagged = record, flagged
        present, self.damaged = self._chunk_files(record)
        self.images.damaged = self.damaged
        self.missing = flagged & ~present
        intact = present & ~self.damaged
        self.complete = intact if self.state == "interrupted" else flagged & intact

    def _chunk_files(self, record):
        """Per level: whether its chunk file is there, and whether a file that is there fails
        its record (it is not the chunk the run wrote at that place: :func:`~.layout.chunk_verified`)."""
        data = self.images.array
        names = set(os.listdir(self.path / DATA)) if (self.path / DATA).is_dir() else set()
        chunk, inner = self.images.file_levels, sharded_inner(data)
        present = np.zeros(len(self.levels), bool)
        damaged = np.zeros(len(self.levels), bool)
        for k in range(math.ceil(len(present) / chunk)):
            name = data.metadata.encode_chunk_key((k, 0, 0))
            if name in names:
                present[k * chunk:(k + 1) * chunk] = True
                damaged[k * chunk:(k + 1) * chunk] = not chunk_verified(self.path / DATA / name, k, record, inner)
        return present, damaged

    def verify_levels(self, wanted: np.ndarray) -> None:
        """Check the chunk files that hold the levels at positions ``wanted`` against the run's
        record now (not as they were when the store was opened): raise :class:`StoreDamaged` for
        one that is not the run's (moved, copied from another run, emptied) or that was deleted
        although its levels were flagged complete. Levels never written (an interrupted run) pass:
        they read as NaN, and ``complete`` says so."""
        images = self.images
        inner = sharded_inner(images.array)
        for k in sorted({int(i) // images.file_levels for i in np.atleast_1d(wanted)}):
            file = images.chunk_file(k)
            if file.is_file():
                if not chunk_verified(file, k, self._record, inner):
                    raise images.not_the_runs(k)
            elif file.exists() or self._flagged[k * images.file_levels:(k + 1) * images.file_levels].any():
                raise StoreDamaged(f"{images.chunk_text(k)} is gone (deleted after its run wrote it, its levels "
                                   "flagged complete), and is not read as NaN; these levels are lost: run the "
                                   "solve again to get them")

    def to_xarray(self) -> Any:
        """The store as an ``xarray.Dataset``, as ``xarray.open_zarr(path)`` gives it (``u`` over
        ``time``, ``x0``, ``x1``; ``level``, ``complete``, ``peak``; the attributes), but verified:
        ``u`` is read lazily, and every read checks the chunk files it reads against the run's
        record first (:meth:`verify_levels`), so a moved, foreign, emptied or deleted chunk file
        raises :class:`StoreDamaged` instead of being handed over as the wrong levels or NaN.
        ``complete`` is this run's (:attr:`complete`). A plain ``xarray.open_zarr`` checks only
        each chunk's own checksum: it reads a chunk file in the wrong place as data."""
        from .xarray_view import verified_dataset
        return verified_dataset(self)

    @property
    def interrupted(self) -> bool:
        """Whether the run stopped before it ended (killed, or failed)."""
        return self.state in ("interrupted", "failed")

    def peak_amplitude(self) -> float:
        """The largest |u| of all complete levels (read from the small ``peak`` array)."""
        peak = self.group["peak"][:]
        peak = peak[np.isfinite(peak)]
        return float(peak.max()) if peak.size else 0.0

    def stored_nbytes(self) -> int:
        """Bytes the wavefield's chunk files take on disk (compare with ``images.nbytes``)."""
        return sum(f.stat().st_size for f in (self.path / DATA).glob("c.*") if f.is_file())

    def __repr__(self) -> str:
        how = {"finished": "", "writing": ", being written now",
               "interrupted": ", interrupted: the run was killed before it ended",
               "failed": f", interrupted: the run failed ({self.reason})"}[self.state]
        if self.missing.any():
            how += f", {int(self.missing.sum())} flagged levels have lost their chunk files"
        if self.damaged.any():
            how += f", {int(self.damaged.sum())} levels are in chunk files that are not the run's (damaged)"
        return (f"<StoredRun {str(self.path)!r}: {int(self.complete.sum())}/{len(self.complete)} levels "
                f"complete, {self.images.shape[1]}x{self.images.shape[2]}{how}>")


def open_store(path: str | os.PathLike) -> StoredRun:
    """Open a store written by ``solve(..., store=path)`` lazily (see :class:`StoredRun`).
    A store opens whatever moment its run was killed at, and says so (``state``)."""
    return StoredRun(path)
