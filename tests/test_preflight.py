"""``python -m course_helper preflight``: what each notebook will run here, and the fix for what is missing."""
import json
import threading

import pytest
from conftest import process_ends

from course_helper import preflight
from course_helper.cli import main


@pytest.fixture(scope="module")
def report():
    """One run of ``preflight --json`` (a few seconds: it starts two MPI ranks and writes to the disk)."""
    out = []
    from course_helper.cli import _parser
    code = preflight.preflight_main(_parser().parse_args(["preflight", "--json"]), say=out.append)
    return code, json.loads(out[0])


#: JupyterLab and the widget extensions come with the lab extra, which a machine running only the unit
#: tests (a GPU node's stock image) may lack: there preflight rightly says the course cannot run.
LAB_PIECES = {"jupyterlab", "widgets"}


def _skip_without_the_lab(doc):
    """Skip a test that needs the whole course installed where only the lab extra is missing."""
    missing = {name for name, c in doc["checks"].items() if c["status"] == "missing"}
    if missing and missing <= LAB_PIECES:
        pytest.skip("JupyterLab or the widget extensions are not installed here: pip install -e '.[lab]'")


def test_preflight_says_the_course_can_run_here_and_names_every_notebook(report):
    code, doc = report
    _skip_without_the_lab(doc)
    assert code == 0, doc["missing"]
    assert doc["can_run"] is True and doc["missing"] == []
    numbers = [p["number"] for p in doc["notebooks"]]
    lessons = [n for n, _, _ in preflight.course_notebooks()]
    assert numbers == lessons
    assert [f"{k:02d}" for k in range(1, 14)] == [n for n in numbers if n != "14"]
    for p in doc["notebooks"]:
        assert p["runs"] and p["missing"] == []
        assert p["real"] or p["modelled"], p           # each says what runs, and how
    # Every check answered, in its bounded time, with one of the four words.
    assert set(doc["checks"]) == set(preflight.CHECKS)
    assert {c["status"] for c in doc["checks"].values()} <= {"ok", "modelled", "warn", "missing"}


def test_the_gpu_is_modelled_where_the_runtime_predicts_times(report):
    import course_helper as ch
    _, doc = report
    expected = "modelled" if ch.runtime.get().predicts_times else "ok"
    assert doc["checks"]["gpu"]["status"] == expected
    gpu_lessons = [p for p in doc["notebooks"] if "gpu" in preflight.NOTEBOOK_NEEDS[p["number"]]]
    key = "modelled" if expected == "modelled" else "real"
    assert all(preflight.CHECKS["gpu"][0] in p[key] for p in gpu_lessons)


def test_the_text_report_lists_each_notebook_and_exits_0(report, capsys):
    _skip_without_the_lab(report[1])
    code = main(["preflight"])
    text = capsys.readouterr().out
    assert code == 0, text
    for _, _, title in preflight.course_notebooks():
        assert title in text
    assert "the course can run here" in text


def test_a_missing_mpiexec_gives_the_command_that_fixes_it(report, monkeypatch, capsys):
    from course_helper.distributed import launch
    _skip_without_the_lab(report[1])

    def no_mpiexec():
        raise FileNotFoundError("no mpiexec found")
    monkeypatch.setattr(launch, "find_mpiexec", no_mpiexec)
    code = main(["preflight"])
    text = capsys.readouterr().out
    assert code == 1, text
    assert "MISSING mpiexec, two ranks" in text
    assert "python3 -m pip install -e '.[distributed]'" in text
    assert "cannot run whole here: missing mpiexec, two ranks" in text
    line = next(line for line in text.splitlines() if "Beyond one GPU" in line)
    assert "MISSING mpiexec" in line                  # notebook 12 is the one that needs it
    assert all("MISSING" not in line for line in text.splitlines() if "Streams and events" in line)


def test_a_missing_piece_names_the_notebooks_that_need_it_and_the_fix():
    checks = {n: preflight.Check(n, t, "ok", "") for n, (t, _) in preflight.CHECKS.items()}
    checks["widgets"] = preflight.Check("widgets", "ipywidgets, ipympl", "missing", "not here", "FIX IT")
    plan = preflight.notebook_plan(checks, preflight.course_notebooks())
    blocked = sorted(p["number"] for p in plan if not p["runs"])
    assert blocked == sorted(n for n, needs in preflight.NOTEBOOK_NEEDS.items() if "widgets" in needs)
    assert all(p["missing"] == [{"what": "ipywidgets, ipympl", "why": "not here", "fix": "FIX IT"}]
               for p in plan if not p["runs"])


def test_what_runs_with_less_is_named_with_its_fix(capsys, monkeypatch):
    checks = {n: preflight.Check(n, t, "ok", "") for n, (t, _) in preflight.CHECKS.items()}
    checks["cupti"] = preflight.Check("cupti", "CUPTI", "warn", "cannot record", "export COURSE_HELPER_TIMING=events")
    plan = preflight.notebook_plan(checks, preflight.course_notebooks())
    limited = [p for p in plan if p["with_less"]]
    assert sorted(p["number"] for p in limited) == sorted(n for n, needs in preflight.NOTEBOOK_NEEDS.items()
                                                          if "cupti" in needs)
    assert all(p["runs"] and p["with_less"] == [{"what": "CUPTI", "why": "cannot record",
                                                 "fix": "export COURSE_HELPER_TIMING=events"}] for p in limited)
    monkeypatch.setattr(preflight, "run_checks", lambda store: checks)
    from course_helper.cli import _parser
    assert preflight.preflight_main(_parser().parse_args(["preflight"])) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "Streams and events" in line)
    assert "with less: CUPTI (fix: export COURSE_HELPER_TIMING=events)" in line


def test_a_check_that_hangs_or_raises_is_contained():
    release = threading.Event()
    status, detail, _ = preflight._bounded(lambda: release.wait(60), 0.2)    # given up on, not waited for
    release.set()                                                               # (then let the thread end)
    assert status == "missing" and "no answer within 0.2 s" in detail

    def broken():
        raise RuntimeError("driver says no")
    assert preflight._bounded(broken, 5) == ("missing", "the check raised RuntimeError: driver says no", "")


def test_a_check_that_crashes_or_hangs_its_process_is_contained():
    # On a GPU the checks that call into the driver, CUPTI or nvCOMP each run in a process of their own.
    assert preflight._in_a_child("os:abort", (), 60) == ("missing", "the check crashed its process (SIGABRT)", "")
    status, detail, _ = preflight._in_a_child("signal:pause", (), 2)       # waits for a signal for ever
    assert status == "missing" and detail == "no answer within 2 s (the check hung and was stopped)"


@pytest.mark.parametrize("name", ["copy_engines", "pinned"])
def test_a_check_in_a_process_of_its_own_finds_what_it_finds_here(name):
    fn = preflight.CHECKS[name][1]
    assert preflight._in_a_child(f"course_helper.preflight:{fn.__name__}", (), 120) == fn()


def test_the_largest_pinned_allocation_is_the_balanced_points_output_stack():
    import course_helper as ch
    n, nt, every = ch.measure.BALANCED_POINT
    saved = len(range(0, nt, every))
    assert preflight.largest_pinned_mib() * 2**20 >= saved * n * n * 4
    assert preflight.largest_pinned_mib() >= 16 * 2048 * 2048 * 4 / 2**20     # notebook 2's host stack


def test_a_store_that_is_not_a_folder_is_refused_early(tmp_path, capsys):
    assert main(["preflight", "--store", str(tmp_path / "nowhere")]) == 2
    assert "--store" in capsys.readouterr().err


@pytest.mark.gpu
def test_on_a_gpu_the_device_pinned_memory_and_cupti_run_for_real(gpu):
    checks = preflight.run_checks()             # on a GPU: the driver's checks each in a process of its own
    r = ch_report()
    assert checks["gpu"].status == "ok" and checks["gpu"].detail.startswith(f"{r['device']}, driver CUDA")
    assert checks["cupy"].status == "ok"
    assert checks["pinned"].status == "ok", checks["pinned"].detail
    assert f"a {preflight.largest_pinned_mib()} MiB pinned allocation worked" in checks["pinned"].detail
    assert checks["copy_engines"].status in ("ok", "warn")
    assert checks["copy_engines"].detail.startswith(f"{r['async_engine_count']} copy engine(s)")
    assert checks["cupti"].status in ("ok", "warn"), checks["cupti"].detail
    if checks["cupti"].status == "ok":
        assert checks["cupti"].detail.startswith("CUPTI recorded a copy")
    assert checks["nvcomp"].status in ("ok", "warn")


def ch_report():
    import course_helper as ch
    return ch.device_report()


def test_ranks_that_fail_to_start_are_missing_with_the_fix(monkeypatch):
    from course_helper.distributed import launch
    monkeypatch.setenv(launch.MPIEXEC_VAR, "false")          # an "mpiexec" that exits 1 at once
    status, detail, fix = preflight.check_mpi()
    assert status == "missing" and "failed (exit 1)" in detail
    assert fix == "python3 -m pip install -e '.[distributed]'"


def test_ranks_that_hang_are_stopped_with_what_they_started(monkeypatch, tmp_path):
    from course_helper.distributed import launch
    pids = tmp_path / "pids"
    hangs = tmp_path / "mpiexec"                              # an "mpiexec" whose ranks never end
    hangs.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {pids}\nwait\n")
    hangs.chmod(0o755)
    monkeypatch.setenv(launch.MPIEXEC_VAR, str(hangs))
    monkeypatch.setattr(preflight, "RANKS_SECONDS", 3)
    status, detail, fix = preflight.check_mpi()
    assert status == "missing" and "did not finish within 3 s" in detail
    assert fix == "python3 -m pip install -e '.[distributed]'"
    rank = int(pids.read_text())
    assert process_ends(rank), f"the rank {rank} outlived the killed session"
