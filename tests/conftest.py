"""Shared fixtures: every backend-dependent test runs on the CPU backend, and on
the GPU backend too when a GPU works here (skipped cleanly otherwise)."""
import gc
import os
import pathlib
import threading
import time

import matplotlib
import pytest

matplotlib.use("Agg")

import course_helper as ch  # noqa: E402


def _gpu_reason():
    return None if ch.runtime.gpu_available() else "no working CUDA GPU here (the GPU tests run on a GPU machine)"


@pytest.fixture(autouse=True)
def _keep_the_backend():
    """Whatever a test does to the backend (set_backend, the CLI's --backend), the next
    test starts on the backend the session chose."""
    chosen = ch.backend_name()
    yield
    if ch.backend_name() != chosen:
        ch.set_backend(chosen)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def backend(request):
    """Run the test on this backend, then restore the one chosen at start."""
    if request.param == "gpu":
        reason = _gpu_reason()
        if reason:
            pytest.skip(reason)
    previous = ch.backend_name()
    ch.set_backend(request.param)
    yield request.param
    ch.synchronize()
    ch.set_backend(previous)


@pytest.fixture
def cpu():
    """CPU backend only (tests of CPU-runtime semantics)."""
    previous = ch.backend_name()
    ch.set_backend("cpu")
    yield "cpu"
    ch.set_backend(previous)


@pytest.fixture
def gpu():
    """GPU backend only (tests of the GPU runtime's own pieces), skipped cleanly without a GPU;
    yields the GPU runtime."""
    reason = _gpu_reason()
    if reason:
        pytest.skip(reason)
    previous = ch.backend_name()
    ch.set_backend("gpu")
    yield ch.runtime.get()
    ch.synchronize()
    ch.set_backend(previous)


@pytest.fixture
def small():
    """A small problem that keeps the tests fast on any backend."""
    return ch.WaveProblem(n0=48, n1=48, nt=50)


def course_threads():
    """The live threads the course's package started (the disk pipeline's: see store.THREAD_NAMES),
    once the garbage is collected (a pipeline dropped without being finished stops its threads
    then). A collection only ends threads, and a full one costs a second in a large test
    process: where none of the course's threads is alive it is not needed."""
    def alive():
        return [t for t in threading.enumerate() if t.name.startswith(ch.disk.THREAD_NAMES) and t.is_alive()]

    if not alive():
        return []
    gc.collect()
    return alive()


def process_ends(pid, seconds=30):
    """Whether process ``pid`` is gone, or a zombie waiting to be reaped, within ``seconds``. A
    killed process closes its pipes before the kernel marks it a zombie, so on a busy machine it
    may still read as running for a moment after what killed it has returned."""
    stat = pathlib.Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + seconds
    while True:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def pytest_report_header(config):
    return (f"course_helper backend: {ch.backend_name()} "
            f"(COURSE_HELPER_BACKEND={os.environ.get('COURSE_HELPER_BACKEND', 'unset')})")


@pytest.fixture
def ctrl_c_at_copy(monkeypatch):
    """``ctrl_c_at_copy(call, deferred=True)``: a Ctrl-C at the ``call``-th copy of the modelled
    device, when it is queued, or while it runs (``deferred``: raised at once, as on a GPU; the
    copy, left pending, runs again whole when the device is next drained, so the Ctrl-C is
    one-shot, as a real one is)."""
    from course_helper.runtime import model
    real, calls = model._begin_copy, []

    def arm(call, deferred=True):
        def failing(dst, src):
            calls.append(1)
            if len(calls) != call:
                return real(dst, src)
            if not deferred:
                raise KeyboardInterrupt
            interrupted = []

            def begin():
                if not interrupted:
                    interrupted.append(1)
                    raise KeyboardInterrupt
                return real(dst, src)()
            return begin

        monkeypatch.setattr(model, "_begin_copy", failing)
    return arm


@pytest.fixture
def fault_at_launch(monkeypatch):
    """``fault_at_launch(call, fault)``: the ``call``-th wave kernel a strategy launches raises
    ``fault`` instead; returns the real ``launch_wave2d``, to put back mid-test."""
    from course_helper import strategies
    real, calls = strategies.launch_wave2d, []

    def arm(call, fault):
        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) == call:
                raise fault("simulated fault in the middle of the loop")
            return real(*args, **kwargs)

        monkeypatch.setattr(strategies, "launch_wave2d", flaky)
        return real
    return arm


@pytest.fixture
def modelled_stopwatch(cpu):
    """A GPU :class:`~course_helper.timelines.stopwatch.Stopwatch` on the CPU backend: its spin
    (a CUDA kernel, compiled by ``__init__``) is a 4 MiB copy on its stream, long next to a launch."""
    from course_helper.timelines.stopwatch import Stopwatch
    watch = Stopwatch.__new__(Stopwatch)
    (watch.s,) = ch.create_streams(1, name="calibrate")
    src, dst = ch.device_zeros(2**22), ch.pinned_empty(2**22)
    watch.hold = lambda ms=4.0: ch.copy_to_host_async(dst, src, watch.s)
    return watch
