"""The capstone (notebook 13): Gray-Scott reaction-diffusion with data moving both ways.

Two fields, ``u`` and ``v``, react and diffuse on a periodic grid (the kernel
``kernels/gray_scott.cu``, launched by :func:`launch_gray_scott`; NumPy on the CPU backend). The
feed rate is a field streamed in from the host: every ``feed_every`` steps the run needs the next
block's feed, frame ``j % nframes`` of a pinned input ring (:attr:`GrayScott.frames`). Every
``save_every`` steps a snapshot of ``v`` goes to the host. So host-to-device copies, kernels and
device-to-host copies can all run at once, each on its own engine.

:func:`check_capstone` runs the learner's loop, ``run(gs, snapshots)``, and asks for five things:
no race (under the sanitizer, on a problem long enough that every buffer of the loop's rings is
reused at least twice: :func:`check_problem`), snapshots identical to those of the course's
one-stream loop (:func:`sequential_snapshots`; on the CPU backend that is the NumPy reference,
:func:`reference_snapshots`, to the bit), its device buffers returned, no host wait inside the
loop, and at least :data:`HIDDEN_NEEDED` of each copy direction hidden under the kernels at the
capstone's balanced point (:data:`BALANCED_POINT`). Its messages name the learner's own streams, events
and buffers. :func:`check_depths` checks the ring depths the learner chose against the times
they measured (times ``ch.elapsed_ms`` returned to them, near the check's own).

A copy's ``level=`` is a label (timelines and messages show it); no check takes it as a claim
about the data: which level a snapshot holds is judged by its content.
"""
from __future__ import annotations

import inspect
import math
import sys
import weakref
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from .. import checks, streams
from ..kernels import RawKernel, source
from ..memory import (InputRing, copy_to_device_async, copy_to_host, copy_to_host_async, device_zeros, is_device_array,
                      pinned_empty)
from ..runtime import observe
from ..runtime.base import byte_span, shares_memory, spans_overlap
from ..runtime.ops import OpKind
from ..solver import timing_only
from ..streams import create_streams, synchronize
from ..timelines import Trace, recording
from .core import (ExerciseError, LoopProgram, LoopRaceError, describe_waits, explain_serial, hidden_by_direction,
                   run_checked, time_ms)

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..runtime.observe import Op
    from ..streams import Event, Stream

__all__ = ["GrayScott", "launch_gray_scott", "reference_snapshots", "sequential_snapshots", "check_capstone",
           "check_depths", "check_problem", "CapstoneError", "BALANCED_POINT", "CHECK_POINT", "HIDDEN_NEEDED",
           "USES_PER_BUFFER", "TIMES_FACTOR"]

#: The capstone's balanced point: the device sets the pace (each block's kernels take about twice
#: as long as one copy of a field, in either direction, on the modelled H200), so overlap can hide
#: both directions under the kernels. ``benchmarks/capstone_point.py`` measures it on a GPU.
BALANCED_POINT = dict(n=3072, steps=720, feed_every=36, save_every=36)
#: The small problem the checker runs first under the sanitizer and compares with the reference
#: (:func:`check_problem` with rings of two buffers each way). Snapshots come twice a block, so a
#: loop that mixes up ``feed_every`` and ``save_every`` shows, and a block ends with a snapshot,
#: so the events recorded there follow one another.
CHECK_POINT = dict(n=48, steps=36, feed_every=6, save_every=3)
#: How many times the check uses every buffer of a ring: once, then reused at least twice, since
#: a missing wait between a buffer's uses shows only when it is reused.
USES_PER_BUFFER = 3
#: The longest check the checker runs (the CPU backend computes it, under the sanitizer): a ring
#: deeper than this many blocks / USES_PER_BUFFER is checked on the reuses that fit.
_CHECK_STEPS_MAX = 360
#: The share of each copy direction that must run under the kernels at the balanced point.
HIDDEN_NEEDED = 0.85

_BLOCK = (32, 8)          # threads per block along (dimension 1, dimension 0)


class CapstoneError(ExerciseError):
    """The capstone's loop misses a rule; the message says which and what to try."""


def _numpy_step(u, v, feed, u_out, v_out, n0, n1, du, dv, kill, dt):
    """The kernel's update in NumPy, operation for operation, in float32."""
    four, one = np.float32(4), np.float32(1)
    lap_u = ((np.roll(u, 1, 0) + np.roll(u, -1, 0)) + (np.roll(u, 1, 1) + np.roll(u, -1, 1))) - four * u
    lap_v = ((np.roll(v, 1, 0) + np.roll(v, -1, 0)) + (np.roll(v, 1, 1) + np.roll(v, -1, 1))) - four * v
    uvv = (u * v) * v
    np.add(u, dt * ((du * lap_u - uvv) + feed * (one - u)), out=u_out)
    np.add(v, dt * ((dv * lap_v + uvv) - (feed + kill) * v), out=v_out)


GRAY_SCOTT = RawKernel(source("gray_scott"), "gray_scott", numpy=_numpy_step, options=("--fmad=false",))


class GrayScott:
    """The Gray-Scott problem of the capstone and every number derived from it.

    Parameters
    ----------
    n : int
        Grid size (``n x n`` cells, periodic).
    steps : int
        Time steps of a run.
    feed_every : int
        Steps per feed block: block ``j`` (steps ``j * feed_every`` to ``(j + 1) * feed_every - 1``)
        reads the feed frame ``j % nframes`` of :attr:`frames`.
    save_every : int
        A snapshot of ``v`` is saved after every ``save_every``-th step.
    nframes : int
        Frames in the input ring: the feed pulses and turns with a period of ``nframes`` blocks.
    du, dv, kill, dt : float
        Diffusion rates (grid units), the kill rate and the time step.
    seed : int
        Seeds the initial patches of ``v``.

    Examples
    --------
    >>> gs = GrayScott(n=64, steps=96)
    >>> gs.nblocks, gs.nsnapshots, gs.snapshot_steps[:2]
    (4, 4, [24, 48])
    """

    def __init__(self, n: int = 256, steps: int = 2400, feed_every: int = 24, save_every: int = 24, nframes: int = 8,
                 du: float = 0.16, dv: float = 0.08, kill: float = 0.06, dt: float = 1.0, seed: int = 13) -> None:
        self.n = checks.positive_int("n (grid size)", n, minimum=3, hint="the 5-point stencil needs 3 cells a side")
        self.steps = checks.positive_int("steps", steps)
        self.feed_every = checks.positive_int("feed_every", feed_every)
        self.save_every = checks.positive_int("save_every", save_every)
        if self.save_every > self.steps:
            raise ValueError(f"save_every={save_every} is more than the {steps} steps of the run: no snapshot "
                             "would be saved; save more often or run longer")
        self.nframes = checks.positive_int("nframes", nframes)
        self.du, self.dv = checks.positive_float("du", du), checks.positive_float("dv", dv)
        self.kill, self.dt = checks.positive_float("kill", kill), checks.positive_float("dt", dt)
        if 4 * max(self.du, self.dv) * self.dt > 1:
            raise ValueError(f"dt * 4 * max(du, dv) = {4 * max(self.du, self.dv) * self.dt:g} is above 1: the "
                             "explicit step would blow up; use a smaller dt or smaller diffusion rates")
        self.seed = int(seed)
        self._frames = None

    def __repr__(self) -> str:
        return (f"GrayScott({self.n}x{self.n}, steps={self.steps}, feed_every={self.feed_every}, "
                f"save_every={self.save_every}, nframes={self.nframes})")

    @classmethod
    def balanced_point(cls) -> GrayScott:
        """The problem of :data:`BALANCED_POINT`."""
        return cls(**BALANCED_POINT)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.n)

    @property
    def nbytes_field(self) -> int:
        """Bytes of one field (a feed frame, a snapshot)."""
        return self.n * self.n * 4

    @property
    def nblocks(self) -> int:
        """Feed blocks in a run (the last one may be shorter)."""
        return -(-self.steps // self.feed_every)

    @property
    def nsnapshots(self) -> int:
        return self.steps // self.save_every

    @property
    def snapshot_steps(self) -> list[int]:
        """After which step each snapshot is taken (snapshot ``i`` after step ``(i + 1) * save_every``)."""
        return [(i + 1) * self.save_every for i in range(self.nsnapshots)]

    @property
    def frames(self) -> InputRing:
        """The feed frames, in a pinned input ring (made on first use)."""
        if self._frames is None:
            checks.host_memory(self.nframes * self.nbytes_field * 3, f"the {self.nframes} feed frames of {self!r}",
                               advice="use a smaller n or fewer frames")
            self._frames = InputRing(np.stack([self.feed_frame(p) for p in range(self.nframes)]))
        return self._frames

    def feed_frame(self, p: int) -> np.ndarray:
        """Feed frame ``p``: stripes of feed rate turning by half a turn over the ``nframes`` frames."""
        x = np.arange(self.n) / self.n
        theta = np.pi * p / self.nframes
        along = 2 * np.pi * 2 * x * np.cos(theta)         # the stripes' phase along a row ...
        down = 2 * np.pi * 2 * x * np.sin(theta)          # ... and down a column
        # sin(along + down), expanded so that sin and cos are taken of 2n numbers rather than n²,
        # and worked out in place (about a third of the time at the balanced point; the same float32 frames)
        stripes = np.multiply.outer(np.cos(down), np.sin(along))
        stripes += np.multiply.outer(np.sin(down), np.cos(along))
        stripes *= 0.008
        stripes += 0.037
        return stripes.astype(np.float32)

    def initial(self) -> tuple[np.ndarray, np.ndarray]:
        """The fields at step 0 (host arrays): ``u = 1``, ``v = 0`` but for a few square patches,
        with a little noise."""
        rng = np.random.default_rng(self.seed)
        u = np.ones(self.shape, np.float32)
        v = np.zeros(self.shape, np.float32)
        size = max(2, self.n // 16)
        for i, j in rng.integers(0, self.n - size, size=(max(3, self.n // 24), 2)):
            u[i:i + size, j:j + size] = 0.5
            v[i:i + size, j:j + size] = 0.25
        u += rng.uniform(-0.01, 0.01, self.shape).astype(np.float32)
        v += rng.uniform(-0.01, 0.01, self.shape).astype(np.float32)
        np.clip(v, 0, 1, out=v)
        return u, v

    def empty_snapshots(self) -> np.ndarray:
        """A pinned host stack for the snapshots, filled with NaN (a snapshot never copied shows)."""
        checks.host_memory(self.nsnapshots * self.nbytes_field, f"the {self.nsnapshots} snapshots of {self!r}",
                           advice="save less often")
        out = pinned_empty((self.nsnapshots, *self.shape))
        observe.notify("host_access", out, "w", "GrayScott.empty_snapshots")
        out.fill(np.nan)
        return out

    def scalars(self) -> tuple:
        """The kernel's arguments after the five arrays."""
        return (np.int32(self.n), np.int32(self.n), np.float32(self.du), np.float32(self.dv),
                np.float32(self.kill), np.float32(self.dt))


#: Argument sets of launch_gray_scott already checked: ids -> weak references to the objects (the
#: death of any drops the entry, before its memory can be reused). A loop launches with the same
#: few buffers every step, so the checks run once per set, as the wave kernel's do.
_CHECKED = {}
_CHECKED_MAX = 64


def launch_gray_scott(u: Any, v: Any, feed: Any, u_next: Any, v_next: Any, gs: GrayScott, n: int,
                      stream: streams.Stream | None = None) -> None:
    """Queue step ``n`` of ``gs``: the fields after step ``n + 1`` into ``u_next``, ``v_next``
    from ``u``, ``v`` and the feed field ``feed``, on ``stream``. On timelines it is
    "gray_scott level ``n + 1``".

    Parameters
    ----------
    u, v, feed, u_next, v_next : device arrays of shape ``gs.shape``, float32
        ``u_next`` and ``v_next`` may share memory with none of the others: each thread reads
        its neighbours' old values while the others write.
    """
    key = (id(gs), id(u), id(v), id(feed), id(u_next), id(v_next))
    known = _CHECKED.get(key)
    if known is None or known[1] != (gs.n, gs.du, gs.dv, gs.kill, gs.dt):
        _check_launch(u, v, feed, u_next, v_next, gs)
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        known = _CHECKED[key] = (tuple(weakref.ref(o, lambda _r, k=key: _CHECKED.pop(k, None))
                                       for o in (gs, u, v, feed, u_next, v_next)),
                                 (gs.n, gs.du, gs.dv, gs.kill, gs.dt), gs.scalars(),
                                 (-(-gs.n // _BLOCK[0]), -(-gs.n // _BLOCK[1])))
    n = checks.positive_int("n (step number)", n, minimum=0)
    GRAY_SCOTT.queue(known[3], _BLOCK, (u, v, feed, u_next, v_next, *known[2]), streams.resolve(stream),
                     (u, v, feed, u_next, v_next), (u_next, v_next), n + 1)


def _check_launch(u, v, feed, u_next, v_next, gs):
    checks.instance("gs", gs, GrayScott, "a GrayScott problem")
    arrays = {"u": u, "v": v, "feed": feed, "u_next": u_next, "v_next": v_next}
    for label, a in arrays.items():
        if not is_device_array(a):
            raise TypeError(f"{label} must be a device array (device_zeros/to_device), got {type(a).__name__}")
        if tuple(a.shape) != gs.shape or a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError(f"{label} must be a C-contiguous float32 array of shape {gs.shape}, got {a.dtype} "
                             f"{tuple(a.shape)}")
    for out in ("u_next", "v_next"):
        for other, a in arrays.items():
            if other != out and shares_memory(arrays[out], a):
                raise ValueError(f"{out} shares memory with {other}: the kernel reads its neighbours' old values "
                                 "while it writes, so it needs fields of its own to write (the other pair of a "
                                 "ping-pong)")


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------
def reference_snapshots(gs: GrayScott) -> np.ndarray:
    """The snapshots of ``v`` in plain NumPy, no device: the reference the kernel is checked against."""
    checks.instance("gs", gs, GrayScott, "a GrayScott problem")
    u, v = gs.initial()
    nxt = [np.empty_like(u), np.empty_like(v)]
    out = np.empty((gs.nsnapshots, *gs.shape), np.float32)
    for n in range(gs.steps):
        _numpy_step(u, v, gs.frames[n // gs.feed_every], nxt[0], nxt[1], *gs.scalars())
        (u, v), nxt = nxt, [u, v]
        if (n + 1) % gs.save_every == 0:
            out[(n + 1) // gs.save_every - 1] = v
    return out


def sequential_snapshots(gs: GrayScott) -> np.ndarray:
    """The snapshots of the course's one-stream loop on the active backend: every step on one
    stream, each feed frame uploaded and each snapshot copied out with the host waiting. A
    learner's loop must give these to the bit (on the CPU backend they are
    :func:`reference_snapshots`)."""
    checks.instance("gs", gs, GrayScott, "a GrayScott problem")
    (s,) = create_streams(1, name="sequential")
    u, v = [device_zeros(gs.shape) for _ in range(2)], [device_zeros(gs.shape) for _ in range(2)]
    feed = device_zeros(gs.shape)
    host_u, host_v = (pinned_empty(gs.shape) for _ in range(2))
    host_u[...], host_v[...] = gs.initial()
    copy_to_device_async(u[0], host_u, s)
    copy_to_device_async(v[0], host_v, s)
    out = pinned_empty((gs.nsnapshots, *gs.shape))
    for n in range(gs.steps):
        if n % gs.feed_every == 0:
            gs.frames.copy_to_device_async(feed, n // gs.feed_every, s)
        launch_gray_scott(u[n % 2], v[n % 2], feed, u[(n + 1) % 2], v[(n + 1) % 2], gs, n, s)
        if (n + 1) % gs.save_every == 0:
            copy_to_host(out[(n + 1) // gs.save_every - 1], v[(n + 1) % 2], s, level=n + 1)
    s.synchronize()
    return np.array(out)


# --------------------------------------------------------------------------
# The checker
# --------------------------------------------------------------------------
def check_problem(in_depth: int = 2, out_depth: int = 2) -> GrayScott:
    """The small problem on which a loop whose feed ring has ``in_depth`` buffers, and whose
    snapshots leave from ``out_depth`` buffers, uses each of them :data:`USES_PER_BUFFER` times
    or more (so each is reused at least twice): :data:`CHECK_POINT`, run for as many steps as
    that takes. :func:`check_capstone` runs the loop on it under the race sanitizer.

    >>> gs = check_problem(3, 1)
    >>> gs.nblocks, gs.nsnapshots
    (9, 18)
    """
    in_depth = checks.positive_int("in_depth", in_depth)
    out_depth = checks.positive_int("out_depth", out_depth)
    every = {"feed_every": CHECK_POINT["feed_every"], "save_every": CHECK_POINT["save_every"]}
    steps = max(CHECK_POINT["steps"], USES_PER_BUFFER * in_depth * every["feed_every"],
                USES_PER_BUFFER * out_depth * every["save_every"])
    period = math.lcm(*every.values())        # whole blocks and whole snapshot intervals
    return GrayScott(n=CHECK_POINT["n"], steps=-(-steps // period) * period, **every)


def check_capstone(run: Callable[[GrayScott, np.ndarray], Any]) -> str:
    """Check the capstone's loop ``run(gs, snapshots)``; raise :class:`CapstoneError` saying what
    is wrong, or return a one-line success message.

    ``run`` makes its own streams, events and device buffers, queues the whole run of ``gs``
    into the pinned stack ``snapshots`` and returns its device buffers (the checker keeps them
    and waits for the device afterwards). The checker runs it:

    1. on a small problem under the race sanitizer, counting the host's waits: first
       :data:`CHECK_POINT`, then, when a buffer of the loop's feed ring (where its uploads from
       ``gs.frames`` land) or of its snapshot ring (what its copies into ``snapshots`` read)
       was not used :data:`USES_PER_BUFFER` times, again on :func:`check_problem` for the ring
       depths the loop used: no race, every snapshot identical to the course's one-stream
       loop's (:func:`sequential_snapshots`; judged by content: a copy's ``level=`` is a
       label), every device buffer the loop used among those it returned (unless it ended
       with ``ch.synchronize()``), and no host wait inside the loop;
    2. at the balanced point (:data:`BALANCED_POINT`) on a timeline (CUPTI on a GPU, the model
       on the CPU backend, which predicts the times without the arithmetic there): at least
       :data:`HIDDEN_NEEDED` of the host-to-device copies and of the device-to-host copies,
       each direction on its own, must run under the kernels. Uploads that are no feed frame
       and come before the first kernel (the initial fields: set-up) are not counted. A
       direction that falls short is told what ordered its copies and the kernels one after
       the other.
    """
    __tracebackhide__ = True
    if run is None:
        raise CapstoneError("`run_capstone` is not written yet: write it, then run this cell again")
    program, small, depths, fewest = _run_reusing(run)
    _check_renewed(program, run)
    _compare(program, small)
    _check_returned(program, run, small)
    if program.host_waits:
        waits = program.host_waits
        raise CapstoneError(f"all {small.nsnapshots} snapshots are right, but the host waited inside the loop "
                            f"{len(waits)} times ({describe_waits(waits)}); the rule: the host never waits in the "
                            "loop - let the streams wait for events instead (stream.wait_event(event))")
    checked = f"all {small.nsnapshots} snapshots are right and no race, {_reuse(depths, fewest)}"
    hidden, trace, set_up, blocking = _balanced(run)
    copied = {OpKind.H2D: "uploads (host to device)", OpKind.D2H: "downloads (device to host)"}
    instead = {OpKind.H2D: ("ch.to_device", "gs.frames.copy_to_device_async(feed[b], j, upload) on your upload "
                            "stream, into a ring of feed buffers"),
               OpKind.D2H: ("ch.copy_to_host", "ch.copy_to_host_async(snapshots[i], staged[s], download) on your "
                            "download stream")}
    for direction, h in hidden.items():
        if h.copy_ms == 0 and blocking[direction]:
            call, fix = instead[direction]
            n = blocking[direction]
            raise CapstoneError(f"your loop ran no asynchronous {copied[direction]} at the balanced point: it made "
                                f"{n} blocking cop{'ies' if n > 1 else 'y'} with {call} inside the loop, so the host "
                                f"waited for each and nothing ran under the kernels. Queue them with {fix}")
        if h.copy_ms == 0:
            raise CapstoneError(f"your loop ran no {copied[direction]} at the balanced point: every block reads its "
                                "feed frame from gs.frames (gs.frames.copy_to_device_async) and every snapshot "
                                "goes to snapshots[i] (ch.copy_to_host_async)")
    short = [d for d, h in hidden.items() if h.copy_fraction < HIDDEN_NEEDED]
    not_counted = (f", not counting your {set_up} set-up upload{'s' if set_up > 1 else ''} before the first "
                   "kernel" if set_up else "")
    measured = "; ".join(f"{copied[d]}: busy {h.copy_ms:.2f} ms, {h.copy_fraction:.0%} of it under the kernels"
                         + (not_counted if d == OpKind.H2D else "") for d, h in hidden.items())
    if short:
        whys = " ".join(f"The {copied[d].split(' ')[0]}: {_why(program, d)}." for d in short)
        raise CapstoneError(f"all {small.nsnapshots} snapshots are right and the host never waited, but at the "
                            f"balanced point the {' and the '.join(copied[d] for d in short)} ran under the kernels "
                            f"less than the {HIDDEN_NEEDED:.0%} asked for. {whys} In this run's trace "
                            f"({trace.clock}): {measured}.")
    return (f"{checked}, the host never waited in the loop, and at the balanced point both directions ran under "
            f"the kernels ({measured}; {trace.clock})")


#: How far the learner's step and copy times may be from the check's own timing of the same work
#: (a factor either way): wide enough for a GPU's run-to-run spread and a step timed with its
#: launch, narrow enough to catch µs for ms, a block's time for a step's, or the two swapped.
TIMES_FACTOR = 2.0


def _positive(name: str, value: Any, whole: bool) -> Any:
    """``checks``' positive number, its error raised as a :class:`CapstoneError` (the notebook's
    cell catches only that)."""
    try:
        return checks.positive_int(name, value) if whole else checks.positive_float(name, value)
    except (TypeError, ValueError) as err:
        what = "a whole number of buffers, 1 or more" if whole else "the time in ms your timing events measured"
        raise CapstoneError(f"{err}: set it to {what}") from None


def _steps_timed(ms: float, times: tuple[float, ...], most: int) -> int | None:
    """The whole number of steps ``n`` (1 to ``most``) for which ``ms * n`` is one of ``times``
    (a time ``elapsed_ms`` returned divided by the steps it timed); None when there is none."""
    for t in times:
        n = round(t / ms)
        if 1 <= n <= most and math.isclose(t / n, ms, rel_tol=1e-9):
            return n
    return None


def _own_times(gs: GrayScott) -> tuple[float, tuple[float, float]]:
    """The check's own timing at ``gs``'s size (times only): one step (a block of ``feed_every``
    steps, divided), and one copy of a field each way (to the host, to the device)."""
    u, v, feed, u_next, v_next = (device_zeros(gs.shape) for _ in range(5))
    host = pinned_empty(gs.shape)
    (stream,) = create_streams(1, name="depth check")
    def warm_time_ms(queue):
        time_ms(stream, queue)             # the second run: the first one warms up
        return time_ms(stream, queue)

    def block():
        for n in range(gs.feed_every):
            launch_gray_scott(u, v, feed, u_next, v_next, gs, n, stream)
    with timing_only():
        step = warm_time_ms(block) / gs.feed_every
        down = warm_time_ms(lambda: copy_to_host_async(host, v, stream))
        up = warm_time_ms(lambda: copy_to_device_async(v, host, stream))
    return step, (down, up)


def check_depths(step_ms: float | None, copy_ms: float | None, in_depth: int | None, out_depth: int | None,
                 gs: GrayScott | None = None) -> str:
    """Check ring depths chosen from measured times (notebook 13's timing cell); raise
    :class:`CapstoneError` saying what is missing or off, or return a one-line verdict.

    The times must be the learner's own measurement: ``copy_ms`` a time ``ch.elapsed_ms`` returned
    in this session, ``step_ms`` one divided by the whole number of steps it timed
    (:func:`~course_helper.streams.elapsed_times`; a typed-in number is refused, as notebook 3's
    check refuses rows written by hand), and each within :data:`TIMES_FACTOR` of the check's own
    timing of one step and one copy at ``gs``'s size (the balanced point by default), so that
    a time in µs, a block's time for a step's or the two swapped are refused.

    From those times, a feed buffer is taken from its upload to the end of its block, so the next
    upload must land during the blocks before it: ``1 + ceil(copy_ms / block)`` feed buffers, a
    block being ``gs.feed_every`` steps. A staging buffer is free once its copy has left:
    ``ceil(copy_ms / (gs.save_every * step_ms))`` of them. Each depth passes when it is that many
    or one more: fewer cannot hide the copies (:func:`check_capstone` would refuse the loop), and
    more only hold memory.

    >>> check_depths(step_ms, copy_ms, 2, 1)      # doctest: +SKIP
    'IN_DEPTH = 2 and OUT_DEPTH = 1 fit your times (they ask for 2 and 1)'
    """
    gs = GrayScott.balanced_point() if gs is None else checks.instance("gs", gs, GrayScott, "a GrayScott problem")
    given = {"step_ms": step_ms, "copy_ms": copy_ms, "IN_DEPTH": in_depth, "OUT_DEPTH": out_depth}
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise CapstoneError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set yet: time one step "
                            "and one copy at the balanced point, then choose the depths from those times")
    step_ms, copy_ms = _positive("step_ms", step_ms, False), _positive("copy_ms", copy_ms, False)
    depths = (_positive("IN_DEPTH", in_depth, True), _positive("OUT_DEPTH", out_depth, True))
    own_step, own_copies = _own_times(gs)
    if (own_step / TIMES_FACTOR <= copy_ms <= own_step * TIMES_FACTOR
            and any(c / TIMES_FACTOR <= step_ms <= c * TIMES_FACTOR for c in own_copies)):
        raise CapstoneError(f"step_ms = {step_ms:.4g} and copy_ms = {copy_ms:.4g} look swapped: the check timed one "
                            f"step at {own_step:.4g} ms and one copy at {own_copies[0]:.4g} ms")
    times = streams.elapsed_times()
    how = ("time it with timing events and ch.elapsed_ms (notebook 2) and compute it, in ms, from what elapsed_ms "
           "returned, rather than typing a number")
    if _steps_timed(copy_ms, times, 1) is None:
        raise CapstoneError(f"copy_ms = {copy_ms:g} is not a time ch.elapsed_ms returned in this session: {how}")
    if _steps_timed(step_ms, times, gs.steps) is None:
        raise CapstoneError(f"step_ms = {step_ms:g} is not a time ch.elapsed_ms returned in this session, nor one "
                            f"divided by the number of steps it timed: {how}")
    size = f"{gs.shape[0]}x{gs.shape[1]}"
    if not own_step / TIMES_FACTOR <= step_ms <= own_step * TIMES_FACTOR:
        raise CapstoneError(
            f"step_ms = {step_ms:.4g} is not one step's time at {size}: the check timed one step at {own_step:.4g} ms "
            f"(one copy at {own_copies[0]:.4g} ms). Time a block of {gs.feed_every} steps on one stream and divide "
            "by the steps, in ms")
    if not any(c / TIMES_FACTOR <= copy_ms <= c * TIMES_FACTOR for c in own_copies):
        raise CapstoneError(
            f"copy_ms = {copy_ms:.4g} is not one copy's time of a {size} field: the check timed one copy at "
            f"{own_copies[0]:.4g} ms (one step at {own_step:.4g} ms). Time one copy of a field between a pinned "
            "host array and the device, in ms")
    block = gs.feed_every * step_ms
    needed = (1 + math.ceil(copy_ms / block), max(1, math.ceil(copy_ms / (gs.save_every * step_ms))))
    asked = f"(they ask for {needed[0]} and {needed[1]})"
    why = {"IN_DEPTH": (f"the next upload ({copy_ms:.3f} ms) must land during the blocks of {gs.feed_every} steps "
                        f"({block:.3f} ms each) before its own, while the kernels read the other feed buffers"),
           "OUT_DEPTH": (f"a staging buffer is free once its copy ({copy_ms:.3f} ms) has left, and snapshots come "
                         f"every {gs.save_every} steps ({gs.save_every * step_ms:.3f} ms)")}
    few = [(name, d, n) for name, d, n in zip(("IN_DEPTH", "OUT_DEPTH"), depths, needed) if d < n]
    if few:
        name, d, n = few[0]
        raise CapstoneError(f"{name} = {d} is too shallow for your times {asked}: {why[name]}; with {d} the "
                            "kernels would wait for the copies, which would not run under them")
    many = [f"{name} = {d}" for name, d, n in zip(("IN_DEPTH", "OUT_DEPTH"), depths, needed) if d > n + 1]
    if many:
        raise CapstoneError(f"{' and '.join(many)} {'is' if len(many) == 1 else 'are'} deeper than your times need "
                            f"{asked}: the extra buffers only hold device memory; one more than asked is fine")
    return f"IN_DEPTH = {depths[0]} and OUT_DEPTH = {depths[1]} fit your times {asked}"


class _Program(LoopProgram):
    """The capstone's view of the loop under the sanitizer: a race's fix names the event the
    loop records after the first access but no stream waits for (the wait the loop left out),
    and an upload queued before the kernels of an earlier block have read the buffer it fills
    is told so (:meth:`_upload_too_early`)."""

    #: Steps per feed block of the problem checked (a subclass per run sets it): a kernel's block.
    feed_every: int | None = None

    def _race(self, first, second):
        error = super()._race(first, second)
        early = self._upload_too_early(first, second, error)
        if early is not None:
            return early
        after = [e for p, e, _ in self.records.get(first.thread, []) if p >= first.clock and self.label_of(e)]
        unwaited = [e for e in after
                    if not any(w.get(id(e), (None,))[0] is e for w in self.waited.values())]
        if not unwaited or unwaited[0] is after[0]:
            return error
        old, new = (f"wait for `{self.label_of(e)}` recorded after" for e in (after[0], unwaited[0]))
        if old not in error.fix:                 # another kind of fix (a wait queued too early)
            return error
        return LoopRaceError(str(error).replace(old, new), error.first, error.second, error.fix.replace(old, new),
                             error.note if isinstance(error, LoopRaceError) else "")


    def _upload_too_early(self, first, second, error):
        """An upload of block ``j``'s frame, then a kernel of an earlier block reading the buffer it
        filled: the kernel needs the frame it was ordered after, so the upload came too early (its
        stream should have waited for that block's last kernel), not the kernel's wait too late.
        The race told so, or None for any other race."""
        up, kernel = first.op, second.op
        if (self.feed_every is None or up is None or kernel is None or up.kind != OpKind.H2D or not first.write
                or kernel.kind != OpKind.KERNEL or second.write or up.level is None or kernel.level is None):
            return None
        frame, block = int(up.level), (int(kernel.level) - 1) // self.feed_every
        if block >= frame:               # the kernel needs this frame: its stream's wait is what is missing
            return None
        buffer = self.names.of(first.array, first.span)
        n1, n2 = self.stream_name(first.thread), self.stream_name(second.thread)
        op1, op2 = f"the upload of block {frame}'s frame (H2D level {frame})", f"the kernel `{kernel.name}`"
        waits = next((w for op, position, _, w in self.queued if op.stream is first.thread and position == first.clock),
                     [])
        meant = [e for e, follows in waits if self.label_of(e) and follows is not None
                 and follows.stream is second.thread]
        last = f"the last kernel of block {block}"
        if meant:
            event = f"`{self.label_of(meant[-1])}`"
            note = (f"`{n1}` waits for {event} before {op1}, but your loop records {event} on `{n2}` before {op2}, "
                    f"which still reads block {block}'s frame from {buffer}")
            fix = (f"record {event} on `{n2}` after {last}, so that {op1} waits until block {block} is done with "
                   f"{buffer}")
        else:
            note = ""
            fix = (f"make `{n1}` wait for an event recorded on `{n2}` after {last} before {op1}: it must not land in "
                   f"{buffer} while block {block} still reads it")
        headline = str(error).splitlines()[0]
        consequence = (f"and {op2}, of block {block}, reads block {block}'s frame, which {op1} has already replaced: "
                       f"the upload came too early" + (f" ({note})" if note else ""))
        message = f"{headline}\n  first:  {error.first},\n  then:   {error.second},\n  {consequence}.\n  Fix: {fix}."
        return LoopRaceError(message, error.first, error.second, fix, note)


class _LastWait:
    """Observer (of every thread): whether the loop (the function whose code is ``code``, or
    what it calls) waited for the whole device (``ch.synchronize()``) after it queued its last
    operation. The checker's own waits, after the loop returned, do not count."""

    def __init__(self, code):
        self.code, self.device_idle = code, False

    def op_queued(self, op: Op) -> None:
        self.device_idle = False

    def host_synced(self, target: Stream | Event | None) -> None:
        if target is not None:
            return
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self.code:
            frame = frame.f_back
        if frame is not None:
            self.device_idle = True


def _count(n, what):
    """"1 feed buffer", "2 feed buffers"."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def _names(run, gs, snapshots):
    """The learner's names for the problem's input ring and the snapshot stack: their parameters'."""
    params = list(inspect.signature(run).parameters)
    names = {}
    if len(params) >= 2:
        names[f"{params[0]}.frames"] = gs.frames.frames
        names[params[1]] = snapshots
    return names


def _run_small(run, gs):
    """Run the loop on a small problem under the sanitizer: its program (host waits in it,
    ``snapshots``, ``device_idle``: whether it ended with ``ch.synchronize()``)."""
    __tracebackhide__ = True
    if not callable(run):
        raise TypeError(f"run must be your function run_capstone(gs, snapshots), got {type(run).__name__}")
    snapshots = gs.empty_snapshots()
    synchronize()
    last = observe.add(_LastWait(getattr(run, '__code__', None)), every_thread=True)
    try:
        program_type = type("_Program", (_Program,), {"feed_every": gs.feed_every})
        program = run_checked(run, _names(run, gs, snapshots), CapstoneError, "give wrong snapshots",
                              args=(gs, snapshots), check_levels=False, program_type=program_type)   # level=: a label
    finally:
        observe.remove(last)
    program.snapshots, program.device_idle = snapshots, last.device_idle
    return program


def _run_reusing(run):
    """Run the loop on :data:`CHECK_POINT`, and again on :func:`check_problem` for the ring
    depths it used, until every buffer of both rings was used :data:`USES_PER_BUFFER` times
    (or the check would pass :data:`_CHECK_STEPS_MAX` steps): the last run's program, its
    problem, the depths ``(feed buffers, snapshot buffers)`` and how often the least used
    buffer of each ring was used."""
    __tracebackhide__ = True
    gs = GrayScott(**CHECK_POINT)
    while True:
        program = _run_small(run, gs)
        rings = _ring_uses(program, gs)
        depths = tuple(len(uses) for uses in rings)
        fewest = tuple(min(uses.values(), default=USES_PER_BUFFER) for uses in rings)
        if min(fewest) >= USES_PER_BUFFER:
            return program, gs, depths, fewest
        longer = check_problem(max(depths[0], 1), max(depths[1], 1))
        steps = min(longer.steps, _CHECK_STEPS_MAX)
        if steps <= gs.steps:            # reused as often as fits, or some buffer taken more rarely than its ring
            return program, gs, depths, fewest
        gs = GrayScott(n=longer.n, steps=steps, feed_every=longer.feed_every, save_every=longer.save_every)


def _reuse(depths, fewest) -> str:
    """How the small run used the loop's rings, truly: "each of your 2 feed buffers and 1 buffer your
    snapshots leave from reused at least twice", or how often the least used one was used."""
    rings = (_count(depths[0], "feed buffer"), f"{_count(depths[1], 'buffer')} your snapshots leave from")
    if min(fewest) >= USES_PER_BUFFER:
        return f"with each of your {rings[0]} and {rings[1]} reused at least twice"
    told = [f"your {ring}" + (" each reused at least once" if uses == 2 else f" each reused at least {uses - 1} times"
                               if uses > 2 else ", some of them used only once (never reused)")
            for ring, uses in zip(rings, fewest)]
    return (f"with {told[0]}, and {told[1]}, in the longest run the check makes ({_CHECK_STEPS_MAX} steps at most): a "
            "race between two uses of a buffer shows only when it is reused")


def _ring_uses(program, gs) -> tuple[Counter, Counter]:
    """The loop's two rings, as the copies used them: how often each device buffer received an
    upload from ``gs.frames`` (the feed ring), and how often each was read by a copy into the
    snapshots (the buffers snapshots leave from); keyed by byte span."""
    frames, stack = byte_span(gs.frames.frames), byte_span(program.snapshots)
    feed, out = Counter(), Counter()
    for op, *_ in program.queued:
        if op.kind == OpKind.H2D and op.writes and any(spans_overlap(byte_span(a), frames) for a in op.reads):
            feed[byte_span(op.writes[0])] += 1
        elif op.kind == OpKind.D2H and op.reads and any(spans_overlap(byte_span(a), stack) for a in op.writes):
            out[byte_span(op.reads[0])] += 1
    return feed, out


def _device_spans(value, depth=0):
    """The byte spans of the device arrays in what a loop returned (in lists, tuples, sets and
    dicts, a few deep)."""
    if is_device_array(value):
        return [byte_span(value)]
    if depth > 4:
        return []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set)) else ()
    return [span for item in items for span in _device_spans(item, depth + 1)]


def _unreturned(program):
    """The device buffers the loop queued work on but did not return, by the name the loop gave them:
    name -> {span: None}, in order; nothing for a loop that ended with ``ch.synchronize()``, which may
    let them go."""
    if program.device_idle:
        return {}
    kept = [s for s in _device_spans(program.returned) if s is not None]
    missing = {}
    for op, *_ in program.queued:
        for a in (*op.reads, *op.writes):
            span = byte_span(a) if is_device_array(a) else None
            if span is not None and not any(k[0] == span[0] and k[1] <= span[1] and span[2] <= k[2] for k in kept):
                missing.setdefault(program.names.of(a, span), {})[span] = None
    return missing


def _check_renewed(program, run):
    """One variable bound to a new device buffer on each turn: each is let go inside the loop, when the
    variable takes the next, while work queued on it may still run; returning the variable keeps only
    the last. Judged before the snapshots, since on a GPU the memory pool may already have handed such
    a buffer to a later allocation and made a snapshot wrong."""
    __tracebackhide__ = True
    name = getattr(run, "__name__", "your loop")
    renewed = [f"`{n}`" for n, spans in _unreturned(program).items()
               if len(spans) > 1 and "[" not in n and " " not in n]
    if renewed:
        raise CapstoneError(f"{' and '.join(renewed)} {'holds' if len(renewed) == 1 else 'hold'} a new device "
                            f"buffer on each turn of `{name}`: each one is let go when the variable takes the next, "
                            "while the copies and kernels queued on it may still run, and the memory pool can hand "
                            "it to the next allocation (notebook 9's buffer let go too early; on a GPU that can "
                            "make snapshots wrong). Fix: make the ring's buffers once, before the loop, reuse them "
                            f"in turn, and return them from `{name}` (the rule of section 13.2)")


def _check_returned(program, run, gs):
    """Every device buffer the loop queued work on must be among those it returned: when the
    loop returns, its locals go, and a buffer let go while queued work still uses it may be
    handed to the next allocation (the rule of section 13.2). A loop that ended with
    ``ch.synchronize()`` may let them go."""
    __tracebackhide__ = True
    missing = _unreturned(program)
    name = getattr(run, "__name__", "your loop")
    if missing:
        listed = ", ".join(list(missing)[:8]) + (", ..." if len(missing) > 8 else "")
        raise CapstoneError(f"all {gs.nsnapshots} snapshots are right, but `{name}` does not return {listed}, "
                            f"device buffers its queued work uses: when `{name}` returns, their last references go "
                            "while the device may still be using them, and the memory pool can hand them to the next "
                            "allocation (notebook 9's buffer let go too early). Fix: return them from "
                            f"`{name}` (the rule of section 13.2); the caller keeps them until the device is done")


def _compare(program, gs):
    """Compare the small run's snapshots with the one-stream loop's, by content."""
    __tracebackhide__ = True
    snapshots = program.snapshots
    observe.notify("host_access", snapshots, "r", "check_capstone")
    expected = sequential_snapshots(gs)
    unwritten = [i for i in range(gs.nsnapshots) if np.isnan(snapshots[i]).all()]
    wrong = [i for i in range(gs.nsnapshots) if i not in unwritten and not np.array_equal(snapshots[i], expected[i])]
    if not unwritten and not wrong:
        return
    problems = []
    if unwritten:
        problems.append(f"snapshots {unwritten} were never written: snapshot i is v after step "
                        f"(i + 1) * gs.save_every, copied into snapshots[i]")
    labels = _labels(program, gs)
    tell = _WhichWrong(gs, expected) if wrong else None
    for i in wrong[:3]:
        found = [k for k in range(gs.nsnapshots) if np.array_equal(snapshots[i], expected[k])]
        if not found:
            problems.append(f"snapshots[{i}] differs from the one-stream loop's ({tell(i, snapshots[i])})")
            continue
        level = gs.snapshot_steps[found[0]]
        label = labels.get(i)
        problems.append(f"snapshots[{i}] holds snapshot {found[0]} (v after step {level})" +
                        (f": your copy labelled level {label} holds level {level}" if label not in (None, level)
                         else ""))
    raise CapstoneError(f"{len(unwritten) + len(wrong)} of {gs.nsnapshots} snapshots are wrong, though the race "
                        "sanitizer found no race: the order is right and an index is not. " + "; ".join(problems))


class _WhichWrong:
    """Says what a wrong snapshot holds, where a NumPy run of the small problem can tell: ``u``
    instead of ``v``, ``v`` after another step (taken before the step, or a step off), or ``v``
    computed with each block reading another block's feed frame. Compared within a tolerance
    scaled to the expected snapshot (a GPU's kernel is not NumPy's to the bit)."""

    def __init__(self, gs: GrayScott, expected: np.ndarray):
        self.gs, self.expected = gs, expected
        self.runs = {}                        # feed shift -> (u after each step, v after each step)

    def _run(self, shift):
        if shift not in self.runs:
            gs = self.gs
            u, v = gs.initial()
            us, vs = [u.copy()], [v.copy()]
            nxt = [np.empty_like(u), np.empty_like(v)]
            for n in range(gs.steps):
                j = n // gs.feed_every + shift        # the ring takes it modulo its frames, as an upload does
                _numpy_step(u, v, gs.frames[j], nxt[0], nxt[1], *gs.scalars())
                (u, v), nxt = nxt, [u, v]
                us.append(u.copy())
                vs.append(v.copy())
            self.runs[shift] = (us, vs)
        return self.runs[shift]

    def __call__(self, i: int, got: np.ndarray) -> str:
        gs = self.gs
        step = gs.snapshot_steps[i]
        atol = 1e-5 * max(1.0, float(np.abs(self.expected[i]).max()))

        def same(a, b):
            return a.shape == b.shape and bool(np.allclose(a, b, rtol=0, atol=atol))
        us, vs = self._run(0)
        if not np.isfinite(got).all():
            return "it holds values that are not numbers: a buffer never written, or read before it was"
        if same(got, us[step]):
            return f"it holds u after step {step}, not v: copy the field v"
        near = [k for k in (step - 1, step + 1, step - 2, step + 2) if 0 <= k <= gs.steps and same(got, vs[k])]
        if near:
            k = near[0]
            when = ("the copy was queued before the step that ends the snapshot; copy v after that step"
                    if k == step - 1 else "a step off")
            return f"it holds v after step {k}, not after step {step}: {when}"
        for shift in (1, -1):
            if same(got, self._run(shift)[1][step]):
                return (f"each block's kernels read the feed frame of block j {'+' if shift > 0 else '-'} 1 instead of "
                        "block j's: upload frame j into the buffer block j reads")
        return "a step, a field or a feed frame is not the one the loop should use there"


def _labels(program, gs):
    """Snapshot index -> the ``level=`` label of the last copy into it (information for messages only)."""
    stack = program.snapshots
    found = {}
    for op, *_ in program.queued:
        if op.kind == OpKind.D2H and op.level is not None:
            for i in range(gs.nsnapshots):
                if any(shares_memory(a, stack[i]) for a in op.writes):
                    found[i] = int(op.level)
    return found


#: The blocking copies a loop might use instead of queued ones, by what their host access is called.
_BLOCKING = {"to_device": OpKind.H2D, "copy_to_host": OpKind.D2H}


class _SetUp:
    """Observer at the balanced point: counts the uploads queued before the first kernel that
    carry no feed frame (the loop's set-up, e.g. the initial fields). It keeps no arrays."""

    def __init__(self, frames):
        self.frames, self.kernels, self.count = byte_span(frames), 0, 0
        # Blocking copies after the first kernel (ch.to_device, ch.copy_to_host): the host waited for
        # each, and none is an asynchronous copy a trace can show under the kernels.
        self.blocking = {OpKind.H2D: 0, OpKind.D2H: 0}

    def host_access(self, array: np.ndarray, mode: str, where: str) -> None:
        if self.kernels and where in _BLOCKING:
            self.blocking[_BLOCKING[where]] += 1

    def op_queued(self, op: Op) -> None:
        if op.kind == OpKind.KERNEL:
            self.kernels += 1
        elif op.kind == OpKind.H2D and not self.kernels and not any(spans_overlap(byte_span(a), self.frames)
                                                                     for a in op.reads):
            self.count += 1


def _without_set_up(trace: Trace, count: int) -> Trace:
    """The trace without ``count`` uploads that started before the first kernel (the set-up:
    the kernels are ordered after it, so no kernel ran under it; any ``count`` of the uploads
    before the first kernel leave the same overlap, and the earliest are dropped)."""
    kernels = trace.kernels
    if not count or not kernels:
        return trace
    first = kernels[0].start_ms
    dropped = {id(e) for e in [e for e in trace.of_kind(OpKind.H2D) if e.start_ms < first][:count]}
    return Trace([e for e in trace.events if id(e) not in dropped], trace.tracks, trace.meta)


def _balanced(run) -> tuple[dict, Trace, int, dict]:
    """Run the loop at the balanced point on a timeline: the hidden share of each copy direction
    (set-up uploads not counted), the trace, how many set-up uploads it had, and how many blocking
    copies of each direction it made after its first kernel."""
    __tracebackhide__ = True
    gs = GrayScott.balanced_point()
    snapshots = gs.empty_snapshots()
    with timing_only():
        kept = run(gs, snapshots)                 # once untimed: on a GPU the first run sets up
        synchronize()
        kept = None                               # its buffers go before the timed run makes its own
        set_up = observe.add(_SetUp(gs.frames.frames))
        try:
            with recording.tracing(strategy="capstone check") as handle:
                kept = run(gs, snapshots)         # its buffers kept until the device is done with them
                synchronize()
        finally:
            observe.remove(set_up)
    del kept
    trace = handle.trace
    return hidden_by_direction(_without_set_up(trace, set_up.count)), trace, set_up.count, set_up.blocking


def _why(program: LoopProgram, direction: str) -> str:
    """Why the copies of ``direction`` could not run during the kernels, in the learner's names."""
    serial = program.why_serial(lambda op: op.kind == direction)
    if serial is None:
        # A kernel waiting for its block's upload is the rule; one waiting for a download is the stall
        waited = _kernel_waits_for(program, direction) if direction == OpKind.D2H else None
        if waited is not None:
            # Each copy may start under a kernel or two, but a kernel soon after waits for the copy itself:
            # the kernels idle while it finishes.
            kernel, event, copy = waited
            label = program.label_of(event)
            name = f"`{label}`" if label else "an event"
            return (f"the kernels wait for each download: before {_name(kernel)} your loop makes "
                    f"`{program.stream_name(kernel.stream)}` wait for {name}, recorded after {_name(copy)} on "
                    f"`{program.stream_name(copy.stream)}`, so the kernels idle until each download is done; stage "
                    "each snapshot into a buffer of its own (a ring of OUT_DEPTH on the device) and copy that out, so "
                    "that a kernel waits only for the copy out of the staging buffer it overwrites")
        if _kernel_waits_for(program, OpKind.D2H) is not None:      # uploads, while the kernels wait for downloads
            return ("nothing orders them before or after the kernels, but the kernels were idle while they ran, "
                    "waiting for the downloads")
        return ("nothing orders them before or after the kernels, but the kernels were idle while they ran, waiting "
                "for something else: look at your loop's timeline for what `compute` waits for")
    return explain_serial(program, serial, _name, copies="they", kernels_stream="the stream of the kernels",
                          own_stream="give them a stream of their own",
                          consequence=("the kernels waited for each copy and the copies for the kernels: a deeper ring "
                                       "lets the next copy run while this block computes"),
                          ordered=("every copy is ordered before or after every kernel by the events your streams "
                                   "wait for"))


def _kernel_waits_for(program: LoopProgram, direction: str) -> tuple[Op, Any, Op] | None:
    """The first kernel whose stream waited, just before it, for an event recorded after a copy of
    ``direction``: ``(kernel, event, copy)``, or None when no kernel waits for such a copy."""
    for op, _, _, waits in program.queued:
        if op.kind != OpKind.KERNEL:
            continue
        for event, follows in waits:
            if follows is not None and follows.kind == direction:
                return op, event, follows
    return None


def _name(op: Op) -> str:
    if op.kind == OpKind.KERNEL:
        return f"the kernel `{op.name}`"
    return f"the {op.kind} copy" + (f" of level {op.level}" if op.level is not None else "")
