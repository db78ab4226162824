import json
import pathlib
import re

import numpy as np
import pytest

import course_helper as ch
from course_helper import bench, checks
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
    from course_helper.compare import time_strategies
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
    real_solve = bench.solve

    def solve(*args, **kwargs):
        r = real_solve(*args, **kwargs)
        made.append(kwargs["trace"])
        # untraced 2, 6, 10 ms and traced 3, 5, 20 ms: the host's speed changes from round to round
        r.elapsed_ms = {1: 2.0, 2: 3.0, 3: 6.0, 4: 5.0, 5: 10.0, 6: 20.0}[len(made)]
        return r

    monkeypatch.setattr(bench, "solve", solve)
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
    doc = json.loads((pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench.json").read_text())
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
    from course_helper.compare import time_strategies
    p = ch.WaveProblem(24, 24, nt=12)
    turns, reference = [], ch.solve(p, "sequential", trace=False).images
    extra = {"same": lambda: (reference.copy(), 2.0), "off": lambda: (reference + 1, 4.0)}
    rows = time_strategies(p, ["events"], repeats=2, also=extra, progress=lambda name, i: turns.append((name, i)))
    assert turns == [(name, i) for i in range(2) for name in ("sequential", "events", "same", "off")]
    assert rows["same"]["times_ms"] == [2.0, 2.0] and rows["off"]["median_ms"] == 4.0
    if ch.runtime.get().computes_data:
        assert rows["events"]["max_diff"] == rows["same"]["max_diff"] == 0.0 and rows["off"]["max_diff"] == pytest.approx(1.0, abs=1e-6)
    assert rows["same"]["speedup"] == pytest.approx(rows["sequential"]["median_ms"] / 2.0)


def test_the_sweep_times_every_untraced_run_before_any_traced_one(backend, monkeypatch):
    """A CUPTI recording leaves the process slower, so no point's untraced runs may follow a
    traced run: the sweep reports both passes, untraced first for every point."""
    traced = []
    real_solve = bench.solve

    def solve(*args, **kwargs):
        traced.append(bool(kwargs.get("trace", True)))
        return real_solve(*args, **kwargs)

    monkeypatch.setattr(bench, "solve", solve)                 # the traced runs
    monkeypatch.setattr(ch.compare, "solve", solve)            # the timed, untraced ones
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
