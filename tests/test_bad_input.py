"""Bad input is refused early, with a message that names what was wrong: device profiles,
problems float32 cannot hold, huge nt, flags given as strings, and the CLI's arguments."""
import copy
import json
import re

import numpy as np
import pytest

import course_helper as ch
from course_helper.measure import bench, disk_sweep
from course_helper import checks, exercises, solver
from course_helper.runtime import profiles
from course_helper.cli import main


# -- device profiles -------------------------------------------------------------
def _set(doc, path, value):
    *parents, last = path.split(".")
    for key in parents:
        doc = doc[key]
    if value is _DELETE:
        del doc[last]
    else:
        doc[last] = value


_DELETE = object()

#: (field changed, new value, what the message must name). Each broke the modelled GPU
#: (a hang, a raw KeyError/ZeroDivisionError/TypeError) or was silently accepted.
MALFORMED = [
    ("links.D2H.latency_us", 1e300, "links.D2H.latency_us"),          # hung solve for ever
    ("links.D2H.latency_us", -1.0, "links.D2H.latency_us"),
    ("links.D2H.latency_us", _DELETE, "links.D2H lacks latency_us"),
    ("links.D2H.latency_us", "2.1", "links.D2H.latency_us must be a number"),
    ("links.H2D.gbps", 0, "links.H2D.gbps"),
    ("links.H2D.gbps", float("nan"), "links.H2D.gbps"),
    ("links.H2D.gbps", 1e-300, "links.H2D.gbps"),
    ("links.D2D", [1, 2], "links.D2D must be a section"),
    ("links.D2H_pageable", _DELETE, "links lacks D2H_pageable"),
    ("kernels.wave2d_4o.points", [[65536, 1e300]], "kernels.wave2d_4o.points[0] time"),   # hung solve
    ("kernels.wave2d_4o.points", [[65536, 0]], "kernels.wave2d_4o.points[0] time"),
    ("kernels.wave2d_4o.points", [], "kernels.wave2d_4o.points must be a list"),
    ("kernels.wave2d_4o.points", [[65536]], "kernels.wave2d_4o.points[0] must be a pair"),
    ("kernels.wave2d_4o.points", [["a", 2.0]], "kernels.wave2d_4o.points[0] bytes"),
    ("kernels.bake", "fast", "kernels.bake must be a section"),
    ("kernels.fill", _DELETE, "kernels lacks fill"),
    ("host_us.launch", -5.0, "host_us.launch"),                        # was accepted
    ("host_us.wake", None, "host_us.wake must be a number"),
    ("host_us.loop_turn", 1e300, "host_us.loop_turn"),
    ("device.async_engine_count", 0, "device.async_engine_count"),
    ("device.async_engine_count", "3", "device.async_engine_count must be a whole number"),
    ("device.async_engine_count", 2.5, "device.async_engine_count must be a whole number"),
    ("device.copies_per_link", -1, "device.copies_per_link"),
    ("graph.copy_node_us", -0.5, "graph.copy_node_us"),
    ("disk.gbps", 0.0, "disk.gbps"),
    ("disk.latency_us", 1e300, "disk.latency_us"),
    ("disk.writers", 0, "disk.writers"),
    ("host_us", _DELETE, "host_us must be a section"),
]


@pytest.mark.parametrize("field,value,named", MALFORMED,
                         ids=[f"{f}={'deleted' if v is _DELETE else repr(v)}"[:40] for f, v, _ in MALFORMED])
def test_a_malformed_profile_is_refused_on_load_naming_the_file_and_field(field, value, named, tmp_path):
    doc = copy.deepcopy(profiles.load("h200"))
    _set(doc, field, value)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        profiles.load(str(path))
    assert str(path) in str(err.value) and named in str(err.value)


def test_a_hanging_profile_never_reaches_the_modelled_gpu(tmp_path):
    doc = copy.deepcopy(profiles.load("h200"))
    doc["links"]["D2H"]["latency_us"] = 1e300
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(doc))
    before = ch.backend_name()
    with pytest.raises(ValueError, match="latency_us"):
        ch.set_backend("cpu", profile=str(path))
    assert ch.backend_name() == before


def test_the_shipped_profiles_pass_validation():
    for name in profiles.available():
        assert profiles.load(name)["device"]["name"]


@pytest.mark.parametrize("value,msg", [("/tmp", "cannot read"), ("no-such-gpu", "no device profile named")])
def test_a_bad_profile_variable_is_named(value, msg, monkeypatch):
    monkeypatch.setenv(profiles.ENV_VAR, value)
    with pytest.raises(ValueError) as err:
        profiles.load()
    assert f"${profiles.ENV_VAR}={value!r}" in str(err.value) and msg in str(err.value)


# -- the problem: huge nt, numbers float32 cannot hold, attributes set later ---------
@pytest.mark.parametrize("kwargs,msg", [
    (dict(nt=10**30), "at most|more than the 2147483647"),
    (dict(nt=2**31), "2147483647"),
    (dict(dx=1e-25), "1/dx0\\^2"),
    (dict(dx=1e25), "1/dx0\\^2"),
    (dict(dx=(1, 1e-22)), "1/dx1\\^2"),
    (dict(dx=1e-300), "1/dx0\\^2"),
    (dict(velocity=1e-30), "dt\\^2"),
    (dict(velocity=1e-30, dx=1e-3), "dt\\^2"),
])
def test_problems_that_would_overflow_are_refused_at_construction(kwargs, msg):
    with pytest.raises(ValueError, match=msg) as err:
        ch.WaveProblem(n0=16, n1=16, **kwargs)
    assert "float32" in str(err.value) or "nt" in str(err.value)


def test_spacings_in_other_units_that_fit_float32_still_run():
    for dx in (1e-15, 1e15):          # the same Courant number: the same wavefield, scale-free
        ref = ch.reference_solution(ch.WaveProblem(n0=24, n1=24, nt=30, dx=dx), every=29)
        assert np.isfinite(ref).all() and np.abs(ref[-1]).max() > 0


def test_velocity_none_is_named():
    with pytest.raises(TypeError, match="velocity must be a wave speed"):
        ch.WaveProblem(velocity=None)


@pytest.mark.parametrize("name,value,err,msg", [
    ("dt", float("nan"), ValueError, "dt"),
    ("dt", -1.0, ValueError, "dt"),
    ("dt", 1e30, ValueError, "float32"),
    ("source", (0, 0), ValueError, "outside the interior"),
    ("source", (8, 15), ValueError, "outside the interior"),
    ("source", 5, TypeError, "pair"),
    ("nt", 10**30, ValueError, "2147483647"),
    ("nt", 2, ValueError, "at least 3"),
    ("n0", 6, ValueError, "source"),
    ("dx1", 1e-22, ValueError, "float32"),
    ("fm", 0.0, ValueError, "fm"),
    ("cfl", 0.3, AttributeError, "fixed"),
    ("vmax", 1.0, AttributeError, "fixed"),
])
def test_numbers_set_after_construction_are_checked_again(name, value, err, msg):
    p = ch.WaveProblem(n0=16, n1=16, nt=10)
    before = getattr(p, name)
    with pytest.raises(err, match=msg):
        setattr(p, name, value)
    assert getattr(p, name) == before                 # a refused value is not kept


def test_a_valid_change_after_construction_is_kept():
    p = ch.WaveProblem(n0=16, n1=16, nt=10)
    p.dt, p.source, p.nt = p.dt / 2, (3, 12), 20
    assert (p.source, p.nt) == ((3, 12), 20)


def test_huge_nt_or_every_fail_early_everywhere():
    with pytest.raises(ValueError, match="every=10"):
        solver.plan_memory(ch.WaveProblem(n0=16, n1=16, nt=100), every=10**29)
    with pytest.raises(ValueError, match="2147483647"):
        ch.compare_strategies(ch.WaveProblem(n0=16, n1=16, nt=10**30), ["events"])


@pytest.mark.parametrize("command", ["run", "compare"])
def test_the_cli_refuses_a_huge_nt_with_a_message(command, tmp_path, capsys):
    extra = ["--store", str(tmp_path / "s.zarr")] if command == "run" else []
    assert main([command, "--backend", "cpu", "--no-progress", "--n", "16", "--nt", str(10**29), *extra]) == 2
    err = capsys.readouterr().err
    assert "2147483647" in err and "Traceback" not in err
    assert not (tmp_path / "s.zarr").exists()


# -- flags and arguments -------------------------------------------------------
def test_flags_are_checked_not_taken_by_truthiness(cpu):
    p = ch.WaveProblem(n0=16, n1=16, nt=10)
    with pytest.raises(TypeError, match="sanitize must be True or False"):
        solver.solve(p, sanitize="no")
    with pytest.raises(TypeError, match="store must be the path"):
        solver.solve(p, store=123)
    with pytest.raises(ValueError, match="unknown strategy"):
        solver.solve(p, strategy=["events"], store="never-made.zarr")


def test_the_memory_advice_never_suggests_every_at_or_above_nt(cpu, monkeypatch):
    monkeypatch.setattr(checks, "host_memory_available", lambda: 8 * 2**20)
    with pytest.raises(MemoryError) as err:
        solver.solve(ch.WaveProblem(n0=1024, n1=1024, nt=10), trace=False)   # 40 MiB, 4 MiB a level
    assert "every=" not in str(err.value) and "store=PATH" in str(err.value)
    with pytest.raises(MemoryError, match=r"every=\d+") as err:
        solver.solve(ch.WaveProblem(n0=512, n1=512, nt=100), trace=False)    # 100 MiB, 1 MiB a level
    every = int(re.search(r"every=(\d+)", str(err.value)).group(1))
    assert every < 100
    solver.plan_memory(ch.WaveProblem(n0=512, n1=512, nt=100), every=every)
    assert checks.host_memory_shortfall(len(range(0, 100, every)) * 2**20) is None   # the advice fits


def test_physical_limit_refuses_a_bad_peak():
    with pytest.raises(ValueError, match="peak_gbps"):
        bench.physical_limit(ch.WaveProblem(n0=16, n1=16, nt=10), peak_gbps=-1)


def test_the_layer_cake_checker_names_bad_input():
    with pytest.raises(TypeError, match="nplanes must be a whole number"):
        exercises.check_layer_cake(np.zeros((4, 8, 8), np.float32), nplanes="4")
    with pytest.raises(exercises.LayerCakeError) as err:
        exercises.check_layer_cake(np.full((4, 8, 8), np.inf, np.float32))
    assert "non-finite" in str(err.value) and "-9223372036854775808" not in str(err.value)


def test_bench_refuses_empty_points(cpu, capsys):
    assert main(["bench", "--backend", "cpu", "--points", "", "--no-progress", "--repeats", "1"]) == 2
    assert "--points is empty" in capsys.readouterr().err


def test_bench_disk_checks_its_folder_before_measuring(cpu, tmp_path, capsys, monkeypatch):
    def measured(*args, **kwargs):
        raise AssertionError("measured before checking the folder")
    monkeypatch.setattr(bench, "peak_d2h_gbps", measured)           # the command line's call
    monkeypatch.setattr(disk_sweep, "peak_d2h_gbps", measured)
    monkeypatch.setattr(disk_sweep, "disk_bandwidth", measured)
    assert main(["bench", "--backend", "cpu", "--disk", str(tmp_path / "missing"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bench_help_says_what_the_cpu_default_is(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a small one on the CPU" not in out and "predicted by the modelled GPU" in out


def test_run_labels_its_modelled_times(cpu, tmp_path, capsys):
    assert main(["run", "--backend", "cpu", "--no-progress", "--store", str(tmp_path / "s.zarr"),
                 "--n", "32", "--nt", "12"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    label = ch.runtime.time_label()
    assert label and f"ms ({label} time)" in line and "GB/s (modelled)" in line
