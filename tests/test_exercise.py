import threading

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


def cake_loop(stack, buffers, mistake=None):
    """The exercise's loop as a function for the checker; ``mistake`` drops or moves one dependency."""
    nplanes, nbuf = len(stack), len(buffers)
    (compute,) = ch.create_streams(1, name="compute")
    io = ch.create_streams(nbuf, name="io")
    baked, copied = ch.create_events(nbuf), ch.create_events(nbuf)

    def loop():
        for k in range(nplanes):
            b = k % nbuf
            if mistake == "host waits":
                io[b].synchronize()
            elif mistake not in ("no wait for copy", "wait for copy after bake"):
                compute.wait_event(copied[b])
            ch.bake_layer(buffers[b], k, compute)
            if mistake == "wait for copy after bake":
                compute.wait_event(copied[b])
            if mistake != "no record of bake":
                compute.record(baked[b])
            if mistake != "no wait for bake":
                io[b].wait_event(baked[b])
            if mistake == "record of copy before copy":
                io[b].record(copied[b])
            ch.copy_to_host_async(stack[k], buffers[b], io[b], level=k)
            if mistake not in ("no record of copy", "record of copy before copy", "host waits"):
                io[b].record(copied[b])
    return loop


def test_checker_runs_a_correct_loop(backend):
    stack, buffers = ch.pinned_empty((9, 16, 16)), [ch.device_empty((16, 16)) for _ in range(3)]
    assert ch.check_layer_cake(stack, loop=cake_loop(stack, buffers), buffers=buffers) == \
        "all 9 layers are correct"


@pytest.mark.parametrize("mistake", ["no wait for copy", "no record of bake", "no wait for bake",
                                     "no record of copy", "wait for copy after bake",
                                     "record of copy before copy"])
def test_every_missing_or_misplaced_dependency_fails_every_time(backend, mistake):
    for nplanes, n in ((6, 8), (24, 64)):                # any size: the sanitizer does not need luck
        stack, buffers = ch.pinned_empty((nplanes, n, n)), [ch.device_empty((n, n)) for _ in range(3)]
        with pytest.raises(ch.LayerCakeError, match="race") as info:
            ch.check_layer_cake(stack, loop=cake_loop(stack, buffers, mistake), buffers=buffers)
        msg = str(info.value)
        assert "buffers[" in msg and "wait" in msg and "np.int64" not in msg


def test_host_waits_inside_the_loop_break_rule_3(backend):
    stack, buffers = ch.pinned_empty((6, 8, 8)), [ch.device_empty((8, 8)) for _ in range(3)]
    with pytest.raises(ch.LayerCakeError, match="host waited inside the loop 6 times") as info:
        ch.check_layer_cake(stack, loop=cake_loop(stack, buffers, "host waits"), buffers=buffers)
    assert "(`io[b].synchronize()` x6)" in str(info.value)      # the line that waited


def test_checker_reads_the_stack_only_when_the_copies_are_done(backend):
    stack = ch.pinned_empty((2, 8, 8))
    io, = ch.create_streams(1, name="io")
    with pytest.raises(ch.RaceError, match="check_layer_cake"):
        with ch.sanitize():
            ch.copy_to_host_async(stack[1], ch.device_zeros((8, 8)), io)
            ch.check_layer_cake(stack)


def test_stored_tracebacks_of_the_exercise_show_no_machine_path():
    import json
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    for path in [root / "notebooks" / "08_exercise_layer_cake.ipynb"]:
        cells = json.loads(path.read_text())["cells"]
        tracebacks = ["\n".join(o.get("traceback", [])) for c in cells for o in c.get("outputs", [])
                      if o.get("output_type") == "error"]
        assert tracebacks, "the exercise notebook should store the unfinished loop's error"
        for tb in tracebacks:
            assert ".py" not in tb and "course_helper/" not in tb, tb


def _to_host_loop(stack, buffers):
    (compute,) = ch.create_streams(1, name="compute")

    def loop():
        for k in range(len(stack)):
            ch.bake_layer(buffers[k % len(buffers)], k, compute)
            stack[k] = ch.to_host(buffers[k % len(buffers)])
    return loop


def _polling_loop(stack, buffers):
    (compute,) = ch.create_streams(1, name="compute")
    io = ch.create_streams(1, name="io")[0]

    def loop():
        for k in range(len(stack)):
            ch.bake_layer(buffers[0], k, compute)
            io.wait_event(compute.record())
            ch.copy_to_host_async(stack[k], buffers[0], io, level=k)
            while not io.query():
                pass
    return loop


@pytest.mark.parametrize("make, line", [(_to_host_loop, "`stack[k] = ch.to_host(buffers[k % len(buffers)])` x5"),
                                        (_polling_loop, "`while not io.query():` x5")],
                         ids=["to_host", "polling"])
def test_every_host_blocking_call_in_the_loop_breaks_rule_3(backend, make, line):
    stack, buffers = ch.pinned_empty((6, 8, 8)), [ch.device_empty((8, 8)) for _ in range(2)]
    with pytest.raises(ch.LayerCakeError, match="host waited inside the loop 5 times") as info:
        ch.check_layer_cake(stack, loop=make(stack, buffers), buffers=buffers)
    assert line in str(info.value)


def _in_a_thread(body):
    errors = []

    def run():
        try:
            body()
        except ch.RaceError as err:            # also raised again when the checker's block ends
            errors.append(err)

    def loop():
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    return loop


def test_a_loop_queued_from_a_thread_is_checked(backend):
    stack, buffers = ch.pinned_empty((6, 8, 8)), [ch.device_empty((8, 8)) for _ in range(3)]
    with pytest.raises(ch.LayerCakeError, match="race") as info:
        ch.check_layer_cake(stack, loop=_in_a_thread(cake_loop(stack, buffers, "no wait for bake")),
                            buffers=buffers)
    assert "buffers[" in str(info.value)
    with pytest.raises(ch.LayerCakeError, match="host waited inside the loop 6 times"):
        ch.check_layer_cake(stack, loop=_in_a_thread(cake_loop(stack, buffers, "host waits")), buffers=buffers)
    assert ch.check_layer_cake(stack, loop=_in_a_thread(cake_loop(stack, buffers)), buffers=buffers) == \
        "all 6 layers are correct"
