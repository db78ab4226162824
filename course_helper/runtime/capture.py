"""Graph capture on the modelled device: a captured graph is the list of calls made on the
captured streams, replayed in order by :meth:`course_helper.runtime.model.ModelRuntime.launch_graph`."""
from __future__ import annotations

import enum
from typing import Any

__all__ = ["Call", "CapturedCall", "ModelGraph"]


class Call(enum.Enum):
    """The calls a capture keeps: queueing work or a host function, recording an event, waiting on one."""
    ENQUEUE = enum.auto()
    HOST_FUNC = enum.auto()
    RECORD = enum.auto()
    WAIT_EVENT = enum.auto()


class ModelGraph:
    """A captured graph: the calls made on the captured streams, replayed in order.

    As in CUDA, a stream that forked from the capture (it waited on an event recorded
    in it) must be joined back: at the end the capturing stream must come after all
    the work captured on every other stream, or the capture fails."""

    def __init__(self, stream: Any) -> None:
        self.origin = stream
        self.nodes = []
        self.streams = [stream]
        # stream -> {captured stream: how many of its work nodes it comes after}, a vector clock
        self.after = {stream: {}}
        self.recorded = {}        # event -> the clock of its stream at its latest record in the capture

    def join(self, stream: Any) -> None:
        """``stream`` forked into the capture: its calls are captured from now on."""
        if stream not in self.streams:
            self.streams.append(stream)
            stream.capture = self
            self.after[stream] = {}

    def add(self, call: Call, args: tuple) -> CapturedCall:
        """Capture the call ``call(*args)``; returns its node."""
        node = CapturedCall(call, args)
        self.nodes.append(node)
        self.note(call, args)
        return node

    def note(self, call: Call, args: tuple) -> None:
        """Follow the ordering of a captured call (see :meth:`unjoined`)."""
        if call is Call.ENQUEUE or call is Call.HOST_FUNC:
            known = self.after[args[0]]
            known[args[0]] = known.get(args[0], 0) + 1
        elif call is Call.RECORD:
            event, stream = args
            self.recorded[event] = dict(self.after[stream])
        elif call is Call.WAIT_EVENT:
            stream, event = args
            known = self.after[stream]
            for s, n in self.recorded.get(event, {}).items():
                known[s] = max(known.get(s, 0), n)

    def unjoined(self) -> list:
        """The streams with captured work that the capturing stream does not come after."""
        end = self.after[self.origin]
        return [s for s in self.streams if s is not self.origin and end.get(s, 0) < self.after[s].get(s, 0)]

    def end(self) -> None:
        """The capture ends: every stream leaves capture mode; raises (and the capture gives no
        graph) if a stream forked from it was not joined back."""
        self.release()
        unjoined = self.unjoined()
        if unjoined:
            origin = self.origin.name
            names = ", ".join(repr(s.name) for s in unjoined)
            raise RuntimeError(
                f"cudaErrorStreamCaptureUnjoined: the capture on {origin!r} forked into {names} "
                f"(a stream that waited on an event recorded in the capture), whose captured work was not "
                f"joined back; before the capture block ends, make {origin!r} wait for it "
                f"(wait_stream, or wait_event on an event recorded after that work). The capture has "
                "ended without a graph.")

    def release(self) -> None:
        """Every stream of the capture leaves capture mode."""
        for s in self.streams:
            s.capture = None


class CapturedCall:
    """One captured call; ``task`` is its task in the latest replay (what timelines read)."""

    __slots__ = ("call", "args", "task")

    def __init__(self, call: Call, args: tuple) -> None:
        self.call, self.args, self.task = call, args, None
