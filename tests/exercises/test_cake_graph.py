"""ch.exercises.check_cake_graph, notebook 10's exercise: right captures pass, wrong ones are
refused with the reason, on both backends (the GPU cases run on a GPU machine)."""
import numpy as np
import pytest

import course_helper as ch
from course_helper.exercises import cake_loop, check_cake_graph

PLANES = 60                                          # launch-bound still, and quick under the model


@pytest.fixture(autouse=True)
def _graphs(backend):
    ok, why = ch.graphs_supported()
    if not ok:
        pytest.skip(why)


def joined_by_streams(stack, compute, io, buffers, baked, copied):
    """The solution of notebook 10: capture the loop, join every IO stream back."""
    with ch.graphs.capture_graph(compute) as cap:
        cake_loop(stack, compute, io, buffers, baked, copied)
        for s in io:
            compute.wait_stream(s)
    return cap.graph


def joined_by_events(stack, compute, io, buffers, baked, copied):
    """Another right answer: each IO stream joins back through its last `copied` record."""
    with ch.graphs.capture_graph(compute) as cap:
        cake_loop(stack, compute, io, buffers, baked, copied)
        for event in copied:
            compute.wait_event(event)
    return cap.graph


@pytest.mark.parametrize("capture", [joined_by_streams, joined_by_events])
def test_a_captured_and_joined_cake_passes(capture):
    verdict = check_cake_graph(capture, nplanes=PLANES)
    assert verdict.passed, verdict
    assert verdict.startswith("Well done")
    assert 0 < verdict.graph_ms <= 0.5 * verdict.loop_ms       # the times it compared come with it


def unanswered(stack, compute, io, buffers, baked, copied):
    return None


def the_capture_not_its_graph(stack, compute, io, buffers, baked, copied):
    with ch.graphs.capture_graph(compute) as cap:
        cake_loop(stack, compute, io, buffers, baked, copied)
        for s in io:
            compute.wait_stream(s)
    return cap


def never_joined(stack, compute, io, buffers, baked, copied):
    with ch.graphs.capture_graph(compute) as cap:
        cake_loop(stack, compute, io, buffers, baked, copied)
    return cap.graph


def ran_before_capturing(stack, compute, io, buffers, baked, copied):
    cake_loop(stack, compute, io, buffers, baked, copied)      # runs the loop: planes land now
    ch.synchronize()
    return joined_by_streams(stack, compute, io, buffers, baked, copied)


def half_the_planes(stack, compute, io, buffers, baked, copied):
    return joined_by_streams(stack[: len(stack) // 2], compute, io, buffers, baked, copied)


def slow_replay(stack, compute, io, buffers, baked, copied):
    """A graph with forty extra bakes per plane: right planes, but no faster than the loop."""
    spare = ch.device_empty(buffers[0].shape)
    with ch.graphs.capture_graph(compute) as cap:
        for k in range(len(stack)):
            for _ in range(40):
                ch.bake_layer(spare, k, compute)
        cake_loop(stack, compute, io, buffers, baked, copied)
        for s in io:
            compute.wait_stream(s)
    return cap.graph


def waits_on_the_host(stack, compute, io, buffers, baked, copied):
    """Notebook 6's way inside a capture: the host may not wait while nothing runs."""
    with ch.graphs.capture_graph(compute) as cap:
        for k in range(len(stack)):
            b = k % len(buffers)
            io[b].synchronize()
            ch.bake_layer(buffers[b], k, compute)
            io[b].wait_event(compute.record(baked[b]))
            ch.copy_to_host_async(stack[k], buffers[b], io[b], level=k)
    return cap.graph


def copies_on_compute(stack, compute, io, buffers, baked, copied):
    """Every copy on the compute stream: right planes, a fast replay, but nothing overlaps."""
    with ch.graphs.capture_graph(compute) as cap:
        cake_loop(stack, compute, [compute] * len(io), buffers, baked, copied)
    return cap.graph


def io_never_forked(stack, compute, io, buffers, baked, copied):
    """Only io[0] waits for a bake recorded in the capture: the other io streams are not part of it."""
    with ch.graphs.capture_graph(compute) as cap:
        for k in range(len(stack)):
            b = k % len(buffers)
            compute.wait_event(copied[b])
            ch.bake_layer(buffers[b], k, compute)
            compute.record(baked[b])
            if k == 0:
                io[b].wait_event(baked[b])
            ch.copy_to_host_async(stack[k], buffers[b], io[b], level=k)
            io[b].record(copied[b])
        for s in io:
            compute.wait_stream(s)
    return cap.graph


def captured_on_io(stack, compute, io, buffers, baked, copied):
    """The capture begins on io[0], but the loop's first work is on compute, never forked into it."""
    with ch.graphs.capture_graph(io[0]) as cap:
        cake_loop(stack, compute, io, buffers, baked, copied)
    return cap.graph


@pytest.mark.parametrize("capture, words", [
    (copies_on_compute, "every plane is right, but in the graph the copies hardly run while the next planes bake"),
    (io_never_forked, "on an event recorded on stream 'io 1', which is not part of the capture"),
    (captured_on_io, "on an event recorded on stream 'compute', which is not part of the capture"),
    (unanswered, "Not answered yet: unanswered returns None"),
    (the_capture_not_its_graph, "should return the captured graph (cap.graph), not _Capture"),
    (never_joined, "Not yet: capturing raised RuntimeError: cudaErrorStreamCaptureUnjoined"),
    (ran_before_capturing, "Not yet: capturing raised UncapturedDependency: stream 'compute' waits, during a "
                           "graph capture, on an event recorded before the capture began"),
    (half_the_planes, f"after a replay {PLANES - PLANES // 2} planes are wrong or missing, "
                      f"the first is plane {PLANES // 2}"),
    (slow_replay, "every plane is right, but the replay took more than half"),
    (waits_on_the_host, "Not yet: capturing raised HostWaitInCapture: synchronising stream 'io 0' during a "
                        "graph capture"),
])
def test_a_wrong_capture_is_refused_with_its_reason(capture, words):
    verdict = check_cake_graph(capture, nplanes=PLANES)
    assert not verdict.passed
    assert words in verdict


def test_bad_input_is_refused_early():
    with pytest.raises(TypeError, match="pass the function itself"):
        check_cake_graph(None)
    with pytest.raises(ValueError, match="at least 1"):
        check_cake_graph(joined_by_streams, nplanes=0)


def test_the_loop_bakes_each_plane_into_its_place():
    stack = ch.pinned_empty((5, 16, 16))
    cake_loop(stack, **ch.exercises.cake_kit(shape=(16, 16)))
    ch.synchronize()
    for k in range(5):
        np.testing.assert_array_equal(stack[k], ch.exercises.layer_values(k, (16, 16)))
