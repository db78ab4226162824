"""Files that appear whole or not at all: one atomic writer for the whole package.

:func:`write_atomically` writes a file under a temporary name in the same folder, flushes it
to the disk, renames it to its name (a rename within one folder is atomic) and flushes the
folder, so that a reader, a killed process or a power cut sees the old file or the new one,
never part of one. The store's chunk files, its metadata, the timelines' exports and the
command line's results all go through it.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Union

import numpy as np

__all__ = ["write_atomically", "PARTIAL", "temporary_name", "sync_folder"]

#: What a file's bytes may be given as: an object with the buffer protocol.
BytesLike = Union[bytes, bytearray, memoryview, np.ndarray]

#: The ending of a file (or folder) not yet under its name: a temporary name ends with it.
PARTIAL = ".partial"


def temporary_name(path: str | os.PathLike) -> Path:
    """A new temporary name beside ``path``: hidden, unique, ending in :data:`PARTIAL`."""
    path = Path(path)
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}{PARTIAL}")


def sync_folder(folder: str | os.PathLike) -> None:
    """Flush the folder's entries (names created, renamed or removed) to the disk."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike, content: BytesLike | tuple[BytesLike, ...] | Callable[[IO[Any]], object],
                     *, binary: bool = True) -> Path:
    """Write the file ``path`` whole or not at all, and return it as a Path.

    ``content`` is the file's bytes (a buffer, or a tuple of buffers written one after the
    other), or a function that writes them to the open file it receives (opened in binary mode
    when ``binary``, else as text). The file is written under :func:`temporary_name`, flushed
    to the disk (``fsync``), renamed to ``path``, and the folder flushed so that the new name
    is on the disk too. If anything fails (an OSError, a Ctrl-C,
    an error raised by ``content``), the temporary file is removed, ``path`` keeps what it held
    before, and the error is raised unchanged. The file gets the usual permissions: 0666 less
    the process's umask.
    """
    path = Path(path)
    tmp = temporary_name(path)
    f = open(tmp, "xb" if binary else "x")    # "x": a new file, never someone else's
    try:
        with f:
            if callable(content):
                content(f)
            else:
                for part in content if isinstance(content, tuple) else (content,):
                    f.write(part)
            f.flush()
            os.fsync(f.fileno())          # the bytes are on the disk before the name says so
        os.replace(tmp, path)              # atomic: readers see the old file or the whole new one
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    sync_folder(path.parent)               # the rename itself is on the disk
    return path
