"""A CUDA kernel of your own, launched on a course stream like the course's own kernels.

:class:`RawKernel` pairs a CUDA C source (compiled by CuPy's ``RawModule`` on a GPU) with the
same computation written in NumPy (what the CPU backend runs). A launch is checked before
anything is queued, is named on timelines (and in Nsight Systems) as the course's kernels are,
and tells the race sanitizer which arrays it reads and which it writes.
"""
from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

from .. import checks, runtime, streams
from ..memory import is_device_array
from ..runtime import observe
from ..runtime.ops import KernelCost, OpKind
from ..runtime.base import CpuDeviceArray

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

__all__ = ["RawKernel", "source", "MODEL_SHAPE"]

#: How the modelled device times a kernel of yours: the profile's measured time of the course's
#: memory-bound stencil (``wave2d_4o``) for the bytes of the kernel's array arguments, each read
#: or written once. A kernel that computes much per byte runs slower on a GPU than modelled.
MODEL_SHAPE = "wave2d_4o"
_MAX_BLOCK = 1024            # threads per block on every CUDA GPU the course runs on


def source(name: str) -> str:
    """The CUDA C source ``kernels/<name>.cu`` shipped with the package (e.g. ``"gray_scott"``)."""
    path = resources.files("course_helper").joinpath(f"kernels/{name}.cu")
    if not path.is_file():
        raise ValueError(f"the package has no kernel {name!r} (kernels/{name}.cu)")
    return path.read_text()


def _dims(label: str, value: object) -> tuple[int, ...]:
    """A launch's grid or block: one to three positive ints."""
    dims = (value,) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    if not isinstance(dims, (tuple, list)) or not 1 <= len(dims) <= 3:
        raise TypeError(f"{label} must be an int or a tuple of one to three ints, as for a CuPy RawKernel, "
                        f"got {value!r}")
    return tuple(checks.positive_int(f"{label}[{i}]", d) for i, d in enumerate(dims))


class RawKernel:
    """A CUDA kernel of your own, launched on a course stream: ``kernel(grid, block, args,
    stream=s, writes=(out,))``, as a ``cupy.RawKernel`` is called.

    Parameters
    ----------
    code : str
        The CUDA C source; the kernel is ``extern "C" __global__``.
    name : str
        The kernel's name in ``code`` (and on timelines).
    numpy : callable
        The same computation in NumPy, run by the CPU backend: called with the launch's
        ``args`` (device arrays as NumPy arrays), it writes the arrays named in ``writes``
        in place, as the kernel does. Write it operation for operation like the kernel, in
        float32, and compile with ``options=("--fmad=false",)``: both backends then give
        bit-identical results.
    options : tuple of str
        NVRTC options for the GPU.

    A launch refuses, before anything is queued, what would make a CUDA kernel read garbage
    or fail later: a Python number among the arguments (its C type is unknown: pass
    ``np.int32(n)``, ``np.float32(x)``), a host array, an array of another backend, a
    non-contiguous view, a grid or block that is not one to three positive ints, more than
    1,024 threads per block, and ``writes`` naming an array that is not an argument.
    On the CPU backend the modelled device times it as :data:`MODEL_SHAPE` does.

    Examples
    --------
    >>> double = RawKernel(r'''
    ... extern "C" __global__ void double_it(const float* x, float* y, const int n) {
    ...     int i = blockIdx.x * blockDim.x + threadIdx.x;
    ...     if (i < n) y[i] = 2.0f * x[i];
    ... }''', "double_it", numpy=lambda x, y, n: np.multiply(x, np.float32(2), out=y))
    >>> from course_helper import memory
    >>> x, y = memory.to_device(np.arange(4, dtype=np.float32)), memory.device_zeros(4)
    >>> double((1,), (128,), (x, y, np.int32(4)), writes=(y,))
    >>> memory.to_host(y)
    array([0., 2., 4., 6.], dtype=float32)
    """

    def __init__(self, code: str, name: str, numpy: Callable[..., object], *, options: Sequence[str] = ()) -> None:
        if not isinstance(code, str) or f"{name}" not in code:
            raise ValueError(f"code must be the CUDA C source that defines the kernel {name!r}")
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be the kernel's C name, got {name!r}")
        if not callable(numpy):
            raise TypeError("numpy must be a function doing the kernel's work in NumPy (the CPU backend runs it)")
        self.code, self.name, self.numpy = code, name, numpy
        self.options = tuple(options)
        self._by_device = {}          # device id -> the kernel compiled for it (GPU only)

    def __repr__(self) -> str:
        return f"<RawKernel {self.name!r}>"

    def _for_stream(self, raw_stream: Any) -> Any:
        """The kernel compiled for the device of the CuPy stream ``raw_stream`` (the GPU runtime
        only calls it: the CPU backend never imports CuPy)."""
        import cupy
        device = raw_stream.device_id
        if device < 0:                  # the legacy default stream
            device = cupy.cuda.runtime.getDevice()
        kernel = self._by_device.get(device)
        if kernel is None:
            with cupy.cuda.Device(device):
                kernel = self._by_device[device] = cupy.RawModule(
                    code=self.code, options=self.options).get_function(self.name)
        return kernel

    def __call__(self, grid: int | tuple[int, ...], block: int | tuple[int, ...], args: Sequence[Any], *,
                 stream: streams.Stream | None = None, writes: Sequence[Any] = (), level: int | None = None) -> None:
        """Queue one launch on ``stream`` (default: the current stream).

        ``writes``: the arrays among ``args`` the kernel writes (all others are read); the race
        sanitizer orders the launch by them. ``level``: the time level (or step) it belongs
        to, which labels it on timelines, "``name`` level ``level``"."""
        grid, block = _dims("grid", grid), _dims("block", block)
        if int(np.prod(block)) > _MAX_BLOCK:
            raise ValueError(f"block {block} has {int(np.prod(block))} threads; a block holds at most "
                             f"{_MAX_BLOCK}")
        args = tuple(args) if isinstance(args, (tuple, list)) else None
        if args is None:
            raise TypeError("args must be a tuple of the kernel's arguments, as for a CuPy RawKernel")
        arrays = [a for a in args if _check_argument(a, self.name)]
        writes = tuple(writes)
        for w in writes:
            if not any(w is a for a in arrays):
                raise ValueError(f"writes names an array that is not one of {self.name}'s arguments: pass "
                                 "the very device arrays of args that the kernel writes")
        if level is not None:
            level = checks.positive_int("level", level, minimum=0)
        self.queue(grid, block, args, streams.resolve(stream), arrays, writes, level)

    def queue(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, stream: streams.Stream,
              arrays: Sequence[Any], writes: Sequence[Any], level: int | None) -> None:
        """Queue a launch whose arguments are checked already (what a call does after its checks;
        a launcher that checks its own arguments once for many launches calls it directly):
        ``arrays`` are the device arrays among ``args``, ``writes`` those the kernel writes,
        ``stream`` a resolved stream."""
        label = self.name if level is None else f"{self.name} level {level}"
        if not runtime.wants_op(stream):          # CuPy on a GPU, nobody watching
            stream.runtime.launch(stream.raw, self._for_stream, grid, block, args)
            if observe.journaling():
                observe.note_op(OpKind.KERNEL, label, stream, level, 0)
            return
        reads = tuple(a for a in arrays if not any(a is w for w in writes))

        def cuda(raw_stream):
            stream.runtime.launch(raw_stream, self._for_stream, grid, block, args)

        def numpy(*outs):
            # The kernel's arguments, each array written replaced by the fresh output it fills.
            out_of = {id(w): o for w, o in zip(writes, outs)}
            self.numpy(*(out_of.get(id(a), a.view(np.ndarray)) if is_device_array(a) else a for a in args))

        op = observe.Op(OpKind.KERNEL, label, stream, level, 0, reads, tuple(writes))
        runtime.submit(stream, op, cuda=cuda, numpy=numpy,
                       cost=KernelCost(MODEL_SHAPE, sum(a.nbytes for a in arrays)))


def _check_argument(a: object, kernel: str) -> bool:
    """Refuse an argument a CUDA kernel cannot take as it is; True for a device array."""
    if is_device_array(a):
        if not a.flags.c_contiguous:
            raise ValueError(f"{kernel} gets a pointer to each array: pass C-contiguous arrays, not a strided "
                             "view (copy it with an async device-to-device copy first)")
        return True
    if isinstance(a, np.generic):
        return False
    if isinstance(a, CpuDeviceArray) or type(a).__module__.startswith("cupy"):
        raise TypeError(f"a device array of another backend was passed to {kernel}; make every array with "
                        "the active backend (device_zeros, to_device)")
    if isinstance(a, np.ndarray):
        raise TypeError(f"a host (NumPy) array was passed to {kernel}, which reads device memory: copy it to "
                        "the device first (to_device, or copy_to_device_async from pinned memory)")
    raise TypeError(f"{kernel} got {a!r} ({type(a).__name__}): pass scalars as NumPy scalars of the kernel's C "
                    "type (np.int32(n) for int, np.float32(x) for float); a Python number's C type is not known, "
                    "and a kernel reading it as another type reads garbage")
