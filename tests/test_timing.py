"""The one timing helper: ``timing.benchmark``'s runs, hooks and result, on both backends."""
import dataclasses
import json

import pytest

import course_helper as ch
from course_helper import runtime
from course_helper.strategies import level_times
from course_helper.timing import Timing, benchmark

MIB = 2**20


@pytest.fixture
def kernel():
    """A stream and a function launching the 256^2 wave kernel on it, once."""
    p = ch.WaveProblem(256, 256, nt=3)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    (s,) = ch.create_streams(1)
    return s, p, (lambda: ch.launch_wave2d(U[0], U[1], U[2], V, p, 0, stream=s))


def test_each_run_is_before_start_calls_end_after(backend):
    """Warm-up calls first; then per run the hook, ``calls`` calls, and ``after`` once the run's work is done."""
    (s,) = ch.create_streams(1)
    src, dst = ch.device_zeros(MIB), ch.pinned_empty(MIB)
    seen = []

    def copy():
        seen.append("call")
        ch.copy_to_host_async(dst, src, s)

    t = benchmark(copy, s, n_repeat=3, n_warmup=2, calls=4, before=lambda: seen.append("before"),
                  after=lambda: seen.append(f"after, done={s.done}"), name="copy 4 MiB")
    assert seen == ["call"] * 2 + (["before"] + ["call"] * 4 + ["after, done=True"]) * 3
    assert (t.name, t.calls, t.warmup, len(t.device_ms), len(t.host_ms)) == ("copy 4 MiB", 4, 2, 3, 3)
    assert all(ms > 0 for ms in t.device_ms + t.host_ms)


def test_the_result_is_a_frozen_record_with_its_statistics(backend):
    (s,) = ch.create_streams(1)
    src, dst = ch.device_zeros(MIB), ch.pinned_empty(MIB)
    t = benchmark(lambda: ch.copy_to_host_async(dst, src, s), s, n_repeat=5, calls=2)
    assert t.min_ms <= t.median_ms <= t.max_ms
    assert t.per_call_ms == t.median_ms / 2
    d = t.as_dict()
    assert d["device_ms"] == list(t.device_ms) and d["median_ms"] == t.median_ms
    assert d["clock"] == (runtime.get().device_label if backend == "cpu" else "CUDA events")
    json.dumps(d)                                   # plain data, ready for a results file
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.calls = 3


def test_median_min_max_of_given_times():
    t = Timing("x", (3.0, 1.0, 2.0, 10.0), (0.5, 0.5, 0.5, 0.5), calls=4)
    assert (t.median_ms, t.min_ms, t.max_ms, t.per_call_ms, t.host_median_ms) == (2.5, 1.0, 10.0, 0.625, 0.5)


def test_behind_a_busy_stream_the_device_alone_is_timed(cpu, kernel):
    """Queued behind a long copy, ten launches take ten modelled kernel times (the profile's);
    from an idle device the host's launch calls set the pace and the time is the host's."""
    s, p, launch = kernel
    src, dst = ch.device_zeros(4 * MIB), ch.pinned_empty(4 * MIB)

    def busy():
        ch.synchronize()
        ch.copy_to_host_async(dst, src, s)

    held = benchmark(launch, s, n_repeat=2, calls=10, before=busy)
    idle = benchmark(launch, s, n_repeat=2, calls=10)
    assert held.per_call_ms == pytest.approx(level_times(p).kernel_ms, abs=2e-6)
    host = runtime.get().profile["host_us"]
    per_launch_ms = (host["launch"] + host["loop_turn"]) * 1e-3      # what the model charges the host a launch
    assert held.host_ms[0] == pytest.approx(10 * per_launch_ms, rel=1e-4)         # to the tick
    assert idle.per_call_ms > 2 * held.per_call_ms                       # the host set the pace


def test_the_end_event_on_another_stream_times_work_that_ends_there(cpu, kernel):
    """Work forked from the timed stream onto another ends there; the end event recorded on the
    timed stream alone would not wait for it."""
    s, p, _ = kernel
    (other,) = ch.create_streams(1, name="other")
    src, dst = ch.device_zeros(16 * MIB), ch.pinned_empty(16 * MIB)
    (fork,) = ch.create_events(1)

    def forked_copy():
        s.record(fork)
        other.wait_event(fork)
        ch.copy_to_host_async(dst, src, other)

    on_other = benchmark(forked_copy, s, end_stream=other, n_repeat=1)
    on_start = benchmark(forked_copy, s, n_repeat=1)
    assert on_other.median_ms > 10 * on_start.median_ms


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fn=3), TypeError, "fn must be a function"),
    (dict(n_repeat=0), ValueError, "n_repeat"),
    (dict(n_warmup=-1), ValueError, "n_warmup"),
    (dict(calls=0), ValueError, "calls"),
    (dict(before="sync"), TypeError, "before must be a function"),
    (dict(after=1), TypeError, "after must be a function"),
    (dict(stream="s"), TypeError, "stream"),
])
def test_bad_arguments_are_refused_before_anything_runs(cpu, kwargs, error, match):
    ran = []
    args = dict(fn=lambda: ran.append(1)) | kwargs
    with pytest.raises(error, match=match):
        benchmark(**args)
    assert not ran


# --------------------------------------------------------------------------
# Host times: one clock per backend, read here
# --------------------------------------------------------------------------
def test_host_times_are_read_on_the_runtimes_clock(cpu):
    """On the CPU backend a host time is the modelled host's: a synchronisation behind a queued
    copy takes the copy's modelled time, whatever the machine's own clock did meanwhile."""
    from course_helper import timing
    (s,) = ch.create_streams(1)
    src, dst = ch.device_zeros(16 * MIB), ch.pinned_empty(16 * MIB)
    rt = runtime.get()
    copy_ms = rt.predicted_ms(ch.runtime.ops.CopyCost(ch.runtime.ops.OpKind.D2H, dst, src))
    with timing.host_timer() as t:
        ch.copy_to_host_async(dst, src, s)
        s.synchronize()
    assert t.end is not None and t.ms >= copy_ms
    assert t.start == pytest.approx(rt.host_ms() - t.ms)       # the modelled clock, not the wall clock
    times = timing.host_times(lambda: ch.copy_to_host_async(dst, src, s), 3, before=ch.synchronize,
                              after=s.synchronize)
    assert len(times) == 3 and all(ms >= copy_ms for ms in times)
    assert max(timing.host_times(lambda: None, 2)) < copy_ms     # nothing queued, nothing waited for


def test_a_block_that_raises_still_ends_its_span():
    from course_helper import timing
    ticks = iter([1.0, 4.0])
    with pytest.raises(ZeroDivisionError), timing.host_timer(lambda: next(ticks)) as t:
        raise ZeroDivisionError("inside the timed block")
    assert (t.start, t.end, t.ms) == (1.0, 4.0, 3.0)


def test_only_the_timing_module_and_the_runtime_read_a_clock():
    """A time of the course is read on the runtime's host clock, or on the machine's own through
    timing.wall_ms: a time.perf_counter() elsewhere would disagree with the modelled host."""
    import ast
    import pathlib
    package = pathlib.Path(ch.__file__).parent
    clocks = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "process_time"}
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative.parts[0] == "runtime" or relative == pathlib.Path("timing.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in clocks and isinstance(node.value, ast.Name)
                    and node.value.id == "time"):
                found.append(f"{relative}:{node.lineno}: time.{node.attr}")
    assert not found, "time it with course_helper.timing (host_timer, host_times, wall_ms):\n" + "\n".join(found)
