import numpy as np
import pytest

import course_helper as ch


def bake_and_copy(nplanes, shape, nbuf):
    """A reference solution of the exercise (the notebook's solution has the same shape)."""
    stack = ch.pinned_empty((nplanes, *shape))
    stack.fill(np.nan)
    buf = [ch.device_empty(shape) for _ in range(nbuf)]
    (compute,) = ch.create_streams(1, name="compute")
    io = ch.create_streams(nbuf, name="io")
    baked, copied = ch.create_events(nbuf), ch.create_events(nbuf)
    for k in range(nplanes):
        b = k % nbuf
        compute.wait_event(copied[b])
        ch.bake_layer(buf[b], k, compute)
        compute.record(baked[b])
        io[b].wait_event(baked[b])
        ch.copy_to_host_async(stack[k], buf[b], io[b], level=k)
        io[b].record(copied[b])
    ch.synchronize()
    return stack


def test_layer_values_are_what_the_kernel_bakes(backend):
    plane = ch.device_empty((20, 30))
    ch.bake_layer(plane, 7)
    np.testing.assert_array_equal(ch.to_host(plane), ch.exercise.layer_values(7, (20, 30)))


def test_a_correct_cake_passes(backend):
    stack = bake_and_copy(12, (32, 48), nbuf=3)
    assert ch.check_layer_cake(stack) == "all 12 layers are correct"


def test_checker_names_missing_and_swapped_planes(cpu):
    stack = bake_and_copy(6, (8, 8), nbuf=2)
    stack[2] = np.nan
    stack[4] = ch.exercise.layer_values(5, (8, 8))
    with pytest.raises(ch.exercise.LayerCakeError) as info:
        ch.check_layer_cake(stack)
    msg = str(info.value)
    assert "plane 2 was never" in msg and "plane 4 holds layer 5" in msg and "wait_event" in msg


def test_checker_refuses_device_and_misshaped_stacks(backend):
    with pytest.raises(ch.exercise.LayerCakeError, match="still on the device"):
        ch.check_layer_cake(ch.device_zeros((2, 4, 4)))
    with pytest.raises(ch.exercise.LayerCakeError, match="3D"):
        ch.check_layer_cake(np.zeros((4, 4)))
    with pytest.raises(ch.exercise.LayerCakeError, match="has 2 planes"):
        ch.check_layer_cake(np.zeros((2, 4, 4)), nplanes=3)


def test_pageable_stack_is_mentioned(cpu):
    stack = np.stack([ch.exercise.layer_values(k, (4, 4)) for k in range(3)])
    assert "not pinned" in ch.check_layer_cake(stack)


def test_bake_layer_bad_input(backend):
    with pytest.raises(TypeError, match="device array"):
        ch.bake_layer(np.zeros((4, 4), np.float32), 0)
    with pytest.raises(ValueError, match="2D float32"):
        ch.bake_layer(ch.device_zeros((2, 4, 4)), 0)
    with pytest.raises(ValueError, match="at least 0"):
        ch.bake_layer(ch.device_zeros((4, 4)), -1)
