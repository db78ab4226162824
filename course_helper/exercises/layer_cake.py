"""The layer-cake exercise: fill the planes of a 3D stack on the device, one
kernel per plane, and copy each plane to the host while the next is baked.

:func:`bake_layer` is the "kernel", :func:`check_layer_cake` the checker that
says what is wrong with a learner's result, and :func:`layer_values` the
expected content of a plane.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import checks, runtime, streams
from ..memory import is_device_array, is_pinned
from ..runtime import observe
from ..runtime.base import byte_span
from ..runtime.ops import KernelCost, OpKind
from ..streams import synchronize
from ..timelines import recording
from ..timelines.timeline import covered_length, intersection_length, merge_intervals
from .core import ExerciseError, LoopProgram, describe_waits, explain_serial, learner_names, run_checked

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from numpy.typing import ArrayLike

    from ..runtime.observe import Op
    from ..streams import Stream

__all__ = ["bake_layer", "layer_values", "check_layer_cake", "LayerCakeError", "oven_us", "OVEN_GBPS",
           "OVERLAP_NEEDED"]

_SOURCE = r"""
extern "C" __global__ void bake_layer(float* plane, const int n0, const int n1, const int k,
                                      const unsigned long long oven_ns) {
    // The oven: each block's first thread waits oven_ns on the GPU's global timer. The grid is
    // small enough that every block is resident at once, so the blocks wait together and the
    // kernel takes about oven_ns plus the time to write the plane.
    if (oven_ns > 0 && threadIdx.x == 0) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < oven_ns);
    }
    __syncthreads();
    const long long size = (long long)n0 * n1;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < size;
         idx += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(idx / n1), j = (int)(idx % n1);
        // Layer k holds k + a small pattern in [0, 0.5): the integer part says which layer it is.
        plane[idx] = (float)k + 0.5f * (float)((i * 7 + j * 3) % 64) / 64.0f;
    }
}
"""

#: How fast the oven bakes: a plane of ``nbytes`` stays ``nbytes / OVEN_GBPS`` ns in it. At about 1.5
#: times the rate of a pinned device-to-host copy on the course's H200 (55 GB/s), a bake takes about
#: two thirds of its plane's copy: long enough that overlapping them matters, short enough that the
#: bakes can hide under the copies.
OVEN_GBPS = 80.0


def oven_us(nbytes: int) -> float:
    """How long (µs) :func:`bake_layer` keeps a plane of ``nbytes`` in the oven."""
    return nbytes / (OVEN_GBPS * 1e3)


class LayerCakeError(ExerciseError):
    """The stack is not what the exercise expects; the message says why and what to try."""


def layer_values(k: int, shape: tuple[int, int]) -> np.ndarray:
    """The expected content of plane ``k`` (float32), computed on the host."""
    n0, n1 = shape
    i = np.arange(n0)[:, None]
    j = np.arange(n1)[None, :]
    pattern = ((i * 7 + j * 3) % 64).astype(np.float32)
    return np.float32(k) + np.float32(0.5) * pattern / np.float32(64.0)


_compiled = {}


def _kernel():
    """The compiled kernel and the largest grid whose blocks are all resident at once."""
    if not _compiled:
        import cupy      # called by the GPU runtime only; the CPU backend never imports CuPy
        _compiled["kernel"] = cupy.RawKernel(_SOURCE, "bake_layer")
        # Two blocks of 256 threads per multiprocessor always fit (every CUDA GPU holds at least 1,024
        # threads per multiprocessor): all blocks are in the oven at the same time.
        _compiled["blocks"] = 2 * cupy.cuda.Device().attributes["MultiProcessorCount"]
    return _compiled["kernel"], _compiled["blocks"]


def bake_layer(plane: Any, k: int, stream: Stream | None = None, *, oven: bool = True) -> None:
    """Queue the kernel that bakes layer ``k`` into the device array ``plane`` on ``stream``.

    The kernel keeps the plane in the oven for :func:`oven_us` (``plane.nbytes`` at
    ``OVEN_GBPS``), about two thirds of the time its copy to the host takes on the course's
    H200, then fills it with :func:`layer_values` ``(k, plane.shape)``. ``oven=False`` leaves out
    the oven (the calibration times the kernel's own work this way; the model adds the oven).
    """
    if not is_device_array(plane):
        raise TypeError("plane must be a device array (device_empty/device_zeros)")
    if plane.ndim != 2 or plane.dtype != np.float32 or not plane.flags.c_contiguous:
        raise ValueError(f"plane must be a C-contiguous 2D float32 array, got {plane.dtype} {plane.shape}")
    k = checks.positive_int("k (layer number)", k, minimum=0)
    oven = checks.flag("oven", oven)
    stream = streams.resolve(stream)
    n0, n1 = plane.shape
    hold_us = oven_us(plane.nbytes) if oven else 0.0

    def cuda(raw_stream):
        kernel, most = _kernel()
        blocks = max(1, min(most, -(-plane.size // 256)))
        with raw_stream:
            kernel((blocks,), (256,), (plane, np.int32(n0), np.int32(n1), np.int32(k),
                                       np.uint64(round(hold_us * 1e3))))

    def numpy(out):
        np.copyto(out, layer_values(k, (n0, n1)))

    op = observe.Op(OpKind.KERNEL, f"bake layer {k}", stream, k, 0, (), (plane,))
    runtime.submit(stream, op, cuda=cuda, numpy=numpy,
                   cost=KernelCost("bake", plane.nbytes, hold_us))


#: The share of the shorter of the two (bakes or copies) that must run under the other: the
#: solution hides all bakes but the first (about 0.96 with 24 planes), a serial loop none.
OVERLAP_NEEDED = 0.5


def check_layer_cake(stack: ArrayLike, nplanes: int | None = None, loop: Callable[[], None] | None = None,
                     buffers: Sequence[Any] | None = None) -> str:
    """Check a layer cake; raise :class:`LayerCakeError` saying what is wrong.

    Without ``loop``, it checks that every plane of ``stack`` holds its own layer.
    With ``loop`` (a function of no arguments that queues the whole cake into
    ``stack``), the checker runs the loop three ways and asks for three things:

    1. no race: run under the race sanitizer, a missing or misplaced dependency
       fails every time, whatever the timing, with the dependency to add;
    2. the right cake, and the host never waiting inside the loop (rule 3);
    3. overlap: run again under :func:`course_helper.tracing` (CUPTI on the GPU,
       the model on the CPU backend), at least ``OVERLAP_NEEDED`` of the bakes'
       or the copies' busy time (the shorter) must run under the other. A loop
       that runs them one after the other is told what ordered them so. When
       the run shows too little but the loop's order does not serialise them
       (planes too small for the device to get ahead of the host), the order
       is judged instead: the overlap its dependencies allow with the whole
       loop queued ahead of the device (the message says which was judged).

    A copy's ``level=`` is only a label (it names the copy on timelines and in
    messages): which layer a plane holds is read from the plane itself.

    Messages name the streams, events and buffers as the loop's own variables
    do (``io[0]``, ``baked[1]``, ``buffers[2]``); ``buffers`` names the device
    plane buffers where the loop's variables do not. Returns a one-line success
    message.
    """
    __tracebackhide__ = True       # a failure shows the learner's cell, not this file
    if is_device_array(stack):
        raise LayerCakeError("the stack is still on the device: the exercise copies every plane to a "
                             "host array made with pinned_empty((nplanes, n0, n1))")
    stack = np.asarray(stack)
    if stack.ndim != 3:
        raise LayerCakeError(f"the stack should be 3D (nplanes, n0, n1), got shape {stack.shape}")
    nplanes = stack.shape[0] if nplanes is None else checks.positive_int("nplanes", nplanes)
    if stack.shape[0] != nplanes:
        raise LayerCakeError(f"the stack has {stack.shape[0]} planes but the cake has {nplanes}")
    program = _run_checked(loop, stack, buffers) if loop is not None else None
    observe.notify("host_access", stack, "r", "check_layer_cake")
    problems, unwritten = [], []
    late = _copied_too_late(program, stack) if program else {}
    for k in range(nplanes):
        plane = stack[k]
        if np.isnan(plane).any():
            unwritten.append(k)
            continue
        if not np.isfinite(plane).all():
            problems.append(f"plane {k} holds non-finite values (inf): it was never a layer - check what "
                            "filled the host stack")
            continue
        expected = layer_values(k, plane.shape)
        if np.array_equal(plane, expected):
            continue
        layers = np.unique(np.floor(plane).astype(np.int64))
        if len(layers) == 1 and late.get(k, (None,))[0] == layers[0]:
            layer, buffer = late[k]
            problems.append(f"plane {k} (stack[{k}]) holds layer {layer}: its copy read {buffer} after the bake of "
                            f"layer {layer} had refilled it (layer {k} was baked there before)")
        elif len(layers) == 1 and layers[0] != k:
            problems.append(f"plane {k} (stack[{k}]) holds layer {int(layers[0])}" + (
                "" if program else ": either an index is wrong (the plane you copy into, the layer you bake) "
                "or its buffer was refilled before the copy read it (a race: pass loop= to tell which)"))
        elif len(layers) > 1:
            problems.append(f"plane {k} (stack[{k}]) mixes layers {[int(x) for x in layers]}" + (
                ": parts of it come from different bakes - check what you copy into it" if program else
                ": the copy overlapped the bake of the same buffer (pass loop= to find the missing wait)"))
        else:
            problems.append(f"plane {k} (stack[{k}]) has the right layer number but wrong values")
    wrong = len(problems) + len(unwritten)
    if unwritten:
        problems.append(f"{_planes(unwritten)} never (fully) written" +
                        (": is every plane copied into its own stack[k]?" if program else
                         " - is every plane copied, and did you synchronise before checking?"))
    if problems:
        head = f"{wrong} of {nplanes} planes are wrong"
        if late:       # no race, yet a copy is ordered after a later bake of the buffer it reads
            head += (". The race sanitizer found no race, but a copy ordered after a later bake of its buffer "
                     "copies that bake's layer: copy each plane out of its buffer before the buffer is baked "
                     "again (make `compute` wait for an event recorded after the copy before it bakes into that "
                     "buffer again)")
        elif program:  # ran under the sanitizer and no race was found: the order is right, an index is not
            head += (". The race sanitizer found no race, so your loop's order is right and an index is "
                     "wrong: layer k belongs in stack[k] (check the plane you copy into and the layer you bake)")
        raise LayerCakeError(head + ":\n  - " + "\n  - ".join(problems[:6]) + ("\n  ..." if len(problems) > 6 else ""))
    if program and program.host_waits:
        waits = program.host_waits
        raise LayerCakeError(f"all {nplanes} layers are correct, but the host waited inside the loop "
                             f"{len(waits)} times ({describe_waits(waits)}); rule 3: the host never waits in "
                             "the loop - let the streams wait for events instead (stream.wait_event(event))")
    pinned = "" if is_pinned(stack) else " (note: the host stack is not pinned, so copies could not overlap)"
    if program is None:
        return f"all {nplanes} layers are correct{pinned}"
    judged = _check_overlap(loop, program, stack)
    if judged is None:
        return (f"all {nplanes} layers are correct and the host never waited in the loop (the overlap was not "
                f"measured: the loop queued its work from another thread, which a trace does not see){pinned}")
    return f"all {nplanes} layers are correct, the host never waited in the loop, and {judged}{pinned}"


def _planes(ks):
    """"plane 3 was" or "planes 3, 4, 9-23 were", the planes ``ks`` (sorted) in runs."""
    runs = []
    for k in ks:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return f"plane {text} was" if len(ks) == 1 else f"planes {text} were"


def _check_overlap(loop, program, stack):
    """Run ``loop`` again, traced, and judge rule 4: the success sentence's end (what was judged),
    None when the trace saw no bake or copy (queued by another thread). Raise
    :class:`LayerCakeError` when the bakes and copies neither ran at the same time in this run nor
    could in the order the loop set (``program``): why, from that order."""
    __tracebackhide__ = True
    nplanes = len(stack)
    with recording.tracing(strategy="layer cake check") as handle:
        loop()
        synchronize()
    trace = handle.trace
    if not trace.kernels or not trace.of_kind(OpKind.D2H):
        return None
    ov = trace.overlap()
    if ov.hidden_fraction >= OVERLAP_NEEDED:
        return "the copies ran while the next planes baked"
    measured = (f"In this run's trace ({trace.clock}) the bakes kept the device busy {ov.compute_ms:.2f} ms "
                f"and the copies {ov.copy_ms:.2f} ms, at the same time for {ov.overlap_ms:.2f} ms: "
                f"{ov.hidden_fraction:.0%} of the shorter ran under the other; the exercise asks for "
                f"{OVERLAP_NEEDED:.0%}.")
    why = _why_serial(program, stack)
    if why is not None:
        raise LayerCakeError(f"all {nplanes} layers are correct and the host never waited, but the bakes and "
                             f"the copies ran one after the other, as your loop's order makes them: {why}. {measured}")
    # The order lets some copies run during bakes and the host never waited, yet this run showed too
    # little: most likely its planes were too small for the device to get ahead of the host. Judge the
    # order itself.
    ordered = ordered_overlap(program)
    work = trace.kernels + trace.of_kind(OpKind.D2H)
    per_plane = 1e3 * (max(e.end_ms for e in work) - min(e.start_ms for e in work)) / nplanes
    bake, copy = (1e3 * sum(e.end_ms - e.start_ms for e in es) / len(es)
                  for es in (trace.kernels, trace.of_kind(OpKind.D2H)))
    run = (f"in this run's trace ({trace.clock}) a bake took {bake:.0f} µs and a copy {copy:.0f} µs, the run "
           f"{per_plane:.0f} µs a plane" +
           (", so the device finished each plane before the host had queued the next" if per_plane >= bake + copy
            else "") + f", and {ov.hidden_fraction:.0%} of the shorter ran under the other")
    if ordered >= OVERLAP_NEEDED:
        return (f"your loop's order lets the copies run while the next planes bake: queued ahead of the device, "
                f"{ordered:.0%} of the shorter of the bakes and the copies would run under the other (judged "
                f"from the order, as this run did not show it: {run})")
    raise LayerCakeError(
        f"all {nplanes} layers are correct and the host never waited, but your loop's order lets only "
        f"{ordered:.0%} of the shorter of the bakes and the copies run under the other, even queued ahead of "
        f"the device (judged from the order; the exercise asks for {OVERLAP_NEEDED:.0%}): most copies are "
        "ordered before or after the bakes around them by the events your streams wait for. A bake needs "
        f"to wait only for the copy out of the buffer it refills ({run})")


#: The rate (GB/s) of a pinned device-to-host copy on the course's H200 (its profile's ``D2H`` link,
#: rounded), for the order's schedule (:func:`ordered_overlap`): only its ratio to ``OVEN_GBPS``
#: matters there.
_COPY_GBPS = 55.0


def ordered_overlap(program: LoopProgram) -> float:
    """How much of the shorter of the bakes and the device-to-host copies would run under the
    other if the host had queued the whole loop before the device began: the overlap the loop's
    order allows, whatever the size of its planes.

    Each operation starts once everything ordered before it has ended (the operation before it on
    its stream, and what the events its stream waited for were recorded after: its vector clock);
    the bakes take turns on one compute engine, and the copies to the host on the link (the
    H200's calibration found one copy at a time per direction). A bake lasts its oven time, a
    copy its bytes at ``_COPY_GBPS``, anything else (a copy on the device, a fill) no time: it
    only orders. Both durations grow with the plane's bytes, so the share is the one a run shows
    when its planes are big enough for the host to keep ahead of the device."""
    ends = {}                       # (id(stream), position on it) -> when that operation ended
    engine_free = {OpKind.KERNEL: 0.0, OpKind.D2H: 0.0}
    bakes, copies = [], []
    for op, position, clock, _ in program.queued:
        start = 0.0
        for stream, seen in clock.items():      # the last operation of each stream ordered before op
            last = seen - 1 if stream is op.stream else seen
            start = max(start, ends.get((id(stream), last), 0.0))
        if op.kind == OpKind.KERNEL:
            took = oven_us(op.writes[0].nbytes) if op.writes else 0.0
        elif op.kind == OpKind.D2H:
            took = op.nbytes / (_COPY_GBPS * 1e3)
        else:
            took = 0.0
        if op.kind in engine_free:
            start = max(start, engine_free[op.kind])
            engine_free[op.kind] = start + took
            (bakes if op.kind == OpKind.KERNEL else copies).append((start, start + took))
        ends[(id(op.stream), position)] = start + took
    baking, copying = merge_intervals(bakes), merge_intervals(copies)
    shorter = min(covered_length(baking), covered_length(copying))
    return intersection_length(baking, copying) / shorter if shorter > 0 else 0.0


def _plane(op: Op, stack: np.ndarray) -> int | None:
    """The plane of ``stack`` a copy writes (None for other operations)."""
    if op.kind != OpKind.D2H or not op.writes:
        return None
    space, lo, _ = byte_span(op.writes[0])
    _, first, end = byte_span(stack)
    return (lo - first) // stack.strides[0] if space == "host" and first <= lo < end else None


def _copied_too_late(program: LoopProgram, stack: np.ndarray) -> dict[int, tuple[int, str]]:
    """The planes whose copy is ordered after a later bake refilled the buffer it reads:
    ``{plane: (the layer that bake wrote, the buffer's name)}``, where the plane's own layer was
    baked into that same buffer before. No race, yet the copy saves the wrong layer. A plane
    copied into more than once is left out: there an index is wrong, not a copy's time. (A
    bake's level is the layer it writes, so this reads no label of the learner's.)"""
    found, copies = {}, {}
    for op, *_ in program.queued:
        plane = _plane(op, stack)
        copies[plane] = copies.get(plane, 0) + 1
    for i, (op, _, clock, _) in enumerate(program.queued):
        plane = _plane(op, stack)
        if plane is None or not op.reads or copies[plane] > 1:
            continue
        source = byte_span(op.reads[0])
        bakes = [q[0] for q in program.queued[:i] if q[0].kind == OpKind.KERNEL and q[0].writes
                 and byte_span(q[0].writes[0]) == source and clock.get(q[0].stream, 0) >= q[1]]
        if len(bakes) > 1 and bakes[-1].level != plane and any(b.level == plane for b in bakes):
            found[plane] = (int(bakes[-1].level), program.names.of(op.reads[0], source))
    return found


def _why_serial(program: LoopProgram, stack: np.ndarray) -> str | None:
    """Why no copy could run during a bake, in the learner's names; None when some could."""
    def name_op(op):
        plane = _plane(op, stack)
        if plane is not None:
            return f"the copy of plane {plane}"
        return f"the bake of layer {op.level}" if op.kind == OpKind.KERNEL else f"the {op.kind} `{op.name}`"

    serial = program.why_serial(lambda op: _plane(op, stack) is not None)
    if serial is None:
        return None
    nbuf = len({byte_span(q[0].writes[0]) for q in program.queued if q[0].kind == OpKind.KERNEL and q[0].writes})
    if nbuf > 1:
        refill = (f"A bake needs only the copy out of the buffer it refills, {nbuf} planes back, done long before "
                  "if each buffer has its own events")
    else:            # one buffer: the wait is needed, the buffer is what is missing
        refill = ("With one buffer that wait is needed (the bake refills the buffer the copy reads), so nothing "
                  "can overlap: bake into several buffers in turn (buffers[k % nbuf]), each with its own events")
    return explain_serial(program, serial, name_op, copies="the copies", kernels_stream="the stream that bakes",
                          own_stream="copy on the IO streams instead",
                          consequence=f"each bake waited for the copy before it, and each copy for its bake. {refill}",
                          ordered=("every copy is ordered before or after every bake by the events your streams wait "
                                   "for, so none could run during a bake"))


def _run_checked(loop, stack, buffers):
    """Run the learner's loop into a fresh (NaN) stack under the sanitizer: the program that
    watched it, with the host waits in it."""
    __tracebackhide__ = True
    if not callable(loop):
        raise TypeError(f"loop must be a function that queues the whole cake, got {type(loop).__name__}")
    synchronize()                                  # nothing earlier still writes the stack
    observe.notify("host_access", stack, "w", "check_layer_cake")
    stack.fill(np.nan)
    names = {"stack": stack}
    if buffers and "buffers" not in learner_names(loop):      # the loop's own name comes first
        names["buffers"] = list(buffers)
    # check_levels=False: a copy's level= only labels it; the check reads which layer a plane holds
    # from the plane itself
    return run_checked(loop, names, LayerCakeError, "bake a wrong cake", check_levels=False)
