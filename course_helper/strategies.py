"""The IO strategies - the heart of the lesson.

Each strategy is one short loop over time levels. Level ``L`` of the
wavefield lives in scratch buffer ``U[L % nscratch]``; the kernel for level L
reads levels L-2 and L-1 and writes level L. Every saved level must reach the
host output ``out.images`` exactly once. The notebooks show these functions
with ``inspect.getsource``, so what you read there is what runs.

* :func:`sequential` - one stream, a blocking copy after every kernel.
* :func:`with_streams` - a compute stream and IO streams; the host waits on
  an IO stream before its buffer is overwritten.
* :func:`with_events` - the same dependencies as events; the host never waits.
* :func:`staged` - copy each saved level device-to-device into a staging ring
  on the compute stream, then to the host from there; compute only waits when
  every staging buffer is still being copied.
* :func:`graph` / :func:`graph_staged` - the event loop / the staged loop
  captured once into a CUDA graph (``solve`` then replays it).
"""
from __future__ import annotations

from dataclasses import replace

from .graphs import capture_graph
from .memory import copy_on_device_async, copy_to_host, copy_to_host_async, zero_async
from .wave import launch_wave2d

__all__ = ["sequential", "with_streams", "with_events", "staged", "graph", "graph_staged"]


def sequential(run):
    """Everything on the default stream; after each kernel a blocking copy to pageable memory."""
    U, m = run.U, run.nscratch                     # m = 3 scratch wavefields
    for level in range(run.nt):
        if level >= 2:                              # levels 0 and 1 are the zero initial state
            launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[level % m],
                          run.V, run.problem, n=level - 2)
        k = run.slot(level)                         # index in the output, or None if not saved
        if k is not None:
            copy_to_host(run.images[k], U[level % m], level=level)   # the host waits here


def with_streams(run):
    """Compute on one stream, copy on IO streams; the host synchronises an IO stream
    before the buffer it reads is overwritten."""
    U, m = run.U, run.nscratch                      # m >= 4 scratch wavefields
    compute, io, ready = run.compute, run.io, run.ready   # io[b] and ready[b] belong to buffer b
    for level in range(run.nt + 3):                 # 3 extra turns copy the last levels
        if level < run.nt:
            b = level % m
            if level >= 2:
                io[b].synchronize()                 # host waits: the copy that read U[b] is done
                launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[b],
                              run.V, run.problem, n=level - 2, stream=compute)
            compute.record(ready[b])                # level is complete when compute gets here
        old = level - 3                             # newest level no kernel touches any more
        k = run.slot(old)
        if k is not None:
            b = old % m
            io[b].wait_event(ready[b])              # device-side: copy after the kernel that made it
            copy_to_host_async(run.images[k], U[b], io[b], level=old)


def with_events(run):
    """The same dependencies expressed with events: the compute stream waits on the
    copy of the buffer it overwrites; the host never blocks."""
    U, m = run.U, run.nscratch
    compute, io, ready, copied = run.compute, run.io, run.ready, run.copied
    for level in range(run.nt + 3):
        if level < run.nt:
            b = level % m
            if level >= 2:
                compute.wait_event(copied[b])       # device-side: the copy that read U[b] is done
                launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[b],
                              run.V, run.problem, n=level - 2, stream=compute)
            compute.record(ready[b])
        old = level - 3
        k = run.slot(old)
        if k is not None:
            b = old % m
            io[b].wait_event(ready[b])
            copy_to_host_async(run.images[k], U[b], io[b], level=old)
            io[b].record(copied[b])                 # U[b] may be overwritten after this point


def staged(run):
    """Stage each saved level with a fast device-to-device copy on the compute stream, then
    copy whole staging buffers (``batch`` levels each) to the host on the IO streams."""
    U, m = run.U, run.nscratch                      # 3 scratch wavefields: only compute touches them
    S, ns, batch = run.staging, len(run.staging), run.batch   # ns staging buffers of `batch` levels
    compute, io, staged_ev, copied = run.compute, run.io, run.ready, run.copied   # per staging buffer
    for level in range(run.nt):
        if level >= 2:
            launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[level % m],
                          run.V, run.problem, n=level - 2, stream=compute)
        k = run.slot(level)
        if k is None:
            continue
        s, j = (k // batch) % ns, k % batch         # staging buffer, and the slot in it
        if j == 0:
            compute.wait_event(copied[s])           # buffer s is free (waits only if the ring is full)
        copy_on_device_async(S[s][j], U[level % m], compute, level=level)
        if j == batch - 1 or k == run.nsaved - 1:   # buffer full (or last level): ship it
            first = k - j
            compute.record(staged_ev[s])
            io[s].wait_event(staged_ev[s])
            copy_to_host_async(run.images[first:k + 1], S[s][:j + 1], io[s], level=run.level_of(first))
            io[s].record(copied[s])


def _captured(loop, run):
    """Capture ``loop`` into a graph that starts from the zero initial state every replay.

    All copies are captured on one IO stream. In a graph every captured stream
    becomes a branch, and copies spread over several branches ran about 10%
    slower where the copies set the pace; one chain of copies runs as fast as
    the stream loops (benchmarks/graph_copies.py)."""
    compute = run.compute
    run = replace(run, io=[run.io[0]] * len(run.io))   # one IO stream for every buffer: one chain of copies
    with capture_graph(compute) as cap:
        zero_async(run.U[0], compute)               # levels 0 and 1 are reset on every replay,
        zero_async(run.U[1], compute)               # or a second replay would start from old data
        loop(run)
        for io, copied in zip(run.io, run.copied):
            if copied.recorded:                     # this IO stream took part in the capture:
                compute.wait_stream(io)             # join it back into the capture stream
    return cap.graph


def graph(run):
    """The event loop, captured into a CUDA graph. Returns the graph; solve() replays it."""
    return _captured(with_events, run)


def graph_staged(run):
    """The staged loop, captured into a CUDA graph. Returns the graph; solve() replays it."""
    return _captured(staged, run)
