"""The GPU stopwatch times with ``timing.benchmark``: on the modelled device (its spin replaced by a
long copy) it gives back the profile's kernel time; on a GPU it times the kernel itself."""
import pytest

import course_helper as ch
from course_helper.strategies import level_times
from course_helper.timelines.stopwatch import Stopwatch


def wave_launch(stream):
    p = ch.WaveProblem(256, 256, nt=3)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    return p, (lambda: ch.launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=stream))


def test_device_ms_is_one_call_of_work_queued_behind_the_spin(modelled_stopwatch):
    p, launch = wave_launch(modelled_stopwatch.s)
    calls = []
    ms = modelled_stopwatch.device_ms(lambda: calls.append(launch()), repeat=8)
    assert ms == pytest.approx(level_times(p).kernel_ms, abs=2e-6)
    assert len(calls) == 1 + 8                      # one untimed warm-up call, then the timed ones


@pytest.mark.gpu
def test_the_stopwatch_times_a_kernel_on_the_gpu(backend):
    if backend != "gpu":
        pytest.skip("measures the GPU")
    watch = Stopwatch()
    p, launch = wave_launch(watch.s)
    assert 0 < watch.device_ms(launch, repeat=10) < 1.0     # a 256^2 kernel: microseconds
    assert watch.host_us(launch, n=20) > 0
