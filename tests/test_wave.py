import gc
import math
import types

import numpy as np
import pytest

import course_helper as ch

#: Largest |GPU - NumPy| difference accepted, relative to the peak amplitude.
#: Measured on an NVIDIA H200 (CuPy 14, 256x256x640): 3.9e-7 absolute at a peak of 2.44.
GPU_TOLERANCE = 1e-6


def test_defaults_reproduce_the_reference_lesson():
    p = ch.WaveProblem()
    assert p.shape == (256, 256) and p.source == (128, 128)
    assert math.isclose(p.dt, 1.16618e-3, rel_tol=1e-5)
    assert math.isclose(p.fm, 34.3)
    assert math.isclose(p.td, math.sqrt(6) / (math.pi * 34.3))
    assert p.nt == 640
    assert math.isclose(p.cfl_limit, math.sqrt(3 / 8))
    assert p.velocity.shape == (256, 256) and p.velocity.dtype == np.float32


def test_layered_velocity_sets_vmax_and_dt():
    v = np.full((64, 64), 1500.0)
    v[32:] = 3000.0
    p = ch.WaveProblem(64, 64, velocity=v, dx=(2.0, 1.0))
    assert p.vmax == 3000.0
    assert math.isclose(p.dt, 0.4 * 1.0 / 3000.0)
    assert math.isclose(p.fm, 3000.0 / (10 * 2.0))


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(n0=4), ValueError, "padding"),
    (dict(n1=3), ValueError, "padding"),
    (dict(n0=32.5), TypeError, "whole number"),
    (dict(dx=0), ValueError, "above 0"),
    (dict(dx=(1.0, -1.0)), ValueError, "above 0"),
    (dict(dx=(1.0, 1.0, 1.0)), ValueError, "pair"),
    (dict(velocity=-343), ValueError, "above 0"),
    (dict(velocity=float("nan")), ValueError, "finite"),
    (dict(velocity=np.ones((10, 10))), ValueError, "shape"),
    (dict(velocity=np.zeros((256, 256))), ValueError, "above 0"),
    (dict(nt=0), ValueError, "at least 3"),
    (dict(nt=-5), ValueError, "at least 3"),
    (dict(cfl=0.7), ValueError, "stability limit"),
    (dict(cfl=0), ValueError, "above 0"),
    (dict(source=(1, 128)), ValueError, "outside the interior"),
    (dict(source=(128, 254)), ValueError, "outside the interior"),
    (dict(source=5), TypeError, "pair"),
])
def test_bad_problems_are_refused(kwargs, err, msg):
    with pytest.raises(err, match=msg):
        ch.WaveProblem(**kwargs)


@pytest.mark.parametrize("velocity,err,msg", [
    (np.where(np.eye(64, dtype=bool), 1e39, 343.0), ValueError, "float32"),
    (1e39, ValueError, "float32"),
    (np.full((64, 64), 1e-50), ValueError, "float32"),
    (np.full((64, 64), 343.0 + 1j), TypeError, "real"),
    (343.0 + 1j, TypeError, "number"),
], ids=["one-cell-overflows", "overflows", "underflows", "complex-array", "complex"])
def test_velocity_that_float32_cannot_hold_is_refused(velocity, err, msg):
    with pytest.raises(err, match=msg):
        ch.WaveProblem(64, 64, velocity=velocity)


def test_uniform_velocity_is_built_on_first_use():
    p = ch.WaveProblem(64, 48, velocity=1500.0)
    assert p.vmax == 1500.0
    v = p.velocity
    assert v.shape == (64, 48) and v.dtype == np.float32 and np.all(v == 1500.0)
    assert p.velocity is v


def test_impossible_problem_is_refused_without_allocating_the_grid(backend):
    import tracemalloc
    tracemalloc.start()
    try:
        p = ch.WaveProblem(n0=40000, n1=40000, nt=5000)     # one level alone is 6.4 GB
        with pytest.raises(MemoryError, match="output stack"):
            ch.solve(p, "sequential", trace=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak / 2**20:.0f} MiB allocated before the refusal"


def test_kernel_source_is_shipped():
    src = ch.kernel_source()
    assert "__global__ void wave2d_4o" in src and "return;" in src


def test_one_step_matches_the_reference(backend):
    p = ch.WaveProblem(40, 52, nt=12, source=(20, 30))
    ref = ch.reference_solution(p)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    for n in range(p.nt - 2):
        ch.launch_wave2d(U[n % 3], U[(n + 1) % 3], U[(n + 2) % 3], V, p, n)
    last = ch.to_host(U[(p.nt - 1) % 3])
    tol = 0 if backend == "cpu" else GPU_TOLERANCE * np.abs(ref).max()
    np.testing.assert_allclose(last, ref[-1], rtol=0, atol=tol)
    assert np.abs(last).max() > 0


def test_many_steps_gpu_vs_numpy_within_tolerance(backend):
    p = ch.WaveProblem(96, 96, nt=200)
    ref = ch.reference_solution(p)
    r = ch.solve(p, "sequential", trace=False)
    diff = r.max_difference(ref)
    if backend == "cpu":
        assert diff == 0.0
    else:
        assert diff <= GPU_TOLERANCE * np.abs(ref).max()
    print(f"{backend}: max |solve - NumPy reference| = {diff:.3g} (peak {np.abs(ref).max():.3g})")


def test_centred_source_gives_a_symmetric_wavefield(backend):
    p = ch.WaveProblem(65, 65, nt=120)          # odd grid: the centre cell is the middle
    assert p.source == (32, 32)
    img = ch.solve(p, "events", trace=False).images[-1].astype(np.float64)
    peak = np.abs(img).max()
    assert peak > 0
    np.testing.assert_allclose(img, img[::-1, :], atol=1e-5 * peak)
    np.testing.assert_allclose(img, img[:, ::-1], atol=1e-5 * peak)
    np.testing.assert_allclose(img, img.T, atol=1e-5 * peak)


def test_walls_stay_zero(backend, small):
    img = ch.solve(small, "streams", trace=False).images
    for edge in (img[:, :2, :], img[:, -2:, :], img[:, :, :2], img[:, :, -2:]):
        assert np.all(edge == 0)


def test_launch_refuses_bad_buffers(backend, small):
    U = [ch.device_zeros(small.shape) for _ in range(3)]
    V = ch.to_device(small.velocity)
    with pytest.raises(ValueError, match="different buffer"):
        ch.launch_wave2d(U[0], U[1], U[1], V, small, 0)
    with pytest.raises(TypeError, match="device array"):
        ch.launch_wave2d(U[0], U[1], np.zeros(small.shape, np.float32), V, small, 0)
    with pytest.raises(ValueError, match="float32"):
        ch.launch_wave2d(U[0], U[1], ch.device_zeros((8, 8)), V, small, 0)
    with pytest.raises(ValueError, match="float32"):
        ch.launch_wave2d(U[0], U[1], ch.device_zeros(small.shape, np.float64), V, small, 0)
    with pytest.raises(ValueError, match="at least 0"):
        ch.launch_wave2d(U[0], U[1], U[2], V, small, -1)
    with pytest.raises(TypeError, match="WaveProblem"):
        ch.launch_wave2d(U[0], U[1], U[2], V, "problem", 0)


def test_launch_refuses_buffers_that_share_memory(backend, small):
    """Aliasing is judged by memory, not by object identity: a view is the same buffer."""
    U = [ch.device_zeros(small.shape) for _ in range(3)]
    V = ch.to_device(small.velocity)
    with pytest.raises(ValueError, match="different buffer"):
        ch.launch_wave2d(U[0], U[1], U[1][...], V, small, 0)
    with pytest.raises(ValueError, match="different buffer"):
        ch.launch_wave2d(U[0][...], U[1], U[0], V, small, 0)
    with pytest.raises(ValueError, match="U0 and U1 share memory"):
        ch.launch_wave2d(U[0], U[0], U[2], V, small, 0)
    with pytest.raises(ValueError, match="velocity model"):
        ch.launch_wave2d(U[0], U[1], V[...], V, small, 0)
    # Neighbouring slices of one allocation do not overlap: accepted, and the step is right.
    stack = ch.device_zeros((3, *small.shape))
    ch.launch_wave2d(stack[0], stack[1], stack[2], V, small, 0)
    ch.launch_wave2d(U[0], U[1], U[2], V, small, 0)
    np.testing.assert_array_equal(ch.to_host(stack[2]), ch.to_host(U[2]))


# -- the stability limit, tested by running the scheme --------------------
#: Spacings (dx0, dx1) in metres: square cells of several sizes and unequal ones.
SPACINGS = [(1.0, 1.0), (2.0, 2.0), (0.5, 0.5), (1.0, 3.0), (3.0, 1.0), (0.25, 1.0), (2.0, 0.7)]


def peak_per_level(dx, courant, nt):
    """Run the NumPy scheme at a Courant number ``Vmax dt / min(dx)`` chosen freely (even an
    unstable one, which WaveProblem refuses) and return max |U| at every level."""
    p = ch.WaveProblem(36, 36, dx=dx, nt=nt)
    p.dt = courant * min(p.dx0, p.dx1) / p.vmax     # bypasses the refusal on purpose
    with np.errstate(over="ignore", invalid="ignore"):
        levels = ch.reference_solution(p).astype(np.float64)
    return np.abs(levels).max(axis=(1, 2))


@pytest.mark.parametrize("dx", SPACINGS, ids=str)
def test_the_stability_limit_holds_when_running(dx):
    limit = ch.WaveProblem(36, 36, dx=dx).cfl_limit
    below = peak_per_level(dx, 0.99 * limit, nt=1500)
    assert np.isfinite(below).all()
    assert below[-500:].max() <= below[:300].max(), "just below the limit the wavefield grew"
    above = peak_per_level(dx, 1.01 * limit, nt=600)
    grown = ~(above < 1e6 * below[:300].max())          # NaN (overflowed) counts as grown
    assert grown.any(), "just above the limit nothing grew"


@pytest.mark.parametrize("dx", SPACINGS, ids=str)
def test_wave_problem_accepts_up_to_the_limit_and_refuses_above(dx):
    limit = math.sqrt(3 / 4) / (min(dx) * math.hypot(1 / dx[0], 1 / dx[1]))
    assert ch.WaveProblem(36, 36, dx=dx, cfl=0.999 * limit).cfl == 0.999 * limit
    with pytest.raises(ValueError, match="stability limit"):
        ch.WaveProblem(36, 36, dx=dx, cfl=1.001 * limit)


@pytest.mark.parametrize("dx", SPACINGS, ids=str)
def test_the_limit_itself_is_accepted_and_runs_bounded(dx):
    """Exactly at the limit, one float below it and one float above it."""
    limit = ch.WaveProblem(36, 36, dx=dx).cfl_limit
    assert ch.WaveProblem(36, 36, dx=dx, cfl=limit).cfl == limit
    assert ch.WaveProblem(36, 36, dx=dx, cfl=math.nextafter(limit, 0)).cfl < limit
    with pytest.raises(ValueError, match="stability limit"):
        ch.WaveProblem(36, 36, dx=dx, cfl=math.nextafter(limit, math.inf))
    at = peak_per_level(dx, limit, nt=1500)
    assert np.isfinite(at).all() and at[-500:].max() <= at[:300].max(), "at the limit the wavefield grew"


def test_the_source_is_a_ricker_wavelet_peaking_at_twice_the_delay():
    """The wavelet against its definition, computed here on its own: minus the second time
    derivative of the Gaussian exp(-(pi fm t)^2), over 2 (pi fm)^2, centred at t = 2 sqrt(6) / (pi fm)
    (notebook 4); the derivative by a central difference."""
    p = ch.WaveProblem(64, 64, nt=400)
    centre = 2 * math.sqrt(6) / (math.pi * p.fm)
    h = 1e-4 / p.fm

    def gaussian(t):
        return np.exp(-(math.pi * p.fm * t) ** 2)
    n = np.arange(p.nt)
    t = n * p.dt - centre
    want = -(gaussian(t + h) - 2 * gaussian(t) + gaussian(t - h)) / h**2 / (2 * (math.pi * p.fm) ** 2)
    got = np.array([p.source_amplitude(k) for k in n], np.float64)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert abs(int(np.argmax(got)) - centre / p.dt) <= 0.5          # the peak, at the level nearest the centre
    assert got[0] == pytest.approx(0, abs=1e-3)                     # it starts from (nearly) nothing


def test_square_cells_of_any_size_share_one_limit():
    for dx in (0.01, 0.5, 1.0, 2.0, 100.0):
        assert ch.WaveProblem(36, 36, dx=dx).cfl_limit == pytest.approx(math.sqrt(3 / 8))


# -- the stencil, checked against calculus rather than against itself ---------
def polynomial_on_grid(problem, degree, rng):
    """A random polynomial of total degree ``degree`` in (x0, x1) sampled on the grid (x in
    about [-1, 1]), and its exact Laplacian."""
    n0, n1 = problem.shape
    x0 = (np.arange(n0) - n0 // 2) * problem.dx0
    x1 = (np.arange(n1) - n1 // 2) * problem.dx1
    X0, X1 = np.meshgrid(x0, x1, indexing="ij")
    u = np.zeros_like(X0)
    laplacian = np.zeros_like(X0)
    for i in range(degree + 1):
        for j in range(degree + 1 - i):
            a = rng.uniform(-1, 1)
            u += a * X0**i * X1**j
            if i >= 2:
                laplacian += a * i * (i - 1) * X0**(i - 2) * X1**j
            if j >= 2:
                laplacian += a * j * (j - 1) * X0**i * X1**(j - 2)
    return u.astype(np.float32), laplacian


@pytest.mark.parametrize("dx", [(1 / 8, 1 / 8), (1 / 8, 1 / 4), (1 / 16, 1 / 8)], ids=str)
def test_one_step_gives_the_exact_second_derivative_of_polynomials(backend, dx):
    """With U0 = U1 = u one step gives U2 = u + dt^2 V^2 (d2u/dx0^2 + d2u/dx1^2). A 4th-order
    stencil is exact for every polynomial of degree <= 5 (a 2nd-order one only up to degree 3)."""
    p = ch.WaveProblem(17, 17, dx=dx, nt=3)
    dt2v2 = (p.dt * p.vmax) ** 2
    core = (slice(2, -2), slice(2, -2))
    rng = np.random.default_rng(7)
    for degree in range(6):
        u, exact = polynomial_on_grid(p, degree, rng)
        U0, U1, U2 = ch.to_device(u), ch.to_device(u), ch.device_zeros(p.shape)
        ch.launch_wave2d(U0, U1, U2, ch.to_device(p.velocity), p, 0)
        got = (ch.to_host(U2).astype(np.float64) - u) / dt2v2
        got[p.source] = exact[p.source]            # the source cell also gets the wavelet
        scale = max(1.0, np.abs(exact[core]).max())
        np.testing.assert_allclose(got[core], exact[core], rtol=0, atol=1e-3 * scale,
                                   err_msg=f"stencil is not exact for degree {degree}")


def test_cuda_kernel_uses_the_numpy_coefficients():
    import re
    src = ch.kernel_source()
    found = re.findall(r"const float c\[5\]\s*=\s*\{([^}]*)\}", src)
    assert len(found) == 1, "expected one coefficient table in the CUDA source"
    cuda = np.array([float(v.strip().rstrip("f")) for v in found[0].split(",")], dtype=np.float32)
    np.testing.assert_array_equal(cuda, ch.wave.STENCIL)


def test_launch_checks_again_what_changed_since_the_last_launch(backend, small):
    """The checks of a buffer set run once and are remembered: a change of the problem's
    numbers afterwards is checked again, and the launch uses the new numbers."""
    U = [ch.device_zeros(small.shape) for _ in range(3)]
    V = ch.to_device(small.velocity)
    ch.launch_wave2d(U[0], U[1], U[2], V, small, 0)
    ch.launch_wave2d(U[0], U[1], U[2], V, small, 1)      # the same set: remembered as checked
    small.n1 *= 2                                        # the arrays no longer fit the problem
    with pytest.raises(ValueError, match="float32 array of shape"):
        ch.launch_wave2d(U[0], U[1], U[2], V, small, 2)
    small.n1 //= 2
    ch.launch_wave2d(U[0], U[1], U[2], V, small, 2)
    expected = ch.to_host(U[2])
    small.dt *= 0.5                                      # the step uses the new time step
    ch.launch_wave2d(U[0], U[1], U[2], V, small, 2)
    assert not np.array_equal(ch.to_host(U[2]), expected)


def test_launch_uses_a_spacing_changed_since_the_last_launch(backend, small):
    U = [ch.to_device(np.random.default_rng(3).standard_normal(small.shape).astype(np.float32)) for _ in range(2)]
    U2, V = ch.device_zeros(small.shape), ch.to_device(small.velocity)
    ch.launch_wave2d(U[0], U[1], U2, V, small, 0)
    first = ch.to_host(U2)
    for name in ("dx0", "dx1"):
        setattr(small, name, getattr(small, name) * 2)
        ch.launch_wave2d(U[0], U[1], U2, V, small, 0)
        changed = ch.to_host(U2)
        assert not np.array_equal(changed, first), f"a new {name} was not used"
        first = changed


class DevicePointer:
    """What shares_memory reads of a C-contiguous device array that is not a NumPy one (CuPy's):
    the address and size."""

    def __init__(self, ptr, nbytes):
        self.data = types.SimpleNamespace(ptr=ptr)
        self.nbytes = self.size = nbytes
        self.flags = types.SimpleNamespace(c_contiguous=True)


@pytest.mark.parametrize("a, b, shared", [((0, 16), (16, 16), False), ((16, 16), (0, 16), False),
                                          ((0, 16), (15, 16), True), ((15, 16), (0, 16), True),
                                          ((0, 64), (16, 4), True), ((16, 4), (0, 64), True)])
def test_device_buffers_share_memory_when_their_byte_ranges_meet(a, b, shared):
    """The GPU's overlap test (address ranges), run on the CPU: half-open ranges [ptr, ptr + nbytes)."""
    assert ch.runtime.base.shares_memory(DevicePointer(*a), DevicePointer(*b)) is shared


def test_host_and_device_memory_never_share_and_views_are_judged_by_their_spans(cpu):
    """One answer on both backends: separate address spaces, and byte spans (two interleaved views
    of one buffer share, as a GPU's addresses cannot tell them apart)."""
    from course_helper.runtime.base import plain_view, shares_memory
    buf = ch.device_zeros((4, 8))
    assert shares_memory(buf[:, ::2], buf[:, 1::2]) and shares_memory(buf[1], buf)
    assert not shares_memory(buf[0], buf[1]) and not shares_memory(buf[:0], buf)
    assert not shares_memory(buf, plain_view(buf))          # the same bytes, seen as host memory


def test_the_default_nt_is_the_box_crossing_time_rounded_down():
    p = ch.WaveProblem(100, 60, dx=(1.0, 2.0), cfl=0.35)
    crossing = max(100 * 1.0, 60 * 2.0) / (p.dt * p.vmax)
    assert crossing % 1 > 0.1                       # not a whole number: rounding matters
    assert p.nt == math.floor(crossing)


def test_launch_puts_the_wavelet_where_the_source_was_moved(backend, small):
    """From a zero wavefield one step is the wavelet alone, at the source cell: moved between two
    launches with the same buffers, the second launch must use the new cell."""
    n = round(2 * small.td / small.dt)                   # near the wavelet's peak
    U0, U1, U2 = (ch.device_zeros(small.shape) for _ in range(3))
    V = ch.to_device(small.velocity)
    for source in (small.source, (10, 13)):
        small.source = source
        ch.launch_wave2d(U0, U1, U2, V, small, n)
        out = ch.to_host(U2)
        assert list(zip(*np.nonzero(out))) == [source] and out[source] == small.source_amplitude(n)


def test_checked_launch_arguments_are_forgotten_with_their_buffers(backend, small):
    """launch_wave2d remembers a checked buffer set by the ids of its objects; when one of them is
    freed its entry goes too, so a new array given the same id is checked afresh."""
    U = [ch.device_zeros(small.shape) for _ in range(3)]
    V = ch.to_device(small.velocity)
    ch.launch_wave2d(U[0], U[1], U[2], V, small, 0)
    key = (id(small), *(id(a) for a in U), id(V))
    assert key in ch.wave._CHECKED
    ch.synchronize()
    del U
    gc.collect()
    assert key not in ch.wave._CHECKED
