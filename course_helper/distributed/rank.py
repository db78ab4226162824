"""One rank's run: its slab, the windows its kernels run on, its buffers, streams and events, and
the few operations its loop is written in (launch a window, save a level, hand saved levels over).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..memory import copy_to_host_async, device_zeros, pinned_empty, to_device
from ..solver import suggest_nscratch
from ..streams import create_events, create_streams, stream_priority_range
from ..wave import PAD, PreparedLaunch, WaveProblem, launch_wave2d, saved_levels
from .link import HaloLink
from .slabs import HALO, Window, decompose

if TYPE_CHECKING:
    from ..streams import Stream
    from .link import Team
    from .slabs import Slab

__all__ = ["NSCRATCH", "RankRun", "ring_for"]

NSCRATCH = 5                #: slab buffers per rank with no snapshots (level L lives in U[L % 5])


def ring_for(slab: "Slab", problem: WaveProblem, every: int | None) -> tuple[int, str]:
    """``(buffers, reason)``: how many slab buffers a rank's ring has. With snapshots, the depth
    the single-GPU ring loops get by default (:func:`course_helper.solver.suggest_nscratch`, the
    rule of :func:`~course_helper.strategies.ring_depth`) for one slab's kernel and copy; without,
    :data:`NSCRATCH`."""
    if not every:
        return NSCRATCH, f"{NSCRATCH}, no snapshots to copy"
    return suggest_nscratch(WaveProblem(n0=slab.rows, n1=problem.n1, nt=problem.nt), every, "events")


class RankRun:
    """Everything one rank's loop needs: its slab, windows, buffers, streams and events.

    ``U[L % m]`` holds level ``L`` of the slab's rows (halos included); a window is a pair
    (:class:`Window`, local row slice): ``whole``, the boundary rows ``edges`` and the ``inner`` rest.
    """

    def __init__(self, team: Team, problem: WaveProblem, strategy: str, every: int | None,
                 on_snapshot: Callable[[int, slice, np.ndarray], object] | None) -> None:
        self.problem, self.strategy, self.every = problem, strategy, every
        self.slab = s = decompose(problem.n0, team.size)[team.rank]
        self.m, self.ring_reason = ring_for(s, problem, every)
        self.U = [device_zeros((s.rows, problem.n1)) for _ in range(self.m)]
        self.V = to_device(np.ascontiguousarray(problem.velocity[s.lo:s.hi]))
        self.levels = np.asarray(saved_levels(problem.nt, every) if every else range(0))
        self.images = pinned_empty((len(self.levels), s.owned, problem.n1))
        self.images.fill(np.nan)
        # The windows: the whole slab, or its boundary rows (inner sides only) and the rest.
        self.whole = self._window(s.first, s.stop)
        top = s.first + HALO if s.up is not None else s.first
        bottom = s.stop - HALO if s.down is not None else s.stop
        self.edges = [self._window(a, b) for a, b in ((s.first, top), (bottom, s.stop)) if b > a]
        self.inner = self._window(top, bottom) if bottom > top else None
        # Each window's rows of every buffer, sliced once: a launch then reuses the same views
        # every level, and launch_wave2d checks an argument set only the first time it sees it
        # (slicing afresh each level made every launch a new set, about 60 us of checks on the host).
        self._views = {id(w): (w, [u[w[1]] for u in self.U], self.V[w[1]])
                       for w in (self.whole, *self.edges, self.inner) if w is not None}
        self._prepared = {}            # (id(window), level % m, stream) -> PreparedLaunch
        self.compute = create_streams(1, name="compute")[0]
        # High priority: the boundary rows it computes (overlap) let the halos leave sooner.
        halo_stream = create_streams(1, priority=stream_priority_range()[1], name="halo")[0]
        self.io = create_streams(self.m, name="io")
        self.ready, self.copied = create_events(self.m), create_events(self.m)
        self.computed = create_events(1)[0]
        # copying[b]: a copy of U[b] to the host was queued and no step has waited for it yet.
        # Only then does a step that writes U[b] queue a wait (most levels are not saved).
        self.copying = [False] * self.m
        self.link = HaloLink(team, s, halo_stream)
        self.on_snapshot = on_snapshot
        self.unsent = deque()          # (level, k, event) copies not yet handed to on_snapshot
        self._streams = [self.compute, halo_stream, *self.io]

    def _window(self, a, b):
        """(sub-problem, local row slice) of global rows a..b plus two rows of context each side."""
        first = a - PAD - self.slab.lo
        return Window(self.problem, a, b), slice(first, first + b - a + 2 * PAD)

    def launch(self, window: tuple[Window, slice], level: int, stream: Stream) -> None:
        """Queue the kernel for ``level`` on the rows of ``window``."""
        m = self.m
        key = (id(window), level % m, stream)
        prepared = self._prepared.get(key)
        if prepared is not None:
            prepared(level - 2)
            return
        hit = self._views.get(id(window))
        if hit is None or hit[0] is not window:        # a window of the caller's own: launched as it is
            U, V = [u[window[1]] for u in self.U], self.V[window[1]]
            launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[level % m], V, window[0], level - 2, stream)
            return
        _, U, V = hit
        # One prepared launch per window, ring position and stream: checked once, and on a GPU
        # each level then costs the host little more than cuLaunchKernel.
        prepared = self._prepared[key] = PreparedLaunch(U[(level - 2) % m], U[(level - 1) % m], U[level % m], V,
                                                        window[0], stream)
        prepared(level - 2)

    def slot(self, level: int) -> int | None:
        """The index of ``level`` among the saved levels, or None if it is not saved."""
        if self.every and level % self.every == 0:
            return level // self.every
        return None

    def wait_until_copied(self, b: int, *streams: Stream) -> None:
        """Make ``streams`` (all that will write ``U[b]``) wait until the copy of the last level saved
        from ``U[b]`` has finished reading it; nothing is queued if no such copy is pending."""
        if self.copying[b]:
            for stream in streams:
                stream.wait_event(self.copied[b])
            self.copying[b] = False

    def save(self, level: int, k: int) -> None:
        """Stream the owned rows of ``level`` to the host on its IO stream."""
        b = level % self.m
        self.io[b].wait_event(self.ready[b])
        copy_to_host_async(self.images[k], self.U[b][HALO:-HALO], self.io[b], level=level)
        self.io[b].record(self.copied[b])
        self.copying[b] = True
        self.unsent.append((level, k, self.copied[b]))

    def hand_over(self, wait: bool = False) -> None:
        """Give the landed snapshots, in order, to ``on_snapshot`` (all of them when ``wait``)."""
        if self.on_snapshot is None:
            # Nobody to hand them to: no polling either (a poll that finds a copy done orders the
            # host after it, which would hide a missing wait from the sanitizer in this run).
            self.unsent.clear()
            return
        while self.unsent and (wait or self.unsent[0][2].done):
            level, k, event = self.unsent.popleft()
            event.synchronize()
            self.on_snapshot(level, slice(self.slab.first, self.slab.stop), self.images[k])

    def close(self) -> None:
        """Release the rank's streams (and its prepared launches, which keep its buffers alive)."""
        self._prepared.clear()
        for s in self._streams:
            close = getattr(s.raw, "close", None)
            if close is not None:
                close()
