"""``timing_only()`` belongs to the thread that entered it: the runs it holds are timed, not
computed, and read NaN; every other run computes, whatever other threads do meanwhile.

The modelled device's own block (``runtime.get().times_only()``) is what ``timing_only()``
enters on the CPU backend; on a GPU the block changes nothing, so these tests run on the CPU
backend only."""
import itertools
import queue
import threading

import numpy as np
import pytest

import course_helper as ch
from course_helper import runtime, strategies

P = ch.WaveProblem(n0=40, n1=32, nt=24)


@pytest.fixture(autouse=True)
def _cpu(cpu):
    yield


@pytest.fixture(scope="module")
def reference():
    previous = ch.backend_name()
    ch.set_backend("cpu")
    try:
        return ch.solve(P, "events", every=2, trace=False).images
    finally:
        ch.set_backend(previous)


class _Worker:
    """A thread that does one thing at a time when told: enter or leave its timing_only()
    block, or report what a solve of its own gives (computed, or NaN)."""

    def __init__(self, name):
        self.orders, self.replies = queue.SimpleQueue(), queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self):
        blocks = []
        while (order := self.orders.get()) is not None:
            try:
                if order == "in":
                    blocks.append(ch.timing_only())
                    blocks[-1].__enter__()
                    self.replies.put(None)
                elif order == "out":
                    blocks.pop().__exit__(None, None, None)
                    self.replies.put(None)
                else:
                    r = ch.solve(P, "events", every=2, trace=False)
                    self.replies.put((runtime.get().computes_data, r.computed, r.images))
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                self.replies.put(exc)

    def __call__(self, order):
        self.orders.put(order)
        reply = self.replies.get(timeout=60)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def stop(self):
        self.orders.put(None)
        self.thread.join(timeout=60)


def _orders():
    """Every order of A in, A out, B in, B out in which each thread enters before it leaves."""
    steps = [("A", "in"), ("A", "out"), ("B", "in"), ("B", "out")]
    for order in itertools.permutations(steps):
        if all(order.index((t, "in")) < order.index((t, "out")) for t in "AB"):
            yield order


@pytest.mark.parametrize("order", list(_orders()), ids=lambda o: ", ".join(f"{t} {s}" for t, s in o))
def test_two_threads_entering_and_leaving_in_any_order(order, reference):
    """After every step each thread computes exactly when it is outside its own block, and so
    does the main thread, which never enters one; after the last step everything computes."""
    workers = {"A": _Worker("A"), "B": _Worker("B")}
    inside = {"A": False, "B": False}
    try:
        for who, step in order:
            workers[who](step)
            inside[who] = step == "in"
            for name, worker in workers.items():
                computes, computed, images = worker("solve")
                assert computes == computed == (not inside[name]), (who, step, name)
                if inside[name]:
                    assert np.isnan(images).all()
                else:
                    assert np.array_equal(images, reference), (who, step, name)
            main = ch.solve(P, "events", every=2, trace=False)
            assert main.computed and np.array_equal(main.images, reference), (who, step)
    finally:
        for worker in workers.values():
            worker.stop()
    assert runtime.get().computes_data


def test_a_store_run_beside_threads_that_loop_in_and_out_of_the_block(tmp_path, reference):
    """The audit's case: threads looping on ``with timing_only(): solve(...)`` while this thread
    streams runs to stores. Every store is finished, every level flagged complete and right."""
    stop = threading.Event()
    errors = []

    def in_and_out():
        try:
            while not stop.is_set():
                with ch.timing_only():
                    r = ch.solve(P, "events", every=2, trace=False)
                    assert not r.computed and np.isnan(r.images).all()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    loopers = [threading.Thread(target=in_and_out, name=f"looper {i}", daemon=True) for i in range(2)]
    for t in loopers:
        t.start()
    try:
        for i in range(6):
            strategy = ("events", "staged", "sequential")[i % 3]
            ch.solve(P, strategy, every=2, trace=False, store=tmp_path / f"{i}.zarr")
            stored = ch.disk.open_store(tmp_path / f"{i}.zarr")
            assert stored.state == "finished" and stored.complete.all(), strategy
            assert np.array_equal(stored.images[:], reference), strategy
    finally:
        stop.set()
        for t in loopers:
            t.join(timeout=60)
    assert not errors, errors
    assert np.array_equal(ch.solve(P, "events", every=2, trace=False).images, reference)   # later solves compute


def test_a_store_is_refused_inside_the_block_only(tmp_path, reference):
    ready, release = threading.Event(), threading.Event()

    def hold_a_block():
        with ch.timing_only():
            ready.set()
            release.wait(60)

    holder = threading.Thread(target=hold_a_block, daemon=True)
    holder.start()
    ready.wait(60)
    try:
        r = ch.solve(P, "events", every=2, trace=False, store=tmp_path / "outside.zarr")   # another thread's block
        assert np.array_equal(r.images[:], reference)
        with ch.timing_only(), pytest.raises(ValueError, match="computes no data"):
            ch.solve(P, "events", every=2, trace=False, store=tmp_path / "inside.zarr")
        assert not (tmp_path / "inside.zarr").exists()
    finally:
        release.set()
        holder.join(timeout=60)


def test_a_prepared_run_computes_as_where_it_was_prepared(reference):
    """prepare() inside the block: the run is timed only and its images read NaN, not whatever
    the memory held; a run prepared outside computes inside the block (``with run:``)."""
    junk = np.full(P.nbytes_level * 12 // 4, 7.0, np.float32)     # leave non-NaN values on the heap
    del junk
    with ch.timing_only():
        timed = ch.prepare(P, "events", every=2)
        assert not timed.computes and np.isnan(timed.images).all()
        with timed:
            strategies.with_events(timed)
        assert np.isnan(timed.images).all()
    outside = ch.prepare(P, "events", every=2)
    with ch.timing_only():
        with outside:
            strategies.with_events(outside)
        assert not runtime.get().computes_data          # the block is as it was
    assert outside.computes and np.array_equal(outside.images, reference)


def test_a_comparison_inside_the_block_says_not_computed():
    small = ch.WaveProblem(n0=32, n1=32, nt=20)
    with ch.timing_only():
        c = ch.compare_strategies(small, ["events"], repeats=1)
    assert not c.computed and c.agree is None
    assert all(r["max_diff"] is None for r in c.rows)
    assert c.table(timings=False).splitlines()[-1].split() == ["events", "not", "computed"]
    outside = ch.compare_strategies(small, ["events"], repeats=1)
    assert outside.computed and outside.agree is True


def test_a_timed_only_run_holds_no_output_stack():
    """The images of a run inside the block read NaN, cannot be written, and take no memory:
    a run whose output stack is 512 MiB leaves the process's resident memory nearly as it was."""
    big = ch.WaveProblem(n0=2048, n1=2048, nt=33)      # 32 saved levels of 16 MiB
    with ch.timing_only():
        before = _resident_mib()
        r = ch.solve(big, "events", trace=False)
        grown = _resident_mib() - before
    assert not r.computed and r.images.shape == (33, 2048, 2048) and np.isnan(r.images[[0, 16, 32]]).all()
    assert not r.images.flags.writeable and "timed only" in repr(r)
    assert grown < 128, f"resident memory grew by {grown:.0f} MiB"


def _resident_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_the_sanitizer_still_follows_a_timed_only_run():
    with ch.timing_only():
        ch.solve(P, "events", every=2, trace=False, sanitize=True)            # ordered: no race
        with pytest.raises(ch.RaceError):
            ch.solve(P, "events", nscratch=3, unsafe=True, trace=False, sanitize=True)
