"""The package's one atomic writer: a file appears whole or not at all."""
import errno
import os
import stat

import numpy as np
import pytest

from course_helper import files


def test_a_new_file_holds_exactly_what_was_written(tmp_path):
    parts = (b"head", memoryview(b"-middle-"), np.arange(3, dtype=np.uint8))
    path = files.write_atomically(tmp_path / "a.bin", parts)
    assert path == tmp_path / "a.bin" and path.read_bytes() == b"head-middle-\x00\x01\x02"
    files.write_atomically(tmp_path / "b.txt", lambda f: f.write("text é"), binary=False)
    assert (tmp_path / "b.txt").read_text() == "text é"
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.txt"]


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt(),
                                     RuntimeError("the writer failed")], ids=["full disk", "ctrl-c", "error"])
def test_a_failure_mid_write_leaves_the_old_file_whole_and_no_temporary_file(tmp_path, failure):
    target = tmp_path / "results.json"
    target.write_text('{"old": true}')

    def half_then_fail(f):
        f.write(b'{"new": ')
        f.flush()                                     # the half is really in the temporary file
        assert [n for n in os.listdir(tmp_path) if n.endswith(files.PARTIAL)]
        raise failure

    with pytest.raises(type(failure)):
        files.write_atomically(target, half_then_fail)
    assert target.read_text() == '{"old": true}'
    assert os.listdir(tmp_path) == ["results.json"]


def test_a_failing_fsync_leaves_the_old_file_whole_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "chunk"
    target.write_bytes(b"old")

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        files.write_atomically(target, b"new bytes")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["chunk"]


def test_the_bytes_reach_the_disk_before_the_name_and_the_name_after(tmp_path, monkeypatch):
    """fsync of the file before the rename, fsync of the folder after it."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", None)), real_replace(a, b))[1])
    files.write_atomically(tmp_path / "x", b"data")
    assert events == [("fsync", False), ("rename", None), ("fsync", True)]


def test_an_existing_temporary_name_is_never_written_over(tmp_path, monkeypatch):
    clash = tmp_path / ".x.clash.partial"
    clash.write_bytes(b"someone else's")
    monkeypatch.setattr(files, "temporary_name", lambda path: clash)
    with pytest.raises(FileExistsError):
        files.write_atomically(tmp_path / "x", b"data")
    assert clash.read_bytes() == b"someone else's" and not (tmp_path / "x").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) for a real full disk")
def test_full_disk_names_the_file_and_leaves_nothing_behind(tmp_path):
    def write_onto_a_full_disk(f):
        f.write("partial")
        with open("/dev/full", "w") as full:     # every write there fails with ENOSPC
            full.write("x")

    with pytest.raises(OSError) as info:
        files.write_atomically(tmp_path / "x.json", write_onto_a_full_disk, binary=False)
    assert info.value.errno == errno.ENOSPC
    assert str(tmp_path / "x.json") in str(info.value) and "free some space" in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)],
                         ids=["umask-022", "umask-077", "umask-002"])
def test_files_get_the_usual_mode_under_the_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        path = files.write_atomically(tmp_path / "x.json", lambda f: f.write("{}"), binary=False)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode


def test_failed_write_removes_the_temporary_file(tmp_path):
    def boom(f):
        f.write("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        files.write_atomically(tmp_path / "x.json", boom, binary=False)
    assert os.listdir(tmp_path) == []
