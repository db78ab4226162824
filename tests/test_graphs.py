"""course_helper.graphs: the capture with one IO stream that the graph strategies and a rank's
captured loop share (capture_graph's own rules are tested with the modelled device's, in
tests/runtime/test_model.py)."""
import numpy as np
import pytest

import course_helper as ch
from course_helper.graphs import capture_with_one_io_stream


def test_a_capture_with_one_io_stream_chains_every_copy_and_joins_what_the_loop_forked(backend):
    ok, why = ch.graphs_supported()
    if not ok:
        pytest.skip(why)
    compute = ch.create_streams(1, name="compute")[0]
    io = ch.create_streams(3, name="io")
    levels = [ch.device_zeros((8, 8)) for _ in range(3)]
    host = ch.pinned_empty((3, 8, 8))
    host.fill(np.nan)
    given = []

    def queue(chain):
        given.append(chain)
        for b, level in enumerate(levels):
            ch.bake_layer(level, b + 1, compute)
            chain[b].wait_event(compute.record())          # the IO stream forks from the capture
            ch.copy_to_host_async(host[b], level, chain[b], level=b)
        return chain[:1]                                   # the one stream it forked
    graph = capture_with_one_io_stream(compute, io, queue)
    assert given == [[io[0]] * 3]                          # every buffer's copies on io[0]
    assert np.isnan(host).all()                            # nothing ran during the capture
    graph.launch()
    compute.synchronize()                                  # the copies were joined back into compute
    for b in range(3):
        np.testing.assert_array_equal(host[b], ch.exercises.layer_values(b + 1, (8, 8)))

    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnjoined"):
        capture_with_one_io_stream(compute, io, lambda chain: queue(chain)[:0])   # a fork left unjoined


def test_a_loop_whose_host_waits_is_refused_by_a_capture_and_its_events_twin_is_captured(backend, small):
    """Both backends refuse a host wait inside a capture with the helper's one message (nothing
    runs during a capture, so the wait could never end); the events loop's waits are on the
    device and capture. Notebook 10 prints this refusal beside the events loop's graph."""
    ok, why = ch.graphs_supported()
    if not ok:
        pytest.skip(why)
    with pytest.raises(ch.graphs.HostWaitInCapture, match="synchronising stream 'io 0' during a graph capture"):
        ch.strategies.capture_loop(ch.strategies.with_streams, ch.prepare(small, "streams"))
    compute = ch.create_streams(1, name="compute")[0]
    for wait in (compute.synchronize, compute.record().synchronize, ch.synchronize):
        with pytest.raises(ch.graphs.HostWaitInCapture), ch.graphs.capture_graph(compute):
            wait()
    compute.synchronize()                                  # after a refused capture the host may wait again
    graph = ch.strategies.capture_loop(ch.strategies.with_events, ch.prepare(small, "events"))
    assert isinstance(graph, ch.graphs.Graph)


def test_a_capture_that_waits_on_an_event_recorded_before_it_is_refused_alike(backend):
    """A graph can only wait on work it captured: both backends refuse a wait, inside a capture,
    on an event recorded before the capture began (CUDA: cudaErrorStreamCaptureIsolation), and
    take the same wait on an event recorded inside the capture, or one never recorded."""
    ok, why = ch.graphs_supported()
    if not ok:
        pytest.skip(why)
    compute, io = ch.create_streams(2)
    before, inside, never = ch.create_events(3)
    src, dst = ch.device_zeros(1024), ch.device_zeros(1024)
    before.record(io)
    ch.synchronize()
    with pytest.raises(ch.graphs.UncapturedDependency, match="recorded before the capture began"):
        with ch.graphs.capture_graph(compute):
            compute.wait_event(before)
    ch.synchronize()
    with ch.graphs.capture_graph(compute) as cap:
        compute.wait_event(never)                      # never recorded: nothing to wait for
        ch.memory.copy_on_device_async(dst, src, compute)
        inside.record(compute)
        compute.wait_event(inside)
    cap.graph.launch()
    ch.synchronize()
