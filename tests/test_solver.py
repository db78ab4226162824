from collections import Counter

import numpy as np
import pytest

import course_helper as ch
from course_helper import checks, solver, strategies
from course_helper.cli import main

STRATEGIES = list(ch.STRATEGIES)                      # the registry drives every parametrised test
GRAPHS = [name for name, entry in ch.STRATEGIES.items() if entry.graph]
STAGED = [name for name, entry in ch.STRATEGIES.items() if entry.staged]


@pytest.fixture(autouse=True)
def _strategy_runs_here(request):
    """A strategy the active backend does not run (graphs without CUDA graphs) is skipped with
    the registry's reason; its refusal is tested in test_graph_refused_on_cpu."""
    strategy = getattr(request.node, "callspec", None) and request.node.callspec.params.get("strategy")
    if strategy is None:
        return
    if "backend" in request.fixturenames:
        request.getfixturevalue("backend")            # switch backend first, then ask
    ok, why = ch.STRATEGIES[strategy].available()
    if not ok:
        pytest.skip(why)


def covered(trace, problem, every):
    """How often each level reached the host, from the trace's device-to-host copies
    (a staged copy ships several consecutive saved levels at once)."""
    count = Counter()
    for e in trace.of_kind("D2H"):
        n = e.bytes // problem.nbytes_level
        count.update(range(e.level, e.level + n * every, every))
    return count


@pytest.fixture
def reference(small):
    return ch.reference_solution(small)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_level_is_written_exactly_once(backend, small, strategy):
    r = ch.solve(small, strategy)
    assert r.images.shape == (small.nt, *small.shape)
    assert not np.isnan(r.images).any(), "a saved level was never written (NaN poison left)"
    assert list(r.levels) == list(range(small.nt))           # levels 0 and 1 included, no gaps
    assert covered(r.trace, small, 1) == Counter(range(small.nt)), "some level was copied twice or not at all"
    assert len(r.trace.kernels) == small.nt - 2
    if strategy in STAGED:
        assert Counter(e.level for e in r.trace.of_kind("D2D")) == Counter(range(small.nt))


def test_all_strategies_give_identical_images(backend, small, reference):
    results = {s: ch.solve(small, s) for s in solver.available_strategies()}
    base = results["sequential"].images
    for s, r in results.items():
        assert np.array_equal(r.images, base), f"{s} differs from sequential"
    if backend == "cpu":
        assert np.array_equal(base, reference)


@pytest.mark.parametrize("every", [2, 7, 49])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_snapshot_interval(backend, small, reference, strategy, every):
    r = ch.solve(small, strategy, every=every)
    assert list(r.levels) == list(range(0, small.nt, every))
    assert covered(r.trace, small, every) == Counter(range(0, small.nt, every))
    assert not np.isnan(r.images).any()
    expected = reference[::every]
    if backend == "cpu":
        assert np.array_equal(r.images, expected)
    else:
        np.testing.assert_allclose(r.images, expected, atol=1e-6 * np.abs(reference).max())


@pytest.mark.parametrize("nscratch", [4, 5, 9])
def test_scratch_ring_sizes_agree(backend, small, nscratch):
    base = ch.solve(small, "sequential", trace=False).images
    for strategy in ("streams", "events"):
        r = ch.solve(small, strategy, nscratch=nscratch, trace=False)
        assert np.array_equal(r.images, base)
        assert r.nscratch == nscratch


def test_too_few_scratch_buffers_is_refused_with_the_race_explained(backend, small):
    with pytest.raises(ValueError, match="race") as info:
        ch.solve(small, "events", nscratch=3)
    assert "nscratch >= 4" in str(info.value) and "unsafe=True" in str(info.value)
    with pytest.raises(ValueError, match="at least 3"):
        ch.solve(small, "events", nscratch=2, unsafe=True)


@pytest.mark.parametrize("strategy", ["streams", "events"])
def test_the_unsafe_ring_gives_a_wrong_answer_that_comparison_catches(backend, small, strategy):
    good = ch.solve(small, "sequential", trace=False)
    bad = ch.solve(small, strategy, nscratch=3, unsafe=True, trace=False)
    assert bad.max_difference(good) > 0


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(strategy="magic"), ValueError, "unknown strategy"),
    (dict(every=0), ValueError, "at least 1"),
    (dict(every=1.5), TypeError, "whole number"),
    (dict(every=50), ValueError, "every=50 is not below nt=50"),
    (dict(strategy="sequential", nscratch=5), ValueError, "always uses 3"),
    (dict(strategy="events", nscratch="5"), TypeError, "whole number"),
])
def test_bad_solve_arguments(backend, small, kwargs, err, msg):
    with pytest.raises(err, match=msg):
        ch.solve(small, **kwargs)


def test_problem_must_be_a_wave_problem(backend):
    with pytest.raises(TypeError, match="WaveProblem"):
        ch.solve({"n0": 10})


def test_output_too_large_for_host_memory_is_refused_before_allocating(backend, monkeypatch, small):
    monkeypatch.setattr(checks, "host_memory_available", lambda: 100_000)
    allocated = []
    monkeypatch.setattr(solver, "pinned_empty", lambda *a, **k: allocated.append(a))
    with pytest.raises(MemoryError, match="every=") as info:
        ch.solve(small, "events")
    assert "MiB" in str(info.value)
    assert allocated == []


def test_plan_memory_counts_bytes(small):
    plan = ch.solver.plan_memory(small, every=5, nscratch=4)
    assert plan["host"] == 10 * 48 * 48 * 4
    assert plan["device"] == 5 * 48 * 48 * 4
    staged = ch.solver.plan_memory(small, "staged", every=5, nstaging=2, batch=3)
    assert staged["device"] == (3 + 2 * 3 + 1) * 48 * 48 * 4


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(every=0), ValueError, "at least 1"),
    (dict(every=50), ValueError, "not below nt"),
    (dict(nscratch=-1), ValueError, "at least 3"),
    (dict(nscratch=3), ValueError, "race"),
    (dict(strategy="sequential", nscratch=5), ValueError, "always uses 3"),
    (dict(strategy="staged", nstaging=-2), ValueError, "at least 1 buffer"),
    (dict(strategy="events", batch=2), ValueError, "only used by the staged"),
    (dict(strategy="warp"), ValueError, "unknown strategy"),
    (dict(unsafe="yes"), TypeError, "True or False"),
])
def test_plan_memory_checks_its_arguments_like_solve(small, kwargs, err, msg):
    with pytest.raises(err, match=msg):
        ch.solver.plan_memory(small, **kwargs)
    with pytest.raises(err, match=msg):
        ch.solve(small, **kwargs)


@pytest.mark.parametrize("flag", ["trace", "unsafe"])
@pytest.mark.parametrize("value", ["no", 0, 1, None, "False"])
def test_solve_refuses_flags_that_are_not_bools(backend, small, flag, value):
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        ch.solve(small, "events", nscratch=3, **{flag: value})


@pytest.mark.parametrize("kwargs,msg", [
    (dict(strategy="staged", nstaging=2000), "nstaging \\(staging buffers\\) must be at most 32"),
    (dict(strategy="events", nscratch=33), "nscratch must be at most 32"),
    (dict(strategy="staged", nscratch=200), "nscratch must be at most 32"),
])
def test_ring_sizes_have_an_upper_bound(backend, small, kwargs, msg):
    from conftest import course_threads
    before = len(course_threads())
    with pytest.raises(ValueError, match=msg) as info:
        ch.solve(small, **kwargs)
    assert "IO stream" in str(info.value)
    assert len(course_threads()) == before                     # refused before any stream was made
    ch.solve(small, kwargs["strategy"], **{k: 32 for k in kwargs if k != "strategy"}, trace=False)


def test_the_whole_plan_must_fit_in_host_memory_on_the_cpu_backend(cpu, monkeypatch, small):
    # 50 saved levels of 9 KiB fit in 80% of 700 kB; adding 30 scratch buffers (and the velocity) does not.
    plan = ch.solver.plan_memory(small, "events", nscratch=30)
    assert plan["host"] <= 0.8 * 700_000 < plan["host"] + plan["device"]
    monkeypatch.setattr(checks, "host_memory_available", lambda: 700_000)
    allocated = []
    monkeypatch.setattr(solver, "device_zeros", lambda *a, **k: allocated.append(a))
    with pytest.raises(MemoryError, match="CPU backend keeps in host memory") as info:
        ch.solve(small, "events", nscratch=30)
    assert "nscratch" in str(info.value)
    assert allocated == []
    monkeypatch.undo()
    ch.solve(small, "events", nscratch=30, trace=False)        # with the real memory it runs


def test_result_without_trace_says_how_to_get_one(backend, small):
    r = ch.solve(small, "events", trace=False)
    assert not r.has_trace
    with pytest.raises(ValueError, match="trace=True"):
        _ = r.trace
    assert "events" in repr(r)
    np.testing.assert_allclose(r.times_ms, r.levels * small.dt * 1e3)


@pytest.mark.parametrize("strategy", ["events", "staged", "sequential"])
def test_a_plan_runs_what_it_checked_and_the_keyword_form_builds_the_same(backend, small, strategy):
    plan = ch.plan(small, strategy, every=3)
    assert plan == ch.plan(small, strategy, 3)                    # the defaults are filled in alike
    planned, keyword = ch.solve(plan, trace=False), ch.solve(small, strategy, every=3, trace=False)
    assert planned.plan == keyword.plan == plan
    assert (planned.nscratch, planned.nscratch_reason, planned.every, planned.batch) == \
        (plan.nscratch, plan.nscratch_reason, 3, plan.batch)
    np.testing.assert_array_equal(planned.images, keyword.images)


def test_a_plan_is_checked_when_it_is_made(backend, small):
    with pytest.raises(ValueError, match="unsafe"):
        ch.plan(small, "events", nscratch=3)
    with pytest.raises(TypeError, match="WaveProblem"):
        ch.plan("problem")
    assert ch.plan(small, "events", nscratch=3, unsafe=True).nscratch == 3


@pytest.mark.parametrize("kwargs", [{"every": 2}, {"nscratch": 6}, {"strategy": "streams"}, {"unsafe": True},
                                    {"batch": 2}])
def test_solve_refuses_settings_beside_a_plan(backend, small, kwargs):
    with pytest.raises(ValueError, match=f"leave out {next(iter(kwargs))}"):
        ch.solve(ch.plan(small, "events"), trace=False, **kwargs)


def test_a_plan_runs_as_checked_wherever_its_output_goes(cpu, small, tmp_path):
    stored = ch.solve(ch.plan(small, "events"), store=tmp_path / "run.zarr", trace=False)
    assert stored.store is not None and not stored.plan.held       # streamed: no stack in host memory
    with ch.timing_only():
        timed_only = ch.plan(small, "events")
        assert not timed_only.held
    r = ch.solve(timed_only, trace=False)                          # outside the block: computed, and held
    assert r.computed and r.plan.held and r.nscratch == timed_only.nscratch
    np.testing.assert_array_equal(r.images, stored.images[:])


def test_a_result_is_frozen(backend, small):
    import dataclasses
    r = ch.solve(small, "events", trace=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.elapsed_ms = 0.0
    with pytest.raises(AttributeError):
        r.nscratch = 9                               # read from the plan, which is frozen too


def test_graph_strategies_refused_where_graphs_are_not(cpu, small, monkeypatch):
    """Where a runtime has no graphs (CuPy for ROCm), the graph strategies refuse, naming the alternative."""
    from course_helper import runtime
    why = "this CuPy is built for ROCm, where the course does not use graphs; use 'staged' or 'events'"
    monkeypatch.setattr(runtime.get(), "graphs_supported", lambda: (False, why))
    assert GRAPHS, "the registry should hold the graph strategies"
    for name in GRAPHS:
        assert name not in solver.available_strategies()
        with pytest.raises(ch.graphs.GraphsUnsupported, match="not available") as info:
            ch.solve(small, name)
        assert "'staged' or 'events'" in str(info.value)


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(strategy="staged", nstaging=0), ValueError, "at least 1 buffer"),
    (dict(strategy="staged", nstaging=-2), ValueError, "at least 1 buffer"),
    (dict(strategy="events", nstaging=2), ValueError, "only used by the staged"),
    (dict(strategy="events", batch=2), ValueError, "only used by the staged"),
    (dict(strategy="staged", batch=0), ValueError, "at least 1"),
    (dict(strategy="staged", batch=2.0), TypeError, "whole number"),
    (dict(strategy="staged", nscratch=2), ValueError, "at least 3"),
])
def test_bad_staging_arguments(backend, small, kwargs, err, msg):
    with pytest.raises(err, match=msg):
        ch.solve(small, **kwargs)


# (3, 17): a batch of all 17 saved levels, the most a run of 50 levels every 3rd takes (a larger
# one is capped: tests/disk/test_compress.py's cap tests)
@pytest.mark.parametrize("nstaging,batch", [(1, 1), (2, 3), (7, 1), (1, 16), (3, 17)])
def test_staging_ring_sizes_agree(backend, small, nstaging, batch):
    base = ch.solve(small, "sequential", every=3, trace=False).images
    r = ch.solve(small, "staged", every=3, nstaging=nstaging, batch=batch)
    assert np.array_equal(r.images, base)
    assert r.nstaging == nstaging and r.nscratch == 3 and r.batch == batch
    assert covered(r.trace, small, 3) == Counter(range(0, small.nt, 3))


def test_chunk_levels_is_what_a_streamed_run_puts_in_one_chunk(tmp_path):
    from course_helper.solver import chunk_levels
    p = ch.WaveProblem(64, 64, nt=20)
    for name in ("events", "staged"):
        run = ch.solve(p, name, trace=False, store=tmp_path / f"{name}.zarr")
        assert chunk_levels(p, name) == run.batch == ch.open_store(run.store).images.chunks[0]
    assert chunk_levels(p, "staged") > 1
    with pytest.raises(ValueError, match="strategy"):
        chunk_levels(p, "warp")


def test_default_batch_aims_at_4_mib_copies():
    from course_helper.solver import default_batch
    assert default_batch(ch.WaveProblem()) == 16                  # 256 KiB levels
    assert default_batch(ch.WaveProblem(1024, 1024, nt=10)) == 1   # 4 MiB levels
    assert default_batch(ch.WaveProblem(512, 512, nt=10)) == 4


def test_graph_replays_are_identical_only_with_the_reset(backend, small):
    base = ch.solve(small, "sequential", trace=False).images
    r = ch.solve(small, "graph", trace=False)
    assert np.array_equal(r.images, base) and r.capture_ms is not None   # (the model charges no capture time)
    # Capture the same loop by hand, with and without resetting levels 0 and 1.
    with ch.prepare(small, "graph") as run:
        g = strategies.capture_loop(strategies.with_events, run)   # with the reset
        for _ in range(2):
            run.images.fill(np.nan)
            g.launch()
            ch.synchronize()
            assert np.array_equal(run.images, base)
    with ch.prepare(small, "graph") as run:                     # fresh events for a new capture
        with ch.graphs.capture_graph(run.compute) as cap:       # without the reset
            strategies.with_events(run)
            for io in run.io:
                run.compute.wait_stream(io)
        cap.graph.launch()
        ch.synchronize()
        cap.graph.launch()
    assert not np.array_equal(run.images, base), "a replay without reset should start from stale levels"


@pytest.mark.parametrize("strategy", GRAPHS)
def test_a_graph_is_set_up_before_its_timed_replay(backend, small, strategy, monkeypatch):
    """solve uploads the captured graph (cudaGraphUpload) before the clock starts, so the one
    timed launch does not set it up; an uploaded graph replays to the same answer."""
    calls, graph_cls = [], ch.graphs.Graph
    for verb in ("upload", "launch"):
        real = getattr(graph_cls, verb)
        monkeypatch.setattr(graph_cls, verb, lambda self, stream=None, _v=verb, _r=real:
                            calls.append(_v) or _r(self, stream))
    r = ch.solve(small, strategy, trace=False)
    assert calls == ["upload", "launch"]
    assert np.array_equal(r.images, ch.solve(small, "sequential", trace=False).images)


def test_prepare_builds_what_the_registry_declares(backend, small):
    for name in solver.available_strategies():
        entry = ch.STRATEGIES[name]
        with ch.prepare(small, name, every=2) as run:
            assert run.strategy == name and run.nscratch == entry.nscratch and len(run.U) == entry.nscratch
            assert run.images.shape == (25, *small.shape) and np.isnan(run.images).all()
            assert ch.is_pinned(run.images) == entry.streams
            nio = run.nstaging if entry.staged else run.nscratch
            assert len(run.io) == len(run.copied) == (nio if entry.streams else 0)
            assert len(run.filled) == (nio if entry.staged else 0)
            assert len(run.ready) == (nio if entry.streams and not entry.staged else 0)
            assert (run.nstaging > 0) == entry.staged


def test_a_loop_run_on_a_prepared_run_gives_the_solve_answer(backend, small):
    with ch.prepare(small, "events", nscratch=6) as run:
        strategies.with_events(run)
    assert np.array_equal(run.images, ch.solve(small, "sequential", trace=False).images)


@pytest.fixture
def extra_strategy():
    """A strategy added the way the course says: one loop, one registry entry."""
    def events_wide(run):
        strategies.with_events(run)

    entry = strategies.register(strategies.Strategy("events-wide", events_wide, nscratch=7, min_nscratch=4))
    yield entry
    del strategies.STRATEGIES["events-wide"]


def test_a_registered_strategy_is_picked_up_everywhere(cpu, small, extra_strategy, capsys, tmp_path):
    r = ch.solve(small, "events-wide")                          # defaults from its entry
    assert r.nscratch == 7 and np.array_equal(r.images, ch.solve(small, "sequential", trace=False).images)
    with pytest.raises(ValueError, match="nscratch >= 4"):      # validation from its entry
        ch.solve(small, "events-wide", nscratch=3)
    assert "events-wide" in solver.available_strategies()
    assert ch.compare_strategies(small, ["events-wide"], repeats=1).agree
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "events-wide" in capsys.readouterr().out             # the command line's choices
    assert main(["compare", "--backend", "cpu", "--n", "24", "--nt", "10", "--repeats", "1",
                 "--strategies", "events-wide", "--no-progress"]) == 0
    assert "events-wide" in capsys.readouterr().out
    with pytest.raises(ValueError, match="already registered"):
        strategies.register(strategies.Strategy("events-wide", strategies.with_events))


@pytest.mark.parametrize("depths", [dict(nscratch=4, min_nscratch=5), dict(nscratch=2, min_nscratch=2),
                                    dict(nscratch=6, min_nscratch=4, max_nscratch=5)])
def test_register_refuses_depths_out_of_order(depths):
    with pytest.raises(ValueError, match="min_nscratch <= nscratch"):
        strategies.register(strategies.Strategy("out-of-order", strategies.with_events, **depths))
    assert "out-of-order" not in solver.STRATEGIES


def test_the_two_strategy_registries_have_one_shape_and_one_way_in():
    """ch.STRATEGIES and ch.distributed.STRATEGIES: each a dict of name -> entry that carries its
    name and a line of help; both refuse a second entry of a name and an entry of another kind."""
    from course_helper import distributed
    from course_helper.distributed import loops
    for registry in (ch.STRATEGIES, distributed.STRATEGIES):
        assert isinstance(registry, dict) and registry
        assert all(entry.name == name and entry.help for name, entry in registry.items())
    with pytest.raises(ValueError, match="already registered"):
        loops.register(loops.HaloStrategy("overlap", distributed.blocking_step))
    with pytest.raises(TypeError, match="register a HaloStrategy"):
        loops.register(strategies.Strategy("events-halo", strategies.with_events))
    with pytest.raises(TypeError, match="register a Strategy"):
        strategies.register(loops.HaloStrategy("halo-events", distributed.overlap_step))
    assert distributed.STRATEGIES["overlap"].step is distributed.overlap_step
    assert "events-halo" not in distributed.STRATEGIES and "halo-events" not in ch.STRATEGIES
