"""The modelled host in front of the modelled device: its clock, what each call costs it, and
its waits (the rules are in :mod:`course_helper.runtime.model`)."""
from __future__ import annotations

from typing import Callable

from .scheduler import Scheduler, Task, ticks

__all__ = ["ModelHost"]


class ModelHost:
    """The host's clock (``t``, ms) and the device's :class:`~.scheduler.Scheduler`, which it
    lets catch up with the host after each call: the device is never simulated past the host's
    time, since the host may still queue work that starts before anything later."""

    def __init__(self, host_us: dict, scheduler: Scheduler) -> None:
        self.t = 0.0
        self.costs_us = host_us       # what each call costs, as measured on the profiled GPU
        self.scheduler = scheduler

    def call(self, what: str, charged: bool = True) -> None:
        """The host makes the API call ``what``: it costs its profiled time (when ``charged``)
        and the device catches up with the host."""
        inside = self.scheduler.inside
        if inside is not None:
            raise RuntimeError(f"a host function ({inside.name}) called the runtime ({what}); "
                               "a host function must not queue or wait for device work, since it "
                               "would wait for itself")
        if charged:
            self.spend(self.costs_us[what] * 1e-3)
        self.catch_up()

    def spend(self, ms: float) -> None:
        """The host's own work takes ``ms`` (rounded up to whole ticks)."""
        self.t += ticks(ms)

    def catch_up(self) -> None:
        """The device is simulated up to the host's time."""
        self.scheduler.advance(self.t)

    def wait(self, task: Task | None, what: str) -> None:
        """A synchronise call, then the host waits until ``task`` is done (None: nothing to wait for)."""
        self.call("synchronize")
        if task is not None:
            self.block_until(lambda: task.done, what, lambda: task.end)

    def block_until(self, condition: Callable[[], bool], what: str, done_at: Callable[[], float]) -> None:
        """After a synchronise call: if ``condition()`` does not hold yet, the host blocks
        until it does (``done_at()``: when that was), then takes its wake-up to get going
        again. A wait whose work is already done costs the call only."""
        if condition():
            return
        self.scheduler.run_until(condition, what)
        self.t = max(self.t, done_at()) + ticks(self.costs_us["wake"] * 1e-3)
        self.catch_up()

    def busy_until(self, task: Task, what: str) -> None:
        """The host is busy until ``task`` ends (not asleep: no wake-up), e.g. copying a pageable
        copy's staged chunks itself."""
        self.scheduler.run_until(lambda: task.done, what)
        self.t = max(self.t, task.end)
