"""The test suite itself: no test leaks its backend into the next one, and every GPU case of the
graph strategies runs on the GPU. Both need a GPU to mean anything (on a CPU-only machine there is
no other backend to leak), so they run pytest in a subprocess on a GPU machine only."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import course_helper as ch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not ch.backend.gpu_available():
        pytest.skip("no working CUDA GPU here: with one backend nothing can leak")


def run_pytest(*args, cwd):
    """pytest -v in a fresh process on the auto-chosen backend (the GPU here); returns its result."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("COURSE_HELPER_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=500)


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
