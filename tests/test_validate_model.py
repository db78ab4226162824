"""The model check's fit of the pageable device-to-host link (benchmarks/validate_model.py)."""
import importlib.util
import json
import pathlib

import pytest

import course_helper as ch
from course_helper.runtime import profiles

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _validate_model():
    spec = importlib.util.spec_from_file_location("validate_model", ROOT / "benchmarks" / "validate_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def restore_backend():
    yield
    ch.set_backend("cpu")


def _profile_with_link(tmp_path, name, latency_us, gbps):
    profile = profiles.load("h200")
    profile["links"]["D2H_pageable"] = {"gbps": gbps, "latency_us": latency_us}
    path = tmp_path / name
    path.write_text(json.dumps(profile))
    return path


def test_the_fit_finds_the_link_that_made_the_times(tmp_path, restore_backend):
    """Sequential times modelled with a known pageable link (30 us, 9 GB/s) are fitted back to it,
    starting from a profile whose link is far off; the direct measurement is kept beside it."""
    vm = _validate_model()
    truth = _profile_with_link(tmp_path, "truth.json", 30.0, 9.0)
    points = [(48, 40, 1), (96, 30, 2), (160, 24, 1)]
    doc = {"points": [{"n": n, "nt": nt, "every": every, "strategies": {"sequential": {"median_ms": 1.0}}}
                      for n, nt, every in points]}
    _, rows = vm.predict(doc, str(truth))
    for point, row in zip(doc["points"], rows):
        point["strategies"]["sequential"]["median_ms"] = row["modelled_ms"]
    start = _profile_with_link(tmp_path, "start.json", 70.0, 16.0)
    worst = vm.fit_pageable(doc, str(start))
    link = json.loads(start.read_text())["links"]["D2H_pageable"]
    assert link["latency_us"] == pytest.approx(30.0, abs=0.5)
    assert link["gbps"] == pytest.approx(9.0, abs=0.05)
    assert worst < 0.01
    assert link["direct_measurement"] == {"gbps": 16.0, "latency_us": 70.0}
    assert "fitted_to" in link
    # one copy time per level size, each the truth's latency + bytes / bandwidth
    assert [size for size, _ in link["fitted_us"]] == sorted(n * n * 4 for n, _, _ in points)
    for size, us in link["fitted_us"]:
        assert us == pytest.approx(30.0 + size / 9e3, rel=0.01)
    _, again = vm.predict(doc, str(start))
    for point, row in zip(doc["points"], again):
        assert row["modelled_ms"] == pytest.approx(point["strategies"]["sequential"]["median_ms"], rel=0.01)


def test_the_shipped_model_is_within_a_tenth_of_the_committed_h200_sweep(restore_backend):
    """benchmarks/model_validation.json holds the shipped H200 profile's model against the committed
    sweep (benchmarks/bench.json): every point and strategy within 10%, and its host-bound point
    (256², where the host costs fitted to the sweep decide) predicted again here gives its rows."""
    vm = _validate_model()
    doc = json.loads((ROOT / "benchmarks" / "model_validation.json").read_text())
    sweep = json.loads((ROOT / "benchmarks" / "bench.json").read_text())
    assert doc["measured"]["created"] == sweep["created"]
    worst = max(doc["rows"], key=lambda r: abs(r["ratio"] - 1))
    assert abs(worst["ratio"] - 1) <= 0.10, worst
    point = next(p for p in sweep["points"] if p["n"] == 256)
    _, rows = vm.predict({"points": [point]}, "h200")
    stored = {r["strategy"]: r for r in doc["rows"] if r["n"] == 256}
    for row in rows:
        assert row["measured_ms"] == stored[row["strategy"]]["measured_ms"]
        assert row["modelled_ms"] == pytest.approx(stored[row["strategy"]]["modelled_ms"], rel=1e-6)
