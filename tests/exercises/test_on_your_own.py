"""The "On your own" checks of notebooks 2, 3, 6 and 9 fail the wrong answers learners give, on
both backends, and pass the solutions (course_helper/exercises/on_your_own.py)."""
import linecache
import re

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
    "event from record": "    done = compute.record()\n    io.wait_event(done)\n",
    "wait before record": "    (done,) = ch.create_events(1)\n    io.wait_event(done)\n    compute.record(done)\n",
    "host waits": "    compute.synchronize()\n",
    "host waits on an event": "    done = compute.record()\n    done.synchronize()\n",
}
#: The copy line of notebook 2's cell, and the learners' other copies.
COPIES = {
    "as given": "    ch.copy_to_host_async(last, U[21 % 3], io)\n",
    "labelled right": "    ch.copy_to_host_async(last, U[21 % 3], io, level=21)\n",
    "level 20": "    ch.copy_to_host_async(last, U[20 % 3], io)\n",
    "level 20, labelled 21": "    ch.copy_to_host_async(last, U[20 % 3], io, level=21)\n",
    "level 21, labelled 20": "    ch.copy_to_host_async(last, U[21 % 3], io, level=20)\n",
    "on compute": "    ch.copy_to_host_async(last, U[21 % 3], compute)\n",
    "four rows": "    ch.copy_to_host_async(ch.pinned_empty((4, p.shape[1])), U[21 % 3][:4], io)\n",
    "none": "    pass\n",
    "into a fresh buffer": "    ch.copy_to_host_async(ch.pinned_empty(p.shape), U[21 % 3], io)\n",
    "then one step more": "    ch.copy_to_host_async(last, U[21 % 3], io)\n"
                          "    ch.launch_wave2d(U[1], U[2], U[0], V, p, 20, stream=compute)\n",
}


def copy_after_kernels(name, copy="as given"):
    ns = {"ch": ch, "np": np}
    exec(NOTEBOOK_2, ns)
    run_cell("def copy_after_kernels(compute, io):\n    steps(20, compute)\n" + COPY_AFTER_KERNELS[name] + COPIES[copy],
             ns, f"{name}, {copy}")
    return ns["copy_after_kernels"]


def test_notebook_2_passes_the_event_and_fails_the_rest(backend):
    assert not ch.exercises.check_copy_after_kernels(None).passed
    for name, copy in (("solution", "as given"), ("event from record", "as given"), ("solution", "labelled right")):
        right = ch.exercises.check_copy_after_kernels(copy_after_kernels(name, copy))
        assert right.passed and right.startswith("Right:"), (name, copy, right)
    for name in ("as given", "wait before record"):
        v = ch.exercises.check_copy_after_kernels(copy_after_kernels(name))
        assert not v.passed and "nothing orders the copy after the kernels" in v, (name, v)
        assert "writes U[0]" in v and "reads U[0]" in v, v              # the learner's names
    for name in ("host waits", "host waits on an event"):
        v = ch.exercises.check_copy_after_kernels(copy_after_kernels(name))
        assert not v.passed and "the host waited" in v, (name, v)
    v = ch.exercises.check_copy_after_kernels(copy_after_kernels("solution", "none"))
    assert not v.passed and "put them back" in v


def test_notebook_2_wants_the_copy_on_io(backend):
    """A copy queued behind the kernels on their own stream needs no event and is ordered, but it
    is the serial loop notebook 2 sets out to leave: refused, with or without an event."""
    for name in ("as given", "solution"):
        v = ch.exercises.check_copy_after_kernels(copy_after_kernels(name, "on compute"))
        assert not v.passed and "queued on `compute`" in v and "Queue it on io" in v, (name, v)


def test_notebook_2_judges_the_level_by_the_data_copied(backend):
    """After a right event, a copy of U[20 % 3] (level 20) is ordered and race-free: the data it
    wrote to the host says it is the wrong level."""
    v = ch.exercises.check_copy_after_kernels(copy_after_kernels("solution", "level 20"))
    assert not v.passed and "it holds level 20, what U[2] holds" in v and "wrote level 21 into U[0]" in v, v
    v = ch.exercises.check_copy_after_kernels(copy_after_kernels("solution", "four rows"))
    assert not v.passed and "it holds none of the levels the steps wrote" in v, v


def test_notebook_2_takes_level_as_a_label(backend):
    """A copy's level= only names it: the right data under a wrong label passes, the wrong data
    under the right label is refused by what it holds."""
    v = ch.exercises.check_copy_after_kernels(copy_after_kernels("solution", "level 21, labelled 20"))
    assert v.passed, v
    v = ch.exercises.check_copy_after_kernels(copy_after_kernels("solution", "level 20, labelled 21"))
    assert not v.passed and "it holds level 20, what U[2] holds" in v and "nothing orders" not in v, v


def test_notebook_2_wants_the_level_in_last(backend):
    """An ordered copy of the right level into a pinned buffer the function allocates itself is
    lost when it returns (`last` keeps what it held): refused, naming `last`."""
    v = ch.exercises.check_copy_after_kernels(copy_after_kernels("solution", "into a fresh buffer"))
    assert not v.passed and "your function allocated itself" in v and "Copy into `last`" in v, v


def test_notebook_2_tells_a_step_after_the_copy_to_wait_on_compute(backend):
    """A kernel queued after the ordered copy overwrites the buffer the copy reads: the fix is compute
    waiting for the copy, not io waiting for the kernels."""
    v = ch.exercises.check_copy_after_kernels(copy_after_kernels("solution", "then one step more"))
    assert not v.passed and "a kernel queued after the copy overwrites" in v, v
    assert "make compute wait for an event recorded on io after the copy" in v, v
    assert "Make io wait" not in v, v


@pytest.mark.parametrize("wait", ["    io.synchronize()\n", "    compute.synchronize()\n", "    ch.synchronize()\n"])
def test_notebook_2_refuses_a_host_wait_after_the_copy(backend, wait):
    """The exercise asks for a host that does not wait at all: a wait after the copy is one too."""
    ns = {"ch": ch, "np": np}
    exec(NOTEBOOK_2, ns)
    run_cell("def copy_after_kernels(compute, io):\n    steps(20, compute)\n" + COPY_AFTER_KERNELS["solution"]
             + COPIES["as given"] + wait, ns, "a wait after the copy")
    v = ch.exercises.check_copy_after_kernels(ns["copy_after_kernels"])
    assert not v.passed and "the host waited after queueing the work" in v and wait.strip() in v, v


#: Bodies of copy_after_kernels a learner might write: right ones the check passes, wrong ones it refuses
#: with what its verdict must say.
OTHER_BODIES = {
    "io waits for the compute stream": (True, "    steps(20, compute)\n    io.wait_stream(compute)\n"
                                              "    ch.copy_to_host_async(last, U[21 % 3], io)\n", "Right:"),
    "the copy in a with-io block": (True, "    steps(20, compute)\n    done = compute.record()\n    with io:\n"
                                          "        io.wait_event(done)\n"
                                          "        ch.copy_to_host_async(last, U[21 % 3])\n", "Right:"),
    "event.record(stream)": (True, "    (done,) = ch.create_events(1)\n    steps(20, compute)\n"
                                   "    done.record(compute)\n    io.wait_event(done)\n"
                                   "    ch.copy_to_host_async(last, U[0], io, level=21)\n", "Right:"),
    "the event recorded on io": (False, "    steps(20, compute)\n    done = io.record()\n    io.wait_event(done)\n"
                                        "    ch.copy_to_host_async(last, U[21 % 3], io)\n",
                                 "`io` waits for `done`, but your loop records `done` on `io`, not on `compute`"),
    "the event recorded before the kernels": (False, "    (done,) = ch.create_events(1)\n    compute.record(done)\n"
                                                     "    steps(20, compute)\n    io.wait_event(done)\n"
                                                     "    ch.copy_to_host_async(last, U[21 % 3], io)\n",
                                              "`io` waits for `done`, but your loop records `done` on `compute` "
                                              "before the kernel `wave2d_4o level 21`"),
    "a wait for another event": (False, "    (done, other) = ch.create_events(2)\n    steps(20, compute)\n"
                                        "    compute.record(done)\n    io.wait_event(other)\n"
                                        "    ch.copy_to_host_async(last, U[21 % 3], io)\n",
                                 "`io` waits for `other`, but your loop never records `other` (it records `done` on "
                                 "`compute` after the kernel `wave2d_4o level 21`)"),
    "the copy on a third stream": (False, "    (other,) = ch.create_streams(1, name='other')\n    steps(20, compute)\n"
                                          "    other.wait_event(compute.record())\n"
                                          "    ch.copy_to_host_async(last, U[21 % 3], other)\n",
                                   "the copy is queued on `other`. Queue it on io"),
    "the host reads the copy's array at once": (False, "    steps(20, compute)\n    io.wait_event(compute.record())\n"
                                                       "    ch.copy_to_host_async(last, U[21 % 3], io)\n"
                                                       "    peek = float(last[0, 0])\n",
                                                "the host (reading an element in `peek = float(last[0, 0])`) reads "
                                                "last while the copy into it may still run"),
}


@pytest.mark.parametrize("name", list(OTHER_BODIES))
def test_notebook_2_judges_loops_written_other_ways(backend, name):
    """Right loops in other words pass; a wrong event (recorded on the wrong stream, before the kernels or
    never) is named, and a host read of the array the copy fills is told apart from a missing event."""
    right, body, words = OTHER_BODIES[name]
    ns = {"ch": ch, "np": np}
    exec(NOTEBOOK_2, ns)
    run_cell("def copy_after_kernels(compute, io):\n" + body, ns, name)
    v = ch.exercises.check_copy_after_kernels(ns["copy_after_kernels"])
    assert v.passed is right and words in v, v
    if not right:
        assert "synchron" not in v and "sanitiz" not in v, v


def test_notebook_2s_check_speaks_only_of_what_notebook_2_taught(backend):
    text = "".join(ch.exercises.check_copy_after_kernels(copy_after_kernels(n, c))
                   for n in COPY_AFTER_KERNELS for c in ("as given", "on compute", "level 20"))
    assert "sanitiz" not in text and "happens-before" not in text


# -- notebook 3: your own speed-up ----------------------------------------------------------------------
#: The stored table of notebook 3's section 3.2 (GB/s, pinned and pageable, an H100), which a learner
#: might read a speed-up off instead of computing theirs.
STORED_TABLE = {1: (16.0, 3.1), 4: (31.6, 6.8), 16: (44.5, 7.7), 64: (50.9, 8.8), 256: (53.9, 10.5)}


def my_measurement(size_mib):
    """Notebook 3's solution: the learner's rows at their size, and the speed-up computed from them."""
    rows = ch.measure_bandwidth(sizes_mib=(size_mib,), repeats=3)
    speed = {r["memory"]: r["gb_per_s"] for r in rows}
    return rows, speed["pinned"] / speed["pageable"], speed


def test_notebook_3_passes_the_speed_up_computed_from_your_rows(backend):
    rows, mine, _ = my_measurement(32)
    right = ch.exercises.check_speedup(rows, mine)
    assert right.passed and right.startswith("Right: your speed-up is the one your rows at 32 MiB give"), right
    assert ch.exercises.check_speedup(rows, rows[0]["gb_per_s"] / rows[1]["gb_per_s"]).passed   # another spelling
    assert ch.exercises.check_speedup(tuple(rows), mine).passed


def test_notebook_3_refuses_a_guess_or_a_number_from_elsewhere(backend):
    rows, mine, speed = my_measurement(32)
    _, at_8_mib, _ = my_measurement(8)
    stored = [pinned / pageable for pinned, pageable in STORED_TABLE.values()]
    for wrong in (5, 5.0, round(mine, 1), round(mine, 2), at_8_mib, *stored):
        v = ch.exercises.check_speedup(rows, wrong)
        assert not v.passed and "your rows at 32 MiB" in v, (wrong, v)
        assert "near it but not it" in v or "is not that" in v, (wrong, v)
    for wrong in (speed["pinned"], speed["pinned"] - speed["pageable"], 3 * mine, mine / 2):
        v = ch.exercises.check_speedup(rows, wrong)
        assert not v.passed and "is not that" in v, (wrong, v)
    inverse = ch.exercises.check_speedup(rows, 1 / mine)
    assert not inverse.passed and "pageable speed over the pinned one" in inverse


def test_notebook_3_says_what_is_wrong_with_the_rows(cpu):
    rows, mine, _ = my_measurement(2)
    assert "Not answered yet" in ch.exercises.check_speedup(None, None)
    assert "Not answered yet" in ch.exercises.check_speedup(rows, None)
    assert "above 0" in ch.exercises.check_speedup(rows, -2.0) and "number" in ch.exercises.check_speedup(rows, "3x")
    several = ch.measure_bandwidth(sizes_mib=(1, 2), repeats=1)
    wrong_rows = {"several sizes": (several, "hold 2 sizes (1, 2 MiB)"),
                  "one row": (rows[:1], "one pinned and one pageable row"),
                  "twice": (rows + rows, "one pinned and one pageable row"),
                  "numbers": ([1, 2], "list of rows (dicts)"),
                  "no speed": ([{"size_mib": 2, "memory": "pinned"}, rows[1]], "with size_mib, memory and gb_per_s"),
                  "a dict": (rows[0], "list of rows (dicts)")}
    for name, (bad, words) in wrong_rows.items():
        v = ch.exercises.check_speedup(bad, mine)
        assert not v.passed and words in v and "ch.measure_bandwidth(sizes_mib=(my_size_mib,))" in v, (name, v)


def test_notebook_3_refuses_rows_written_by_hand_or_changed(cpu):
    """Rows typed in (with the speed-up they give) are not a measurement; nor are measured rows
    whose speed was changed afterwards."""
    rows, mine, _ = my_measurement(2)
    typed = [{"size_mib": 32.0, "memory": "pinned", "gb_per_s": 50.0},
             {"size_mib": 32.0, "memory": "pageable", "gb_per_s": 10.0}]
    v = ch.exercises.check_speedup(typed, 5.0)
    assert not v.passed and "not rows ch.measure_bandwidth returned" in v, v
    changed = [dict(rows[0], gb_per_s=rows[0]["gb_per_s"] * 2), rows[1]]
    v = ch.exercises.check_speedup(changed, changed[0]["gb_per_s"] / changed[1]["gb_per_s"])
    assert not v.passed and "not rows ch.measure_bandwidth returned" in v, v
    assert ch.exercises.check_speedup([dict(r) for r in rows], mine).passed        # copies of the rows are fine


def test_notebook_3_answers_the_old_call_with_the_new_one(cpu):
    """check_speedup(my_size_mib, my_speedup), the form of older copies of notebook 3: a size holds
    no measurement to judge, and the verdict says what to pass instead."""
    _, mine, _ = my_measurement(8)
    for speedup in (mine, None):
        v = ch.exercises.check_speedup(8, speedup)
        assert not v.passed and "a size (8 MiB) does not hold it" in v and "check_speedup(my_rows, my_speedup)" in v


def test_notebook_3_does_not_measure_again(cpu, monkeypatch):
    """The verdict is about the learner's measurement: the check itself copies nothing."""
    rows, mine, _ = my_measurement(2)
    monkeypatch.setattr(ch.memory, "_timed_copies", lambda *a: pytest.fail("the check measured again"))
    assert ch.exercises.check_speedup(rows, mine).passed


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


@pytest.mark.gpu
def test_notebook_6_on_a_gpu_refuses_a_shallow_ring_and_an_empty_answer(gpu, balanced):
    """On a GPU the border between enough and too few buffers moves with the run (and with other work
    on the GPU), so only what no run can change is asserted there; the border itself is tested on the
    modelled GPU below, where every run is the same."""
    problem, every = balanced
    shallow = ch.exercises.check_ring_depth(4, problem, every)          # the fewest a ring may have
    assert not shallow.passed and "is not deep enough yet" in shallow and "of the shorter" in shallow
    assert "not answered" in ch.exercises.check_ring_depth(None, problem, every)


def test_notebook_6_wants_the_fewest_buffers(cpu, balanced):
    problem, every = balanced
    best = fewest(problem, every)
    deep = ch.exercises.check_ring_depth(best + 3, problem, every)
    assert not deep.passed and "with one buffer fewer for" in deep and "is not the fewest" in deep
    # hidden_fraction is a share of the shorter busy time, kernels' or copies': the words say so
    for verdict in (deep, ch.exercises.check_ring_depth(None, problem, every)):
        assert "of the shorter of their busy times" in verdict and "of the copies" not in verdict, verdict
    shallow = ch.exercises.check_ring_depth(best - 3, problem, every)
    assert not shallow.passed and "is not deep enough yet" in shallow and "of the shorter" in shallow
    assert not ch.exercises.check_ring_depth(3, problem, every).passed
    assert "not answered" in ch.exercises.check_ring_depth(None, problem, every)
    right = ch.exercises.check_ring_depth(best, problem, every)
    assert right.passed and "with one buffer fewer for only" in right and "of the shorter" in right
    ring_depth = ch.strategies.ring_depth(*ch.strategies.level_times(problem)[:2])
    assert ring_depth > best and not ch.exercises.check_ring_depth(ring_depth, problem, every).passed


@pytest.mark.parametrize("nscratch", [on_your_own.MAX_RING + 1, 100])
def test_notebook_6_answers_a_ring_too_deep_to_run_with_a_verdict(backend, balanced, nscratch):
    """More buffers than the streams loop takes: the check's own verdict, not solve's ValueError."""
    problem, every = balanced
    v = ch.exercises.check_ring_depth(nscratch, problem, every)
    assert not v.passed and f"nscratch={nscratch} is more buffers than the streams loop takes" in v, v


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
            {before_copy}
            ch.copy_to_host_async(run.images[k], U[c], {copy_stream}, level=old)
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
    "the wrong io stream": {"before_kernel": "io[(b + 2) % m].synchronize()"},
    "every copy on compute": {"copy_stream": "compute"},
    "on compute, with notebook 6's wait": {"copy_stream": "compute", "before_kernel": "io[b].synchronize()"},
    "the device chains them": {"before_kernel": "[compute.wait_event(s.record()) for s in io]",
                               "before_copy": "io[c].wait_event(compute.record())"},
    # right, in other words
    "an event recorded on the spot": {"before_kernel": "compute.wait_event(io[b].record())"},
    "wait_stream": {"before_kernel": "compute.wait_stream(io[b])"},
    "the host waits for the copy's event": {"setup": "copied = [None] * m",
                                            "before_kernel": "copied[b] is not None and copied[b].synchronize()",
                                            "after_copy": "copied[c] = io[c].record()"},
    # right, with labels that are not the levels the copies hold (a label claims nothing)
    "notebook 6's wait, each copy labelled by its level": {"before_kernel": "io[b].synchronize()",
                                                           "replace": [("level=old)", "level=level)")]},
    "notebook 6's wait, each copy labelled by its buffer": {"before_kernel": "io[b].synchronize()",
                                                            "replace": [("level=old)", "level=c)")]},
    # wrong without a race: every copy on compute, out of the buffer the kernel has just written
    "on compute, from the newest buffer": {"copy_stream": "compute",
                                           "replace": [("run.images[k], U[c]", "run.images[k], U[(c + 3) % m]")]},
    # wrong: the wait is there, on the wrong event or too seldom
    "an event recorded on compute": {"before_kernel": "compute.wait_event(compute.record())"},
    "the copy's event recorded before the copy": {"setup": "copied = ch.create_events(m)",
                                                  "before_kernel": "compute.wait_event(copied[b])",
                                                  "before_copy": "io[c].record(copied[c])"},
    "notebook 6's wait in the first round only": {"before_kernel": "io[b].synchronize() if level < m else None"},
    "the whole device, every m levels": {"before_kernel": "ch.synchronize() if level % m == 0 else None"},
}


def race_fix(name):
    parts = {"setup": "pass", "before_kernel": "pass", "before_copy": "pass", "after_copy": "pass",
             "copy_stream": "io[c]", **FIXES[name]}
    source = PLANTED.format(**{k: v for k, v in parts.items() if k != "replace"})
    for old, new in parts.get("replace", ()):
        assert old in source, old
        source = source.replace(old, new)
    ns = {"ch": ch}
    run_cell(source, ns, name)
    return ns["my_loop"]


def test_notebook_9_passes_the_fixes_that_wait_only_where_needed(backend):
    for name in ("notebook 6's wait", "events instead", "an event recorded on the spot", "wait_stream",
                 "the host waits for the copy's event", "notebook 6's wait, each copy labelled by its level",
                 "notebook 6's wait, each copy labelled by its buffer"):
        v = ch.exercises.check_race_fix(race_fix(name))
        assert v.passed, (name, v)


@pytest.mark.parametrize("name", ["planted", "the wrong io stream"])
def test_notebook_9_shows_the_race_left_without_giving_the_fix(backend, name):
    """The race is shown: its two operations and the wait missing between them, in the loop's
    names; not which line to write."""
    v = ch.exercises.check_race_fix(race_fix(name))
    assert not v.passed and "still reports a race" in v and "synchron" not in v.replace("ch.sanitize", ""), v
    assert "the D2H copy of level 0 on `io[0]` reads U[0]" in v, v
    assert "the kernel `wave2d_4o level 5` on `compute` writes U[0]" in v, v
    assert "nothing makes `compute` wait for that work on `io[0]`" in v, v


def test_notebook_9_judges_the_saved_levels_by_their_data(backend):
    """Ordered, race-free and wrong: the levels that differ are listed; no race is claimed."""
    v = ch.exercises.check_race_fix(race_fix("on compute, from the newest buffer"))
    assert not v.passed and "no race, but 120 saved levels (0, 1, 2, 3, 4, 5, ...) differ" in v, v


@pytest.mark.parametrize("name, note", [
    ("an event recorded on compute", " (`compute` waits for an event, but your loop records it on `compute`, not on "
                                     "`io[0]`)"),
    ("the copy's event recorded before the copy", " (`compute` waits for `copied[0]`, but your loop records "
                                                  "`copied[0]` on `io[0]` before the D2H copy of level 0)"),
    ("notebook 6's wait in the first round only", ""),
    ("the whole device, every m levels", ""),
])
def test_notebook_9_shows_why_a_wait_that_is_there_did_not_order(backend, name, note):
    """A wait on the wrong event, or too seldom, leaves the race: shown with the wait the loop has and why it
    did not order the two (its event's record), still without the line to write."""
    v = ch.exercises.check_race_fix(race_fix(name))
    assert not v.passed and "still reports a race" in v, v
    assert re.search(r"the D2H copy of level \d+ on `io\[\d\]` reads U\[\d\], then the kernel `wave2d_4o level \d+` "
                     r"on `compute` writes U\[\d\], and nothing makes `compute` wait for that work on `io\[\d\]` in "
                     r"between", v), v
    assert f"in between{note}. Find where" in v, v


@pytest.mark.parametrize("name, why", [
    ("every copy on compute", "the copies ran on `compute`, the stream of the kernels"),
    ("on compute, with notebook 6's wait", "the copies ran on `compute`, the stream of the kernels"),
    ("the device chains them", "your loop makes `compute` wait for an event, recorded after the copy into images["),
])
def test_notebook_9_fails_a_fix_that_gives_up_the_overlap(backend, name, why):
    """Race-free, right, no host wait too many, and serial: no copy can run during a kernel. The
    verdict says why, and how much of the copying a traced run hid under kernels (none)."""
    v = ch.exercises.check_race_fix(race_fix(name))
    assert not v.passed and "no copy can run during a kernel" in v and why in v, v
    assert re.search(r"the copies took \d+\.\d{3} ms, and 0% of that time ran under a kernel", v), v


@pytest.mark.parametrize("name, words", [
    ("the whole device", "`ch.synchronize()` x118 waits for the whole device"),
    ("and the compute stream", "`io[b].synchronize(); compute.synchronize()` x117 waits for a kernel"),
    ("the copy, at once", "`io[c].synchronize()` x119 waits for a copy that the next operation does not touch"),
    ("notebook 6's wait and the device", "`io[b].synchronize(); ch.synchronize()` x118 waits for the whole device"),
])
def test_notebook_9_fails_an_over_synchronised_fix(backend, name, words):
    v = ch.exercises.check_race_fix(race_fix(name))
    assert not v.passed and "no race and every saved level is right" in v and words in v, v
