"""Calibration's event-timed measurements, run on the modelled device where they have an exact
answer (the profile the model was built from), and on a GPU."""
import pytest

from course_helper import runtime
from course_helper.measure import calibrate
from course_helper.timelines.stopwatch import Stopwatch


def test_the_wake_up_measured_on_the_model_is_the_profiles(modelled_stopwatch):
    wake, after, unhurried = calibrate._wake(modelled_stopwatch, n=3)
    assert len(after) == len(unhurried) == 3
    assert wake == pytest.approx(runtime.get().profile["host_us"]["wake"], abs=4e-3)


@pytest.mark.gpu
def test_the_wake_up_is_measured_on_the_gpu(backend):
    if backend != "gpu":
        pytest.skip("measures the GPU")
    wake, after, unhurried = calibrate._wake(Stopwatch(), n=10)
    assert len(after) == len(unhurried) == 10 and min(after + unhurried) > 0 and wake >= 0


def test_calibration_refuses_the_cpu_backend(cpu):
    with pytest.raises(RuntimeError, match="measures a real GPU"):
        calibrate.calibrate(progress=lambda _: None)
