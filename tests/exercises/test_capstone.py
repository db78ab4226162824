"""The capstone (notebook 13): the Gray-Scott kernel against NumPy, its launcher's checks, and the
checker, which passes the solution notebook's own loop with margin and fails the wrong loops
learners write (each made from the solution by changing what a learner would), on both backends."""
import numpy as np
import pytest

import course_helper as ch
from benchmarks.capstone_point import solution_loop, solution_source
from course_helper.exercises import capstone

GPU_TOLERANCE = 1e-6         # of the peak, as the wave kernel (tests/test_wave.py)


def loop(*changes, in_depth=2, out_depth=1):
    """The solution's loop with each ``(old, new)`` of ``changes`` made to its source (each must be there)."""
    source = solution_source()
    for old, new in changes:
        assert old in source, f"the solution no longer has {old!r}"
        source = source.replace(old, new)
    return solution_loop(in_depth, out_depth, source)


def verdict(run):
    with pytest.raises(ch.exercises.CapstoneError) as info:
        ch.exercises.check_capstone(run)
    return str(info.value)


# -- the problem and the kernel ---------------------------------------------------------------------------
def test_the_one_stream_loop_is_the_numpy_reference(backend):
    gs = capstone.GrayScott(**capstone.CHECK_POINT)
    device, numpy_ = ch.exercises.sequential_snapshots(gs), ch.exercises.reference_snapshots(gs)
    assert not np.isnan(device).any() and np.abs(numpy_).max() > 0.2
    if ch.backend_name() == "cpu":
        np.testing.assert_array_equal(device, numpy_)
    else:
        np.testing.assert_allclose(device, numpy_, atol=GPU_TOLERANCE * np.abs(numpy_).max())


def test_the_reaction_makes_patterns_and_the_feed_turns():
    gs = capstone.GrayScott(n=64, steps=960, feed_every=24, save_every=480, nframes=8)
    last = ch.exercises.reference_snapshots(gs)[-1]
    assert 0.1 < float(last.max()) < 1 and float(last.min()) >= 0 and (last > 0.1).mean() > 0.05
    assert not np.array_equal(gs.frames[0], gs.frames[1]) and np.array_equal(gs.frames[0], gs.frames[8])
    assert 0.028 < float(gs.frames[3].min()) and float(gs.frames[3].max()) < 0.046


def test_a_step_is_named_on_timelines_and_its_checks_come_first(backend):
    gs = capstone.GrayScott(n=16, steps=4, feed_every=2, save_every=2)
    u, v, feed, u2, v2 = (ch.device_zeros(gs.shape) for _ in range(5))
    (s,) = ch.create_streams(1, name="compute")
    with ch.tracing() as t:
        ch.exercises.launch_gray_scott(u, v, feed, u2, v2, gs, 6, s)
        ch.synchronize()
    assert [(e.name, e.level) for e in t.kernels] == [("gray_scott level 7", 7)]
    with pytest.raises(ValueError, match="u_next shares memory with u"):
        ch.exercises.launch_gray_scott(u, v, feed, u, v2, gs, 0, s)
    with pytest.raises(ValueError, match="shape"):
        ch.exercises.launch_gray_scott(u, v, ch.device_zeros((8, 8)), u2, v2, gs, 0, s)
    with pytest.raises(TypeError, match="device array"):
        ch.exercises.launch_gray_scott(u, v, np.zeros(gs.shape, np.float32), u2, v2, gs, 0, s)
    with pytest.raises(TypeError, match="GrayScott"):
        ch.exercises.launch_gray_scott(u, v, feed, u2, v2, ch.WaveProblem(16, 16, nt=4), 0, s)
    assert s.done


@pytest.mark.parametrize("kwargs, words", [
    (dict(n=2), "at least 3"), (dict(steps=10, save_every=20), "no snapshot"), (dict(du=0.3), "blow up"),
    (dict(nframes=0), "nframes"), (dict(kill=-1), "kill"),
])
def test_a_problem_that_cannot_run_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        capstone.GrayScott(**kwargs)


# -- the checker ---------------------------------------------------------------------------------------------
def test_the_solution_passes_with_margin(backend):
    run = solution_loop()
    assert ch.exercises.check_capstone(run).startswith("all 3 snapshots are right, no race, the host never waited")
    gs = capstone.GrayScott.balanced_point()
    with ch.timing_only(), ch.tracing() as t:
        kept = run(gs, gs.empty_snapshots())        # the loop's buffers, kept until the device is done
        ch.synchronize()
    del kept
    hidden = ch.exercises.hidden_by_direction(t.trace)
    margin = 0.05 if ch.backend_name() == "cpu" else 0.0      # the GPU's margin: benchmarks/capstone_point.py
    assert min(h.fraction for h in hidden.values()) >= capstone.HIDDEN_NEEDED + margin, hidden


def test_a_serial_loop_fails(backend):
    msg = verdict(loop(('for s in ("compute", "upload", "download"))', 'for s in ("compute", "upload", "download"))\n'
                        '    upload = download = compute                                      # one stream for all')))
    assert "the uploads (host to device) and the downloads (device to host) ran under the kernels less" in msg
    assert msg.count("they ran on `compute`, the stream of the kernels") == 2


def test_a_loop_that_hides_only_one_direction_fails_for_that_one(backend):
    """The uploads on the compute stream: the kernels wait for each, and each snapshot, staged after
    it, leaves on its own stream while the next block computes."""
    msg = verdict(loop(('for s in ("compute", "upload", "download"))', 'for s in ("compute", "upload", "download"))\n'
                        '    upload = compute')))
    assert "balanced point the uploads (host to device) ran under the kernels less" in msg, msg
    assert "The uploads: they ran on `compute`, the stream of the kernels" in msg and "The downloads" not in msg


def test_one_feed_buffer_serialises_the_uploads(backend):
    msg = verdict(solution_loop(in_depth=1))
    assert "the uploads (host to device)" in msg
    assert "your loop makes `compute` wait for `uploaded[0]`, recorded after the H2D copy of level 0 on `upload`" in msg


def test_a_host_wait_in_the_loop_fails(backend):
    msg = verdict(loop(("download.record(saved[s])", "download.record(saved[s])\n"
                                                      "            download.synchronize()")))
    assert "the host waited inside the loop 2 times (`download.synchronize()` x2)" in msg   # the last one ends it


@pytest.mark.parametrize("wait, buffer", [
    ("compute.wait_event(uploaded[b])", "feed[0]"),
    ("upload.wait_event(used[b])", "feed[0]"),
    ("compute.wait_event(saved[s])", "staged[0]"),
    ("download.wait_event(ready[s])", "staged[0]"),
])
def test_a_missing_wait_is_a_race_named_in_the_loops_words(backend, wait, buffer):
    msg = verdict(loop((wait, "pass")))
    assert msg.startswith("your loop has a race: it can give wrong snapshots on any run")
    assert f"race on {buffer}" in msg and "synchronise" not in msg, msg


def test_a_wrong_index_is_found_without_a_race(backend):
    msg = verdict(loop(("ch.copy_to_host_async(snapshots[i]", "ch.copy_to_host_async(snapshots[0]")))
    assert "though the race sanitizer found no race" in msg and "snapshots [1, 2] were never written" in msg


def test_a_fresh_notebook_is_told_to_write_the_loop(cpu):
    def run_capstone(gs, snapshots):
        raise NotImplementedError("write your loop here")
    assert verdict(run_capstone) == ("`run_capstone` is not written yet: replace its `raise NotImplementedError` "
                                     "with the loop, then run this cell again")
