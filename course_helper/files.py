"""Files that appear whole or not at all: one atomic writer for the whole package.

:func:`write_atomically` writes a file under a temporary name in the same folder, flushes it
to the disk, renames it to its name (a rename within one folder is atomic) and flushes the
folder, so that a reader, a killed process or a power cut sees the old file or the new one,
never part of one. The store's chunk files, its metadata, the timelines' exports and the
command line's results all go through it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Union

import numpy as np

__all__ = ["write_atomically", "PARTIAL", "temporary_name", "sync_folder", "cannot_write"]

#: What a file's bytes may be given as: an object with the buffer protocol.
BytesLike = Union[bytes, bytearray, memoryview, np.ndarray]

#: What to do about the usual reasons a file cannot be written.
_WRITE_ADVICE = {
    errno.ENOSPC: "the disk is full: free some space or write to another folder",
    errno.EDQUOT: "the disk quota is used up: free some space or write to another folder",
    errno.EACCES: "you may not write there: choose a folder of your own",
    errno.EPERM: "you may not write there: choose a folder of your own",
    errno.EROFS: "that file system is read-only: write to another folder",
    errno.ENOENT: "the folder does not exist: create it first or choose another",
    errno.ENOTDIR: "part of the path is a file, not a folder: choose another path",
    errno.EISDIR: "a folder of that name is in the way: choose another file name",
}


def cannot_write(path: str | os.PathLike, exc: OSError, what: str = "") -> OSError:
    """``exc``, an error of the file system met while writing ``path``, as the same kind of
    OSError with the same errno, saying which file (``what``, e.g. "create the store", in
    place of "write") and what to do. Its message names ``path``, never a temporary name."""
    advice = _WRITE_ADVICE.get(exc.errno, "check the path, or write to another folder")
    err = type(exc)(f"cannot {what or 'write'} {path}: {exc.strerror or exc}; {advice}")
    err.errno = exc.errno
    return err


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
    is on the disk too. If anything fails (an OSError, a Ctrl-C, an error raised by
    ``content``), the temporary file is removed and ``path`` keeps what it held before. An
    error of the file system (a full disk, no permission, no such folder) is raised as the same
    kind of ``OSError`` with the same ``errno``, naming the file and what to do; any other error
    is raised unchanged. The file gets the usual permissions: 0666 less the process's umask.
    """
    path = Path(path)
    try:
        _write_through_temporary(path, content, binary)
    except OSError as exc:
        if exc.errno is None:
            raise
        raise cannot_write(path, exc) from exc
    return path


def _write_through_temporary(path, content, binary):
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
