import dataclasses
import json
import pathlib
import re

import pytest

import course_helper as ch
from course_helper.measure import bench, sweep
from course_helper import checks, runtime
from course_helper.cli import main


def test_bench_point_is_well_formed(backend):
    strategies = ch.solver.available_strategies()          # every strategy this backend runs
    p = bench.bench_point(48, 40, 3, strategies, repeats=2)
    assert p["saved_levels"] == 14 and p["output_bytes"] == 14 * 48 * 48 * 4
    assert p["bound_ms"] == max(p["compute_only_ms"], p["copy_floor_ms"]) > 0
    assert p["bound_by"] in ("compute", "copies")
    # on the GPU the events loop in plain CuPy is measured too, as a reference row right after events
    rows = list(p["strategies"])
    if backend == "gpu":
        assert rows[rows.index("events") + 1] == "raw-cupy-events"
        rows.remove("raw-cupy-events")
    assert rows == strategies
    for name, r in p["strategies"].items():
        assert len(r["times_ms"]) == 2 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["efficiency"] == pytest.approx(p["bound_ms"] / r["median_ms"])
        assert r["identical_to_sequential"], name
        if name in strategies:            # what tracing costs, and which clock timed the traces
            assert r["traced_ms"] > 0 and r["untraced_beside_ms"] > 0 and r["trace_overhead"] > 0
            assert r["trace_timing"] in ("CUPTI", "CUDA events", "modelled H200")
            assert r["overlap_timing"] == r["trace_timing"]
            assert 0 <= r["overlap_ms"] <= min(r["compute_busy_ms"], r["copy_busy_ms"])
            assert 0 <= r["hidden_fraction"] <= 1
    assert p["strategies"]["sequential"]["speedup"] == 1.0
    if backend == "gpu":                  # the helper's events loop against the plain-CuPy one
        raw = p["strategies"]["raw-cupy-events"]
        assert raw["events_over_raw"] == bench.paired_ratio(p["strategies"]["events"]["times_ms"], raw["times_ms"])


def test_paired_ratio_compares_round_by_round():
    # a host twice as slow in the second round: the medians' ratio is 1.25, each round's is 1.5
    assert bench.paired_ratio([3.0, 6.0], [2.0, 4.0]) == pytest.approx(1.5)
    assert bench.paired_ratio([1.0, 3.0, 9.0], [1.0, 2.0, 3.0]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="equally long"):
        bench.paired_ratio([1.0], [1.0, 2.0])


def test_the_raw_row_runs_right_after_the_events_loop(backend):
    """A row held against a strategy runs back to back with it in every round."""
    from course_helper.measure.compare import time_strategies
    p = ch.WaveProblem(24, 24, nt=12)
    turns, reference = [], ch.solve(p, "sequential", trace=False).images
    extra = {"raw": lambda: (reference.copy(), 2.0)}
    time_strategies(p, ["events", "staged"], repeats=2, also=extra, also_after="events",
                    progress=lambda name, i: turns.append(name))
    assert turns == ["sequential", "events", "raw", "staged"] * 2
    with pytest.raises(ValueError, match="also_after"):
        time_strategies(p, ["events"], repeats=1, also=extra, also_after="graph")


def test_tracing_cost_is_taken_in_rounds_of_one_untraced_and_one_traced_run(backend, monkeypatch):
    made = []
    real_solve = sweep.solve

    def solve(*args, **kwargs):
        r = real_solve(*args, **kwargs)
        made.append(kwargs["trace"])
        # untraced 2, 6, 10 ms and traced 3, 5, 20 ms: the host's speed changes from round to round
        return dataclasses.replace(r, elapsed_ms={1: 2.0, 2: 3.0, 3: 6.0, 4: 5.0, 5: 10.0, 6: 20.0}[len(made)])

    monkeypatch.setattr(sweep, "solve", solve)
    cost = bench.measure_trace_cost(ch.WaveProblem(24, 24, nt=12), "events", 1, repeats=3)
    assert made == [False, True] * 3
    # round by round 1.5, 0.83, 2.0 -> median 1.5 (the medians' ratio would be 5 / 6)
    assert cost["trace_overhead"] == pytest.approx(1.5) and cost["untraced_beside_ms"] == 6.0
    assert cost["traced_ms"] == 5.0


def test_point_too_large_for_host_memory_is_skipped_not_run(cpu, monkeypatch):
    monkeypatch.setattr(checks, "host_memory_available", lambda: 10_000)
    p = bench.bench_point(64, 40, 1, ["sequential", "events"], repeats=1)
    assert "host memory" in p["skipped"] and "strategies" not in p


def test_bench_cli_writes_json_and_plot(cpu, tmp_path, capsys):
    code = main(["bench", "--backend", "cpu", "--points", "40x30x1,40x30x5", "--repeats", "1",
                 "--strategies", "sequential,staged", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["machine"]["backend"] == "cpu" and len(doc["points"]) == 2
    assert doc["peak_d2h_gbps"] > 0
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "efficiency" in out and "staged" in out
    assert doc["machine"]["clock"] == "modelled H200" and "modelled H200" in out


def test_bench_on_the_cpu_predicts_times_without_computing(cpu, capsys):
    code = main(["bench", "--backend", "cpu", "--points", "40x30x1", "--repeats", "1",
                 "--strategies", "sequential,events", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "times only" in captured.err and "modelled H200" in captured.out


@pytest.mark.parametrize("points,msg", [("256x640", "NxNTxEVERY"), ("axbxc", "NxNTxEVERY"),
                                        ("64x10x20", "not below nt")])
def test_bench_cli_bad_points(cpu, points, msg, capsys):
    assert main(["bench", "--backend", "cpu", "--points", points, "--no-progress", "--repeats", "1"]) == 2
    assert msg in capsys.readouterr().err


def test_bench_refuses_unknown_strategy(cpu):
    with pytest.raises(ValueError, match="unknown strategy"):
        bench.run_bench([(32, 20, 1)], ["warp"], repeats=1)


def test_bench_plot_labels_are_readable(cpu):
    import matplotlib.pyplot as plt
    doc = json.loads((pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench.json").read_text())
    for p in doc["points"]:                       # speedups as on a CPU: all just under 1x
        for r in p.get("strategies", {}).values():
            r["speedup"] = 0.8 + 0.15 * r["efficiency"]
    fig = bench.plot_bench(doc)
    fig.draw_without_rendering()
    speedup = fig.axes[1]
    boxes = [t.get_window_extent() for t in speedup.get_xticklabels() if t.get_text()]
    assert len(boxes) == len([p for p in doc["points"] if "strategies" in p])
    assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:])), "x labels overlap"
    lo, hi = speedup.get_ylim()
    shown = [t.get_text() for t in speedup.get_yticklabels()
             if t.get_text() and lo <= t.get_position()[1] <= hi]
    assert len(shown) >= 2 and all(re.fullmatch(r"[0-9.]+x", s) for s in shown), shown
    plt.close(fig)


def test_strategies_take_turns_and_extra_rows_are_timed_alike(backend):
    """Each round runs every strategy once, so a host that slows down part-way slows them all;
    an extra row (the benchmark's plain-CuPy loop) takes its turn and is compared the same way."""
    from course_helper.measure.compare import time_strategies
    p = ch.WaveProblem(24, 24, nt=12)
    turns, reference = [], ch.solve(p, "sequential", trace=False).images
    extra = {"same": lambda: (reference.copy(), 2.0), "off": lambda: (reference + 1, 4.0)}
    rows = time_strategies(p, ["events"], repeats=2, also=extra, progress=lambda name, i: turns.append((name, i)))
    assert turns == [(name, i) for i in range(2) for name in ("sequential", "events", "same", "off")]
    assert rows["same"]["times_ms"] == [2.0, 2.0] and rows["off"]["median_ms"] == 4.0
    if ch.runtime.get().computes_data:
        assert rows["events"]["max_diff"] == rows["same"]["max_diff"] == 0.0
        assert rows["off"]["max_diff"] == pytest.approx(1.0, abs=1e-6)
    assert rows["same"]["speedup"] == pytest.approx(rows["sequential"]["median_ms"] / 2.0)


def test_the_sweep_times_every_untraced_run_before_any_traced_one(backend, monkeypatch):
    """A CUPTI recording leaves the process slower, so no point's untraced runs may follow a
    traced run: the sweep reports both passes, untraced first for every point."""
    traced = []
    real_solve = sweep.solve

    def solve(*args, **kwargs):
        traced.append(bool(kwargs.get("trace", True)))
        return real_solve(*args, **kwargs)

    monkeypatch.setattr(sweep, "solve", solve)                 # the traced runs
    monkeypatch.setattr(ch.measure.compare, "solve", solve)         # the timed, untraced ones
    seen = []
    doc = bench.run_bench([(32, 20, 1), (40, 20, 2)], ["events"], repeats=1,
                          progress=lambda point, stage: seen.append((point["n"], stage, len(traced))))
    assert [(n, stage) for n, stage, _ in seen] == [(32, "untraced"), (40, "untraced"), (32, "traced"), (40, "traced")]
    untraced_done = seen[1][2]                    # solves made when the last point's untraced pass ended
    assert untraced_done and not any(traced[:untraced_done])
    # then rounds of one untraced run (beside it, for the ratio) and one traced run
    assert traced[untraced_done:] == [False, True] * (len(traced[untraced_done:]) // 2)
    assert all("trace_overhead" in r for p in doc["points"] for name, r in p["strategies"].items()
               if name in ch.STRATEGIES)


_OVERLAP_KEYS = ("compute_busy_ms", "copy_busy_ms", "overlap_ms", "hidden_fraction")


def test_each_strategy_reports_how_much_overlapped_in_its_traced_runs(cpu):
    """The busy times, overlap and hidden fraction of a point's rows are Trace.overlap() of its
    traced runs (the model is deterministic: any traced run gives the same numbers)."""
    p = bench.bench_point(512, 40, 1, ["sequential", "events"], repeats=2, nscratch=8)
    problem = ch.WaveProblem(512, 512, nt=40)
    for name, row in p["strategies"].items():
        r = ch.solve(problem, name, every=1, nscratch=8 if name == "events" else None)
        assert {k: row[k] for k in _OVERLAP_KEYS} == pytest.approx({k: v for k, v in r.trace.overlap().as_dict().items()
                                                                   if k in _OVERLAP_KEYS})
        assert row["overlap_timing"] == row["trace_timing"] == "modelled H200"
        assert row["nscratch"] == r.nscratch
    assert p["nscratch"] == 8 and p["strategies"]["events"]["nscratch"] == 8
    assert p["strategies"]["sequential"]["overlap_ms"] == 0.0 < p["strategies"]["events"]["overlap_ms"]
    lines = bench.table({"points": [p]}).splitlines()
    assert lines[0].split()[-6:] == ["traced", "compute", "D2H", "overlap", "hidden", "identical"]
    events = next(line for line in lines if " events " in line)
    row = p["strategies"]["events"]
    assert (f"{row['compute_busy_ms']:.2f} {row['copy_busy_ms']:.2f} {row['overlap_ms']:.2f} "
            f"{100 * row['hidden_fraction']:.0f}%") in " ".join(events.split())
    assert lines[1].startswith("512^2x40 e1 s8")


def test_the_ring_sweep_measures_every_point_at_every_depth(cpu, monkeypatch):
    monkeypatch.setattr(ch.measure.compare, "solve", _times_only(ch.measure.compare.solve))
    doc = bench.run_bench([(128, 40, 4)], ["events"], repeats=1, nscratch=[5, 12])
    assert [(p["n"], p["nscratch"]) for p in doc["points"]] == [(128, 5), (128, 12)]
    hidden = [p["strategies"]["events"]["hidden_fraction"] for p in doc["points"]]
    assert [p["strategies"]["events"]["nscratch"] for p in doc["points"]] == [5, 12]
    assert all(0.0 <= h <= 1.0 for h in hidden)
    for p in doc["points"]:       # the keys readers of bench.json use are all still there
        want = {"median_ms", "times_ms", "efficiency", "speedup", "identical_to_sequential"}
        assert want <= set(p["strategies"]["events"])


def _times_only(solve):
    def run(*args, **kwargs):
        rt = ch.runtime.get()
        with rt.times_only(rt.modelled):
            return solve(*args, **kwargs)
    return run


def test_a_ring_depth_a_strategy_cannot_use_is_refused_before_anything_is_measured(cpu, monkeypatch):
    monkeypatch.setattr(sweep, "peak_d2h_gbps", lambda *a, **k: pytest.fail("measured before checking"))
    with pytest.raises(ValueError, match="nscratch=3 is unsafe"):
        bench.run_bench([(64, 40, 1)], ["events"], repeats=1, nscratch=[8, 3])
    with pytest.raises(ValueError, match="at least one ring depth"):
        bench.run_bench([(64, 40, 1)], ["events"], repeats=1, nscratch=[])


@pytest.mark.parametrize("text,depths", [("5,8,12", [5, 8, 12]), (" 24 ", [24]), ("8,8,5", [8, 5])])
def test_parse_nscratch(text, depths):
    assert bench.parse_nscratch(text) == depths


@pytest.mark.parametrize("text", ["", "5,,8", "five", "0", "-4", "2.5"])
def test_parse_nscratch_refuses_what_is_not_a_ring_depth(text):
    with pytest.raises(ValueError, match="--nscratch"):
        bench.parse_nscratch(text)


def test_the_sweep_has_a_balanced_point(cpu):
    """At the balanced point a copy fits between two saved levels (not copy-bound), spans many
    kernels (so overlap pays), and a kernel outlasts the host's turn (launch, record, wait_event)."""
    from course_helper.strategies import level_times
    assert bench.BALANCED_POINT in bench.DEFAULT_POINTS
    n, nt, every = bench.BALANCED_POINT
    t = level_times(ch.WaveProblem(n0=n, n1=n, nt=nt))
    host_us = runtime.get().profile["host_us"]
    turn_ms = (host_us["launch"] + host_us["record"] + host_us["wait_event"] + host_us["loop_turn"]) * 1e-3
    assert 8 * t.kernel_ms < t.copy_ms < every * t.kernel_ms
    assert t.kernel_ms > 2 * turn_ms


def test_bench_cli_sweeps_the_ring_depth(cpu, tmp_path, capsys):
    code = main(["bench", "--backend", "cpu", "--points", "64x40x4", "--nscratch", "5,9", "--repeats", "1",
                 "--strategies", "events", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [p["nscratch"] for p in doc["points"]] == [5, 9]
    assert all(set(_OVERLAP_KEYS) <= set(p["strategies"]["events"]) for p in doc["points"])
    assert "64^2x40 e4 s5" in out and "64^2x40 e4 s9" in out and "hidden" in out


@pytest.mark.parametrize("extra,msg", [(["--nscratch", "5,x"], "ring depth 'x'"),
                                       (["--nscratch", "5", "--disk", "."], "leave it out with --disk")])
def test_bench_cli_bad_nscratch(cpu, extra, msg, capsys):
    assert main(["bench", "--backend", "cpu", "--points", "64x40x4", "--no-progress", "--repeats", "1", *extra]) == 2
    assert msg in capsys.readouterr().err


def test_compare_table_shows_busy_times_overlap_and_hidden_fraction(cpu):
    p = ch.WaveProblem(512, 512, nt=40)
    c = ch.compare_strategies(p, ["events"], repeats=1)
    lines = c.table().splitlines()
    assert lines[0].split()[8:] == ["compute", "ms", "D2H", "ms", "overlap", "ms", "hidden", "max", "diff"]
    for row, line in zip(c.rows, lines[2:]):
        o = c.results[row["strategy"]].trace.overlap()
        assert (row["compute_busy_ms"], row["copy_busy_ms"], row["overlap_ms"], row["hidden_fraction"]) == \
            (o.compute_ms, o.copy_ms, o.overlap_ms, o.hidden_fraction)
        assert line.split()[5:9] == [f"{o.compute_ms:.2f}", f"{o.copy_ms:.2f}", f"{o.overlap_ms:.2f}",
                                     f"{100 * o.hidden_fraction:.0f}%"]
    assert c.rows[1]["hidden_fraction"] > 0 and "timing: modelled H200" in lines[-1]
    assert "modelled H200" in c.plot().get_title()


def test_compare_plot_puts_each_speedup_above_its_error_bar(cpu):
    c = ch.compare_strategies(ch.WaveProblem(64, 64, nt=20), ["events"], repeats=1)
    c.rows[1]["max_ms"] = 3 * c.rows[1]["median_ms"]          # a long error bar, as a noisy host gives
    ax = c.plot()
    labels = {t.get_text(): t.xy[1] for t in ax.texts}
    for r in c.rows:
        assert labels[f"{r['speedup']:.2f}x"] >= r["max_ms"]     # the label clears the bar's cap
    assert ax.get_ylim()[1] > max(r["max_ms"] for r in c.rows)


def test_the_bench_checks_each_strategy_once_per_point_and_passes_the_plans_down(cpu, monkeypatch):
    checked, real = [], ch.solver._validate

    def validate(*args, **kwargs):
        checked.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(ch.solver, "_validate", validate)
    bench.bench_point(48, 20, 2, ["events", "staged"], repeats=1)
    assert checked == ["sequential", "events", "staged"]      # timing, the limit B and the traces reuse them
    checked.clear()
    bench.run_bench([(48, 20, 2)], ["events"], repeats=1, nscratch=[6])
    assert checked == ["sequential", "events"]


def test_the_bench_refuses_an_unsafe_ring_in_the_solver_s_words_with_its_own_fix(cpu):
    with pytest.raises(ValueError, match=r"nscratch=3 is unsafe .*\(a race\); .*at least 4") as refused:
        bench.bench_point(48, 20, 1, ["events"], repeats=1, nscratch=3)
    with pytest.raises(ch.solver.UnsafeRing) as solver_said:
        ch.plan(ch.WaveProblem(48, 48, nt=20), "events", nscratch=3)
    assert str(refused.value).startswith(solver_said.value.rule) and "unsafe=True" not in str(refused.value)
