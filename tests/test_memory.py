import numpy as np
import pytest

import course_helper as ch


def test_pinned_arrays_and_views_are_pinned(backend):
    a = ch.pinned_empty((4, 8))
    z = ch.memory.pinned_zeros(16, dtype=np.float64)
    assert a.shape == (4, 8) and a.dtype == np.float32
    assert z.dtype == np.float64 and np.all(z == 0)
    assert ch.is_pinned(a) and ch.is_pinned(z)
    assert ch.is_pinned(a[2]) and ch.is_pinned(a[1:3, 2:])
    assert not ch.is_pinned(np.empty((4, 8), np.float32))
    assert not ch.is_pinned(ch.device_zeros(3))
    assert not ch.is_pinned([1, 2, 3])


def test_pinned_registration_ends_with_the_array(cpu):
    a = ch.pinned_empty(1000)
    addr = a.ctypes.data
    del a
    b = np.empty(1000, np.float32)
    if b.ctypes.data == addr:      # the allocator reused the block: it must not look pinned
        assert not ch.is_pinned(b)


@pytest.mark.parametrize("bad", [-1, (2, -3), "many", (2.5,)])
def test_bad_shapes_are_refused(backend, bad):
    with pytest.raises((TypeError, ValueError)):
        ch.pinned_empty(bad)
    with pytest.raises((TypeError, ValueError)):
        ch.device_zeros(bad)


def test_async_round_trip_into_slices_of_a_pinned_stack(backend):
    rng = np.random.default_rng(0)
    planes = [rng.random((16, 24), dtype=np.float32) for _ in range(5)]
    dev = [ch.to_device(p) for p in planes]
    stack = ch.pinned_empty((5, 16, 24))
    stack.fill(np.nan)
    streams = ch.create_streams(2)
    for k, d in enumerate(dev):
        ch.copy_to_host_async(stack[k], d, streams[k % 2], level=k)
    ch.synchronize()
    np.testing.assert_array_equal(stack, np.stack(planes))
    back = ch.device_zeros((16, 24))
    ch.copy_to_device_async(back, stack[3], streams[0])
    other = ch.device_zeros((16, 24))
    ch.memory.copy_on_device_async(other, back, streams[0])
    streams[0].synchronize()
    np.testing.assert_array_equal(ch.to_host(other), planes[3])


def test_pageable_buffer_is_refused_with_the_reason(backend):
    src = ch.device_zeros(8)
    with pytest.raises(ValueError, match="pageable") as info:
        ch.copy_to_host_async(np.empty(8, np.float32), src)
    assert "pinned_empty" in str(info.value) and "returns only when the copy has finished" in str(info.value)
    with pytest.raises(ValueError, match="pageable"):
        ch.copy_to_device_async(src, np.zeros(8, np.float32))


def _busy_stream_then_copy(dst, src):
    """A stream kept busy for 0.2 s by a host function, then the copy into ``dst``; returns
    the stream, whether it was done right after the copy call returned, and the trace."""
    import time
    (s,) = ch.create_streams(1, name="io")
    with ch.tracing() as trace:
        s.launch_host_func(lambda: time.sleep(0.2))
        ch.copy_to_host_async(dst, src, s, allow_pageable=True)
        done_at_return = s.done
        ch.synchronize()
    return s, done_at_return, trace


def test_a_pageable_copy_on_request_returns_only_when_it_has_finished(backend):
    """cudaMemcpyAsync into pageable memory blocks the host until the copy is done (on a GPU
    really, on the CPU backend as modelled); a pinned target, for contrast, returns at once."""
    x = np.arange(4 * 2**20, dtype=np.float32)
    src = ch.to_device(x)
    pageable = np.full_like(x, -1)
    s, done_at_return, trace = _busy_stream_then_copy(pageable, src)
    assert done_at_return, "the call returned before the copy (and the work before it) had finished"
    np.testing.assert_array_equal(pageable, x)
    assert [e.name for e in trace.of_kind("host wait")] == ["pageable copy"]
    _, pinned_done_at_return, pinned_trace = _busy_stream_then_copy(ch.pinned_empty(x.shape), src)
    assert not pinned_done_at_return and not pinned_trace.of_kind("host wait")
    with pytest.raises(ValueError, match="pageable"):           # the default is still the refusal
        ch.copy_to_host_async(pageable, src, s)


def test_the_modelled_host_waits_for_a_pageable_copy_on_its_timeline(cpu):
    from course_helper.runtime import model
    from course_helper import runtime
    rt = runtime.get()
    (s,) = ch.create_streams(1)
    n = 4 * 2**20
    src, dst = ch.device_zeros(n), np.empty(n, np.float32)
    with ch.tracing() as trace:
        t0 = rt.host_ms()
        ch.copy_to_host_async(dst, src, s, allow_pageable=True)
        waited = rt.host_ms() - t0
    assert waited >= model.link_ms(rt.profile, "D2H_pageable", 4 * n)   # the host's clock covers the copy
    (copy,), (wait,) = trace.copies, trace.of_kind("host wait")
    assert copy.duration_ms >= model.link_ms(rt.profile, "D2H_pageable", 4 * n) * (1 - 1e-6)
    assert wait.track == "host" and wait.name == "pageable copy"
    assert wait.start_ms <= copy.start_ms and wait.end_ms == pytest.approx(copy.end_ms, abs=1e-5)
    assert trace.clock                                              # labelled modelled


def test_mismatches_are_refused_before_anything_is_queued(backend):
    (s,) = ch.create_streams(1)
    src = ch.device_zeros((4, 4))
    with pytest.raises(ValueError, match="shape mismatch"):
        ch.copy_to_host_async(ch.pinned_empty((4, 5)), src, s)
    with pytest.raises(ValueError, match="dtype mismatch"):
        ch.copy_to_host_async(ch.pinned_empty((4, 4), np.float64), src, s)
    wide = ch.pinned_empty((4, 8))
    with pytest.raises(ValueError, match="not C-contiguous"):
        ch.copy_to_host_async(wide[:, ::2], src, s)
    with pytest.raises(TypeError, match="device array but a host"):
        ch.copy_to_host_async(ch.device_zeros((4, 4)), src, s)
    with pytest.raises(TypeError, match="host .NumPy. array but a device"):
        ch.copy_to_host_async(ch.pinned_empty((4, 4)), np.zeros((4, 4), np.float32), s)
    with pytest.raises(TypeError, match="device array but a host"):
        ch.to_device(src)
    with pytest.raises(TypeError, match="device array is expected"):
        ch.to_host(np.zeros(3))
    with pytest.raises(TypeError, match="Stream"):
        ch.copy_to_host_async(ch.pinned_empty((4, 4)), src, stream="io")
    assert s.done                    # nothing was queued


def test_read_only_host_targets_are_refused_before_anything_is_queued(backend):
    (s,) = ch.create_streams(1)
    src = ch.to_device(np.ones((4, 4), np.float32))
    frozen = ch.memory.pinned_zeros((4, 4))
    frozen.flags.writeable = False
    stack = ch.memory.pinned_zeros((3, 4, 4))
    frozen_view = stack[1]
    frozen_view.flags.writeable = False
    for dst in (frozen, frozen_view):
        with pytest.raises(ValueError, match="read-only"):
            ch.copy_to_host_async(dst, src, s)
        with pytest.raises(ValueError, match="read-only"):
            ch.memory.copy_to_host(dst, src, s)
    assert s.done                    # nothing was queued
    ch.synchronize()                 # and nothing fails later
    assert not frozen.any() and not stack.any()


def test_blocking_copy_accepts_pageable_memory(backend):
    x = np.arange(10, dtype=np.float32)
    out = np.empty(10, np.float32)
    ch.memory.copy_to_host(out, ch.to_device(x))
    np.testing.assert_array_equal(out, x)


def test_bandwidth_helper_reports_pinned_and_pageable(backend):
    rows = ch.measure_bandwidth(sizes_mib=(1, 8), repeats=2)
    assert [(r["size_mib"], r["memory"]) for r in rows] == [
        (1, "pinned"), (1, "pageable"), (8, "pinned"), (8, "pageable")]
    for r in rows:
        assert r["correct"] and r["gb_per_s"] > 0
        if r["memory"] == "pageable":
            assert r["returned_early"] == 0      # a pageable "async" copy never returns early
    if backend == "gpu":
        assert all(r["returned_early"] > 0 for r in rows if r["memory"] == "pinned")


@pytest.mark.parametrize("sizes,repeats,err", [((), 2, ValueError), ((-1,), 2, ValueError),
                                               (3, 2, TypeError), ((1,), 0, ValueError)])
def test_bandwidth_helper_bad_input(backend, sizes, repeats, err):
    with pytest.raises(err):
        ch.measure_bandwidth(sizes, repeats=repeats)


# -- the copy checks, with strided and non-contiguous sources and targets ------------
def _pinned(shape):
    return ch.memory.pinned_zeros(shape)


def _device(shape):
    return ch.device_zeros(shape)


def _pageable(shape):
    return np.zeros(shape, np.float32)


#: (copy function, its destination, its source, the side refused): each side strided or transposed in
#: turn, the other side a fitting contiguous array. A strided view has the right shape and dtype,
#: so only the layout check can refuse it.
NON_CONTIGUOUS = [
    ("copy_to_host_async", lambda: _pinned((4, 8))[:, ::2], lambda: _device((4, 4)), "destination"),
    ("copy_to_host_async", lambda: _pinned((4, 4)), lambda: _device((4, 8))[:, ::2], "source"),
    ("copy_to_host_async", lambda: _pinned((4, 4)).T, lambda: _device((4, 4)), "destination"),
    ("copy_to_host_async", lambda: _pinned((4, 4)), lambda: _device((4, 4)).T, "source"),
    ("copy_to_host_async", lambda: _pinned(8)[::-1], lambda: _device(8), "destination"),
    ("copy_to_host_async", lambda: _pinned(8), lambda: _device(16)[::2], "source"),
    ("copy_to_device_async", lambda: _device((4, 8))[:, ::2], lambda: _pinned((4, 4)), "destination"),
    ("copy_to_device_async", lambda: _device((4, 4)), lambda: _pinned((4, 8))[:, ::2], "source"),
    ("copy_to_device_async", lambda: _device((4, 4)), lambda: _pinned((4, 4)).T, "source"),
    ("copy_on_device_async", lambda: _device((4, 8))[:, ::2], lambda: _device((4, 4)), "destination"),
    ("copy_on_device_async", lambda: _device((4, 4)), lambda: _device((4, 8))[:, 1::2], "source"),
    ("copy_on_device_async", lambda: _device((4, 4)), lambda: _device((4, 4)).T, "source"),
    ("copy_to_host", lambda: _pageable((4, 8))[:, ::2], lambda: _device((4, 4)), "destination"),
    ("copy_to_host", lambda: _pageable((4, 4)), lambda: _device((4, 8))[:, ::2], "source"),
]


@pytest.mark.parametrize("copy,make_dst,make_src,side", NON_CONTIGUOUS,
                         ids=[f"{c}-{side}-{i}" for i, (c, _, _, side) in enumerate(NON_CONTIGUOUS)])
def test_strided_and_transposed_sides_are_refused_before_anything_is_queued(backend, copy, make_dst, make_src, side):
    (s,) = ch.create_streams(1)
    dst, src = make_dst(), make_src()
    with pytest.raises(ValueError, match=f"the {side} is not C-contiguous"):
        getattr(ch.memory, copy)(dst, src, s)
    assert s.done                    # nothing was queued
    if copy == "copy_to_host_async":     # and the loops' quick acceptance does not take it either
        assert ch.memory._usual_host_target(dst, src, s) is None


def test_the_quick_acceptance_takes_only_the_usual_valid_copy(backend):
    """copy_to_host_async accepts the loops' copy in a few operations and runs the full checks on
    anything else: the quick test must say None wherever the checks would refuse (or, for a
    pageable target, take the blocking path), and give the target's address where they accept."""
    (s,) = ch.create_streams(1)
    src = ch.device_zeros((4, 4))
    stack = ch.memory.pinned_zeros((3, 4, 4))
    assert ch.memory._usual_host_target(stack[1], src, s) == stack[1].ctypes.data
    frozen = ch.memory.pinned_zeros((4, 4))
    frozen.flags.writeable = False
    refused = {"pageable": np.zeros((4, 4), np.float32), "read-only": frozen,
               "other shape": ch.memory.pinned_zeros((4, 5)), "other dtype": ch.memory.pinned_zeros((4, 4), np.float64),
               "device target": ch.device_zeros((4, 4)), "empty": ch.memory.pinned_zeros((0, 4))}
    for what, dst in refused.items():
        source = src if what != "empty" else ch.device_zeros((0, 4))
        assert ch.memory._usual_host_target(dst, source, s) is None, what
    assert ch.memory._usual_host_target(ch.memory.pinned_zeros((4, 4)), np.zeros((4, 4), np.float32), s) is None


def test_an_array_reaching_past_a_pinned_allocation_is_not_pinned(cpu):
    """Pinned means every byte is pinned: a view one byte longer than its pinned allocation is not."""
    block = ch.memory.pinned_zeros(16, dtype=np.uint8)
    assert ch.is_pinned(block) and ch.is_pinned(block[15:])
    longer = np.lib.stride_tricks.as_strided(block, shape=(17,))      # addresses only: never read
    assert not ch.is_pinned(longer)
    assert not ch.is_pinned(np.lib.stride_tricks.as_strided(block[15:], shape=(2,)))


def test_a_read_only_pageable_target_is_refused_even_on_request(backend):
    (s,) = ch.create_streams(1)
    frozen = np.zeros((4, 4), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ch.copy_to_host_async(frozen, ch.device_zeros((4, 4)), s, allow_pageable=True)
    assert s.done


def test_device_copies_between_ranges_one_byte_apart_or_overlapping(backend):
    """Half-open byte ranges: touching slices copy; slices sharing one byte are refused."""
    (s,) = ch.create_streams(1)
    buf = ch.to_device(np.arange(16, dtype=np.uint8))
    ch.memory.copy_on_device_async(buf[0:8], buf[8:16], s)
    ch.memory.copy_on_device_async(buf[8:16], buf[0:8], s)
    for dst, src in ((buf[0:8], buf[7:15]), (buf[7:15], buf[0:8])):
        with pytest.raises(ValueError, match="overlap"):
            ch.memory.copy_on_device_async(dst, src, s)
    assert ch.to_host(buf).tolist() == list(range(8, 16)) * 2


def test_a_blocking_copy_is_charged_the_link_of_its_host_memory(cpu):
    """copy_to_host into pageable memory takes the pageable link's time on the model, into pinned
    memory the pinned link's (the two differ in every profile)."""
    rt = ch.runtime.get()
    src = ch.device_zeros(2**20)
    took = {}
    for link, dst in (("D2H_pageable", np.empty(2**20, np.float32)), ("D2H", ch.pinned_empty(2**20))):
        with ch.tracing() as trace:
            ch.memory.copy_to_host(dst, src)
        (copy,) = trace.copies
        took[link] = copy.duration_ms
        assert copy.duration_ms == pytest.approx(ch.runtime.model.link_ms(rt.profile, link, src.nbytes), rel=1e-4)
    assert took["D2H_pageable"] != took["D2H"]
