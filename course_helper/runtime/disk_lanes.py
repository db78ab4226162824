"""The modelled disk: chunks' writes on writer lanes, a stage of the modelled machine after
the copies (the rules are in :mod:`course_helper.runtime.model`)."""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from .scheduler import Lane, Scheduler, Task, ticks

__all__ = ["DiskWrite", "ModelDisk"]


class ModelDisk:
    """The writer lanes of the modelled disk, on the device's scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.lanes = {}               # name -> the lane of one writer

    def write(self, profile: dict, lane: str, after: Any, encode: Callable[[], Any], now: float) -> DiskWrite:
        """Queue one chunk's write on the writer lane ``lane`` (a name) at the host time ``now``, as
        the device ``profile`` says (its ``disk`` section):
        it starts when the event ``after`` (recorded after the copy into the chunk's slot) has
        completed and the lane's previous write has ended, and takes the profile's disk latency
        (the lane's own: the lanes' latencies overlap) + bytes / bandwidth (shared with the other
        lanes' writes, as copies share a link).

        ``encode()`` is called when the write begins (the copy has landed) and returns the
        file to write (its bytes, or an object whose ``nbytes`` is its size); a writer thread gets it from the
        returned :class:`DiskWrite`'s ``result()`` and writes the real file. Nothing that thread does
        moves the model's clocks."""
        spec = profile.get("disk")
        if spec is None:
            raise RuntimeError(f"the profile {profile.get('name', '')!r} has no 'disk' section (the "
                               "disk's write bandwidth and latency), so a run streamed to disk cannot be "
                               "modelled; calibrate it again with `python -m course_helper calibrate`")
        bandwidth = spec["gbps"] * 1e6                              # bytes per ms
        self.scheduler.add_link("disk", bandwidth)
        stream = self.lanes.get(lane)
        if stream is None:
            stream = self.lanes[lane] = Lane(self.scheduler, 0, lane, disk=True)
        write = DiskWrite(lane)
        deps = [after.task] if after.task is not None else []
        begin = functools.partial(write.begin, encode, after)     # when the copy has landed
        write.first = self.scheduler.add(stream, "disk latency", now, deps, begin=begin,
                                         duration=ticks(spec["latency_us"] * 1e-3))
        write.task = self.scheduler.add(stream, "disk write", now, [], link="disk", peak=bandwidth)
        return write


class DiskWrite:
    """One chunk's write to the modelled disk (see :meth:`ModelRuntime.disk_write`)."""

    def __init__(self, lane: str) -> None:
        self.lane = lane
        self.first: Task | None = None     # its latency, then its bytes (tasks of the lane's stream)
        self.task: Task | None = None
        self._result = self._error = None
        self._ready = threading.Event()

    def begin(self, encode: Callable[[], Any], after: Any) -> None:
        """The write begins in modelled time (its copy, before the event ``after``, has landed):
        ``encode()`` gives the bytes to write, which set the write's size, and the writer thread
        waiting in :meth:`result` gets them (or what ``encode`` or the copy raised). Nothing if
        the write was cancelled."""
        if self._ready.is_set():
            return                                              # cancelled: nobody waits for it
        try:
            if after.task is not None and after.task.error is not None:
                raise after.task.error                          # the copy failed: nothing to write
            self._result = encode()
            size = getattr(self._result, "nbytes", None)       # the bytes the file holds
            self.task.remaining = float(memoryview(self._result).nbytes if size is None else size)
        except BaseException as exc:  # noqa: BLE001 - handed to the writer thread
            self._error = exc
        finally:
            self._ready.set()

    @property
    def done(self) -> bool:
        """Whether the write has ended, in modelled time (the host's clock has passed its end)."""
        return self.task.done

    def interval(self) -> tuple[float, float]:
        """The write's (start, end) in modelled ms, on the host clock's axis (once done)."""
        return self.first.start, self.task.end

    def cancel(self, exc: BaseException) -> None:
        """The write will never begin (the run stopped before its copy ran): ``result()``
        raises ``exc`` instead of waiting. Nothing if it has begun."""
        if not self._ready.is_set():
            self._error = exc
            self._ready.set()

    def result(self) -> Any:
        """What ``encode()`` returned, once the write has begun in modelled time (waits in real
        time, moving no clock; one caller takes it); raises what ``encode`` raised."""
        while not self._ready.wait(0.05):
            if self.first.done and not self._ready.is_set():
                # Its start ended without handing over the bytes (a Ctrl-C came in between).
                raise self.first.error or RuntimeError(f"the write on {self.lane!r} was interrupted")
        if self._error is not None:
            raise self._error
        result, self._result = self._result, None      # handed over: the write keeps no hold on the bytes
        return result
