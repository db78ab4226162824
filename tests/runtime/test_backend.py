import os
import subprocess
import sys

import pytest

import course_helper as ch

GPU_ONLY = ("memory_gib", "multiprocessors", "compute_capability", "async_engine_count",
            "concurrent_kernels", "runtime_version", "driver_version")


def _run(code, backend_env):
    env = dict(os.environ)
    if backend_env is None:
        env.pop("COURSE_HELPER_BACKEND", None)
    else:
        env["COURSE_HELPER_BACKEND"] = backend_env
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_backend_name_is_gpu_or_cpu(backend):
    assert ch.backend_name() == backend


def test_first_use_prints_one_line_saying_why():
    p = _run("import course_helper as ch; ch.backend_name(); ch.backend_name(); ch.device_report()", "cpu")
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith("course_helper:")]
    assert len(lines) == 1
    assert "CPU backend" in lines[0] and "COURSE_HELPER_BACKEND=cpu" in lines[0]


def test_unknown_backend_word_is_refused_clearly():
    p = _run("import course_helper as ch; ch.backend_name()", "quantum")
    assert p.returncode != 0
    assert "is not a backend" in p.stderr and "auto" in p.stderr


def test_set_backend_refuses_unknown_word_and_keeps_the_current_one():
    before = ch.backend_name()
    with pytest.raises(ValueError, match="not a backend"):
        ch.set_backend("tpu")
    with pytest.raises(TypeError):
        ch.set_backend(3)
    assert ch.backend_name() == before


@pytest.mark.skipif(ch.runtime.gpu_available(), reason="a GPU works here")
def test_gpu_requested_without_gpu_says_why():
    p = _run("import course_helper as ch; ch.backend_name()", "gpu")
    assert p.returncode != 0
    assert "BackendUnavailable" in p.stderr
    assert "cannot run here" in p.stderr and "Unset COURSE_HELPER_BACKEND" in p.stderr
    # asked for in code (or by a command's --backend), the error does not blame the variable
    with pytest.raises(ch.runtime.BackendUnavailable, match="CPU backend") as info:
        ch.set_backend("gpu")
    assert "COURSE_HELPER_BACKEND" not in str(info.value) and "--backend auto" in str(info.value)


def test_auto_falls_back_or_takes_the_gpu():
    p = _run("import course_helper as ch; print(ch.backend_name())", "auto")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == ("gpu" if ch.runtime.gpu_available() else "cpu")


def test_device_report_fields(backend, capsys):
    rep = ch.device_report()
    assert rep["backend"] == backend
    for key in ("device", "cpu", "cores", "numpy", "times", *GPU_ONLY):
        assert key in rep
    assert rep["times"].startswith("modelled on NVIDIA H200" if backend == "cpu" else "measured on")
    if backend == "cpu":
        assert all(str(rep[k]).startswith("n/a") for k in GPU_ONLY)
        assert rep["device"].startswith("CPU")
    else:
        assert isinstance(rep["async_engine_count"], int) and rep["async_engine_count"] >= 0
        assert rep["multiprocessors"] > 0 and rep["memory_gib"] > 0
    ch.device_report(print_it=True)
    out = capsys.readouterr().out
    assert "async_engine_count" in out and rep["device"] in out


# --------------------------------------------------------------------------
# What the runtime can do, asked instead of its backend's name
# --------------------------------------------------------------------------
def test_the_runtime_says_what_it_can_do(backend):
    rt = ch.runtime.get()
    if backend == "cpu":
        assert rt.predicts_times and rt.modelled and not rt.runs_cuda
        assert rt.provenance == rt.profile["provenance"]
        assert rt.predicted_disk_gbps() == rt.profile["disk"]["gbps"]
    else:
        assert rt.runs_cuda and not rt.predicts_times and not rt.modelled
        assert rt.provenance is None and rt.predicted_disk_gbps() is None
        with pytest.raises(NotImplementedError, match="does not model the disk"):
            rt.disk_wait(None)


def test_a_request_waits_for_first_use_and_set_backend_rules_the_gpu_out():
    code = ("from course_helper.runtime import backend as b\n"
            "print(b.may_use_gpu(), b.requested())\n"
            "b.request('cpu')\n"
            "print(b.may_use_gpu(), b.requested(), b._state.name)\n"
            "print(b.backend_name(), b.reason())\n")
    p = _run(code, "auto")
    assert p.returncode == 0, p.stderr
    first, second, third = [x for x in p.stdout.splitlines() if not x.startswith("course_helper:")]
    assert first == "True auto"
    assert second == "False cpu None"              # asked for, not chosen: nothing probed yet
    assert third == "cpu asked for the CPU"
    p = _run("import course_helper as ch\nch.set_backend('cpu')\n"
             "print(ch.runtime.backend.may_use_gpu())\n", "gpu")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "False"    # the code's choice, not the environment's


def test_a_request_for_no_backend_is_refused():
    from course_helper.runtime import backend as b
    with pytest.raises(ValueError, match="is not a backend"):
        b.request("quantum")
    with pytest.raises(ValueError, match="is not a backend"):
        b.environment_for("tpu")
    assert b.environment_for("cpu") == {b.ENV_VAR: "cpu"}
