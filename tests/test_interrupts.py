"""Ctrl-C inside a run streamed to a store leaves no thread of the course alive and the process
usable: the next plain solve gives the reference result.

The Ctrl-Cs are real SIGINTs (``signal.pthread_kill`` to the main thread, as a terminal's Ctrl-C
lands), sent by a thread of the test in a burst: the first one stops the run somewhere in its
loop, the next ones land in its clean-up (the sink's stop, the drain, the ExitStack's unwinding).
Where each lands differs from run to run; what is asserted holds wherever it lands.
"""
import _thread
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest

import course_helper as ch
from course_helper import disk
from course_helper.timelines import recording
from conftest import course_threads

#: Every strategy that can stream to a store (the graph strategies cannot); two of them also with
#: the chunks compressed on the (modelled) device, whose ring and pipeline differ.
STORE_STRATEGIES = tuple(name for name, entry in ch.strategies.STRATEGIES.items() if not entry.graph)


@pytest.fixture(autouse=True)
def _cpu():
    ch.set_backend("cpu")


def _problem():
    return ch.WaveProblem(n0=32, n1=32, nt=30)


class _CtrlCs:
    """A burst of ``count`` Ctrl-Cs to the main thread from a thread of the test, the first after
    ``first_s`` seconds, then one every ``gap_s`` seconds: SIGINTs (``signal.pthread_kill``), or
    ``_thread.interrupt_main()``, which runs the SIGINT handler as a SIGINT would.

    Inside the block, a Ctrl-C is Python's (``KeyboardInterrupt``) wherever ``solve`` runs, and
    dropped elsewhere: the test itself is never interrupted (the ones that come after the run
    has ended are counted in ``late``). The course's code treats any Python handler as it treats
    Python's own (it holds or defers the signal, then hands it on to the handler it found)."""

    def __init__(self, first_s, gap_s, count, how):
        self.late = 0
        main = threading.main_thread().ident
        send_one = {"SIGINT": lambda: signal.pthread_kill(main, signal.SIGINT),
                    "interrupt_main": _thread.interrupt_main}[how]

        def send():
            time.sleep(first_s)
            for _ in range(count):
                send_one()
                time.sleep(gap_s)
        self.thread = threading.Thread(target=send, name="test ctrl-c sender", daemon=True)

    def _handle(self, signum, frame):
        caller = sys._getframe(1)            # where it would be raised: in a frame of solve's, or not
        while caller is not None and caller.f_code is not SOLVE:
            caller = caller.f_back
        if caller is None:
            self.late += 1
            return
        raise KeyboardInterrupt

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self._handle)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.thread.join()
        time.sleep(0.02)                     # a SIGINT sent last reaches this thread, and is dropped
        signal.signal(signal.SIGINT, self.previous)
        return False


SOLVE = ch.solver.solve.__code__


def _run_interrupted(problem, strategy, path, compress, first_s, rng, how):
    """One run to ``path`` under a burst of Ctrl-Cs: the KeyboardInterrupt that stopped it, or None
    if it finished first. Any other error fails the test."""
    with _CtrlCs(first_s, gap_s=rng.uniform(0.0002, 0.002), count=30, how=how):
        try:
            ch.solve(problem, strategy, trace=rng.random() < 0.5, store=path, compress=compress)
        except KeyboardInterrupt as stopped:
            return stopped
    return None


def _threads_alive_now():
    """The course's threads alive now, with no garbage collected: a notebook keeps the last error's
    traceback (and so the interrupted run's frames) alive, so its threads must end without one."""
    return [t for t in threading.enumerate() if t.name.startswith(disk.THREAD_NAMES) and t.is_alive()]


@pytest.mark.parametrize("strategy, compress", [(name, None) for name in STORE_STRATEGIES]
                         + [("events", "gpu-zstd"), ("staged", "gpu-zstd")])
def test_ctrl_cs_in_a_store_run_leave_no_thread_and_a_usable_process(tmp_path, strategy, compress):
    _check_ctrl_cs_in_store_runs(tmp_path, strategy, compress)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy, compress", [("events", None), ("staged", None), ("staged", "gpu-zstd")])
def test_ctrl_cs_in_a_store_run_on_the_gpu(gpu, tmp_path, strategy, compress):
    """The same on a GPU: the writers wait for real copies there, and nvCOMP's stage (where it
    starts) has a thread of its own."""
    _check_ctrl_cs_in_store_runs(tmp_path, strategy, compress)


def _check_ctrl_cs_in_store_runs(tmp_path, strategy, compress):
    """Three runs of ``strategy`` to a store under bursts of Ctrl-Cs, the first one landing in
    each third of a run in turn; after each: no thread of the course alive, no timeline left
    recording, the store's state a truthful one, and a plain solve gives the reference result."""
    problem = _problem()
    reference = ch.solve(problem, strategy, trace=False).images
    start = time.perf_counter()
    ch.solve(problem, strategy, trace=False, store=tmp_path / "whole.zarr", compress=compress)
    whole_s = time.perf_counter() - start            # (only to spread the first Ctrl-C over a run)
    rng = random.Random(f"{strategy} {compress}")      # varied points, the same on every run of the test

    def interrupted_run(i, first_s):
        path = tmp_path / f"run{i}.zarr"
        stopped = _run_interrupted(problem, strategy, path, compress, first_s, rng,
                                   how="SIGINT" if i % 2 == 0 else "interrupt_main")
        # (``stopped`` holds the run's frames, as a notebook's last traceback does)
        assert not _threads_alive_now(), f"alive after run {i}, its error kept: {_threads_alive_now()}"
        stopped = stopped is not None
        assert not course_threads(), f"alive after run {i}: {course_threads()}"
        assert recording.current() is None                  # no timeline left recording
        if path.exists():                                    # (a store that keeps nothing is removed)
            assert disk.open_store(path).state in ("failed", "finished")
        again = ch.solve(problem, strategy, trace=True)      # the process is usable
        np.testing.assert_array_equal(again.images, reference)
        return stopped

    # One in each third of the run; a loaded machine can stretch or shrink a run past its burst, so
    # until one run has been stopped, more runs follow with the burst from their start.
    stopped = sum(interrupted_run(i, whole_s * (i + rng.random()) / 3) for i in range(3))
    for i in range(3, 9):
        if stopped:
            break
        stopped += interrupted_run(i, 0.0)
    assert stopped, "no Ctrl-C came while a run was going, in 9 runs"


# -- the modelled device: a Ctrl-C never lands inside its bookkeeping -----------------------
def test_a_ctrl_c_in_modelled_work_waits_for_the_devices_next_step(monkeypatch):
    """A SIGINT that comes while the modelled device runs an operation's NumPy work (or moves a
    task between its queues) is raised at the device's next step: the work it came in runs to its
    end, the KeyboardInterrupt reaches the host, and the device goes on with what is queued."""
    real, sent, finished = ch.exercises.layer_values, [], []

    def interrupted(k, shape):
        if k == 3 and not sent:
            sent.append(k)
            signal.raise_signal(signal.SIGINT)          # Python runs its handler here, at once
        values = real(k, shape)
        finished.append(k)
        return values

    monkeypatch.setattr(ch.exercises.layer_cake, "layer_values", interrupted)
    (s,) = ch.create_streams(1)
    planes = [ch.device_zeros((8, 8)) for _ in range(6)]
    with pytest.raises(KeyboardInterrupt):
        for k, plane in enumerate(planes):
            ch.bake_layer(plane, k, s)
        s.synchronize()
    assert 3 in finished                                 # the layer it came in was baked whole
    s.synchronize()
    for k in finished:
        np.testing.assert_array_equal(ch.to_host(planes[k]), real(k, (8, 8)))


def test_a_ctrl_c_stops_a_host_function_at_once():
    """A learner's host function may never return: a Ctrl-C stops it where it is, and its stream
    reports it as interrupted."""
    (s,) = ch.create_streams(1)
    reached = []

    def endless():
        signal.raise_signal(signal.SIGINT)
        reached.append("after the Ctrl-C")              # never: the KeyboardInterrupt came first

    with pytest.raises(KeyboardInterrupt):
        s.launch_host_func(endless)                      # (an idle stream runs it right away)
        s.synchronize()
    assert not reached
    with pytest.raises(RuntimeError, match="interrupted"):
        s.synchronize()
    s.synchronize()                                      # told once: the stream is usable again
