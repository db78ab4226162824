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


@pytest.mark.parametrize("point", [capstone.CHECK_POINT, dict(n=256), dict(n=100, nframes=5)])
def test_a_feed_frame_is_the_stripes_formula_to_the_last_bit(point):
    """The frames are sin(4π (x cos θ + y sin θ)) of the docstring, whichever way they are computed."""
    gs = capstone.GrayScott(**point)
    x = np.arange(gs.n) / gs.n
    for p in range(gs.nframes):
        theta = np.pi * p / gs.nframes
        phase = 4 * np.pi * (x[None, :] * np.cos(theta) + x[:, None] * np.sin(theta))
        np.testing.assert_array_equal(gs.feed_frame(p), (0.037 + 0.008 * np.sin(phase)).astype(np.float32))


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
#: The solution's initial fields uploaded asynchronously on `upload`, as notebooks 3 and 7 teach, the kernels
#: waiting for them: set-up, which the balanced point does not count among the loop's uploads.
ASYNC_START = [("""    u = [ch.to_device(u0), ch.device_zeros(gs.shape)]                # the fields, ping-pong
    v = [ch.to_device(v0), ch.device_zeros(gs.shape)]
""", """    u, v = [ch.device_empty(gs.shape) for _ in range(2)], [ch.device_empty(gs.shape) for _ in range(2)]
    start = ch.pinned_empty((2, *gs.shape))
    start[0], start[1] = u0, v0
"""), ("""    for j in range(min(IN_DEPTH, gs.nblocks)):""", """    (arrived,) = ch.create_events(1)
    ch.copy_to_device_async(u[0], start[0], upload)
    ch.copy_to_device_async(v[0], start[1], upload)
    upload.record(arrived)
    compute.wait_event(arrived)
    for j in range(min(IN_DEPTH, gs.nblocks)):"""), ("return u, v, feed, staged", "return u, v, feed, staged, start")]
#: The lines that record `used[b]` and queue the next upload, which a learner may put after the snapshot's.
USED = """        if (n + 1) % gs.feed_every == 0 or n + 1 == gs.steps:
            compute.record(used[b])                   # block j is done with feed[b]
            if j + IN_DEPTH < gs.nblocks:
                upload_block(j + IN_DEPTH)
"""


def test_the_solution_passes_with_margin(backend):
    run = solution_loop()
    assert ch.exercises.check_capstone(run).startswith(
        "all 12 snapshots are right and no race, with each of your 2 feed buffers and 1 buffer your snapshots leave "
        "from reused at least twice, the host never waited")
    gs = capstone.GrayScott.balanced_point()
    with ch.timing_only(), ch.tracing() as t:
        kept = run(gs, gs.empty_snapshots())        # the loop's buffers, kept until the device is done
        ch.synchronize()
    del kept
    hidden = ch.exercises.hidden_by_direction(t.trace)
    margin = 0.05 if ch.backend_name() == "cpu" else 0.0      # the GPU's margin: benchmarks/capstone_point.py
    assert min(h.copy_fraction for h in hidden.values()) >= capstone.HIDDEN_NEEDED + margin, hidden


@pytest.mark.parametrize("in_depth, out_depth", [(3, 3), (6, 12)])
def test_deeper_rings_are_checked_with_every_buffer_reused_twice(cpu, in_depth, out_depth):
    msg = ch.exercises.check_capstone(solution_loop(in_depth, out_depth))
    gs = capstone.check_problem(in_depth, out_depth)
    assert gs.nblocks >= 3 * in_depth and gs.nsnapshots >= 3 * out_depth
    assert msg.startswith(f"all {gs.nsnapshots} snapshots are right and no race, with each of your {in_depth} feed "
                          f"buffers and {out_depth} buffers your snapshots leave from reused at least twice"), msg


@pytest.mark.parametrize("depth", [2, 3, 6, 12])   # 6 feed buffers, 12 snapshot buffers: none reused on the first
@pytest.mark.parametrize("changes, ring, buffer, fix", [                    # check point (6 blocks, 12 snapshots)
    ([("upload.wait_event(used[b])", "pass")], "in", "feed[0]", "make `upload` wait for `used[0]`"),
    ([("if n % gs.feed_every == 0:", "if n % gs.feed_every == 0 and j < IN_DEPTH:")], "in", "feed[0]",
     "queue the wait for `uploaded[0]` on `compute`"),
    ([("compute.wait_event(saved[s])", "pass")], "out", "staged[0]", "make `compute` wait for `saved[0]`"),
], ids=["no upload wait for used", "compute waits for the upload in the first round only", "no wait for saved"])
def test_a_ring_that_races_only_when_reused_is_refused(backend, depth, changes, ring, buffer, fix):
    """The rings of the issue: each race shows only when a buffer is used again, which the first
    check point (6 blocks, 12 snapshots) does not do for a ring as deep as its blocks or snapshots."""
    depths = dict(in_depth=depth) if ring == "in" else dict(out_depth=depth)
    msg = verdict(loop(*changes, **depths))
    assert msg.startswith("your loop has a race: it can give wrong snapshots on any run"), msg
    assert f"race on {buffer}" in msg and fix in msg, msg


def test_a_loop_that_returns_no_buffers_is_refused(backend):
    msg = verdict(loop(("return u, v, feed, staged", "return None")))
    assert "`run_capstone` does not return feed[0], feed[1]" in msg and "staged[0]" in msg, msg
    assert "Fix: return them from `run_capstone`" in msg
    msg = verdict(loop(("return u, v, feed, staged", "return u, v")))
    assert "`run_capstone` does not return feed[0], feed[1], staged[0], device buffers" in msg, msg


#: The solution's staging, with a new device buffer for each snapshot in `tmp`.
STAGING = """            compute.wait_event(saved[s])              # the copy out of staged[s] has left
            ch.memory.copy_on_device_async(staged[s], v[(n + 1) % 2], compute, level=n + 1)"""
FRESH = [(STAGING, """            tmp = ch.device_empty(gs.shape)           # a new buffer for each snapshot
            ch.memory.copy_on_device_async(tmp, v[(n + 1) % 2], compute, level=n + 1)"""),
         ("ch.copy_to_host_async(snapshots[i], staged[s], download",
          "ch.copy_to_host_async(snapshots[i], tmp, download")]


def test_a_buffer_made_on_every_turn_is_let_go_inside_the_loop(backend):
    """Each `tmp` goes when the variable takes the next one, while its copy may still run: returning `tmp`
    would keep only the last, so the message says what to do instead."""
    msg = verdict(loop(*FRESH))
    assert "`tmp` holds a new device buffer on each turn of `run_capstone`" in msg, msg
    assert "Fix: make the ring's buffers once, before the loop, reuse them in turn, and return them" in msg, msg


def test_a_buffer_made_on_every_turn_is_told_before_the_snapshots_it_may_spoil(cpu):
    """On a GPU the pool hands a let-go `tmp` to the next allocation while its copy still runs, and the
    snapshots come out wrong: the check names the buffer, the cause, not the wrong snapshots. Here the
    wrong snapshot is made by hand (the field u instead of v), on the modelled GPU, whose pool waits."""
    spoiled = [(STAGING, FRESH[0][1].replace("v[(n + 1) % 2], compute", "u[(n + 1) % 2], compute")), FRESH[1]]
    msg = verdict(loop(*spoiled))
    assert "`tmp` holds a new device buffer on each turn of `run_capstone`" in msg, msg
    assert "snapshots are wrong" not in msg, msg


def test_buffers_never_reused_are_not_said_to_be_reused(cpu):
    """A new staging buffer for every snapshot, all kept and returned: right, and the verdict does not claim
    the reuse it could not check."""
    kept = FRESH + [("    for j in range(min(IN_DEPTH", "    kept = []\n    for j in range(min(IN_DEPTH"),
                    ("level=n + 1)\n            compute.record(ready[s])",
                     "level=n + 1)\n            kept.append(tmp)\n            compute.record(ready[s])"),
                    ("return u, v, feed, staged", "return u, v, feed, kept")]
    msg = ch.exercises.check_capstone(loop(*kept))
    assert "your 2 feed buffers each reused at least" in msg, msg
    assert "buffers your snapshots leave from, some of them used only once (never reused)" in msg, msg
    assert "reused at least twice" not in msg


#: Wrong loops of the hidden set's kind, refused by the sanitizer on the small problem: each with the ring
#: depths it is written for and the words its fix must hold (the event the loop meant, named).
WRONG_EVENTS = {
    "used recorded on upload": ([("compute.record(used[b])", "upload.record(used[b])")], {},
                                "Fix: record `used[0]` on `compute` after the kernel `gray_scott level 6`, not on "
                                "`upload`"),
    "ready recorded on download": ([("compute.record(ready[s])", "download.record(ready[s])")], {},
                                   "Fix: record `ready[0]` on `compute` after the D2D copy of level 3, not on "
                                   "`download`"),
    "saved recorded on compute": ([("download.record(saved[s])", "compute.record(saved[s])")], {},
                                  "Fix: record `saved[0]` on `download` after the D2H copy of level 3, not on "
                                  "`compute`"),
    "used recorded a step before the block ends": (
        [("        if (n + 1) % gs.feed_every == 0 or n + 1 == gs.steps:\n            compute.record(used[b])",
          "        if (n + 2) % gs.feed_every == 0 or n + 1 == gs.steps:\n            compute.record(used[b])")], {},
        "the upload came too early (`upload` waits for `used[0]` before the upload of block 2's frame (H2D level 2), "
        "but your loop records `used[0]` on `compute` before the kernel `gray_scott level 6`, which still reads block "
        "0's frame from feed[0]).\n  Fix: record `used[0]` on `compute` after the last kernel of block 0"),
    "uploaded recorded before its upload": (
        [("        gs.frames.copy_to_device_async(feed[b], j, upload)\n        upload.record(uploaded[b])",
          "        upload.record(uploaded[b])\n        gs.frames.copy_to_device_async(feed[b], j, upload)")], {},
        "Fix: record `uploaded[0]` on `upload` after the H2D copy of level 0, not before it"),
    "download waits for ready before it is recorded": (
        [("            compute.record(ready[s])\n            download.wait_event(ready[s])",
          "            download.wait_event(ready[s])\n            compute.record(ready[s])")], {},
        "Fix: queue the wait for `ready[0]` on `download` after the record of `ready[0]` on `compute`"),
    "saved waited for in the first round only": (
        [("compute.wait_event(saved[s])", "compute.wait_event(saved[s]) if i < OUT_DEPTH else None")],
        dict(out_depth=2), "Fix: queue the wait for `saved[0]` on `compute` after the record of `saved[0]` on "
                           "`download`"),
    "a snapshot copied out of the other staging buffer": (
        [("ch.copy_to_host_async(snapshots[i], staged[s]", "ch.copy_to_host_async(snapshots[i], staged[(s + 1) % 2]")],
        dict(out_depth=2), "the D2H copy of level 3 on `download` reads staged[1]"),
    "the host reads a snapshot inside the loop": (
        [("            download.record(saved[s])",
          "            download.record(saved[s])\n            peek = float(snapshots[i].max())")], {},
        "Fix: read snapshots[0] only after your loop has returned and the device is done with it"),
}


@pytest.mark.parametrize("name", list(WRONG_EVENTS))
def test_a_wrong_event_or_access_is_named_in_the_loops_words(backend, name):
    changes, depths, words = WRONG_EVENTS[name]
    msg = verdict(loop(*changes, **depths))
    assert msg.startswith("your loop has a race: it can give wrong snapshots on any run"), msg
    assert words in msg and "synchronise" not in msg, msg


def test_downloads_on_the_compute_stream_fail_for_the_downloads(backend):
    msg = verdict(loop(("ch.copy_to_host_async(snapshots[i], staged[s], download",
                        "ch.copy_to_host_async(snapshots[i], staged[s], compute")))
    assert "The downloads: they ran on `compute`, the stream of the kernels" in msg, msg


#: Right loops written in other ways: events made by record() and event.record(stream), a with-stream block
#: for the kernels, no level labels, the buffers returned in a dict; and the staging copy on the download
#: stream, the kernels waiting for it before they overwrite the field it reads.
WRITTEN_OTHERWISE = [
    ("            compute.record(ready[s])\n            download.wait_event(ready[s])",
     "            download.wait_event(compute.record())"),
    ("download.record(saved[s])", "saved[s].record(download)"),
    ("        ch.exercises.launch_gray_scott(u[n % 2], v[n % 2], feed[b], u[(n + 1) % 2], v[(n + 1) % 2], gs, n, "
     "compute)",
     "        with compute:\n            ch.exercises.launch_gray_scott(u[n % 2], v[n % 2], feed[b], u[(n + 1) % 2], "
     "v[(n + 1) % 2], gs, n)"),
    (", level=n + 1)", ")"),                                          # both copies' labels
    ("return u, v, feed, staged", "return dict(u=u, v=v, feed=feed, staged=staged)"),
]
STAGED_ON_DOWNLOAD = [
    ("""            compute.wait_event(saved[s])              # the copy out of staged[s] has left
            ch.memory.copy_on_device_async(staged[s], v[(n + 1) % 2], compute, level=n + 1)
            compute.record(ready[s])
            download.wait_event(ready[s])
            ch.copy_to_host_async(snapshots[i], staged[s], download, level=n + 1)
            download.record(saved[s])""",
     """            download.wait_event(compute.record())     # v after step n is written
            ch.memory.copy_on_device_async(staged[s], v[(n + 1) % 2], download, level=n + 1)
            download.record(ready[s])                 # v[(n + 1) % 2] may be written again
            ch.copy_to_host_async(snapshots[i], staged[s], download, level=n + 1)"""),
    ("        ch.exercises.launch_gray_scott(u[n % 2], v[n % 2]",
     """        if n > gs.save_every and n % gs.save_every == 1:   # step n writes the field snapshot i - 1 read
            compute.wait_event(ready[(n // gs.save_every - 1) % OUT_DEPTH])
        ch.exercises.launch_gray_scott(u[n % 2], v[n % 2]"""),
]


@pytest.mark.parametrize("changes", [WRITTEN_OTHERWISE, STAGED_ON_DOWNLOAD],
                         ids=["written otherwise", "staged on download"])
def test_a_right_loop_written_otherwise_passes(backend, changes):
    assert ch.exercises.check_capstone(loop(*changes)).startswith("all 12 snapshots are right and no race")


def test_a_loop_that_ends_with_a_synchronize_passes(backend):
    final = ("    return u, v, feed, staged",
             "    ch.synchronize()                         # the device is done\n    return u, v, feed, staged")
    assert ch.exercises.check_capstone(loop(final)).startswith("all 12 snapshots are right and no race")
    # Once the device is done, the buffers may go: nothing queued uses them any more.
    assert ch.exercises.check_capstone(loop(final, ("return u, v, feed, staged", "return None"))).startswith("all 12")


def test_level_is_a_label_not_a_claim_about_the_data(backend):
    """Labels that differ from the steps the snapshots hold pass when the data are right; when an
    index is wrong, the message may name a copy's label, as information."""
    labelled = ("ch.copy_to_host_async(snapshots[i], staged[s], download, level=n + 1)",
                "ch.copy_to_host_async(snapshots[i], staged[s], download, level=i)")
    assert ch.exercises.check_capstone(loop(labelled)).startswith("all 12 snapshots are right and no race")
    shifted = ("ch.copy_to_host_async(snapshots[i], staged[s], download, level=n + 1)",
               "ch.copy_to_host_async(snapshots[(i + 1) % gs.nsnapshots], staged[s], download, level=i)")
    msg = verdict(loop(shifted))
    assert "though the race sanitizer found no race" in msg
    assert "snapshots[1] holds snapshot 0 (v after step 3): your copy labelled level 0 holds level 3" in msg, msg


def test_the_notebooks_sanitize_cell_takes_level_as_a_label_too(backend):
    """Notebook 13's cell 13.6 runs the loop under ch.sanitize(levels=False): copies labelled by their
    snapshot index pass there as they pass the check; a plain ch.sanitize() takes labels that number the
    levels as a claim (notebook 9), and reports the staging copy labelled 0 that reads level 3."""
    labelled = loop(("ch.copy_to_host_async(snapshots[i], staged[s], download, level=n + 1)",
                     "ch.copy_to_host_async(snapshots[i], staged[s], download, level=i)"),
                    ("copy_on_device_async(staged[s], v[(n + 1) % 2], compute, level=n + 1)",
                     "copy_on_device_async(staged[s], v[(n + 1) % 2], compute, level=i)"))
    small = capstone.check_problem(2, 1)
    with ch.sanitize(levels=False):
        snaps = small.empty_snapshots()
        kept = labelled(small, snaps)
        ch.synchronize()
    np.testing.assert_array_equal(snaps, ch.exercises.sequential_snapshots(small))
    with pytest.raises(ch.RaceError, match="so the copy saves level 3 as level 0"):
        with ch.sanitize():
            snaps = small.empty_snapshots()
            kept = labelled(small, snaps)
            ch.synchronize()
    del kept


def test_an_initial_upload_on_a_stream_is_set_up_not_counted(backend):
    msg = ch.exercises.check_capstone(loop(*ASYNC_START))
    assert "not counting your 2 set-up uploads before the first kernel" in msg, msg


def test_a_missing_upload_wait_names_the_feed_rings_event(backend):
    """`used[b]` recorded after the snapshot's `ready[s]`: the fix still names `used[0]`, the event recorded
    for the feed ring and waited for by nothing, not `ready[0]`, which orders the upload only by chance."""
    source = solution_source().replace(USED, "")
    end = source.index("    return u, v, feed, staged")
    reordered = (solution_source(), source[:end] + USED + source[end:])
    assert ch.exercises.check_capstone(loop(reordered)).startswith("all 12 snapshots are right")
    for changes in ([reordered], ASYNC_START):
        msg = verdict(loop(*changes, ("upload.wait_event(used[b])", "pass")))
        assert "race on feed[0]" in msg and "Fix: make `upload` wait for `used[0]`" in msg, msg


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


#: No staging ring: each snapshot copied straight from the field, the kernels waiting for that copy
#: before the step that overwrites the field (right, and no race, but the kernels wait for each download).
DIRECT_DOWNLOADS = [
    ("""            compute.wait_event(saved[s])              # the copy out of staged[s] has left
            ch.memory.copy_on_device_async(staged[s], v[(n + 1) % 2], compute, level=n + 1)
            compute.record(ready[s])
            download.wait_event(ready[s])
            ch.copy_to_host_async(snapshots[i], staged[s], download, level=n + 1)""",
     """            download.wait_event(compute.record())
            ch.copy_to_host_async(snapshots[i], v[(n + 1) % 2], download, level=n + 1)"""),
    ("        ch.exercises.launch_gray_scott(u[n % 2], v[n % 2]",
     """        if n > 1 and n % gs.save_every == 1:          # step n overwrites the field the snapshot reads
            compute.wait_event(saved[0])
        ch.exercises.launch_gray_scott(u[n % 2], v[n % 2]"""),
]
#: The feed uploaded with the blocking ch.to_device inside the loop (each buffer kept, so none is let go).
BLOCKING_FEED = [
    ("        gs.frames.copy_to_device_async(feed[b], j, upload)",
     "        feed[b] = ch.to_device(gs.frames[j])\n        kept.append(feed[b])"),
    ("    for j in range(min(IN_DEPTH, gs.nblocks)):", "    kept = []\n    for j in range(min(IN_DEPTH, gs.nblocks)):"),
    ("return u, v, feed, staged", "return u, v, feed, staged, kept"),
]


def test_kernels_waiting_for_each_download_are_told_so(backend):
    msg = verdict(loop(*DIRECT_DOWNLOADS))
    assert "The downloads: the kernels wait for each download: before the kernel" in msg, msg
    assert "wait for `saved[0]`, recorded after the D2H copy" in msg and "waiting for something else" not in msg, msg
    if "The uploads:" in msg:           # held up by the kernels' waits for the downloads
        assert "The uploads: nothing orders them before or after the kernels, but the kernels were idle while they " \
               "ran, waiting for the downloads" in msg, msg


def test_a_blocking_upload_in_the_loop_is_told_so(backend):
    msg = verdict(loop(*BLOCKING_FEED))
    assert "your loop ran no asynchronous uploads (host to device) at the balanced point" in msg, msg
    assert "blocking copies with ch.to_device inside the loop, so the host waited for each" in msg, msg
    assert "gs.frames.copy_to_device_async(feed[b], j, upload)" in msg, msg


def test_a_host_wait_in_the_loop_fails(backend):
    msg = verdict(loop(("download.record(saved[s])", "download.record(saved[s])\n"
                                                      "            download.synchronize()")))
    assert "the host waited inside the loop 11 times (`download.synchronize()` x11)" in msg   # the last one ends it


@pytest.mark.parametrize("wait, buffer, event", [
    ("compute.wait_event(uploaded[b])", "feed[0]", "uploaded[0]"),
    ("upload.wait_event(used[b])", "feed[0]", "used[0]"),
    ("compute.wait_event(saved[s])", "staged[0]", "saved[0]"),
    ("download.wait_event(ready[s])", "staged[0]", "ready[0]"),
])
def test_a_missing_wait_is_a_race_named_in_the_loops_words(backend, wait, buffer, event):
    msg = verdict(loop((wait, "pass")))
    assert msg.startswith("your loop has a race: it can give wrong snapshots on any run")
    assert f"race on {buffer}" in msg and f"wait for `{event}`" in msg and "synchronise" not in msg, msg


def test_a_wrong_index_is_found_without_a_race(backend):
    msg = verdict(loop(("ch.copy_to_host_async(snapshots[i]", "ch.copy_to_host_async(snapshots[0]")))
    assert "though the race sanitizer found no race" in msg
    assert "snapshots [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11] were never written" in msg


@pytest.mark.parametrize("old, new, words", [
    ("copy_on_device_async(staged[s], v[(n + 1) % 2]", "copy_on_device_async(staged[s], u[(n + 1) % 2]",
     "snapshots[0] differs from the one-stream loop's (it holds u after step 3, not v: copy the field v)"),
    ("copy_on_device_async(staged[s], v[(n + 1) % 2]", "copy_on_device_async(staged[s], v[n % 2]",
     "snapshots[0] differs from the one-stream loop's (it holds v after step 2, not after step 3: the copy was "
     "queued before the step that ends the snapshot"),
    ("gs.frames.copy_to_device_async(feed[b], j, upload)", "gs.frames.copy_to_device_async(feed[b], j + 1, upload)",
     "each block's kernels read the feed frame of block j + 1 instead of block j's"),
])
def test_a_wrong_snapshot_says_what_it_holds(backend, old, new, words):
    """The wrong field, a snapshot taken before its step, or the next block's feed: each told apart."""
    msg = verdict(loop((old, new)))
    assert "though the race sanitizer found no race" in msg and words in msg, msg
    assert "a step, a field or a feed frame" not in msg, msg


def test_a_fresh_notebook_is_told_to_write_the_loop(cpu):
    def run_capstone(gs, snapshots):
        raise NotImplementedError("write your loop here")
    assert verdict(run_capstone) == ("`run_capstone` is not written yet: replace its `raise NotImplementedError` "
                                     "with the loop, then run this cell again")


# -- the ring depths from the measured times -------------------------------------------------------------------
def measured(gs):
    """Notebook 13's timing cell (the solution's): one step (a block timed, divided by its steps) and
    one copy at ``gs``'s size, each from what ch.elapsed_ms returned; and the block's time."""
    u, v, feed, u_next, v_next = (ch.device_zeros(gs.shape) for _ in range(5))
    host = ch.pinned_empty(gs.shape)
    (stream,) = ch.create_streams(1, name="timing")
    start, end = ch.create_events(2, timing=True)

    def time_ms(queue):
        for _ in range(2):
            stream.record(start)
            queue()
            stream.record(end)
            end.synchronize()
        return ch.elapsed_ms(start, end)

    def one_block():
        for n in range(gs.feed_every):
            ch.exercises.launch_gray_scott(u, v, feed, u_next, v_next, gs, n, stream)
    with ch.timing_only():
        block_ms = time_ms(one_block)
        copy_ms = time_ms(lambda: ch.copy_to_host_async(host, v, stream))
    return block_ms / gs.feed_every, copy_ms, block_ms


def asked(gs, step, copy):
    """The depths the times ask for (notebook 13's solution)."""
    return 1 + int(np.ceil(copy / (gs.feed_every * step))), max(1, int(np.ceil(copy / (gs.save_every * step))))


def test_depths_from_the_measured_times_pass_and_one_more(backend):
    gs = capstone.GrayScott.balanced_point()
    step, copy, _ = measured(gs)
    need_in, need_out = asked(gs, step, copy)
    assert ch.exercises.check_depths(step, copy, need_in, need_out) == (
        f"IN_DEPTH = {need_in} and OUT_DEPTH = {need_out} fit your times (they ask for {need_in} and {need_out})")
    assert ch.exercises.check_depths(step, copy, need_in + 1, need_out + 1).startswith(
        f"IN_DEPTH = {need_in + 1} and OUT_DEPTH = {need_out + 1} fit")


def test_depths_too_shallow_to_hide_the_copies_are_refused(backend):
    """IN_DEPTH = 1 at the balanced point: the next upload would wait for the whole block, as
    check_capstone then shows; a ring of snapshots shallower than the copies need likewise."""
    gs = capstone.GrayScott.balanced_point()
    step, copy, _ = measured(gs)
    need_in, need_out = asked(gs, step, copy)
    assert need_in >= 2
    with pytest.raises(ch.exercises.CapstoneError, match=f"IN_DEPTH = {need_in - 1} is too shallow for your times"):
        ch.exercises.check_depths(step, copy, need_in - 1, need_out)
    with pytest.raises(ch.exercises.CapstoneError, match=f"IN_DEPTH = {need_in + 2} is deeper than your times need"):
        ch.exercises.check_depths(step, copy, need_in + 2, need_out)
    short = capstone.GrayScott(n=gs.n, steps=72, feed_every=4, save_every=4)   # a copy outlasts 4 steps
    step, copy, _ = measured(short)
    need_in, need_out = asked(short, step, copy)
    assert need_out >= 2
    with pytest.raises(ch.exercises.CapstoneError, match=f"OUT_DEPTH = {need_out - 1} is too shallow"):
        ch.exercises.check_depths(step, copy, need_in, need_out - 1, short)


def test_depths_judge_the_learners_own_times(backend):
    """Typed-in times, a step in µs, a block's time as a step's, or the two swapped are refused."""
    gs = capstone.GrayScott.balanced_point()
    step, copy, block = measured(gs)
    need = asked(gs, step, copy)
    cases = [((round(step, 3), copy), "step_ms = .* is not a time ch.elapsed_ms returned"),
             ((step, round(copy, 2) + 0.001), "copy_ms = .* is not a time ch.elapsed_ms returned"),
             ((step * 1000, copy), "is not a time ch.elapsed_ms returned"),
             ((block, copy), "is not one step's time at 3072x3072"),
             ((copy, step), "look swapped")]
    for (s, c), words in cases:
        with pytest.raises(ch.exercises.CapstoneError, match=words):
            ch.exercises.check_depths(s, c, *need)


@pytest.mark.parametrize("args, words", [
    ((None, 0.7, None, 1), "step_ms, IN_DEPTH are not set yet"),
    ((0.06, -1.0, 2, 1), "copy_ms must be a finite number above 0"),
    ((0.06, 0.7, 2, 0), "OUT_DEPTH must be at least 1"),
    ((0.06, 0.7, 2.0, 1), "IN_DEPTH must be a whole number"),
])
def test_depths_malformed_are_told_as_the_checks_own_error(cpu, args, words):
    """The notebook's cell catches only CapstoneError: a malformed value is one, not a ValueError."""
    with pytest.raises(ch.exercises.CapstoneError, match=words):
        ch.exercises.check_depths(*args)
