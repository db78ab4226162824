import json

import numpy as np
import pytest

import course_helper as ch
from course_helper import bench
from course_helper.cli import main


def test_bench_point_is_well_formed(backend):
    strategies = ["sequential", "events", "staged", "graph", "graph-staged"]
    p = bench.bench_point(48, 40, 3, strategies, repeats=2)
    assert p["saved_levels"] == 14 and p["output_bytes"] == 14 * 48 * 48 * 4
    assert p["bound_ms"] == max(p["compute_only_ms"], p["copy_floor_ms"]) > 0
    assert p["bound_by"] in ("compute", "copies")
    assert list(p["strategies"]) == strategies
    for name, r in p["strategies"].items():
        assert len(r["times_ms"]) == 2 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["efficiency"] == pytest.approx(p["bound_ms"] / r["median_ms"])
        assert r["identical_to_sequential"], name
    assert p["strategies"]["sequential"]["speedup"] == 1.0


def test_point_too_large_for_host_memory_is_skipped_not_run(cpu, monkeypatch):
    monkeypatch.setattr(bench, "host_memory_available", lambda: 10_000)
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
