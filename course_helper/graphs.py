"""CUDA graphs: record a whole loop of device work once, replay it with one launch.

Launching a kernel from Python costs the host a few microseconds. When each
kernel runs for only a few microseconds too, the host, not the GPU, sets the
pace. Stream capture records the work queued on a stream (and on the streams
that join it through events) into a graph instead of running it; replaying
the graph launches all of it at once.

The modelled GPU of the CPU backend has graphs too: a capture records the
operations, and a replay costs the host one launch plus the captured device
work. On CuPy built for ROCm :func:`capture_graph` raises
:class:`GraphsUnsupported` naming the reason and the alternative.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from . import checks, runtime, streams
from .runtime import observe
from .runtime.base import GraphsUnsupported, HostWaitInCapture, UncapturedDependency

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence
    from typing import Any

    from .streams import Stream

__all__ = ["GraphsUnsupported", "HostWaitInCapture", "UncapturedDependency", "Graph", "capture_graph",
           "capture_with_one_io_stream",
           "graphs_supported"]


def graphs_supported() -> tuple[bool, str]:
    """``(True, "")`` when graphs work here, else ``(False, reason)``."""
    return runtime.get().graphs_supported()


class Graph:
    """A captured graph; :meth:`launch` replays it on a stream."""

    def __init__(self, raw: Any, stream: Stream):
        self.raw = raw
        self.stream = stream

    def upload(self, stream: Stream | None = None) -> None:
        """Prepare the replay on ``stream`` (default: the capture stream) ahead of the first
        :meth:`launch`, which then does not pay for it (``cudaGraphUpload``). Asynchronous,
        like a launch; ``solve`` uploads right after the capture, outside the timed replay."""
        stream = self.stream if stream is None else streams.resolve(stream)
        stream.runtime.upload_graph(self.raw, stream.raw)

    def launch(self, stream: Stream | None = None) -> None:
        """Replay the whole captured loop on ``stream`` (default: the capture stream)."""
        stream = self.stream if stream is None else streams.resolve(stream)
        stream.runtime.launch_graph(self.raw, stream.raw)
        observe.notify("graph_launched", self, stream)


class _Capture:
    graph: Graph | None = None     # the captured graph, once the block has ended


@contextlib.contextmanager
def capture_graph(stream: Stream) -> Iterator[_Capture]:
    """Capture the work queued on ``stream`` inside the block into a :class:`Graph`.

    Other streams join the capture by waiting on an event recorded on a
    captured stream (a *fork*), and must be joined back before the block ends
    (``stream.wait_stream(other)``). Nothing runs during capture, so a host
    wait inside the block (synchronising a stream, an event or the device)
    raises :class:`HostWaitInCapture` on both backends.

    Examples
    --------
    >>> with capture_graph(compute) as cap:          # doctest: +SKIP
    ...     launch_wave2d(..., stream=compute)
    >>> cap.graph.launch()                            # doctest: +SKIP
    """
    ok, why = graphs_supported()
    if not ok:
        raise GraphsUnsupported(why)
    checks.instance("stream", stream, streams.Stream, "a Stream from create_streams()")
    if stream.is_default:
        raise ValueError("capture on a stream from create_streams(); the default stream cannot be captured")
    cap = _Capture()
    rt = stream.runtime
    rt.begin_capture(stream.raw)
    observe.notify("capture_started", stream)
    ended = False
    try:
        yield cap
        ended = True
        graph = rt.end_capture(stream.raw)      # refuses an unjoined fork, as CUDA does (and ends the capture)
    except BaseException:
        if not ended:
            rt.abort_capture(stream.raw)
        observe.notify("capture_ended", stream, None)    # over, with no graph
        raise
    cap.graph = Graph(graph, stream)
    observe.notify("capture_ended", stream, cap.graph)


def capture_with_one_io_stream(compute: Stream, io: Sequence[Stream],
                               queue: Callable[[list[Stream]], Iterable[Stream]]) -> Graph:
    """Capture a loop into a :class:`Graph` on ``compute``, every copy on one IO stream.

    ``queue(chain)`` queues the loop's work, with ``chain`` in place of its IO streams ``io``:
    ``chain[b]`` is ``io[0]`` for every buffer ``b``. In a graph every captured stream becomes a
    branch, and one chain of copies keeps pace with the stream loops where copies spread over
    several branches fell behind them (docs/results.md). ``queue`` returns the streams it forked
    into the capture (each stream other than ``compute`` that it queued work on); each joins
    ``compute`` back before the capture ends, as a capture requires. The single-GPU graph
    strategies (:func:`course_helper.strategies.capture_loop`) and a rank's captured loop
    (:func:`course_helper.distributed.capture_rank_loop`) are captured this way.
    """
    chain = [io[0]] * len(io)
    with capture_graph(compute) as cap:
        for stream in queue(chain):
            compute.wait_stream(stream)
    return cap.graph
