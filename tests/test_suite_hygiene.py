"""The test suite itself: its thread-leak check sees the threads the package really starts; no
test leaks its backend into the next one, and every GPU case of the graph strategies runs on the
GPU. The last two need a GPU to mean anything (on a CPU-only machine there is no other backend to
leak), so they run pytest in a subprocess on a GPU machine only."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import course_helper as ch
from conftest import course_threads

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture
def _needs_a_gpu():
    if not ch.runtime.gpu_available():
        pytest.skip("no working CUDA GPU here: with one backend nothing can leak")


def test_the_thread_leak_check_sees_every_thread_the_package_starts(tmp_path, cpu):
    """course_threads() (the leak check of test_failure_modes and others) finds a live disk
    pipeline's threads, and each of them has a name from store.THREAD_NAMES."""
    before = set(threading.enumerate())
    sink = ch.disk.DiskSink(tmp_path / "s.zarr", ch.WaveProblem(n0=16, n1=16, nt=8), 1, 1)
    try:
        started = {t for t in threading.enumerate() if t not in before and t.name.startswith("disk ")}
        assert len(started) == sink.writers + 2
        assert started <= set(course_threads())
    finally:
        sink.finish()
    assert not course_threads()
    ch.disk.measure_disk_bandwidth(tmp_path, mib=1, chunk_mib=1, writers=2)
    assert not course_threads()


def run_pytest(*args, cwd):
    """pytest -v in a fresh process on the auto-chosen backend (the GPU here); returns its result."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("COURSE_HELPER_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=500)


@pytest.mark.gpu
@pytest.mark.usefixtures("_needs_a_gpu")
def test_a_cli_run_on_the_cpu_does_not_leak_into_the_next_test(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leak.py").write_text(textwrap.dedent("""
        import course_helper as ch
        from course_helper.cli import main

        def test_1_cli_on_the_cpu():
            assert main(["compare", "--backend", "cpu", "--n", "32", "--nt", "20", "--repeats", "1",
                         "--strategies", "events", "--no-progress"]) == 0

        def test_2_the_next_test_is_back_on_the_gpu():
            assert ch.backend_name() == "gpu"
    """))
    p = run_pytest(str(tmp_path), cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-4000:]


@pytest.mark.gpu
@pytest.mark.usefixtures("_needs_a_gpu")
def test_graph_cases_run_on_the_gpu_after_a_cpu_cli_run():
    """The CLI test leaves nothing behind, and each graph case runs on its own backend: the
    [gpu-graph*] cases on the GPU, the [cpu-graph*] cases on the modelled GPU; none is skipped."""
    p = run_pytest("tests/test_cli.py::test_compare_end_to_end_on_the_cpu_backend", "tests/test_solver.py",
                   "-k", "end_to_end or graph", cwd=ROOT)
    outcomes = dict(re.findall(r"^tests/test_solver\.py::(\S+\[(?:cpu|gpu)-graph[^\]]*\]) (\w+)", p.stdout, re.M))
    assert outcomes, p.stdout[-4000:]
    assert any("[gpu-graph" in case for case in outcomes) and any("[cpu-graph" in case for case in outcomes)
    wrong = {case: outcome for case, outcome in outcomes.items() if outcome != "PASSED"}
    assert not wrong, p.stdout[-4000:]
    assert p.returncode == 0, p.stdout[-4000:]


def _notebook(source):
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    return nbformat.writes(nb)


def test_a_notebook_over_the_memory_limit_fails_and_every_peak_is_printed(tmp_path):
    """The root conftest reads each notebook's kernel peak memory after its last cell: printed
    for every notebook, and on the CPU backend one over the limit fails, saying how much it took."""
    pytest.importorskip("nbval")
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "small.ipynb").write_text(_notebook("x = 1"))
    (tmp_path / "large.ipynb").write_text(_notebook("import numpy as np\nbig = np.ones(300 * 2**20, np.uint8)"))
    # in the pytest process itself (test_on_workers_... below checks the same on workers)
    env = dict(os.environ, COURSE_HELPER_BACKEND="cpu", COURSE_NOTEBOOK_MEMORY_MIB="250", COURSE_TEST_WORKERS="0")
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
                        "large.ipynb", "small.ipynb"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stdout[-3000:]
    peaks = {name: mib for mib, name in re.findall(r"^\s*([\d,]+) MiB  (\w+\.ipynb)$", p.stdout, re.M)}
    assert set(peaks) == {"large.ipynb", "small.ipynb"}, p.stdout[-3000:]
    assert int(peaks["large.ipynb"].replace(",", "")) > 300 > int(peaks["small.ipynb"].replace(",", ""))
    assert "FAILED large.ipynb::Cell 0" in p.stdout and "more than the 250 MiB" in p.stdout


def _course_with_a_checkpoint(root):
    """A copy of the course's notebooks/ under ``root`` as JupyterLab leaves it after opening one:
    a checkpoint copy in ``notebooks/.ipynb_checkpoints`` (and one in a hidden folder of solutions)."""
    shutil.copytree(ROOT / "notebooks", root / "notebooks", ignore=shutil.ignore_patterns(".*"))
    lesson = sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))[0]
    for folder in (root / "notebooks" / ".ipynb_checkpoints", root / "notebooks" / "solutions" / ".ipynb_checkpoints"):
        folder.mkdir()
        shutil.copy(lesson, folder / f"{lesson.stem}-checkpoint.ipynb")
    return root


def test_the_course_s_notebooks_leave_out_jupyterlab_s_checkpoint_copies(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    from course_paths import course_notebooks
    root = _course_with_a_checkpoint(tmp_path)
    found = course_notebooks(root)
    assert [p.relative_to(root) for p in found] == [p.relative_to(ROOT) for p in course_notebooks(ROOT)]
    assert len(list((root / "notebooks").rglob("*.ipynb"))) == len(found) + 2      # the copies are there
    assert not [p for p in found if "checkpoint" in p.name]


def test_pytest_collects_no_checkpoint_copy_of_a_notebook(tmp_path):
    """pytest --nbval over notebooks/ (the testpaths) leaves hidden folders out, by pytest's default
    norecursedirs; a pyproject that set its own norecursedirs would have to keep ".*"."""
    import tomllib
    assert ".*" in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"].get(
        "norecursedirs", [".*"])
    root = _course_with_a_checkpoint(tmp_path)
    for path in (root / "notebooks").rglob("*.ipynb"):                 # one cell each: collection only
        path.write_text('{"cells": [{"cell_type": "code", "execution_count": null, "id": "a", "metadata": {}, '
                        '"outputs": [], "source": "1"}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    (root / "pytest.ini").write_text("[pytest]\n")
    listed = subprocess.run([sys.executable, "-m", "pytest", "--nbval", "--collect-only", "-q", "-p",
                             "no:cacheprovider", "notebooks"], cwd=root, capture_output=True, text=True, timeout=120)
    files = {line.split("::")[0] for line in listed.stdout.splitlines() if "::" in line}
    assert files and not [f for f in files if "checkpoint" in f], listed.stdout + listed.stderr
    assert len(files) == len(list((root / "notebooks").rglob("*.ipynb"))) - 2


def test_the_suite_runs_on_at_most_four_workers_and_on_none_with_one_cpu_or_a_gpu(monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("course_root_conftest", ROOT / "conftest.py")
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    monkeypatch.delenv("COURSE_TEST_WORKERS", raising=False)
    assert [root_conftest.default_workers(cpus, gpu=False) for cpus in (1, 2, 3, 16)] == [0, 3, 4, 4]
    assert root_conftest.default_workers(16, gpu=True) == 0         # tests that time the GPU would share it
    monkeypatch.setenv("COURSE_TEST_WORKERS", "7")
    assert root_conftest.default_workers(16, gpu=False) == root_conftest.default_workers(16, gpu=True) == 7


def test_on_workers_a_notebook_runs_whole_and_its_peak_and_the_skips_reach_the_summary(tmp_path):
    """Under pytest-xdist (the suite's default where it is installed) a notebook's cells run in
    order in one worker's kernel, and what the workers found comes back to the summary: the
    skipped tests counted by reason, each notebook's peak memory, and a notebook failed for going
    over the memory limit (here 1 MiB: each does, once its cells have passed)."""
    pytest.importorskip("xdist", reason='pytest-xdist runs the suite on workers: pip install -e ".[test]"')
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    cells = [{"cell_type": "code", "execution_count": 1, "id": "a", "metadata": {}, "source": "x = 41", "outputs": []},
             {"cell_type": "code", "execution_count": 2, "id": "b", "metadata": {}, "source": "print(x + 1)",
              "outputs": [{"output_type": "stream", "name": "stdout", "text": "42\n"}]}]
    for k in range(2):
        (tmp_path / f"n{k}.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                                          "nbformat_minor": 5}))
    (tmp_path / "test_skips.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("k", range(3))
        def test_skipped(k):
            pytest.skip("a reason of this test's own")

        def test_passes():
            pass
        """))
    env = {**os.environ, "COURSE_TEST_WORKERS": "2", "COURSE_HELPER_BACKEND": "cpu", "COURSE_NOTEBOOK_MEMORY_MIB": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--nbval", "-p", "no:randomly"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "created: 2/2 workers" in out and "2 failed, 3 passed, 3 skipped" in out, out
    for name in ("n0", "n1"):           # the second cell passed (it needs the first's x), then the limit
        assert f"FAILED {name}.ipynb::Cell 1" in out
    # once per notebook in the failures section (the short summary repeats it, cut or not by the width)
    assert len(re.findall(r"^\s*n[01]\.ipynb took [\d,]+ MiB .*more than the 1 MiB a learner's machine is promised",
                          out, re.M)) == 2, out
    assert re.search(r"^\s+3  a reason of this test's own$", out, re.M), out
    assert len(re.findall(r"^\s*[\d,]+ MiB  n[01]\.ipynb$", out, re.M)) == 2, out
