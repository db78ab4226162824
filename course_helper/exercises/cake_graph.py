"""Notebook 10's exercise: notebook 8's layer cake, captured into a CUDA graph.

Many small planes make the layer cake launch-bound, as the wave's small grids are: the host's
six calls per plane take longer than the plane's bake and copy. The learner writes
``capture(stack, compute, io, buffers, baked, copied)``, which captures the cake's loop
(:func:`cake_loop`) into a graph and returns it. :func:`check_cake_graph` replays that graph into
an empty stack and asks for every plane, copies that run while the next planes bake (notebook 8's
rule: :data:`~.layer_cake.OVERLAP_NEEDED` of the shorter of the bakes and the copies under the
other, in a traced replay), in at most half the time of the same loop queued from Python (the
stream loop). On the CPU backend both times are the modelled GPU's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import graphs
from ..memory import copy_to_host_async, device_empty, pinned_empty
from ..streams import create_events, create_streams, synchronize
from .core import ExerciseError, Verdict, run_checked, time_ms
from .layer_cake import OVERLAP_NEEDED, bake_layer, layer_values, ordered_overlap

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..streams import Stream

__all__ = ["CAKE_GRAPH_PLANES", "CAKE_GRAPH_SHAPE", "CAKE_GRAPH_BUFFERS", "GRAPH_SHARE",
           "cake_loop", "cake_kit", "time_ms", "check_cake_graph"]

#: The cake of notebook 10: many small planes, so that the host's calls set the stream loop's pace.
CAKE_GRAPH_PLANES, CAKE_GRAPH_SHAPE, CAKE_GRAPH_BUFFERS = 240, (128, 128), 3
#: The replay must take at most this share of the stream loop's time.
GRAPH_SHARE = 0.5


def cake_loop(stack: Any, compute: Stream, io: list[Stream], buffers: list[Any], baked: list[Any],
              copied: list[Any]) -> None:
    """Notebook 8's loop: bake plane k on ``compute`` into ``buffers[k % nbuf]``, copy it into
    ``stack[k]`` on ``io[k % nbuf]``; events order each copy after its bake and each bake after
    the copy out of its buffer, so the host never waits."""
    for k in range(len(stack)):
        b = k % len(buffers)
        compute.wait_event(copied[b])
        bake_layer(buffers[b], k, compute)
        compute.record(baked[b])
        io[b].wait_event(baked[b])
        copy_to_host_async(stack[k], buffers[b], io[b], level=k)
        io[b].record(copied[b])


def cake_kit(nbuf: int = CAKE_GRAPH_BUFFERS, shape: tuple[int, int] = CAKE_GRAPH_SHAPE) -> dict[str, Any]:
    """Fresh streams, device buffers and events for one run (or one capture) of :func:`cake_loop`:
    the keyword arguments ``compute, io, buffers, baked, copied``."""
    (compute,) = create_streams(1, name="compute")
    return dict(compute=compute, io=create_streams(nbuf, name="io"),
                buffers=[device_empty(shape) for _ in range(nbuf)],
                baked=create_events(nbuf), copied=create_events(nbuf))


def _stream_loop_ms(shape: tuple[int, ...]) -> float:
    """The stream loop's time for a stack of ``shape`` (its second run: the first one warms up
    and compiles the kernel)."""
    kit, out = cake_kit(CAKE_GRAPH_BUFFERS, shape[1:]), pinned_empty(shape)

    def loop():
        cake_loop(out, **kit)
        for s in kit["io"]:
            kit["compute"].wait_stream(s)          # the end event comes after every copy
    time_ms(kit["compute"], loop)
    return time_ms(kit["compute"], loop)


def _order_overlap(capture: Callable[..., Any], shape: tuple[int, ...]) -> str:
    """Capture again, under the race sanitizer, into a stack of ``shape``: "" when the order the
    capture recorded lets the copies run while the next planes bake (notebook 8's rule, judged from
    the order as notebook 8's check does for planes too small to show it: a 256² plane bakes and
    copies in a few µs, and a replay on a GPU hides little of that however right its order), else
    why not. A race in the captured work is told as such."""
    out = pinned_empty(shape)
    kit = cake_kit()
    try:
        program = run_checked(lambda: capture(out, **kit), {"stack": out}, ExerciseError,
                              "fill a plane with the wrong layer", check_levels=False)
    except ExerciseError as err:
        return str(err)
    ordered = ordered_overlap(program)
    if ordered >= OVERLAP_NEEDED:
        return ""
    return (f"the order your capture recorded lets only {ordered:.0%} of the shorter of the bakes and the copies "
            f"run under the other, even with the whole graph queued (judged from the order, as in notebook 8; "
            f"it asks for {OVERLAP_NEEDED:.0%})")


def check_cake_graph(capture: Callable[..., Any], nplanes: int = CAKE_GRAPH_PLANES) -> Verdict:
    """Capture the cake with ``capture(stack, compute, io, buffers, baked, copied)``, replay the
    graph it returns into an empty stack, and compare: every plane must hold its layer, the copies
    must be able to run while the next planes bake (a second capture under the race sanitizer, judged
    from its order: notebook 8's rule), and
    the replay must take at most :data:`GRAPH_SHARE` of the stream loop's time. Returns a
    :class:`~.core.Verdict` saying what passed or what to fix; once the graph was replayed, it
    also carries the two times it compared, ``loop_ms`` and ``graph_ms`` (device time, on the CPU
    backend the modelled GPU's)."""
    if not callable(capture):
        raise TypeError(f"check_cake_graph wants your capture function (capture_cake), got "
                        f"{type(capture).__name__}: pass the function itself, without calling it")
    if not isinstance(nplanes, int) or nplanes < 1:
        raise ValueError(f"nplanes must be a whole number of planes, at least 1, got {nplanes!r}")
    name = getattr(capture, "__name__", "your capture")
    supported, reason = graphs.graphs_supported()
    if not supported:
        return Verdict(f"Skipped: {reason}", False)
    shape = (nplanes, *CAKE_GRAPH_SHAPE)
    loop_ms = _stream_loop_ms(shape)
    stack = pinned_empty(shape)
    stack.fill(np.nan)
    try:
        graph = capture(stack, **cake_kit())
    except Exception as err:  # noqa: BLE001 - the learner's capture failed: say how, as a verdict
        return Verdict(f"Not yet: capturing raised {type(err).__name__}: {err}", False)
    if graph is None:
        return Verdict(f"Not answered yet: {name} returns None.", False)
    if not isinstance(graph, graphs.Graph):
        return Verdict(f"Not yet: {name} should return the captured graph (cap.graph), "
                       f"not {type(graph).__name__}.", False)
    synchronize()
    if not np.isnan(stack).all():
        return Verdict(f"Not yet: planes were copied before the graph was launched: {name} should only "
                       "capture the loop (inside the capture block nothing runs), not run it.", False)
    graph_ms = time_ms(graph.stream, graph.launch)
    wrong = [k for k in range(nplanes) if not np.array_equal(stack[k], layer_values(k, CAKE_GRAPH_SHAPE))]
    if wrong:
        verdict = Verdict(f"Not yet: after a replay {len(wrong)} planes are wrong or missing, "
                          f"the first is plane {wrong[0]}.", False)
    elif (serial := _order_overlap(capture, shape)):
        verdict = Verdict("Not yet: every plane is right, but in the graph the copies hardly run while the next "
                          f"planes bake: {serial}. Capture notebook 8's loop as it is, each copy on its own io[b] "
                          "stream forked into the capture by its wait for baked[b], so that copies run while the "
                          "next planes bake.", False)
    elif graph_ms > GRAPH_SHARE * loop_ms:
        verdict = Verdict("Not yet: every plane is right, but the replay took more than half the stream "
                          "loop's time.", False)
    else:
        verdict = Verdict("Well done: every plane is right, and the replay took less than half the stream "
                          "loop's time.", True)
    verdict.loop_ms, verdict.graph_ms = loop_ms, graph_ms
    return verdict
