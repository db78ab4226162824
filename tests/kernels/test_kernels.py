"""A kernel of your own on a course stream (ch.kernels.RawKernel), frames streamed to the device
from a pinned input ring (ch.memory.InputRing), and the NVTX ranges named as on timelines."""
import importlib
import types

import numpy as np
import pytest

import course_helper as ch
from course_helper.kernels import RawKernel
from course_helper.runtime import nvtx_ranges, observe

SAXPY = r"""
extern "C" __global__ void saxpy(const float* x, const float* y, float* out, const float a, const int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + y[i];
}
"""


def saxpy_numpy(x, y, out, a, n):
    np.add(a * x[:n], y[:n], out=out[:n])


@pytest.fixture
def saxpy():
    return RawKernel(SAXPY, "saxpy", numpy=saxpy_numpy, options=("--fmad=false",))


def test_a_kernel_of_your_own_gives_the_same_answer_on_both_backends(backend, saxpy):
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((2, 1000)).astype(np.float32)
    out = ch.device_zeros(1000)
    saxpy(4, 256, (ch.to_device(x), ch.to_device(y), out, np.float32(0.5), np.int32(1000)), writes=(out,))
    np.testing.assert_array_equal(ch.to_host(out), np.float32(0.5) * x + y)


def test_its_launches_are_named_on_timelines_by_level(backend, saxpy):
    x, out = ch.device_zeros(64), ch.device_zeros(64)
    (s,) = ch.create_streams(1, name="compute")
    with ch.tracing() as t:
        for level in (7, 8):
            saxpy(1, 64, (x, x, out, np.float32(1), np.int32(64)), stream=s, writes=(out,), level=level)
        saxpy(1, 64, (x, x, out, np.float32(1), np.int32(64)), stream=s, writes=(out,))
        ch.synchronize()
    assert [(e.name, e.track, e.level) for e in t.kernels] == [
        ("saxpy level 7", "compute", 7), ("saxpy level 8", "compute", 8), ("saxpy", "compute", None)]


def test_the_sanitizer_sees_what_it_reads_and_writes(backend, saxpy):
    x, out = ch.device_zeros(64), ch.device_zeros(64)
    host = ch.pinned_empty(64)
    compute, io = ch.create_streams(2)
    with pytest.raises(ch.RaceError, match="saxpy level 1") as info:
        with ch.sanitize(names={"out": out}):
            saxpy(1, 64, (x, x, out, np.float32(1), np.int32(64)), stream=compute, writes=(out,), level=1)
            ch.copy_to_host_async(host, out, io)          # nothing orders the copy after the kernel
    assert "writes out" in str(info.value) and "reads out" in str(info.value)
    with ch.sanitize():                                     # reading the same input on two streams is fine
        scratch = ch.device_zeros(64)                       # kept until the work that reads it is done
        saxpy(1, 64, (x, x, out, np.float32(1), np.int32(64)), stream=compute, writes=(out,))
        saxpy(1, 64, (x, x, scratch, np.float32(1), np.int32(64)), stream=io, writes=())
        ch.synchronize()


def test_the_model_times_it_as_the_stencil_for_its_bytes(cpu, saxpy):
    n = 1 << 20
    x, out = ch.device_zeros(n), ch.device_zeros(n)
    with ch.tracing() as t:
        saxpy(n // 256, 256, (x, x, out, np.float32(1), np.int32(n)), writes=(out,))
        ch.synchronize()
    profile = ch.runtime.get().profile
    expected_us = ch.runtime.model.kernel_us(profile, ch.kernels.MODEL_SHAPE, 3 * 4 * n)
    assert t.kernels[0].duration_ms == pytest.approx(expected_us * 1e-3, abs=1e-6)   # to a tick


@pytest.mark.parametrize("call, error, words", [
    (lambda k, x, o: k(1, 64, (x, o, 1.0, 64), writes=(o,)), TypeError, "NumPy scalars"),
    (lambda k, x, o: k(1, 64, (np.zeros(64, np.float32), o, np.float32(1), np.int32(64)), writes=(o,)),
     TypeError, r"host \(NumPy\) array"),
    (lambda k, x, o: k(1, 64, (x, o, np.float32(1), np.int32(64)), writes=(ch.device_empty(64),)),
     ValueError, "not one of saxpy's arguments"),
    (lambda k, x, o: k((1, 1, 1, 1), 64, (x, o, np.float32(1), np.int32(64)), writes=(o,)), TypeError, "one to three"),
    (lambda k, x, o: k(1, (64, 32), (x, o, np.float32(1), np.int32(64)), writes=(o,)), ValueError, "at most 1024"),
    (lambda k, x, o: k(0, 64, (x, o, np.float32(1), np.int32(64)), writes=(o,)), ValueError, "grid"),
    (lambda k, x, o: k(1, 64, (x.reshape(8, 8)[:, ::2], o, np.float32(1), np.int32(64)), writes=(o,)),
     ValueError, "C-contiguous"),
    (lambda k, x, o: k(1, 64, [x, o, np.float32(1)][0], writes=(o,)), TypeError, "tuple of the kernel's arguments"),
], ids=["python number", "host array", "writes not an argument", "4-d grid", "block too large", "empty grid",
        "strided view", "args not a tuple"])
def test_bad_launches_are_refused_before_anything_is_queued(backend, saxpy, call, error, words):
    x, out = ch.device_zeros(64), ch.device_zeros(64)
    (s,) = ch.create_streams(1)
    with s:                                           # the launches would go to s
        with pytest.raises(error, match=words):
            call(saxpy, x, out)
    assert s.done


def test_a_kernel_needs_its_source_and_a_numpy_twin():
    with pytest.raises(ValueError, match="defines the kernel 'saxpy'"):
        RawKernel("extern \"C\" __global__ void other() {}", "saxpy", numpy=saxpy_numpy)
    with pytest.raises(TypeError, match="in NumPy"):
        RawKernel(SAXPY, "saxpy", numpy=None)
    with pytest.raises(ValueError, match="no kernel 'nope'"):
        ch.kernels.source("nope")
    assert "wave2d_4o" in ch.kernels.source("wave2d_4o") == ch.kernel_source()


# -- the pinned input ring ------------------------------------------------------------------------
def test_an_input_ring_streams_its_frames_round_and_round(backend):
    frames = np.arange(3 * 4 * 4, dtype=np.float32).reshape(3, 4, 4)
    ring = ch.memory.InputRing(frames)
    assert ch.is_pinned(ring[0]) and len(ring) == 3
    dst = [ch.device_zeros((4, 4)) for _ in range(2)]
    (upload,) = ch.create_streams(1, name="upload")
    with ch.tracing() as t:
        for j in range(5):
            ring.copy_to_device_async(dst[j % 2], j, upload)
        ch.synchronize()
    assert [(e.kind, e.name, e.level) for e in t.copies] == [("H2D", f"H2D level {j}", j) for j in range(5)]
    np.testing.assert_array_equal(ch.to_host(dst[0]), frames[4 % 3])
    np.testing.assert_array_equal(ch.to_host(dst[1]), frames[3 % 3])


def test_no_host_write_can_change_a_frame_a_copy_may_read(backend):
    frames = np.ones((2, 4, 4), np.float32)
    ring = ch.memory.InputRing(frames)
    frames[0] = 7                                     # the ring holds its own copy
    assert ring[0][0, 0] == 1
    with pytest.raises(ValueError, match="read-only"):
        ring[0][0, 0] = 2


def test_an_input_ring_refuses_what_is_no_stack_of_frames(backend):
    with pytest.raises(ValueError, match="at least one frame"):
        ch.memory.InputRing(np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="device array"):
        ch.memory.InputRing(ch.device_zeros((2, 4, 4)))
    with pytest.raises(ValueError, match="at least 0"):
        ch.memory.InputRing(np.zeros((2, 4, 4), np.float32))[-1]


def test_a_missing_wait_for_an_uploaded_frame_is_a_race(backend, saxpy):
    ring = ch.memory.InputRing(np.ones((2, 64), np.float32))
    feed, out = ch.device_zeros(64), ch.device_zeros(64)
    upload, compute = ch.create_streams(2)
    with pytest.raises(ch.RaceError, match="H2D copy of level 0"):
        with ch.sanitize():
            ring.copy_to_device_async(feed, 0, upload)
            saxpy(1, 64, (feed, feed, out, np.float32(1), np.int32(64)), stream=compute, writes=(out,))


# -- NVTX ---------------------------------------------------------------------------------------------
def test_ranges_are_on_only_under_a_profiler_or_when_asked():
    assert not nvtx_ranges.wanted({})
    assert nvtx_ranges.wanted({"NVTX_INJECTION64_PATH": "/opt/nsys/libToolsInjection64.so"})
    assert not nvtx_ranges.wanted({"NVTX_INJECTION64_PATH": "/x.so", "COURSE_HELPER_NVTX": "0"})
    assert nvtx_ranges.wanted({"COURSE_HELPER_NVTX": "1"})


def test_without_a_profiler_nothing_listens_and_work_is_queued_as_before(monkeypatch):
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("COURSE_HELPER_NVTX", raising=False)
    assert nvtx_ranges.active() is None and nvtx_ranges.start() is None
    assert not observe.wants_ops() and not observe.hears("op_queued")


def test_under_a_profiler_every_operation_is_a_range_named_as_on_timelines(cpu, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        push_range=lambda message, color, domain: calls.append(("push", message, domain)),
        pop_range=lambda domain: calls.append(("pop", domain)),
        mark=lambda message, color, domain: calls.append(("mark", message, domain)))
    monkeypatch.setattr(importlib, "import_module", lambda name: fake if name == "nvtx" else None)
    try:
        assert nvtx_ranges.start({"NVTX_INJECTION64_PATH": "/x.so"}) is nvtx_ranges.active() is not None
        problem = ch.WaveProblem(16, 16, nt=4)
        U = [ch.device_zeros(problem.shape) for _ in range(3)]
        host = ch.pinned_empty(problem.shape)
        (s,) = ch.create_streams(1, name="compute")
        ch.launch_wave2d(U[0], U[1], U[2], ch.to_device(problem.velocity), problem, 0, stream=s)
        ch.copy_to_host_async(host, U[2], s, level=2)
        s.synchronize()
    finally:
        nvtx_ranges.stop()
    assert calls == [("push", "wave2d_4o level 2", "course_helper"), ("pop", "course_helper"),
                     ("push", "D2H level 2", "course_helper"), ("pop", "course_helper"),
                     ("mark", "wait for compute", "course_helper")]
    assert nvtx_ranges.active() is None and not observe.wants_ops()
