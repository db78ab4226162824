"""The host's own reads and writes of pinned memory, as the race sanitizer sees them.

An asynchronous copy reads or writes pinned host memory while the host goes on. The host's
own accesses to that memory are the other half of a race: reading a copy's destination before
the copy has landed sees old data (CuPy issue 7820), writing the source of a host-to-device
copy before the copy has run changes what it takes (CuPy issue 8789). The sanitizer orders
these accesses like any other, so it must hear of them.

Every pinned array the helper makes is a :class:`~course_helper.runtime.base.PinnedArray`.
While a sanitizer watches (:func:`watch`, undone by :func:`unwatch`; they nest), that class
gets hooks, and each access of a pinned array or of any view of it is announced to the
observers as ``host_access(array, mode, where)``. Outside a sanitizer the class has no hooks:
a timed run pays nothing for them.

What counts as an access:

* **a read**: an element (``a[3, 4]``), fancy indexing, a copy (``a.copy()``, ``astype``,
  ``np.array(a)``, ``np.array([a, b])``), every NumPy function and ufunc given the array
  (``np.max(a)``, ``a == b``, ``a.sum()``), ``np.asarray(a)`` (the sanitizer cannot follow the plain
  array it returns, so it counts as a read now), printing, pickling, a plot (Matplotlib copies what
  it draws);
* **a write**: ``a[...] = x``, ``a.fill(v)``, ``a.sort()``, ``a += 1``, ``np.copyto(a, x)``, ``out=a``,
  ``np.add.at(a, ...)``, ``a.flat = x``, ``a.flat[i] = x``;
* **no access**: a view (``a[k]``, ``a.T``, ``a.reshape(...)``, ``a.view(...)``,
  ``np.broadcast_to(a, shape)``), the shape, dtype, flags or address, ``np.shares_memory``.

A view of a watched array is watched: it is a PinnedArray too. That includes
``a.view(np.ndarray)``, which while a sanitizer watches gives a PinnedArray (outside one, a plain
array as usual), the plain views NumPy functions such as ``np.broadcast_to`` return, and
``a.flat``, whose reads (``a.flat[i]``, iterating, ``np.array(a.flat)``) and writes are heard like
indexing. A view taken before a copy was queued is heard like the array.

Not seen, exactly:

* the buffer protocol and raw addresses: ``memoryview(a)``, ``a.data``, ``a.ctypes``,
  ``a.__array_interface__``, ``np.frombuffer(a)``, and compiled code (or ctypes) that reads or
  writes the memory through them, such as ``f.readinto(a)`` or a random generator's
  ``rng.random(out=a)``;
* a pinned array assigned into a plain one, ``x[...] = a`` or ``x[i] = a``: NumPy copies it in C
  without asking ``a`` (``np.copyto(x, a)`` and ``x[...] = a.copy()`` are heard);
* ``a.base`` (the plain array under the helper's pinned memory) and NumPy's methods called on the
  class ``np.ndarray`` itself (``np.ndarray.view(a, np.ndarray)``, ``np.ndarray.__setitem__(a, ...)``);
* a view as another subclass of ``np.ndarray`` (``a.view(np.recarray)``, ``np.matrix``, a masked
  array), and ``np.nditer(a)``; NumPy functions that use it, or assign ``a`` into a plain array,
  inside (``np.lib.format.write_array``, ``np.rec.fromarrays``);
* what is done with a plain array made over the memory: ``np.asarray(a)`` and
  ``np.lib.stride_tricks.as_strided(a, ...)`` (taking either counts as a read then);
* a plain view or flat iterator taken before the sanitizer started (``v = a.view(np.ndarray)`` or
  ``a.flat`` outside the ``with`` block, used inside it): only what is taken while it watches is
  watched;
* memory pinned another way than the helper's ``pinned_empty``.
"""
from __future__ import annotations

import linecache
import sys
import threading
from typing import Any

import numpy as np

from .runtime import observe
from .runtime.base import PinnedArray

__all__ = ["watch", "unwatch", "watching"]

_lock = threading.Lock()
_watchers = 0
_local = threading.local()       # .depth: hooks entered in this thread (only the outermost announces)
_plain_getitem = np.ndarray.__getitem__
_plain_setitem = np.ndarray.__setitem__
_plain_view = np.ndarray.view
_plain_flat = np.ndarray.flat          # the C attribute (a descriptor): ``_plain_flat.__get__(a)`` is ``a.flat``

#: NumPy functions that look at an array's shape or memory, or return a view of it: no access.
_NO_ACCESS = frozenset(getattr(np, name) for name in (
    "shape", "ndim", "size", "shares_memory", "may_share_memory", "transpose", "reshape", "squeeze",
    "expand_dims", "moveaxis", "swapaxes", "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_to",
    "diagonal", "split", "array_split", "hsplit", "vsplit", "dsplit", "result_type", "iscomplexobj",
    "isrealobj", "ravel") if hasattr(np, name))
#: NumPy functions that write their first argument.
_WRITE_FIRST = frozenset(getattr(np, name) for name in (
    "copyto", "put", "putmask", "place", "fill_diagonal", "put_along_axis") if hasattr(np, name))
#: NumPy's array constructors, C functions that take a PinnedArray's memory without a hook of the class.
_CONSTRUCTORS = ("array", "asarray", "asanyarray", "ascontiguousarray", "asfortranarray")
_numpy_originals = {}


def watch() -> None:
    """A sanitizer starts watching: host accesses of pinned arrays are announced from now on."""
    global _watchers
    with _lock:
        _watchers += 1
        if _watchers == 1:
            for name, hook in _HOOKS.items():
                setattr(PinnedArray, name, hook)
            for name in _CONSTRUCTORS:
                _numpy_originals[name] = original = getattr(np, name)
                setattr(np, name, _constructor(original))


def unwatch() -> None:
    """A sanitizer stops watching (the last one to stop takes the hooks away)."""
    global _watchers
    with _lock:
        if _watchers == 0:
            return
        _watchers -= 1
        if _watchers == 0:
            for name in _HOOKS:
                delattr(PinnedArray, name)
            for name, original in _numpy_originals.items():
                setattr(np, name, original)
            _numpy_originals.clear()


def watching() -> bool:
    """Whether the hooks are on (some sanitizer watches)."""
    return _watchers > 0


# --------------------------------------------------------------------------
# Announcing an access
# --------------------------------------------------------------------------
class _inside:
    """``with _inside():`` around NumPy's own work: what it touches in turn is the same access."""

    __slots__ = ()

    def __enter__(self):
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc):
        _local.depth -= 1
        return False


def _outermost():
    return not getattr(_local, "depth", 0)


#: Top-level packages whose frames are not where an access was written (the caller's line is).
_LIBRARIES = frozenset({"numpy", "matplotlib", "PIL", "zarr", "xarray", "numcodecs", "pandas", "contextlib",
                        "functools", "threading", "concurrent", "copy", "pickle", "course_helper"})


def _where(entry):
    """Who accessed the memory, for messages: ``entry`` (the NumPy call) and the line of code
    outside NumPy, Matplotlib and the helper that made it (its text, never its file's path)."""
    frame = sys._getframe(2)
    helper = None
    while frame is not None:
        package = str(frame.f_globals.get("__name__", "")).split(".")[0]
        if package not in _LIBRARIES:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno, frame.f_globals)
            line = line.split("  # ")[0].strip()          # the code, not its comment
            return f"{entry} in `{line}`" if line else entry
        if (package == "course_helper" and helper is None and frame.f_globals.get("__name__") != __name__
                and frame.f_code.co_name != "<module>"):
            helper = frame.f_code.co_name
        frame = frame.f_back
    return f"{entry} in {helper}()" if helper else entry


def _touch(array, mode, entry):
    """Announce that the host reads (``"r"``) or writes (``"w"``) ``array`` through ``entry``."""
    # an empty part (a[0:0]) holds no byte a copy could be writing
    if _outermost() and observe.hears("host_access") and not (isinstance(array, np.ndarray) and array.size == 0):
        observe.notify("host_access", array, mode, _where(entry))


def _touch_all(values, mode, entry):
    """:func:`_touch` every PinnedArray among ``values`` (nested lists and tuples too)."""
    for v in values:
        if isinstance(v, PinnedArray):
            _touch(v, mode, entry)
        elif isinstance(v, (list, tuple)):
            _touch_all(v, mode, entry)


def _within(part, whole):
    """Whether the array ``part`` lies in the memory of ``whole`` (a view of it, not a copy)."""
    return np.may_share_memory(_plain_view(part, np.ndarray), _plain_view(whole, np.ndarray))   # bounds only: cheap


def _target(a, key):
    """What ``a[key]`` touches: a view of it (an element as a 0-d view), or all of ``a`` for an
    index that copies (fancy indexing)."""
    with _inside():
        part = _plain_getitem(a, key)
        if not isinstance(part, np.ndarray):                       # one element: its 0-d view
            part = _plain_getitem(a, (*key, Ellipsis) if isinstance(key, tuple) else (key, Ellipsis))
    # an empty part shares no memory by NumPy's test, but touches nothing either
    return part if isinstance(part, np.ndarray) and (part.size == 0 or _within(part, a)) else a


# --------------------------------------------------------------------------
# The hooks of PinnedArray while a sanitizer watches
# --------------------------------------------------------------------------
def _getitem(self, key):
    with _inside():
        out = _plain_getitem(self, key)
    if not isinstance(out, np.ndarray):
        _touch(_target(self, key), "r", "reading an element")
    elif out.size and not _within(out, self):
        _touch(self, "r", "fancy indexing")
    return out


def _setitem(self, key, value):
    if _outermost():
        _touch(_target(self, key), "w", "assignment")
        _touch_all([value], "r", "assignment")
    with _inside():
        _plain_setitem(self, key, value)


def _array_ufunc(self, ufunc, method, *inputs, **kwargs):
    out = kwargs.get("out")
    if _outermost():
        entry = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
        _touch_all(inputs, "r", entry)
        _touch_all(out if isinstance(out, tuple) else [out], "w", entry)
        if method == "at":                           # ``np.add.at(a, i, b)`` updates ``a`` in place
            _touch_all(inputs[:1], "w", entry)
    plain = tuple(_plain_view(x, np.ndarray) if isinstance(x, PinnedArray) else x for x in inputs)
    if out is not None:
        kwargs["out"] = tuple(_plain_view(o, np.ndarray) if isinstance(o, PinnedArray) else o for o in out)
    with _inside():
        result = getattr(ufunc, method)(*plain, **kwargs)
    if out is None or method == "at":
        return result
    return out[0] if len(out) == 1 else out           # the caller's own arrays, not the plain views


def _array_function(self, func, types, args, kwargs):
    if func in _NO_ACCESS:
        with _inside():
            result = np.ndarray.__array_function__(self, func, types, args, kwargs)
        return _rewatch(result, self)
    if _outermost():
        entry = f"np.{func.__name__}"
        if func in _WRITE_FIRST and args:
            _touch_all(args[:1], "w", entry)
            _touch_all(args[1:], "r", entry)
        else:
            _touch_all(args, "r", entry)
        for name, value in kwargs.items():
            _touch_all([value], "w" if name == "out" else "r", entry)
    with _inside():
        return np.ndarray.__array_function__(self, func, types, args, kwargs)


def _rewatch(result, array):
    """A view NumPy gave back as a plain array (``np.broadcast_to`` does, whatever it is given) made a
    PinnedArray again, so that its use is heard like that of any other view of ``array``."""
    if type(result) is np.ndarray and _within(result, array):
        return _plain_view(result, PinnedArray)
    if isinstance(result, (list, tuple)) and any(type(r) is np.ndarray for r in result):
        return type(result)(_rewatch(r, array) for r in result)
    return result


def _array_finalize(self, obj):
    # A new PinnedArray made from ``obj`` by NumPy's C code: a copy of it (not a view) reads it.
    if isinstance(obj, PinnedArray) and _outermost() and not _within(self, obj):
        _touch(obj, "r", "a copy")


def _constructor(original):
    """``np.asarray`` and the other constructors: taking a pinned array's memory reads it."""
    def construct(*args, **kwargs):
        given = args[:1] or [kwargs.get("object", kwargs.get("a"))]
        if isinstance(given[0], _WatchedFlat):
            _touch(given[0].array, "r", f"np.{original.__name__}")
        else:                       # the array itself, or arrays in a list (``np.array([a, b])``)
            _touch_all(given, "r", f"np.{original.__name__}")
        with _inside():
            return original(*args, **kwargs)
    construct.__name__ = original.__name__
    construct.__doc__ = original.__doc__
    return construct


def _view(self, *args, **kwargs):
    # ``a.view(dtype)`` stays a PinnedArray by itself; ``a.view(np.ndarray)`` would step out of the
    # watching class with the same memory, so while a sanitizer watches it is a PinnedArray too.
    with _inside():
        out = _plain_view(self, *args, **kwargs)
    return _plain_view(out, PinnedArray) if type(out) is np.ndarray else out


def _flat_part(array, key):
    """What ``array.flat[key]`` touches: one element for an integer index; for another index, the
    part it selects when the array is contiguous (then its flat order is its memory's), else all of it."""
    if isinstance(key, (int, np.integer)) and array.size:
        index = np.unravel_index(int(key) % array.size, array.shape)
        return _plain_getitem(array, (*index, Ellipsis))          # the element as a 0-d view
    if array.flags.c_contiguous:
        return _target(_plain_view(array, np.ndarray).reshape(-1), key)
    return array


class _WatchedFlat:
    """``a.flat`` of a PinnedArray while a sanitizer watches: NumPy's flat iterator, whose reads
    and writes of ``a`` are announced like indexing ``a`` itself."""

    __slots__ = ("array", "_flat")

    def __init__(self, array):
        self.array, self._flat = array, _plain_flat.__get__(array)

    def __getitem__(self, key):
        _touch(_flat_part(self.array, key), "r", ".flat[...]")
        with _inside():
            return self._flat[key]

    def __setitem__(self, key, value):
        if _outermost():
            _touch(_flat_part(self.array, key), "w", ".flat[...] assignment")
            _touch_all([value], "r", ".flat[...] assignment")
        with _inside():
            self._flat[key] = value

    def __iter__(self):
        return self

    def __next__(self):
        if self._flat.index < self.array.size:
            _touch(_flat_part(self.array, self._flat.index), "r", "iterating over .flat")
        return next(self._flat)

    def __len__(self):
        return len(self._flat)

    def __array__(self, dtype=None, copy=None):
        _touch(self.array, "r", ".flat")
        with _inside():
            return np.asarray(self._flat, dtype=dtype)

    def copy(self):
        """A flat copy of the array (reads all of it)."""
        _touch(self.array, "r", ".flat.copy()")
        with _inside():
            return self._flat.copy()

    def __getattr__(self, name):                 # .base, .index, .coords: no access
        return getattr(self._flat, name)


def _byteswap(self, inplace=False):
    if _outermost():
        for m in "rw" if inplace else "r":
            _touch(self, m, ".byteswap()")
    with _inside():
        return np.ndarray.byteswap(self, inplace)


def _set_flat(self, value):
    if _outermost():
        _touch(self, "w", ".flat assignment")
        _touch_all([value], "r", ".flat assignment")
    with _inside():
        _plain_flat.__set__(self, value)


def _method(name, mode, *, only_1d=False):
    """A hook for the ndarray method ``name``: it reads (``"r"``), writes (``"w"``) or does both
    (``"rw"``) the array, then runs NumPy's own method."""
    plain = getattr(np.ndarray, name)

    def hook(self, *args, **kwargs):
        if _outermost() and (not only_1d or self.ndim <= 1):
            for m in mode:
                _touch(self, m, f".{name}()")
        with _inside():
            return plain(self, *args, **kwargs)
    hook.__name__ = name
    return hook


_HOOKS: dict[str, Any] = {
    "__getitem__": _getitem,
    "__setitem__": _setitem,
    "__array_ufunc__": _array_ufunc,
    "__array_function__": _array_function,
    "__array_finalize__": _array_finalize,
    "view": _view,
    "flat": property(_WatchedFlat, _set_flat, doc=np.ndarray.flat.__doc__),
    # C methods that go through none of the above
    **{name: _method(name, "r") for name in (
        "tolist", "tobytes", "item", "tofile", "dump", "dumps", "argmax", "argmin", "argsort", "nonzero",
        "searchsorted", "take", "repeat", "compress", "choose", "dot", "__array__", "__repr__", "__str__",
        "__format__", "__bool__", "__float__", "__int__", "__index__", "__complex__", "__reduce__",
        "__reduce_ex__")},
    "__iter__": _method("__iter__", "r", only_1d=True),     # a stack yields views; a 1-D array, its values
    **{name: _method(name, "w") for name in ("fill", "put", "setfield")},
    "byteswap": _byteswap,
    **{name: _method(name, "rw") for name in ("sort", "partition")},
}
