"""Races of the host with its copies, under the race sanitizer: the host's own reads and writes
of pinned arrays, host functions, arrays let go too early; notebook 9's four races from the field
(each caught on both backends, each fix clean, and shown in the data on the modelled device where
it can be); and every notebook's and solution's loops run under the sanitizer with no false alarm.
"""
import ast
import gc
import io
import os
import pathlib
import pickle
import shutil
import tempfile
import weakref

import matplotlib.pyplot as plt
import nbformat
import numpy as np
import pytest

import course_helper as ch
from course_helper import host_watch
from course_helper.runtime import observe
from course_helper.runtime.base import PinnedArray

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_9 = "09_what_goes_wrong.ipynb"


def cell(notebook, cell_id):
    """The source of the cell ``cell_id`` of ``notebooks/<notebook>``."""
    nb = nbformat.read(ROOT / "notebooks" / notebook, as_version=4)
    found = [c.source for c in nb.cells if c.get("id") == cell_id]
    assert found, f"{notebook} has no cell {cell_id!r}: update this test with the notebook"
    return found[0]


def run_cell(notebook, cell_id, namespace, start=None):
    """Run a notebook cell (from the line that begins with ``start``, if given) in ``namespace``."""
    source = cell(notebook, cell_id)
    if start is not None:
        source = source[source.index(start):]
    exec(compile(source, f"{notebook} cell {cell_id}", "exec"), namespace)
    return namespace


def functions_of(notebook, cell_id, namespace):
    """Define the functions of a notebook cell in ``namespace`` (its other lines, which set up the
    notebook's full-size arrays, are left out: the caller puts small ones in ``namespace``)."""
    tree = ast.parse(cell(notebook, cell_id))
    defs = ast.Module([node for node in tree.body if isinstance(node, ast.FunctionDef)], [])
    exec(compile(defs, f"{notebook} cell {cell_id}", "exec"), namespace)
    return namespace


# --------------------------------------------------------------------------
# What counts as a host access of a pinned array
# --------------------------------------------------------------------------
class Heard:
    """An observer that keeps the host accesses it hears: (mode, shape, first byte offset)."""

    def __init__(self, base):
        self.base, self.got = base, []

    def host_access(self, array, mode, where):
        offset = array.__array_interface__["data"][0] - self.base.__array_interface__["data"][0]
        self.got.append((mode, array.shape, offset))


@pytest.fixture
def heard():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4).view(PinnedArray)
    h = observe.add(Heard(a))
    host_watch.watch()
    yield a, h
    host_watch.unwatch()
    observe.remove(h)


ACCESSES = [
    ("a view", lambda a: a[1], []),
    ("a transposed view", lambda a: a.T, []),
    ("np.shares_memory", lambda a: np.shares_memory(a, a[0]), []),
    ("iterating over planes", lambda a: list(a), []),
    ("one element", lambda a: a[1, 2, 3], [("r", (), 4 * 23)]),
    ("float() of an element", lambda a: float(a[0, 0, 1]), [("r", (), 4)]),
    ("fancy indexing", lambda a: a[[0, 1]], [("r", (2, 3, 4), 0)]),
    ("assigning a plane", lambda a: a.__setitem__(1, 0), [("w", (3, 4), 48)]),
    ("a ufunc", lambda a: a[1] + 1, [("r", (3, 4), 48)]),
    ("an in-place ufunc", lambda a: a.__iadd__(1), [("r", (2, 3, 4), 0), ("w", (2, 3, 4), 0)]),
    ("a reduction", lambda a: a.max(), [("r", (2, 3, 4), 0)]),
    ("np.array_equal", lambda a: np.array_equal(a[0], a[0]), [("r", (3, 4), 0), ("r", (3, 4), 0)]),
    ("np.asarray", lambda a: np.asarray(a), [("r", (2, 3, 4), 0)]),
    ("np.array", lambda a: np.array(a[1]), [("r", (3, 4), 48)]),
    ("a copy", lambda a: a.copy(), [("r", (2, 3, 4), 0)]),
    ("astype", lambda a: a[0].astype(np.float64), [("r", (3, 4), 0)]),
    ("fill", lambda a: a[0].fill(7), [("w", (3, 4), 0)]),
    ("np.copyto", lambda a: np.copyto(a[1], a[0]), [("w", (3, 4), 48), ("r", (3, 4), 0)]),
    ("an out= argument", lambda a: np.add(1, 2, out=a[0, 0]), [("w", (4,), 0)]),
    ("repr", lambda a: repr(a[0]), [("r", (3, 4), 0)]),
    ("tolist", lambda a: a[0].tolist(), [("r", (3, 4), 0)]),
    ("argmax", lambda a: a.argmax(), [("r", (2, 3, 4), 0)]),
    ("a plain view", lambda a: a.view(np.ndarray)[1], []),
    ("a reduction of a plain view", lambda a: a.view(np.ndarray)[1].sum(), [("r", (3, 4), 48)]),
    ("assigning through a plain view", lambda a: a.view(np.ndarray).__setitem__(1, 0), [("w", (3, 4), 48)]),
    ("a view as another dtype", lambda a: a.view(np.int32)[0, 1, 2], [("r", (), 24)]),
    ("an element of .flat", lambda a: a.flat[5], [("r", (), 20)]),
    ("a slice of .flat", lambda a: a.flat[12:], [("r", (12,), 48)]),
    ("an element of a transpose's .flat", lambda a: a.T.flat[1], [("r", (), 48)]),
    ("assigning an element of .flat", lambda a: a.flat.__setitem__(3, 0), [("w", (), 12)]),
    ("assigning .flat", lambda a: setattr(a, "flat", 5), [("w", (2, 3, 4), 0)]),
    ("np.array of .flat", lambda a: np.array(a[1].flat), [("r", (3, 4), 48)]),
    ("the length and base of .flat", lambda a: (len(a.flat), a.flat.base), []),
    ("np.add.at", lambda a: np.add.at(a[1], [0], 1), [("r", (3, 4), 48), ("w", (3, 4), 48)]),
    ("setfield", lambda a: a[1].setfield(3, np.float32), [("w", (3, 4), 48)]),
    ("byteswap in place", lambda a: a[1].byteswap(inplace=True), [("r", (3, 4), 48), ("w", (3, 4), 48)]),
    ("byteswap to a copy", lambda a: a[1].byteswap(), [("r", (3, 4), 48)]),
    ("np.array of a list", lambda a: np.array([a[1], a[0]]), [("r", (3, 4), 48), ("r", (3, 4), 0)]),
    ("np.broadcast_to", lambda a: np.broadcast_to(a[1], (2, 3, 4)), []),
    ("a reduction of np.broadcast_to", lambda a: np.broadcast_to(a[1], (2, 3, 4)).sum(), [("r", (2, 3, 4), 48)]),
]


@pytest.mark.parametrize("what,touch,expected", ACCESSES, ids=[a[0] for a in ACCESSES])
def test_what_the_host_is_heard_doing_with_a_pinned_array(heard, what, touch, expected):
    a, h = heard
    touch(a)
    assert h.got == expected


def test_matplotlib_reads_what_it_draws(heard):
    a, h = heard
    fig, ax = plt.subplots()
    ax.imshow(a[1])
    plt.close(fig)
    assert ("r", (3, 4), 48) in h.got                # (then it reads its own copy of the plane)


def test_the_hooks_exist_only_while_a_sanitizer_watches(cpu):
    gc.collect()                                     # a sanitizer an earlier test dropped without closing
    plain_asarray = np.asarray
    assert "__getitem__" not in vars(PinnedArray) and not host_watch.watching()
    with ch.sanitize():
        assert "__getitem__" in vars(PinnedArray) and np.asarray is not plain_asarray
        with ch.sanitize():                          # nested: the inner one's end leaves them on
            pass
        assert "__getitem__" in vars(PinnedArray)
    assert "__getitem__" not in vars(PinnedArray) and np.asarray is plain_asarray
    with pytest.raises(KeyError), ch.sanitize():        # a block left by an error takes them away too
        raise KeyError("the loop failed")
    assert not host_watch.watching() and np.asarray is plain_asarray


def test_pinned_arrays_are_pinned_arrays_and_what_is_computed_from_them_is_plain(backend):
    a = ch.pinned_empty((3, 4))
    assert type(a) is PinnedArray and type(a[1]) is PinnedArray and ch.is_pinned(a[1])
    assert type(a + 1) is np.ndarray and type(a.max(axis=0)) is np.ndarray
    b = a
    b += 1                                           # in place: the same array, still pinned
    assert b is a


# --------------------------------------------------------------------------
# The host's reads and writes against the copies
# --------------------------------------------------------------------------
@pytest.fixture
def world(backend):
    """A plane baked on `compute`, copied to the host on `io`, with a host array to copy into."""
    compute, io, other = ch.create_streams(3)
    plane, snap = ch.device_empty((32, 32)), ch.pinned_empty((32, 32))
    baked, = ch.create_events(1)

    def bake_and_copy():
        snap.fill(np.nan)
        ch.bake_layer(plane, 3, compute)
        compute.record(baked)
        io.wait_event(baked)
        ch.copy_to_host_async(snap, plane, io)
    yield dict(compute=compute, io=io, other=other, plane=plane, snap=snap, bake_and_copy=bake_and_copy)
    ch.synchronize()


def _read_after_stream_sync(w):
    w["io"].synchronize()


def _read_after_event_sync(w):
    w["io"].record().synchronize()


def _read_after_done_poll(w):
    done = w["io"].record()
    while not done.done:
        pass


def _read_after_device_sync(w):
    ch.synchronize()


@pytest.mark.parametrize("wait", [_read_after_stream_sync, _read_after_event_sync, _read_after_done_poll,
                                  _read_after_device_sync], ids=["stream", "event", ".done", "device"])
def test_reading_after_a_wait_is_no_race(world, wait):
    with ch.sanitize(names={"snap": world["snap"]}):
        world["bake_and_copy"]()
        wait(world)
        assert int(np.floor(world["snap"]).max()) == 3


def test_reading_before_any_wait_is_a_race_naming_the_array_the_copy_and_the_wait(world):
    with pytest.raises(ch.RaceError) as info:
        with ch.sanitize(names={"snap": world["snap"]}):
            world["bake_and_copy"]()
            peak = world["snap"].max()           # noqa: F841 - the read is the point
    message = str(info.value)
    assert "race on snap (host memory)" in message
    assert "the D2H copy on `stream 1` writes snap" in message
    assert "the host (np.maximum.reduce in `peak = world[\"snap\"].max()" in message
    assert "Fix: synchronise `stream 1` (or an event recorded after the D2H copy on it)" in message


def test_a_host_function_queued_after_the_copy_reads_it_in_order(world):
    got = []
    with ch.sanitize(names={"snap": world["snap"]}):
        world["bake_and_copy"]()
        world["io"].launch_host_func(lambda: got.append(int(np.floor(world["snap"]).max())))
        ch.synchronize()
    assert got == [3]


def test_a_host_function_on_another_stream_races_with_the_copy(world):
    with pytest.raises(ch.RaceError, match=r"the host function `<lambda>` on `stream 2` reads snap"):
        with ch.sanitize(names={"snap": world["snap"]}):
            world["bake_and_copy"]()
            world["other"].launch_host_func(lambda: world["snap"].max())
            ch.synchronize()
    ch.synchronize()


def test_a_host_write_after_queueing_a_host_function_that_reads_races(world):
    """Whichever runs first (the function, on its stream's thread, or the host's write), a race."""
    snap, io = world["snap"], world["io"]
    with pytest.raises(ch.RaceError, match=r"race on snap(.|\n)*the host function `<lambda>` on `stream 1` reads"):
        with ch.sanitize(names={"snap": snap}):
            snap.fill(0)
            io.launch_host_func(lambda: snap.max())
            snap[...] = 1                        # not ordered before the function queued above
            ch.synchronize()
    ch.synchronize()


def test_overwriting_the_source_of_a_pending_h2d_copy_races(world):
    src = ch.pinned_empty((32, 32))
    src[...] = 1
    with pytest.raises(ch.RaceError, match=r"the H2D copy on `stream 1` reads src"):
        with ch.sanitize(names={"src": src}):
            ch.copy_to_device_async(world["plane"], src, world["io"])
            src[...] = 2
    ch.synchronize()
    with ch.sanitize(names={"src": src}):            # after the copy has read it: fine
        ch.copy_to_device_async(world["plane"], src, world["io"])
        world["io"].synchronize()
        src[...] = 2


def _sum_of_a_plain_view(h):
    h.view(np.ndarray).sum()


def _flat_element(h):
    h.flat[0]                                    # noqa: B018 - the read is the point


def _assign_flat(h):
    h.flat = 5


def _assign_a_plain_view(h):
    h.view(np.ndarray)[:] = 5


ESCAPES = [(_sum_of_a_plain_view, "D2H", "reads"), (_flat_element, "D2H", "reads"),
           (_assign_flat, "H2D", "writes"), (_assign_a_plain_view, "H2D", "writes")]


@pytest.mark.parametrize("access,copy,does", ESCAPES, ids=[e[0].__name__.strip("_") for e in ESCAPES])
def test_a_plain_view_and_flat_of_a_pinned_array_are_heard(world, access, copy, does):
    """``.view(np.ndarray)`` and ``.flat`` reach the same memory: before the copy is waited for,
    a race; after a wait, none, and the access does what NumPy does."""
    h, io = world["snap"], world["io"]
    h[...] = 1

    def start_copy():
        if copy == "D2H":
            ch.copy_to_host_async(h, world["plane"], io)
        else:
            ch.copy_to_device_async(world["plane"], h, io)
    with pytest.raises(ch.RaceError, match=rf"the {copy} copy on `stream 1` (reads|writes) h(.|\n)*the host "):
        with ch.sanitize(names={"h": h}):
            start_copy()
            access(h)
    ch.synchronize()
    h[...] = 1
    with ch.sanitize(names={"h": h}):
        start_copy()
        io.synchronize()
        access(h)
        assert type(h.view(np.ndarray)) is PinnedArray            # so its own use is heard too
    if does == "writes":
        assert (h == 5).all()
    assert type(h.view(np.ndarray)) is np.ndarray                  # outside a sanitizer: NumPy's own


def _copy_on(h, device, stream, copy):
    if copy == "D2H":
        ch.copy_to_host_async(h, device, stream)
    else:
        ch.copy_to_device_async(device, h, stream)


#: Hostile host accesses of a copy's host array: (name, access, the copy it races with). ``access``
#: is given the array and a transposed view of it taken before the copy was queued.
HEARD = [
    ("a transpose's row", lambda h, early: h.T[0].sum(), "D2H"),
    ("an element of a flat reshape", lambda h, early: h.reshape(-1)[0], "D2H"),
    ("a strided slice's sum", lambda h, early: h[::2].sum(), "D2H"),
    ("tolist", lambda h, early: h.tolist(), "D2H"),
    ("tobytes", lambda h, early: h.tobytes(), "D2H"),
    ("astype", lambda h, early: h.astype(np.float64), "D2H"),
    ("np.asarray", lambda h, early: np.asarray(h), "D2H"),
    ("ravel", lambda h, early: h.ravel()[0], "D2H"),
    ("item", lambda h, early: h.item(0), "D2H"),
    ("a matrix product", lambda h, early: h @ np.ones((32, 32), np.float32), "D2H"),
    ("np.save", lambda h, early: np.save(io.BytesIO(), h), "D2H"),
    ("a plain view of a dtype view", lambda h, early: h.view(np.float32).view(np.ndarray)[0, 0], "D2H"),
    ("pickling", lambda h, early: pickle.dumps(h), "D2H"),
    ("a view taken before the copy", lambda h, early: early[0, 0], "D2H"),
    ("np.array of a list", lambda h, early: np.array([h]), "D2H"),
    ("np.broadcast_to", lambda h, early: np.broadcast_to(h, (2, 32, 32)).sum(), "D2H"),
    ("np.copyto", lambda h, early: np.copyto(h, np.ones((32, 32), np.float32)), "H2D"),
    ("fill", lambda h, early: h.fill(0), "H2D"),
    ("sort", lambda h, early: h.sort(), "H2D"),
    ("an in-place add", lambda h, early: h.__iadd__(1), "H2D"),
    ("a transpose's row assigned", lambda h, early: h.T.__setitem__(0, 1), "H2D"),
    ("a view taken before the copy, written", lambda h, early: early.__setitem__((0, 0), 9), "H2D"),
]


@pytest.mark.parametrize("what,access,copy", HEARD, ids=[h[0] for h in HEARD])
def test_hostile_host_accesses_before_the_wait_are_races_and_after_it_are_not(world, what, access, copy):
    h, io = world["snap"], world["io"]
    h[...] = 1
    with pytest.raises(ch.RaceError, match=rf"the {copy} copy on `stream 1` (reads|writes) h(.|\n)*the host "):
        with ch.sanitize(names={"h": h}):
            early = h.T
            _copy_on(h, world["plane"], io, copy)
            access(h, early)
    ch.synchronize()
    with ch.sanitize(names={"h": h}):                # no false alarm once the copy is waited for
        early = h.T
        _copy_on(h, world["plane"], io, copy)
        io.synchronize()
        access(h, early)


#: What the sanitizer cannot hear (course_helper/host_watch.py lists it exactly): each access races
#: with the copy, and passes unheard. ``said`` is how the four lists of it name the access.
UNHEARD = [
    ("memoryview", lambda h, plain: bytes(memoryview(h)), "D2H", "memoryview(a)"),
    ("np.frombuffer", lambda h, plain: np.frombuffer(h, np.float32).sum(), "D2H", "np.frombuffer(a)"),
    ("readinto", lambda h, plain: io.BytesIO(bytes(h.nbytes)).readinto(h), "H2D", "f.readinto(a)"),
    ("a generator's out=", lambda h, plain: np.random.default_rng(0).random(out=h, dtype=np.float32), "H2D",
     "rng.random(out=a)"),
    ("assigned into a plain array", lambda h, plain: np.zeros((32, 32), np.float32).__setitem__(Ellipsis, h), "D2H",
     "x[...] = a"),
    ("a.base", lambda h, plain: h.base.sum(), "D2H", "a.base"),
    ("np.ndarray's own view", lambda h, plain: np.ndarray.view(h, np.ndarray).sum(), "D2H",
     "np.ndarray.view(a, np.ndarray)"),
    ("a recarray view", lambda h, plain: h.view(np.recarray).sum(), "D2H", "a.view(np.recarray)"),
    ("np.nditer", lambda h, plain: next(iter(np.nditer(h))), "D2H", "np.nditer(a)"),
    ("np.lib.format.write_array, which reads through np.nditer",
     lambda h, plain: np.lib.format.write_array(io.BytesIO(), h), "D2H", "np.nditer(a)"),
    ("np.rec.fromarrays, which assigns into a plain array", lambda h, plain: np.rec.fromarrays([h[0]]), "D2H",
     "x[...] = a"),
    ("using what np.asarray gave", lambda h, plain: plain["asarray"].__setitem__(0, 1), "H2D", "np.asarray(a)"),
    ("as_strided", lambda h, plain: np.lib.stride_tricks.as_strided(h).__setitem__(0, 1), "H2D",
     "np.lib.stride_tricks.as_strided(a"),
    ("a plain view taken before the sanitizer", lambda h, plain: plain["view"].sum(), "D2H",
     "taken before the sanitizer started"),
]


def _the_lists_of_what_is_not_heard():
    nb9 = cell(NOTEBOOK_9, "c09-practice")
    docs = (ROOT / "docs" / "helper-package.md").read_text()
    return {"host_watch": host_watch.__doc__, "sanitizer": ch.sanitizer.__doc__,
            "docs/helper-package.md": " ".join(docs.split()), "notebook 9": " ".join(nb9.split())}


@pytest.mark.parametrize("what,access,copy,said", UNHEARD, ids=[u[0] for u in UNHEARD])
def test_what_the_sanitizer_cannot_hear_is_unheard_and_listed(world, what, access, copy, said):
    """If one of these is heard one day, the lists must lose it; while unheard, every list names it."""
    h, io = world["snap"], world["io"]
    h[...] = 1
    plain = {"view": h.view(np.ndarray)}                   # taken outside the sanitizer: a plain view
    with ch.sanitize(names={"h": h}):
        plain["asarray"] = np.asarray(h)                   # taking it is a read (no race yet)
        _copy_on(h, world["plane"], io, copy)
        access(h, plain)                                   # a race, not heard
        ch.synchronize()
    for where, text in _the_lists_of_what_is_not_heard().items():
        assert said in " ".join(text.split()), f"{where} does not list {said!r} among what is not heard"


# --------------------------------------------------------------------------
# Arrays let go too early
# --------------------------------------------------------------------------
def test_letting_a_device_buffer_go_while_another_stream_reads_it_races(world):
    compute, io = world["compute"], world["io"]
    host = ch.pinned_empty((32, 32))
    with pytest.raises(ch.RaceError, match=r"is let go .*the memory pool of `default`") as info:
        with ch.sanitize(names={"host": host}):
            tmp = ch.device_empty((32, 32))
            io.wait_event(compute.record())
            ch.copy_to_host_async(host, tmp, io)
            del tmp
            io.synchronize()
    assert "the D2H copy on `stream 1` reads a 32x32 float32 device array" in str(info.value)
    assert "make `default` wait for an event recorded after the D2H copy on `stream 1`" in str(info.value)


@pytest.mark.parametrize("order", ["the pool's stream waits", "the host waits"])
def test_letting_a_device_buffer_go_once_it_is_ordered_is_no_race(world, order):
    io, host = world["io"], ch.pinned_empty((32, 32))
    with ch.sanitize():
        tmp = ch.device_zeros((32, 32))
        ch.copy_to_host_async(host, tmp, io)
        if order == "the host waits":
            io.synchronize()
        else:
            ch.default_stream().wait_event(io.record())   # CuPy's advice for its pool (issue 8068)
        del tmp
        ch.device_zeros((32, 32))
        ch.synchronize()


def test_a_buffer_allocated_on_a_stream_goes_back_to_that_streams_pool(world):
    io, host = world["io"], ch.pinned_empty((32, 32))
    with ch.sanitize():
        with io:
            tmp = ch.device_zeros((32, 32))          # from io's pool, used on io only: ordered
        ch.copy_to_host_async(host, tmp, io)
        del tmp
        ch.synchronize()


@pytest.mark.parametrize("overwrite", ["a fill", "an H2D copy"])
def test_overwriting_a_buffer_from_the_host_while_another_stream_reads_it_races(world, overwrite):
    """A fill or a copy from the host queued on the default stream (the current one here) is not
    ordered after the work of a non-blocking stream."""
    io, plane, host = world["io"], world["plane"], ch.pinned_empty((32, 32))
    with pytest.raises(ch.RaceError, match=r"race on plane(.|\n)*the D2H copy on `stream 1` reads plane"):
        with ch.sanitize(names={"plane": plane}):
            ch.copy_to_host_async(host, plane, io)
            if overwrite == "a fill":
                ch.memory.zero_async(plane)
            else:
                ch.copy_to_device_async(plane, ch.pinned_empty((32, 32)), ch.default_stream())
    ch.synchronize()


@pytest.mark.gpu
def test_cupys_pool_hands_a_buffer_let_go_to_the_next_allocation_on_its_stream(backend):
    """What the rule for letting go rests on (CuPy issue 8068): the next allocation of the same size
    on the same stream gets the same memory."""
    if backend != "gpu":
        pytest.skip("the CPU backend has no memory pool")
    a = ch.device_empty((256, 256))
    address = a.data.ptr
    del a
    assert ch.device_empty((256, 256)).data.ptr == address


def test_letting_a_pinned_source_go_before_its_copy_ran_races(world):
    compute, io, plane = world["compute"], world["io"], world["plane"]
    with pytest.raises(ch.RaceError, match=r"the host lets go of a 32x32 float32 host array"):
        with ch.sanitize():
            src = ch.pinned_empty((32, 32))
            src[...] = 1
            ch.bake_layer(plane, 1, compute)
            io.wait_event(compute.record())
            ch.copy_to_device_async(plane, src, io)
            del src                                  # CuPy issue 8789: the pinned pool may reuse it
            io.synchronize()


def test_the_sanitizer_keeps_no_buffer_alive(world):
    io = world["io"]
    with ch.sanitize() as san:
        buf, host = ch.device_zeros((8, 8)), ch.pinned_empty((8, 8))
        ch.copy_to_host_async(host, buf, io)
        io.synchronize()
        ref = weakref.ref(buf)
        del buf
        gc.collect()
        assert ref() is None                         # else a buffer let go too early would hide
        assert san.owners                            # it still watches the others
    assert not san.owners


# --------------------------------------------------------------------------
# Notebook 9's races from the field
# --------------------------------------------------------------------------
RIGHT = {"read_too_early": "1", "overwrite_the_source": "2", "let_go_too_early": "4",
         "write_later": "0 | 1 | 2 | 3 | 4 | 5"}
CAUGHT = {"read_too_early": r"race on snap \(host memory\)(.|\n)*the host \(.*\) reads snap",
          "overwrite_the_source": r"race on src \(host memory\)(.|\n)*the host \(.*\) writes src",
          "let_go_too_early": r"is let go \(its last reference went: the memory pool of `default`",
          "write_later": r"race on plane \(device memory\)(.|\n)*the D2H copy of level 0 on `disk` reads plane"}


def field_races():
    """Notebook 9's setup cell of its four races, run on the active backend."""
    return run_cell(NOTEBOOK_9, "c09-host-setup", {"ch": ch, "np": np})


@pytest.mark.parametrize("bug", list(RIGHT))
def test_each_field_race_is_caught_and_its_fix_runs_clean(backend, bug):
    races = field_races()
    names = {name: races[name] for name in ("plane", "snap", "src", "stack")}
    with pytest.raises(ch.RaceError, match=CAUGHT[bug]):
        with ch.sanitize(names=names):
            races[bug](fix=False)
            ch.synchronize()
    ch.synchronize()
    with ch.sanitize(names=names):
        assert races[bug](fix=True) == RIGHT[bug]
    ch.synchronize()


@pytest.mark.parametrize("bug", list(RIGHT))
def test_the_modelled_device_shows_the_field_races_in_the_data(cpu, bug):
    """Every run the same: wrong data, but where the race is the pool's (the modelled device has no
    pool, and its queued work holds its buffers until it starts: only the sanitizer sees that one)."""
    races = field_races()
    got = [races[bug](fix=False) for _ in range(2)]
    ch.synchronize()
    assert got[0] == got[1]
    if bug == "let_go_too_early":
        assert got[0] == RIGHT[bug]
    else:
        assert got[0] != RIGHT[bug]


def test_notebook_9_cites_the_field_issues():
    text = cell(NOTEBOOK_9, "c09-host-races")
    for link in ("cupy/cupy/issues/7820", "cupy/cupy/pull/7938", "cupy/cupy/issues/8789",
                 "cupy/cupy/issues/8068", "NVIDIA/earth2studio/pull/1047"):
        assert link in text


# --------------------------------------------------------------------------
# No false alarms: every notebook's and solution's loops, under the sanitizer
# --------------------------------------------------------------------------
def nb01(tmp):
    """Notebook 1: a round trip, read after an event's synchronize (cell c01-11)."""
    run_cell("01_setup_and_device.ipynb", "c01-11", {"ch": ch, "np": np}, start="(stream,) =")


def nb02(tmp):
    """Notebook 2: its kernels and copies on one stream, two streams, an event, the default and
    blocking streams, timing events, a host function, host waits; the exercise's solution."""
    p = ch.WaveProblem(n0=32, n1=32, nt=40)
    ns = {"ch": ch, "np": np, "p": p, "U": [ch.device_zeros(p.shape) for _ in range(3)],
          "V": ch.to_device(p.velocity), "big": ch.device_zeros((4, 64, 64)), "host": ch.pinned_empty((4, 64, 64))}
    functions_of("02_streams_and_events.ipynb", "c02-04", ns)
    for cell_id in ("c02-06", "c02-08", "c02-10", "c02-12", "c02-14", "c02-16", "c02-19", "c02-21", "c02-23"):
        run_cell("02_streams_and_events.ipynb", cell_id, ns)
    solution = "solutions/02_streams_and_events_solution.ipynb"
    for cell_id in ("s02-04", "s02-05"):
        run_cell(solution, cell_id, ns)
    compute, io = ch.create_streams(2)
    ns["copy_after_kernels"](compute, io)
    ch.synchronize()
    assert np.isfinite(ns["last"]).all()


def nb03(tmp):
    """Notebook 3: bandwidth, compute and save into pinned and pageable memory with `.done` polls,
    and a stack copied on four streams, read after the device's synchronize."""
    ch.measure_bandwidth(sizes_mib=(1,), repeats=2)
    p = ch.WaveProblem(n0=48, n1=48, nt=120)
    (compute,), (io,), (computed,) = ch.create_streams(1, name="compute"), ch.create_streams(1, name="io"), \
        ch.create_events(1)
    ns = {"ch": ch, "np": np, "p": p, "U": [ch.device_zeros(p.shape) for _ in range(3)], "V": ch.to_device(p.velocity),
          "levels": ch.device_zeros((6, 48, 48)), "compute": compute, "io": io, "computed": computed}
    functions_of("03_pinned_memory.ipynb", "c03-14", ns)
    run_cell("03_pinned_memory.ipynb", "c03-14", ns, start="traces = {}")
    run_cell("03_pinned_memory.ipynb", "c03-17", ns)
    run_cell("03_pinned_memory.ipynb", "c03-12", ns)


def nb04_to_07(tmp):
    """Notebooks 4 to 7: the strategies solved, their images compared and read."""
    ns = {"ch": ch, "np": np}
    run_cell("04_wave_equation.ipynb", "c04-16", ns)
    ns["problem"] = ch.WaveProblem(n0=48, n1=48, nt=60)
    run_cell("04_wave_equation.ipynb", "c04-13", ns)
    run_cell("06_concurrent_streams.ipynb", "c06-06", ns, start="sequential =")
    ladder = ch.compare_strategies(ns["problem"], ["sequential-pinned", "streams", "events"], repeats=1)
    assert ladder.agree


def nb08(tmp):
    """Notebook 8's solution: the layer cake, checked and traced."""
    nplanes, nbuf, shape = 6, 3, (32, 32)
    (compute,) = ch.create_streams(1, name="compute")
    ns = {"ch": ch, "np": np, "plt": plt, "nplanes": nplanes, "nbuf": nbuf, "stack": ch.pinned_empty((nplanes, *shape)),
          "buffers": [ch.device_empty(shape) for _ in range(nbuf)], "compute": compute,
          "io": ch.create_streams(nbuf, name="io"), "baked": ch.create_events(nbuf), "copied": ch.create_events(nbuf)}
    solution = "solutions/08_exercise_layer_cake_solution.ipynb"
    functions_of(solution, "c08s-05", ns)
    for cell_id in ("c08s-07", "c08s-09"):
        run_cell(solution, cell_id, ns)
    plt.close("all")


def nb09(tmp):
    """Notebook 9: the lesson's loops under their own sanitizer, and the solution of 9.4."""
    ns = {"ch": ch, "np": np, "problem": ch.WaveProblem(n0=48, n1=48, nt=60)}
    run_cell(NOTEBOOK_9, "e5f014f2", ns)
    solution = "solutions/09_what_goes_wrong_solution.ipynb"
    for cell_id in ("cb466a72", "7bc0a539"):
        run_cell(solution, cell_id, ns)


def nb10(tmp):
    """Notebook 10's solution: the layer cake's stream loop, captured into a graph and replayed."""
    solution = "solutions/10_layer_cake_graph_solution.ipynb"
    ns = {"ch": ch, "np": np, "plt": plt}
    for cell_id in ("c10-own-setup", "c10-own-answer", "c10-own-check", "s10-times"):
        run_cell(solution, cell_id, ns)


def nb11(tmp):
    """Notebook 11: runs streamed to Zarr stores, compared with the runs kept in memory."""
    ns = {"ch": ch, "np": np, "os": os, "tempfile": tempfile}
    try:
        run_cell("11_streaming_to_disk.ipynb", "1b896140", ns)
    finally:
        shutil.rmtree(ns.get("folder", tmp / "none"), ignore_errors=True)


def notebook_9_fixes(tmp):
    """Notebook 9's four races, fixed."""
    races = field_races()
    for bug, right in RIGHT.items():
        assert races[bug](fix=True) == right


NOTEBOOK_LOOPS = [nb01, nb02, nb03, nb04_to_07, nb08, nb09, nb10, nb11, notebook_9_fixes]


@pytest.mark.parametrize("loops", NOTEBOOK_LOOPS, ids=[f.__name__ for f in NOTEBOOK_LOOPS])
def test_the_notebooks_loops_raise_no_race(backend, loops, tmp_path, capsys):
    with ch.sanitize():                              # a RaceError here is a false alarm
        loops(tmp_path)
        ch.synchronize()


@pytest.mark.parametrize("empty", [lambda h: h[0:0].sum(), lambda h: h[[]].sum(), lambda h: h[2:2].__setitem__(..., 5),
                                   lambda h: h[np.zeros(len(h), bool)].sum()],
                         ids=["an empty slice", "an empty index list", "assigning to an empty slice",
                              "an all-false mask"])
def test_touching_no_element_of_a_pinned_array_is_no_race(world, empty):
    """An empty part of the array holds no byte the copy writes: no false alarm (NumPy says an empty
    view shares no memory with its array, which must not make it count as a copy of all of it)."""
    h = world["snap"]
    with ch.sanitize(names={"h": h}):
        _copy_on(h, world["plane"], world["io"], "D2H")
        empty(h)
        with pytest.raises(ch.RaceError, match="race on h"):   # while a real element is still heard
            h[0:1].sum()
    ch.synchronize()
