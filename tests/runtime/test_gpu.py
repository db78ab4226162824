"""The GPU runtime's own pieces that the shared tests cannot reach: the packed kernel launch."""
import threading

import numpy as np
import pytest

import course_helper as ch

pytestmark = pytest.mark.gpu

_SCALE = r'''
extern "C" __global__ void scale(const float* x, float* y, const int n, const float s) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = s * x[i];
}'''


@pytest.fixture
def scale(gpu):
    import cupy
    kernel = cupy.RawKernel(_SCALE, "scale")
    x = cupy.arange(1000, dtype=cupy.float32)
    y = cupy.zeros_like(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    return gpu, kernel, x, y, stream


def _packed(scale, s):
    rt, kernel, x, y, stream = scale
    return rt.pack_launch(stream, lambda _stream: kernel, (4,), (256,), (x, y, np.int32(x.size), np.float32(s)))


def test_a_packed_launch_computes_what_the_cupy_call_does(scale):
    rt, kernel, x, y, stream = scale
    import cupy
    expected = cupy.zeros_like(y)
    kernel((4,), (256,), (x, expected, np.int32(x.size), np.float32(3)), stream=stream)
    _packed(scale, 3)(stream, np.float32(3))
    stream.synchronize()
    assert cupy.array_equal(y, expected) and float(y[10]) == 30.0


def test_each_packed_launch_takes_its_own_last_argument(scale):
    """The driver copies the arguments when a launch is queued, so rewriting the last one for the
    next launch leaves the queued one as it was."""
    rt, kernel, x, y, stream = scale
    import cupy
    launch = _packed(scale, 0)
    out = cupy.empty((3, x.size), cupy.float32)
    for i, s in enumerate((2, 5, 7)):
        launch(stream, np.float32(s))
        cupy.cuda.runtime.memcpyAsync(out[i].data.ptr, y.data.ptr, y.nbytes, 3, stream.ptr)
    stream.synchronize()
    assert [float(v) for v in out[:, 1]] == [2.0, 5.0, 7.0]


def test_a_packed_launch_works_from_a_thread_that_never_used_the_device(scale):
    """A fresh thread may have no current CUDA context, which the driver's launch needs: the
    launch then goes through CuPy's, which makes one current."""
    rt, kernel, x, y, stream = scale
    launch, errors = _packed(scale, 0), []

    def run():
        try:
            launch(stream, np.float32(4))
            stream.synchronize()
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    assert float(y[3]) == 12.0


def test_launch_wave2d_packs_an_argument_set_once_and_keeps_it(gpu, small):
    U = [ch.device_zeros(small.shape) for _ in range(3)]
    V = ch.to_device(small.velocity)
    s = ch.create_streams(1, name="compute")[0]
    ch.launch_wave2d(U[0], U[1], U[2], V, small, 0, stream=s)
    checked = ch.wave._CHECKED[(id(small), *(id(a) for a in U), id(V))]
    first = checked.packed
    assert first is not None
    ch.launch_wave2d(U[0], U[1], U[2], V, small, 1, stream=s)
    assert checked.packed is first
    ch.synchronize()


def _stencil_levels(p, stream, launch):
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    levels = []
    for level in range(2, p.nt):
        n = level - 2
        launch(U[n % 3], U[(n + 1) % 3], U[level % 3], V, n)
        stream.synchronize()
        levels.append(ch.to_host(U[level % 3]))
    return np.stack(levels)


@pytest.mark.parametrize("stream", ["course stream", "default stream"])
def test_packed_launches_of_the_stencil_are_bit_identical_to_cupy_calls(gpu, stream):
    """A loop of packed launches on a three-buffer ring, against the same loop of CuPy's own
    RawKernel calls, level by level, on a stream of the course's and on the legacy default stream."""
    p = ch.WaveProblem(n0=64, n1=80, nt=30)
    s = ch.create_streams(1, name="compute")[0] if stream == "course stream" else ch.streams.resolve(None)
    packed = _stencil_levels(p, s, lambda U0, U1, U2, V, n: ch.launch_wave2d(U0, U1, U2, V, p, n, stream=s))
    scalars, grid = ch.wave._kernel_scalars_and_grid(p)
    called = _stencil_levels(p, s, lambda U0, U1, U2, V, n: gpu.launch(
        s.raw, ch.wave._gpu_kernel, grid, ch.wave._BLOCK, (U0, U1, U2, V, *scalars, p.source_amplitude(n))))
    assert np.abs(called).max() > 0
    np.testing.assert_array_equal(packed, called)


def test_prepared_launches_of_the_stencil_are_bit_identical_to_launch_wave2d(gpu):
    """One PreparedLaunch per position of a three-buffer ring, its first call through launch_wave2d
    and the rest through the packed launch, against launch_wave2d level by level."""
    p = ch.WaveProblem(n0=64, n1=80, nt=30)
    s = ch.create_streams(1, name="compute")[0]
    prepared = {}

    def launch(U0, U1, U2, V, n):
        if n % 3 not in prepared:
            prepared[n % 3] = ch.wave.PreparedLaunch(U0, U1, U2, V, p, s)
        prepared[n % 3](n)

    fast = _stencil_levels(p, s, launch)
    assert all(pl._packed is not None for pl in prepared.values())     # the packed path was taken
    plain = _stencil_levels(p, s, lambda U0, U1, U2, V, n: ch.launch_wave2d(U0, U1, U2, V, p, n, stream=s))
    assert np.abs(fast).max() > 0
    np.testing.assert_array_equal(fast, plain)


def test_a_prepared_launch_follows_a_change_to_its_problem(gpu):
    """After a first loop on the packed launches, the problem's dt and source change: the next
    calls prepare again, and the second loop is launch_wave2d's with the new numbers, bit for bit."""
    p = ch.WaveProblem(n0=64, n1=80, nt=30)
    s = ch.create_streams(1, name="compute")[0]
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    prepared = [ch.wave.PreparedLaunch(U[n], U[(n + 1) % 3], U[(n + 2) % 3], V, p, s) for n in range(3)]

    def loop():
        for u in U:
            ch.memory.zero_async(u, s)
        levels = []
        for n in range(p.nt - 2):
            prepared[n % 3](n)
            s.synchronize()
            levels.append(ch.to_host(U[(n + 2) % 3]))
        return np.stack(levels)
    first = loop()
    assert all(pl._packed is not None for pl in prepared)              # the packed path was taken
    p.dt *= 0.5
    p.source = (20, 30)
    changed = loop()
    plain = _stencil_levels(p, s, lambda U0, U1, U2, V, n: ch.launch_wave2d(U0, U1, U2, V, p, n, stream=s))
    assert np.abs(changed).max() > 0 and not np.array_equal(changed, first)
    np.testing.assert_array_equal(changed, plain)
