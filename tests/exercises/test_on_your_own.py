"""The "On your own" checks of notebooks 2, 3, 6 and 9 fail the wrong answers learners give, on
both backends, and pass the solutions (course_helper/exercises/on_your_own.py)."""
import linecache
from types import SimpleNamespace

import numpy as np
import pytest

import course_helper as ch
from course_helper.exercises import on_your_own

def run_cell(source, ns, name):
    """Run ``source`` as a notebook cell: its lines readable afterwards (IPython keeps them in
    linecache too), so that messages can quote them."""
    filename = f"<cell {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), ns)


# -- notebook 2: make a copy wait for a kernel -------------------------------------------------------
NOTEBOOK_2 = """
p = ch.WaveProblem(n0=128, n1=128, nt=30)
U = [ch.device_zeros(p.shape) for _ in range(3)]
V = ch.to_device(p.velocity)
last = ch.pinned_empty(p.shape)

def steps(count, stream, U=U):
    for n in range(count):
        ch.launch_wave2d(U[n % 3], U[(n + 1) % 3], U[(n + 2) % 3], V, p, n, stream=stream)
"""

COPY_AFTER_KERNELS = {
    "as given": "",
    "solution": "    (done,) = ch.create_events(1)\n    compute.record(done)\n    io.wait_event(done)\n",
    "wait before record": "    (done,) = ch.create_events(1)\n    io.wait_event(done)\n    compute.record(done)\n",
    "host waits": "    compute.synchronize()\n",
    "host waits on an event": "    done = compute.record()\n    done.synchronize()\n",
}


def copy_after_kernels(name, copy=True):
    ns = {"ch": ch, "np": np}
    exec(NOTEBOOK_2, ns)
    body = COPY_AFTER_KERNELS[name] + ("    ch.copy_to_host_async(last, U[21 % 3], io)\n" if copy else "    pass\n")
    run_cell("def copy_after_kernels(compute, io):\n    steps(20, compute)\n" + body, ns, name)
    return ns["copy_after_kernels"]


def test_notebook_2_passes_the_event_and_fails_the_rest(backend):
    assert not ch.exercises.check_copy_after_kernels(None).passed
    right = ch.exercises.check_copy_after_kernels(copy_after_kernels("solution"))
    assert right.passed and right.startswith("Right:")
    for name in ("as given", "wait before record"):
        v = ch.exercises.check_copy_after_kernels(copy_after_kernels(name))
        assert not v.passed and "nothing orders the copy after the kernels" in v, (name, v)
        assert "writes U[0]" in v and "reads U[0]" in v, v              # the learner's names
    for name in ("host waits", "host waits on an event"):
        v = ch.exercises.check_copy_after_kernels(copy_after_kernels(name))
        assert not v.passed and "the host waited" in v, (name, v)
    v = ch.exercises.check_copy_after_kernels(copy_after_kernels("solution", copy=False))
    assert not v.passed and "put them back" in v


def test_notebook_2s_check_speaks_only_of_what_notebook_2_taught(backend):
    text = "".join(ch.exercises.check_copy_after_kernels(copy_after_kernels(n)) for n in COPY_AFTER_KERNELS)
    assert "sanitiz" not in text and "happens-before" not in text


# -- notebook 3: your own speed-up ----------------------------------------------------------------------
def measured_speedup(size_mib):
    rows = ch.measure_bandwidth(sizes_mib=(size_mib,), repeats=3)
    speed = {r["memory"]: r["gb_per_s"] for r in rows}
    return speed["pinned"] / speed["pageable"], speed


def test_notebook_3_measures_what_you_claim(backend):
    size = 8
    mine, speed = measured_speedup(size)
    assert not ch.exercises.check_speedup(size, None).passed
    right = ch.exercises.check_speedup(size, mine)
    assert right.passed, right
    inverse = ch.exercises.check_speedup(size, 1 / mine)
    assert not inverse.passed and "pageable speed over the pinned one" in inverse
    # Half the answer is refused where the speed-up measures the same every time (the model); on a
    # GPU the check's own rounds moved by more than that on an H100 machine (5.09x here, then a round
    # under 4.08x), and the deterministic test below holds the GPU's factor to refusing half.
    wrongs = (speed["pinned"], speed["pinned"] - speed["pageable"], 3 * mine)
    for wrong in wrongs + ((mine / 2,) if backend == "cpu" else ()):
        v = ch.exercises.check_speedup(size, wrong)
        assert not v.passed and "measured again at 8 MiB" in v and "is not within" in v, (wrong, v)
    assert "above 0" in ch.exercises.check_speedup(size, -2.0) and "number" in ch.exercises.check_speedup(size, "3x")
    assert not ch.exercises.check_speedup(-1, mine).passed


def test_notebook_3_takes_the_check_at_the_learners_size_not_the_arithmetic(cpu, monkeypatch):
    """The old check recomputed a ratio from the learner's own rows; this one measures itself."""
    seen = []
    real = on_your_own.measure_bandwidth
    monkeypatch.setattr(on_your_own, "measure_bandwidth", lambda **kw: seen.append(kw) or real(**kw))
    ch.exercises.check_speedup(2, 3.0)
    assert seen == [{"sizes_mib": (2.0,), "repeats": 3}]


# -- notebook 6: the fewest buffers ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def balanced():
    n, nt, every = ch.measure.BALANCED_POINT
    return ch.WaveProblem(n0=n, n1=n, nt=nt), every


def hidden(problem, every, nscratch):
    runs = 1 if ch.backend_name() == "cpu" else 3          # as the check measures it: the median on a GPU
    with ch.timing_only():
        return float(np.median([ch.solve(problem, "streams", every=every, nscratch=nscratch).trace.overlap()
                                .hidden_fraction for _ in range(runs)]))


def fewest(problem, every):
    return next(m for m in range(4, 33) if hidden(problem, every, m) >= on_your_own.RING_GOAL)


def test_notebook_6_wants_the_fewest_buffers(backend, balanced):
    problem, every = balanced
    best = fewest(problem, every)
    deep = ch.exercises.check_ring_depth(best + 3, problem, every)
    assert not deep.passed and "one buffer fewer hides" in deep and "is not the fewest" in deep
    shallow = ch.exercises.check_ring_depth(best - 3, problem, every)
    assert not shallow.passed and "does not hide the copies yet" in shallow
    assert not ch.exercises.check_ring_depth(3, problem, every).passed
    assert "not answered" in ch.exercises.check_ring_depth(None, problem, every)
    if ch.backend_name() == "cpu":       # on a GPU the border moves a little from run to run
        right = ch.exercises.check_ring_depth(best, problem, every)
        assert right.passed and "one buffer fewer hides only" in right
        ring_depth = ch.strategies.ring_depth(*ch.strategies.level_times(problem)[:2])
        assert ring_depth > best and not ch.exercises.check_ring_depth(ring_depth, problem, every).passed


def test_notebook_6_compares_with_a_baseline(cpu, balanced):
    problem, every = balanced
    with ch.timing_only():
        pinned = ch.solve(problem, "sequential-pinned", every=every, trace=False)
    v = ch.exercises.check_ring_depth(fewest(problem, every), problem, every, baseline=pinned)
    assert "x the sequential-pinned loop" in v and "(modelled H200)" in v


# -- notebook 9: find the race ------------------------------------------------------------------------------
PLANTED = """
def my_loop(run):
    U, m, compute, io, ready = run.U, run.nscratch, run.compute, run.io, run.ready
    {setup}
    for level in range(run.nt + 3):
        if level < run.nt:
            b = level % m
            if level >= 2:
                {before_kernel}
                ch.launch_wave2d(U[(level - 2) % m], U[(level - 1) % m], U[b], run.V, run.problem,
                                 n=level - 2, stream=compute)
            compute.record(ready[b])
        old = level - 3
        k = run.slot(old)
        if k is not None:
            c = old % m
            io[c].wait_event(ready[c])
            ch.copy_to_host_async(run.images[k], U[c], io[c], level=old)
            {after_copy}
"""

FIXES = {
    "planted": {},
    "notebook 6's wait": {"before_kernel": "io[b].synchronize()"},
    "events instead": {"setup": "copied = ch.create_events(m)", "before_kernel": "compute.wait_event(copied[b])",
                       "after_copy": "io[c].record(copied[c])"},
    "the whole device": {"before_kernel": "ch.synchronize()"},
    "and the compute stream": {"before_kernel": "io[b].synchronize(); compute.synchronize()"},
    "the copy, at once": {"after_copy": "io[c].synchronize()"},
    "notebook 6's wait and the device": {"before_kernel": "io[b].synchronize(); ch.synchronize()"},
}


def race_fix(name):
    parts = {"setup": "pass", "before_kernel": "pass", "after_copy": "pass", **FIXES[name]}
    ns = {"ch": ch}
    run_cell(PLANTED.format(**parts), ns, name)
    return ns["my_loop"]


def test_notebook_9_passes_the_fixes_that_wait_only_where_needed(backend):
    for name in ("notebook 6's wait", "events instead"):
        v = ch.exercises.check_race_fix(race_fix(name))
        assert v.passed, (name, v)


def test_notebook_9_fails_the_planted_race_without_giving_the_fix(backend):
    v = ch.exercises.check_race_fix(race_fix("planted"))
    assert not v.passed and "still reports a race" in v and "synchron" not in v.replace("ch.sanitize", "")


@pytest.mark.parametrize("name, words", [
    ("the whole device", "`ch.synchronize()` x118 waits for the whole device"),
    ("and the compute stream", "`io[b].synchronize(); compute.synchronize()` x117 waits for a kernel"),
    ("the copy, at once", "`io[c].synchronize()` x119 waits for a copy that the next operation does not touch"),
    ("notebook 6's wait and the device", "`io[b].synchronize(); ch.synchronize()` x118 waits for the whole device"),
])
def test_notebook_9_fails_an_over_synchronised_fix(backend, name, words):
    v = ch.exercises.check_race_fix(race_fix(name))
    assert not v.passed and "no race and every saved level is right" in v and words in v, v


def test_notebook_3_on_a_gpu_measures_again_before_it_says_no(monkeypatch):
    """Pageable copies vary from minute to minute on a GPU machine: the check takes an answer any of
    up to SPEEDUP_ROUNDS measurements agrees with, and says no only after all of them."""
    rounds = iter([3.0, 8.3, 6.0, 3.0, 8.3])
    calls = []

    def measure(**kw):
        calls.append(kw)
        return [{"memory": "pinned", "gb_per_s": next(rounds)}, {"memory": "pageable", "gb_per_s": 1.0}]

    monkeypatch.setattr(on_your_own, "measure_bandwidth", measure)
    monkeypatch.setattr(on_your_own.runtime, "get", lambda: SimpleNamespace(predicts_times=False))
    assert ch.exercises.check_speedup(32, 8.3).passed and len(calls) == 2
    calls.clear()
    v = ch.exercises.check_speedup(32, 20.0)
    assert not v.passed and len(calls) == on_your_own.SPEEDUP_ROUNDS and "6.00x, 3.00x, 8.30x" in v, v
    assert "not within a factor of 1.6" in v, v


def test_notebook_3_on_a_gpu_takes_a_speed_up_the_host_has_moved_since_but_not_half_or_double(monkeypatch):
    """The solution's 5.31x against the check's 3.67x three times (an H100 machine, seconds apart):
    within the GPU's factor; half, double or the inverse of the measurement is still refused."""
    monkeypatch.setattr(on_your_own, "measure_bandwidth", lambda **kw: [
        {"memory": "pinned", "gb_per_s": 48.9}, {"memory": "pageable", "gb_per_s": 13.3}])
    monkeypatch.setattr(on_your_own.runtime, "get", lambda: SimpleNamespace(predicts_times=False))
    measured = 48.9 / 13.3
    assert ch.exercises.check_speedup(32, 5.31).passed
    for wrong in (measured / 2, measured * 2, 48.9):
        assert not ch.exercises.check_speedup(32, wrong).passed, wrong
    inverse = ch.exercises.check_speedup(32, 1 / measured)
    assert not inverse.passed and "pageable speed over the pinned one" in inverse
