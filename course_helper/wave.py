"""The running example: a 2D acoustic wave, "a firework in a box".

:class:`WaveProblem` holds the physics and the derived numbers;
:func:`launch_wave2d` queues one time step of the ``wave2d_4o`` stencil on a
stream (the CUDA kernel in ``kernels/wave2d_4o.cu`` on the GPU, the same
update in NumPy on the CPU); :func:`reference_solution` is the plain NumPy
answer every strategy is checked against.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any

import numpy as np

from . import checks, kernels, runtime, streams
from .runtime import observe
from .runtime.base import shares_memory
from .runtime.ops import KernelCost, OpKind
from .memory import is_device_array

__all__ = ["PreparedLaunch", "WaveProblem", "launch_wave2d", "reference_solution", "ricker", "kernel_source",
           "STENCIL", "stability_limit", "saved_levels"]

#: 4th-order central-difference coefficients of the second derivative, as float32.
STENCIL = np.array([-1 / 12, 4 / 3, -5 / 2, 4 / 3, -1 / 12], dtype=np.float32)
PAD = 2           # untouched cells on each side: the reflecting walls
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)  # normal range
_BLOCK = (32, 8)  # threads per block along (dimension 1, dimension 0)
_KERNEL = OpKind.KERNEL   # read on every launch: a global costs a tenth of a class attribute (see runtime/ops.py)


def ricker(t: float, fm: float) -> float:
    """The Ricker wavelet (1 - 2 pi^2 fm^2 t^2) exp(-pi^2 fm^2 t^2) at time ``t`` (s)."""
    a = (math.pi * fm * t) ** 2
    return (1.0 - 2.0 * a) * math.exp(-a)


def stability_limit(dx0: float, dx1: float) -> float:
    """The largest stable Courant number ``Vmax dt / min(dx0, dx1)`` of this scheme.

    The 4th-order stencil's second difference has its largest eigenvalue,
    ``16 / (3 dx^2)``, on the grid's shortest wave (sign flipping cell to cell);
    the centred time step stays bounded while ``Vmax^2 dt^2`` times the sum of
    those eigenvalues over both dimensions is at most 4. Hence
    ``Vmax dt <= sqrt(3/4) / hypot(1/dx0, 1/dx1)``, which is ``sqrt(3/8)`` (about
    0.612) in Courant numbers for square cells of any size. Notebook 4 derives it.
    """
    return math.sqrt(3 / 4) / (min(dx0, dx1) * math.hypot(1 / dx0, 1 / dx1))


class WaveProblem:
    """The 2D wave problem and every number derived from it.

    Parameters
    ----------
    n0, n1 : int
        Grid size in cells along dimensions 0 and 1 (default 256 x 256),
        including the two padding cells on each side.
    dx : float or (float, float)
        Grid spacing in metres (default 1 m).
    velocity : float or array of shape (n0, n1)
        Wave speed in m/s (default 343, sound in air); an array gives a
        heterogeneous medium, e.g. layers.
    cfl : float
        Courant number ``Vmax dt / min(dx)`` (default 0.4); at most
        :attr:`cfl_limit`, the stability limit of this scheme.
    nt : int, optional
        Number of time levels. Default: long enough for the wave to cross the
        box, ``floor(max(n0 dx0, n1 dx1) / (dt Vmax))``.
    source : (int, int), optional
        Source cell, default the centre ``(n0 // 2, n1 // 2)``.
    points_per_wavelength : float
        Sets the Ricker peak frequency ``fm = Vmax / (ppw max(dx))`` (default 10).

    Attributes
    ----------
    dt : float
        Time step in seconds.
    version : int
        How many times a number of the problem was set after it was made (``p.dt = ...``): what
        was prepared from it (:class:`PreparedLaunch`) compares it to see that it changed.
    fm : float
        Peak frequency of the Ricker wavelet in Hz.
    td : float
        Wavelet delay ``sqrt(6) / (pi fm)`` in seconds.
    vmax : float
        Largest velocity in m/s.
    cfl_limit : float
        Largest stable Courant number for this grid.
    nt : int
        Number of time levels (level 0 and 1 are the zero initial state).
    velocity : numpy.ndarray
        The (n0, n1) float32 velocity model (a uniform one is kept as one
        number and built on first use).

    Examples
    --------
    >>> p = WaveProblem()
    >>> p.nt, round(p.fm, 1)
    (640, 34.3)
    """

    def __init__(self, n0: int = 256, n1: int = 256, dx: float | tuple[float, float] = 1.0,
                 velocity: float | np.ndarray = 343.0, cfl: float = 0.4, nt: int | None = None,
                 source: tuple[int, int] | None = None, points_per_wavelength: float = 10.0) -> None:
        self.n0 = _checked_size(n0, self, "n0")
        self.n1 = _checked_size(n1, self, "n1")
        if isinstance(dx, (tuple, list)):
            if len(dx) != 2:
                raise ValueError(f"dx must be one spacing or a pair (dx0, dx1), got {dx!r}")
            dx0, dx1 = dx
        else:
            dx0 = dx1 = dx
        self.dx0 = _checked_spacing(dx0, self, "dx0")
        self.dx1 = _checked_spacing(dx1, self, "dx1")
        self._velocity, self._uniform_velocity = self._velocity_model(velocity)
        self.vmax = self._uniform_velocity if self._velocity is None else float(self._velocity.max())
        self.cfl_limit = stability_limit(self.dx0, self.dx1)
        self.cfl = checks.positive_float("cfl", cfl)
        if self.cfl > self.cfl_limit:
            raise ValueError(f"cfl={self.cfl} is above this scheme's stability limit {self.cfl_limit:.4f}: "
                             "the solution would blow up; choose a smaller cfl (0.4 is the course default)")
        ppw = checks.positive_float("points_per_wavelength", points_per_wavelength)
        self.points_per_wavelength = ppw
        self.dt = _checked_dt(self.cfl * min(self.dx0, self.dx1) / self.vmax, self)
        self.fm = self.vmax / (ppw * max(self.dx0, self.dx1))
        self.td = math.sqrt(6.0) / (math.pi * self.fm)
        self.nt = _checked_nt(nt, self)
        self.source = _checked_source(source, self)
        self.version = 0
        self._built = True

    def __setattr__(self, name: str, value: object) -> None:
        # Once built, the numbers the kernels read are checked again when set (a notebook may
        # set ``p.dt`` to explore stability); those everything else was derived from are fixed.
        if self.__dict__.get("_built"):
            if name in _FIXED:
                raise AttributeError(f"a WaveProblem's {name} is fixed when it is made (dt, fm and the "
                                     f"stability limit were derived from it); make a new problem, "
                                     f"e.g. WaveProblem(..., {name}=...)")
            if name in _RECHECKED:
                value = _RECHECKED[name](value, self)
            if not name.startswith("_"):
                if name == "version":
                    raise AttributeError("a WaveProblem's version counts the changes to its numbers; it is "
                                         "not set by hand")
                object.__setattr__(self, name, value)
                # Counted after the change: what was prepared with the old numbers sees it differ.
                object.__setattr__(self, "version", self.version + 1)
                return
        object.__setattr__(self, name, value)

    def _velocity_model(self, velocity):
        """``(array, None)`` for a heterogeneous medium, ``(None, speed)`` for a uniform one: a
        uniform medium stays one number until an array is asked for, so that a problem too
        large to run is refused by ``solve`` before anything of grid size is allocated."""
        if velocity is None or isinstance(velocity, (str, bytes)):
            raise TypeError(f"velocity must be a wave speed in m/s (a number) or an (n0, n1) array of "
                            f"speeds, got {velocity!r}")
        if np.isscalar(velocity):
            v = checks.positive_float("velocity (m/s)", velocity)
            if not _F32_TINY <= v <= _F32_MAX:
                raise ValueError(f"velocity {v} m/s does not fit in float32 (the kernel's type); "
                                 f"use a speed between {_F32_TINY:.3g} and {_F32_MAX:.3g} m/s")
            return None, float(np.float32(v))
        if type(velocity).__module__.startswith("cupy"):
            raise TypeError("velocity must be a host (NumPy) array; WaveProblem copies it to the device itself")
        v = np.asarray(velocity)
        if v.shape != (self.n0, self.n1):
            raise ValueError(f"velocity array has shape {v.shape} but the grid is {(self.n0, self.n1)}; "
                             "give one velocity per cell")
        if np.issubdtype(v.dtype, np.complexfloating):
            raise TypeError(f"velocity must be real, got a {v.dtype} array; a wave speed has no "
                            "imaginary part (pass velocity.real if that is what you mean)")
        if not np.issubdtype(v.dtype, np.number) or not np.all(np.isfinite(v)) or v.min() <= 0:
            raise ValueError("velocity must hold finite numbers above 0 m/s in every cell")
        if v.max() > _F32_MAX or v.min() < _F32_TINY:
            raise ValueError(f"velocity values from {v.min():.3g} to {v.max():.3g} m/s do not all fit in "
                             f"float32 (the kernel's type), which holds {_F32_TINY:.3g} to {_F32_MAX:.3g}; "
                             "check the units of the velocity model")
        return np.ascontiguousarray(v, dtype=np.float32), None

    @property
    def velocity(self) -> np.ndarray:
        """The (n0, n1) float32 velocity model (for a uniform medium built on first use)."""
        if self._velocity is None:
            self._velocity = np.full(self.shape, self._uniform_velocity, dtype=np.float32)
        return self._velocity

    # -- derived numbers the kernel needs --------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.n0, self.n1)

    @property
    def nbytes_level(self) -> int:
        """Bytes of one wavefield (one saved level)."""
        return self.n0 * self.n1 * 4

    def source_amplitude(self, n: int) -> np.float32:
        """The wavelet value added at step ``n`` (which computes level n+2), as float32."""
        return np.float32(ricker(n * self.dt - 2.0 * self.td, self.fm))

    def describe(self) -> dict:
        """A dict of the problem's numbers with their units (rounded for printing)."""
        return {"grid (cells)": f"{self.n0} x {self.n1}", "spacing (m)": (self.dx0, self.dx1),
                "Vmax (m/s)": self.vmax, "CFL": self.cfl, "CFL limit": round(self.cfl_limit, 4),
                "dt (s)": float(f"{self.dt:.6g}"), "fm (Hz)": round(self.fm, 4),
                "td (s)": float(f"{self.td:.6g}"), "NT (levels)": self.nt, "source": self.source}

    def __repr__(self) -> str:
        return (f"WaveProblem({self.n0}x{self.n1}, dx=({self.dx0}, {self.dx1}) m, Vmax={self.vmax} m/s, "
                f"cfl={self.cfl}, dt={self.dt:.6g} s, fm={self.fm:.4g} Hz, nt={self.nt})")


#: The most time levels a problem may have: a sanity bound (a bigger nt is a typo, and would
#: overflow the sizes derived from it).
MAX_NT = 2**31 - 1
#: What stays fixed once a WaveProblem is made: the numbers dt, fm and the stability limit
#: were derived from (a slab of the halo course is rebuilt from them).
_FIXED = ("vmax", "cfl", "cfl_limit", "points_per_wavelength")


def _quiet(compute):
    """``compute()`` with float overflow and underflow giving inf and 0 rather than warnings."""
    with np.errstate(over="ignore", under="ignore", divide="ignore"):
        return compute()


def _fits_float32(what, value, cause):
    """Refuse a number the kernel computes in float32 when float32 cannot hold it (it would
    overflow to inf or flush to 0, and the wavefield turn to NaN without an error)."""
    v = abs(float(value))
    if not (_F32_TINY <= v <= _F32_MAX):
        raise ValueError(f"{cause} makes the kernel's {what} = {v:.3g}, which float32 (the kernel's type, "
                         f"{_F32_TINY:.3g} to {_F32_MAX:.3g}) cannot hold; express the problem in other "
                         "units (e.g. km and km/s) so that spacing, speed and time step stay near 1")


def _checked_size(n, problem, name):
    """A grid size: at least one interior cell inside the walls, and the source still inside."""
    n = checks.positive_int(name, n, minimum=2 * PAD + 1,
                            hint="the stencil needs 2 padding cells on each side of at least one interior cell")
    source = problem.__dict__.get("source")
    if source is not None and source[0 if name == "n0" else 1] >= n - PAD:
        raise ValueError(f"{name}={n} would leave the source {source} outside the interior; move the source first")
    return n


def _checked_spacing(d, problem, name):
    """A grid spacing (m) whose 1/d^2, a kernel argument, fits in float32."""
    d = checks.positive_float(f"{name} (grid spacing, m)", d)
    _fits_float32(f"1/{name}^2", _quiet(lambda: 1.0 / np.float64(d) / d), f"the grid spacing {name}={d} m")
    return d


def _checked_wavelet(value, problem, name):
    return checks.positive_float(f"{name} (the Ricker wavelet's {'peak frequency' if name == 'fm' else 'delay'})",
                                 value)


def _checked_dt(dt, problem):
    """The time step ``dt`` (s), refused unless it and the kernel's float32 numbers made of it fit."""
    dt = checks.positive_float("dt (time step, s)", dt)
    dt2 = _quiet(lambda: np.float32(dt * dt))
    cause = f"the time step dt={dt:.6g} s"
    _fits_float32("dt^2", dt2, cause)
    vmin = problem.vmax if problem._velocity is None else float(problem._velocity.min())
    for v in {np.float32(vmin), np.float32(problem.vmax)}:
        _fits_float32("dt^2 V", _quiet(lambda: dt2 * v), cause)
        _fits_float32("dt^2 V^2", _quiet(lambda: dt2 * v * v), cause)
    return dt


def _checked_nt(nt, problem):
    """The number of time levels (default: the box-crossing time), refused unless 3 <= nt <= MAX_NT."""
    default = nt is None
    if default:
        crossing = max(problem.n0 * problem.dx0, problem.n1 * problem.dx1) / (problem.dt * problem.vmax)
        nt = int(math.floor(crossing + 1e-9))   # guard against 639.9999999 for 640
    nt = checks.positive_int("nt (number of time levels)", nt, minimum=3,
                             hint="levels 0 and 1 are the initial state, so at least one step needs nt >= 3")
    if nt > MAX_NT:
        where = " (the default: the time the wave takes to cross the box)" if default else ""
        raise ValueError(f"nt={nt}{where} is more than the {MAX_NT} (2**31 - 1) time levels a problem may "
                         "have; give a smaller nt")
    return nt


def _checked_source(source, problem):
    """The source cell (default: the centre), refused unless it is an interior cell."""
    if source is None:
        source = (problem.n0 // 2, problem.n1 // 2)
    try:
        p0, p1 = source
    except (TypeError, ValueError):
        raise TypeError(f"source must be a pair of cell indices (P0, P1), got {source!r}") from None
    p0 = checks.positive_int("source P0", p0, minimum=0)
    p1 = checks.positive_int("source P1", p1, minimum=0)
    if not (PAD <= p0 < problem.n0 - PAD and PAD <= p1 < problem.n1 - PAD):
        raise ValueError(f"source {(p0, p1)} is outside the interior [{PAD}, {problem.n0 - PAD - 1}] x "
                         f"[{PAD}, {problem.n1 - PAD - 1}]; padding cells are walls and never updated")
    return (p0, p1)


#: Set after a WaveProblem is made, these are checked as the constructor checks them.
_RECHECKED = {"dt": _checked_dt, "nt": _checked_nt, "source": _checked_source,
              **{name: functools.partial(_checked_size, name=name) for name in ("n0", "n1")},
              **{name: functools.partial(_checked_spacing, name=name) for name in ("dx0", "dx1")},
              **{name: functools.partial(_checked_wavelet, name=name) for name in ("fm", "td")}}


def kernel_source() -> str:
    """The CUDA C source of ``wave2d_4o`` shipped with the package."""
    return kernels.source("wave2d_4o")


def _gpu_kernel(raw_stream):
    """The compiled ``wave2d_4o`` for the device of the CuPy stream ``raw_stream`` (called by
    the GPU runtime only)."""
    device = raw_stream.device_id        # set when CuPy made the stream; -1 for the legacy default
    if device < 0:
        import cupy      # imported here so that the CPU backend never imports CuPy
        device = cupy.cuda.runtime.getDevice()
    return _compiled(device)


@functools.lru_cache(maxsize=None)
def _compiled(device_id):
    import cupy
    module = cupy.RawModule(code=kernel_source(), options=("--fmad=false",))
    return module.get_function("wave2d_4o")


def _numpy_step(U0, U1, U2, V, dt2, inv_dx02, inv_dx12, p0, p1, amp):
    """The same update as the CUDA kernel, operation for operation, in float32."""
    n0, n1 = U1.shape
    U2[PAD:n0 - PAD, PAD:n1 - PAD] = _numpy_update(U0, U1, V, dt2, inv_dx02, inv_dx12, p0, p1, amp)


def _numpy_update(U0, U1, V, dt2, inv_dx02, inv_dx12, p0, p1, amp):
    """The new values of the cells inside the padding (what ``_numpy_step`` writes)."""
    n0, n1 = U1.shape
    c = STENCIL
    core = (slice(PAD, n0 - PAD), slice(PAD, n1 - PAD))
    # u = (2 U1 - U0) + ((dt2 v) v) (d0 / dx0^2 + d1 / dx1^2), each operation as the kernel does
    # it, into three arrays the size of the grid (a large grid on the CPU backend takes no more).
    d0 = c[0] * U1[0:n0 - 4, PAD:n1 - PAD]
    d1 = c[0] * U1[PAD:n0 - PAD, 0:n1 - 4]
    term = np.empty_like(d0)
    for m in range(1, 5):
        d0 += np.multiply(c[m], U1[m:n0 - 4 + m, PAD:n1 - PAD], out=term)
        d1 += np.multiply(c[m], U1[PAD:n0 - PAD, m:n1 - 4 + m], out=term)
    d0 *= inv_dx02
    d0 += np.multiply(d1, inv_dx12, out=term)               # the Laplacian
    v = V[core]
    np.multiply(dt2, v, out=d1)
    d1 *= v
    d1 *= d0                                                # ((dt2 v) v) times the Laplacian
    u = np.multiply(np.float32(2), U1[core], out=d0)
    u -= U0[core]
    u += d1
    u[p0 - PAD, p1 - PAD] += amp
    return u


def _step_args(problem):
    return (np.float32(problem.dt ** 2), np.float32(1 / problem.dx0 ** 2), np.float32(1 / problem.dx1 ** 2))


def kernel_cost(nbytes_level: int) -> KernelCost:
    """What a modelled GPU charges for one launch of the wave kernel on a level of
    ``nbytes_level`` bytes: its profile's ``wave2d_4o`` time for the bytes the kernel moves
    (it reads two levels and the velocity and writes a third: four levels' worth)."""
    return KernelCost("wave2d_4o", 4 * nbytes_level)


def launch_wave2d(U0: Any, U1: Any, U2: Any, V: Any, problem: WaveProblem, n: int,
                  stream: streams.Stream | None = None) -> None:
    """Queue step ``n``: compute level n+2 into ``U2`` from levels n (``U0``) and n+1 (``U1``).

    Parameters
    ----------
    U0, U1, U2, V : device arrays of shape (n0, n1), float32
        Two older levels, the output level and the velocity model. No two of
        ``U0``, ``U1`` and ``U2`` may share memory, nor ``U2`` and ``V``.
    problem : WaveProblem
    n : int
        The step number (sets the source term's time ``n dt - 2 td``).
    stream : Stream, optional
        Where to queue the kernel (default: the current stream).
    """
    # Every level of a loop launches: the usual arguments (exact types) pass two identity tests.
    if type(problem) is not WaveProblem:
        checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    if type(n) is not int or n < 0:
        n = checks.positive_int("n (step number)", n, minimum=0)
    checked = _launch_arguments(U0, U1, U2, V, problem)      # checks them (see _check_launch)
    scalars, grid = checked.scalars, checked.grid
    stream = streams.resolve(stream)
    amplitude = problem.source_amplitude(n)
    if not runtime.wants_op(stream):
        # CuPy on a GPU, nobody watching: the kernel goes straight to the runtime, its arguments
        # packed once per argument set (only the amplitude changes from level to level), and only
        # the thread's op journal hears of it.
        raw = stream.raw
        packed = checked.packed
        if packed is None or not packed.serves(raw):
            packed = checked.packed = stream.runtime.pack_launch(raw, _gpu_kernel, grid, _BLOCK,
                                                                 (U0, U1, U2, V, *scalars, amplitude))
        packed(raw, amplitude)
        if observe.journaling():
            observe.note_op(_KERNEL, f"wave2d_4o level {n + 2}", stream, n + 2, 0)
        return
    args = (U0, U1, U2, V, *scalars, amplitude)

    def cuda(raw_stream):
        stream.runtime.launch(raw_stream, _gpu_kernel, grid, _BLOCK, args)

    cost = kernel_cost(U2.nbytes)

    def numpy(rows):                 # rows: U2's rows PAD..n0-PAD, the op's output
        rows[:, PAD:-PAD] = _numpy_update(U0.view(np.ndarray), U1.view(np.ndarray), V.view(np.ndarray), *args[6:])

    # What it writes: the rows between the two padding rows at each end (a window of a slab shares
    # those context rows with its neighbouring window, which writes them itself).
    op = observe.Op(_KERNEL, f"wave2d_4o level {n + 2}", stream, n + 2, 0, (U0, U1, V), (U2[PAD:-PAD],))
    runtime.submit(stream, op, cuda=cuda, numpy=numpy, cost=cost)


class PreparedLaunch:
    """:func:`launch_wave2d` with its arrays, problem and stream fixed, for a loop that launches the
    same argument set every few levels (a rank's window of one buffer of its ring): ``prepared(n)``
    queues step ``n`` as ``launch_wave2d(U0, U1, U2, V, problem, n, stream)`` does.

    The arguments are checked here, once. On a GPU with nobody observing the stream's work, a call
    then only reads the source amplitude from a table it fills as steps come (a rank's loop repeats
    them) and queues the packed launch: the checks, the wavelet and the argument lookups cost a
    launch about as much host time as ``cuLaunchKernel`` itself. Anything else (the CPU backend, an
    observer, the first launch) goes through launch_wave2d. It keeps the arrays alive (the packed
    launch holds their addresses).

    A change to the problem after it was prepared (``problem.dt = ...``, another source) is noticed
    at the next call, by the problem's :attr:`~WaveProblem.version` (one comparison a call): that
    call prepares again, through launch_wave2d's checks, with the new numbers.
    """

    def __init__(self, U0: Any, U1: Any, U2: Any, V: Any, problem: WaveProblem,
                 stream: streams.Stream | None = None) -> None:
        checks.instance("problem", problem, WaveProblem, "a WaveProblem")
        _launch_arguments(U0, U1, U2, V, problem)          # a clear error now, not at the first launch
        self._args = (U0, U1, U2, V, problem)
        self._stream = streams.resolve(stream)
        self._amplitudes = {}                              # step -> source amplitude, filled on first use
        self._packed = None
        self._version = problem.version                   # the problem's numbers these were made from

    def __call__(self, n: int) -> None:
        """Queue step ``n`` (level n+2 from levels n and n+1) on the prepared stream."""
        if self._args[4].version != self._version:        # the problem changed: prepare again
            self._version, self._amplitudes, self._packed = self._args[4].version, {}, None
        stream, packed = self._stream, self._packed
        if packed is not None and type(n) is int and n >= 0 and not runtime.wants_op(stream):
            amplitude = self._amplitudes.get(n)
            if amplitude is None:
                amplitude = self._amplitudes[n] = self._args[4].source_amplitude(n)
            packed(stream.raw, amplitude)
            if observe.journaling():
                observe.note_op(_KERNEL, f"wave2d_4o level {n + 2}", stream, n + 2, 0)
            return
        launch_wave2d(*self._args, n, stream)
        if not runtime.wants_op(stream):                   # that launch packed the arguments
            self._packed = _launch_arguments(*self._args).packed


def _kernel_scalars_and_grid(problem):
    """The kernel's arguments after the four arrays, but the source amplitude, and its grid."""
    n0, n1 = problem.shape
    p0, p1 = problem.source
    scalars = (np.int32(n0), np.int32(n1), *_step_args(problem), np.int32(p0), np.int32(p1))
    grid = ((n1 + _BLOCK[0] - 1) // _BLOCK[0], (n0 + _BLOCK[1] - 1) // _BLOCK[1])
    return scalars, grid


class _Checked:
    """An argument set of launch_wave2d that passed its checks: the problem's numbers the kernel
    reads, the kernel's scalar arguments but the source amplitude, its grid, and (on a GPU) the
    launch with all of them packed, made on the first launch that needs it."""
    __slots__ = ("refs", "numbers", "scalars", "grid", "packed")

    def __init__(self, refs, numbers, scalars, grid):
        self.refs, self.numbers, self.scalars, self.grid, self.packed = refs, numbers, scalars, grid, None


#: Argument sets of launch_wave2d already checked: (ids) -> :class:`_Checked`.
#: The strategies launch with the same few buffers every level, so the checks run once per set
#: and buffer ring, not once per level. Weak references: a cached set keeps no memory alive, and
#: the death of any of its objects removes the set (the references' callback) before the
#: object's memory is freed, so an id found here always belongs to the object checked, and a
#: packed launch never holds the address of freed memory.
_CHECKED = {}
_CHECKED_MAX = 256


def _launch_arguments(U0, U1, U2, V, problem):
    """The checked argument set (:class:`_Checked`) of these arrays, checking them
    (:func:`_check_launch`) on first sight. The checks cost a launch about a sixth of its host
    time on the CPU backend, and a loop launches with the same few buffers every level."""
    key = (id(problem), id(U0), id(U1), id(U2), id(V))
    # What may change in place on the same objects is the problem's numbers (a notebook may set
    # p.dt). An array can be reshaped in place (``a.shape = ...``) but keeps its size and memory,
    # which is all the kernel relies on once the set has been checked.
    numbers = (problem.n0, problem.n1, problem.dt, problem.dx0, problem.dx1, problem.source)
    hit = _CHECKED.get(key)
    if hit is not None and hit.numbers == numbers:
        return hit
    _check_launch(U0, U1, U2, V, problem)
    scalars, grid = _kernel_scalars_and_grid(problem)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()

    def forget(_ref):
        _CHECKED.pop(key, None)

    checked = _CHECKED[key] = _Checked(tuple(weakref.ref(o, forget) for o in (problem, U0, U1, U2, V)),
                                       numbers, scalars, grid)
    return checked


def _check_launch(U0, U1, U2, V, problem):
    """Refuse arguments launch_wave2d cannot run with (see its docstring)."""
    checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    for label, a in (("U0", U0), ("U1", U1), ("U2", U2), ("V", V)):
        if not is_device_array(a):
            raise TypeError(f"{label} must be a device array (device_zeros/to_device), got {type(a).__name__}")
        if tuple(a.shape) != problem.shape or a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError(f"{label} must be a C-contiguous float32 array of shape {problem.shape}, "
                             f"got {a.dtype} {tuple(a.shape)}")
    if shares_memory(U2, U0) or shares_memory(U2, U1):
        raise ValueError("U2 must be a different buffer from U0 and U1 (it shares memory with one of them, "
                         "e.g. a view): the kernel reads its neighbours' old values while it writes, so an "
                         "in-place update is a race")
    if shares_memory(U2, V):
        raise ValueError("U2 shares memory with the velocity model V: the kernel would overwrite V while "
                         "reading it; write the new level into a scratch buffer of its own")
    if shares_memory(U0, U1):
        raise ValueError("U0 and U1 share memory, but they hold two different levels (n and n+1); "
                         "pass two different buffers of the ring, e.g. U[n % 3] and U[(n + 1) % 3]")


def saved_levels(nt: int, every: int) -> range:
    """The time levels a run of ``nt`` levels saves when it keeps every ``every``-th one:
    0, every, 2*every, ... below nt. The one definition the solver, the store, the halo ranks and
    the reference solution share."""
    return range(0, nt, every)


def save_interval(every: int, nt: int) -> int:
    """``every``, checked as the interval between saved levels of a run of ``nt`` levels: a
    positive whole number below ``nt`` (else only level 0, the zero initial state, would be
    saved). The one home of that rule: the solver and the halo ranks (and their launcher) check it here."""
    every = checks.positive_int("every", every)
    if every >= nt:
        raise ValueError(f"every={every} is not below nt={nt}: only level 0 (the zero initial state) "
                         "would be saved; choose every < nt")
    return every


def reference_solution(problem: WaveProblem, every: int = 1) -> np.ndarray:
    """Plain NumPy answer: every ``every``-th level from 0 to nt-1, shape (nsaved, n0, n1).

    No streams, no device: the ground truth the strategies are checked against.
    """
    checks.instance("problem", problem, WaveProblem, "a WaveProblem")
    every = checks.positive_int("every", every)
    levels = saved_levels(problem.nt, every)
    out = np.empty((len(levels), *problem.shape), np.float32)
    ring = [np.zeros(problem.shape, np.float32) for _ in range(3)]
    dt2, idx0, idx1 = _step_args(problem)
    for level in range(problem.nt):
        if level >= 2:
            n = level - 2
            _numpy_step(ring[n % 3], ring[(n + 1) % 3], ring[level % 3], problem.velocity,
                        dt2, idx0, idx1, *problem.source, problem.source_amplitude(n))
        if level % every == 0:
            out[level // every] = ring[level % 3]
    return out
