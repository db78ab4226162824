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
