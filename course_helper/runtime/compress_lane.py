"""The modelled compression engine: a chunk of saved levels compressed on the device, then its
compressed bytes copied to the host, a stage between the copies and the disk (the rules are in
:mod:`course_helper.runtime.model`)."""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from .ops import OpKind
from .scheduler import Lane, Scheduler, Task, ticks

__all__ = ["CompressedChunk", "ModelCompressor", "compress_spec"]


def compress_spec(profile: dict, codec: str) -> dict | None:
    """The profile's measured figures of ``codec`` on the device (``gbps``, ``latency_us``), or
    None where the profile has none (its ``compress`` section may say why, in ``note``)."""
    spec = profile.get("compress", {}).get(codec)
    return spec if isinstance(spec, dict) else None


class ModelCompressor:
    """The compression lane of the modelled device, on its scheduler: one chunk at a time on the
    device's compression engine (a stage of its own beside the kernels: nvCOMP's kernels share
    the GPU with the wave kernel, which the model leaves out), each followed by the copy of its
    compressed bytes to the host on the device-to-host link."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.lane = None

    def compress(self, profile: dict, codec: str, after: Any, nbytes: int, work: Callable[[], Any],
                 now: float) -> CompressedChunk:
        """Queue the compression of one chunk of ``nbytes`` at the host time ``now``: it starts
        when the event ``after`` (recorded after the copy into the chunk's device slot) has
        completed and the previous chunk's compression has ended, and takes the profile's
        ``latency_us + nbytes / gbps`` of ``codec``; then its compressed bytes cross the D2H
        link (latency + bytes / bandwidth, shared with the other copies).

        ``work()`` is called when the compression begins (the copy has landed) and returns what
        the chunk compresses to (an object whose ``nbytes`` are the bytes that cross to the
        host); :meth:`CompressedChunk.result` hands it over."""
        spec = compress_spec(profile, codec)
        if spec is None:
            raise RuntimeError(f"the profile {profile.get('name', '')!r} has no figures for {codec!r} "
                               "compression on the device, so it cannot be modelled")
        if self.lane is None:
            # A lane of its own whose failures are each its chunk's (as the disk's writer lanes).
            self.lane = Lane(self.scheduler, 0, "compress", disk=True)
        link = profile["links"][OpKind.D2H]
        peak = link["gbps"] * 1e6                                       # bytes per ms
        chunk = CompressedChunk(link["latency_us"] * 1e-3 * peak)
        deps = [after.task] if after.task is not None else []
        chunk.compress = self.scheduler.add(
            self.lane, "compress", now, deps, begin=functools.partial(chunk.begin, work, after), engine="compress",
            duration=ticks(spec["latency_us"] * 1e-3 + nbytes / (spec["gbps"] * 1e6)))
        chunk.task = self.scheduler.add(self.lane, "D2H compressed", now, [], begin=chunk.copy_begin,
                                        engine="copy", link=str(OpKind.D2H), peak=peak)
        return chunk


class CompressedChunk:
    """One chunk on the modelled compression engine: ``compress`` (its compression) and
    ``task`` (the copy of its compressed bytes, after which its disk write may begin)."""

    def __init__(self, latency_bytes: float) -> None:
        self.compress: Task | None = None
        self.task: Task | None = None
        self._latency_bytes = latency_bytes      # the link's latency, as the bytes it would have moved
        self._result = None
        self._ready = threading.Event()

    def begin(self, work: Callable[[], Any], after: Any) -> None:
        """The compression begins in modelled time: ``work()`` compresses the chunk, whose size
        sets the copy's bytes. What it, or the copy before it, raised is the chunk's error."""
        if after.task is not None and after.task.error is not None:
            raise after.task.error                          # the copy into the slot failed
        self._result = work()
        self.task.remaining = float(self._result.nbytes) + self._latency_bytes
        self._ready.set()

    def copy_begin(self) -> None:
        """The copy of the compressed bytes begins: nothing to copy if the compression failed."""
        if self.compress.error is not None:
            raise self.compress.error

    def result(self) -> Any:
        """What ``work()`` returned (call it once the copy has begun: the disk write's start)."""
        if not self._ready.is_set():
            raise self.compress.error or RuntimeError("the chunk's compression did not run")
        return self._result

    @property
    def nbytes(self) -> int:
        """The compressed bytes that crossed to the host (0 before the compression began)."""
        return int(self._result.nbytes) if self._result is not None else 0

    def intervals(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """The (start, end) in modelled ms of the compression and of the copy (once done)."""
        return (self.compress.start, self.compress.end), (self.task.start, self.task.end)
