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
"""
from __future__ import annotations

from .memory import copy_to_host, copy_to_host_async
from .wave import launch_wave2d

__all__ = ["sequential", "with_streams", "with_events"]


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
