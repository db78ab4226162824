"""``python -m course_helper grade``: learners' notebooks run on the CPU backend, one line per exercise.

The real notebooks are graded once per session (notebook 8's solution, and notebook 8 as the course
ships it); the hostile notebooks are tiny, with small timeouts, so the file stays quick.
"""
import argparse
import json
import pathlib
import shutil

import nbformat
import pytest
from conftest import process_ends

from course_helper import grading
from course_helper.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "notebooks" / "solutions" / "08_exercise_layer_cake_solution.ipynb"
UNTOUCHED = ROOT / "notebooks" / "08_exercise_layer_cake.ipynb"

#: A notebook whose one exercise passes at once: a right cake built on the host.
RIGHT_CAKE = ["import numpy as np\nimport course_helper as ch",
              "stack = np.stack([ch.exercises.layer_values(k, (8, 8)) for k in range(3)])\n"
              "print(ch.check_layer_cake(stack))"]


def notebook(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr().out
    return code, out


@pytest.fixture(scope="session")
def class_of_two(tmp_path_factory):
    """Two learners graded in one call: ``ada`` hands in notebook 8's solution, ``bo`` notebook 8
    untouched. Returns (exit status, the text lines, the JSON report of the same notebooks)."""
    root = tmp_path_factory.mktemp("class")
    shutil.copy(SOLUTION, (root / "ada").mkdir() or root / "ada" / UNTOUCHED.name)
    shutil.copy(UNTOUCHED, (root / "bo").mkdir() or root / "bo" / UNTOUCHED.name)
    lines = []
    args = argparse.Namespace(paths=[str(root / "ada"), str(root / "bo")], timeout=300,
                                      max_output=grading.DEFAULT_MAX_OUTPUT, json=True)
    code = grading.grade_main(args, say=lines.append)
    return code, json.loads(lines[0])


def _learner(doc, name):
    return next(r for r in doc["learners"] if r["learner"] == name)


def test_the_solution_of_notebook_8_passes(class_of_two):
    _, doc = class_of_two
    ada = _learner(doc, "ada")
    assert ada["passed"] and ada["exercises_passed"] == ada["exercises"] == 1
    (exercise,) = ada["notebooks"][0]["exercises"]
    assert exercise["check"] == "check_layer_cake" and exercise["passed"]
    assert exercise["message"].startswith("all 24 layers are correct")      # the check's own sentence
    assert exercise["calls"] == 3           # the solution also shows two refused loops; one pass is enough


def test_notebook_8_untouched_fails_with_the_checks_sentence(class_of_two):
    code, doc = class_of_two
    assert code == 1 and doc["passed"] is False
    bo = _learner(doc, "bo")
    assert not bo["passed"] and bo["exercises_passed"] == 0
    (exercise,) = bo["notebooks"][0]["exercises"]
    checked_in = next(i for i, c in enumerate(nbformat.read(UNTOUCHED, as_version=4).cells)
                      if c.cell_type == "code" and "check_layer_cake(" in c.source)   # its first call
    assert exercise["check"] == "check_layer_cake" and exercise["cell"] == checked_in and not exercise["passed"]
    assert "`bake_cake` is not written yet" in exercise["message"]
    # The cell the notebook expects to raise (tagged raises-exception) is not held against it.
    assert bo["notebooks"][0]["errors"] == []


def test_text_report_one_line_per_exercise_and_exit_0_when_all_pass(tmp_path, capsys):
    right = notebook(tmp_path / "cara.ipynb", RIGHT_CAKE)
    code, out = run(["grade", str(right), "--timeout", "120"], capsys)
    assert code == 0, out
    assert "CPU backend" in out and "no GPU needed" in out
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert lines == [f"PASS  cara  cara.ipynb  check_layer_cake (cell 1): {lines[0].split(': ', 1)[1]}"]
    assert "== cara: 1 of 1 exercises passed" in out


def test_a_notebook_that_loops_for_ever_is_stopped_at_its_timeout(tmp_path, capsys):
    loops = notebook(tmp_path / "loops.ipynb", ["import course_helper as ch", "while True:\n    pass",
                                                "print(ch.exercises.check_copy_after_kernels(None))"])
    code, out = run(["grade", str(loops), "--timeout", "15"], capsys)
    assert code == 1
    assert "FAIL  loops  loops.ipynb  check_copy_after_kernels (cell 2): not run: the notebook ran past its 15 s " \
           "timeout in cell 1 before the check ran" in out
    assert "STOP  loops  loops.ipynb: the notebook ran past its 15 s timeout in cell 1" in out


def test_hostile_notebooks_are_contained_and_reported(tmp_path, capsys):
    folder = tmp_path / "mallory"
    notebook(folder / "b_raises.ipynb", ["import course_helper as ch", "raise ValueError('oops')",
                                         "print(ch.exercises.check_copy_after_kernels(None))",
                                         "undefined_name\nch.exercises.check_race_fix(None)"])
    notebook(folder / "c_floods.ipynb", ["print('x' * 3_000_000)", *RIGHT_CAKE])
    notebook(folder / "d_raises_megabytes.ipynb", ["raise ValueError('y' * 3_000_000)", *RIGHT_CAKE])
    code, out = run(["grade", str(folder), "--timeout", "300", "--max-output", "10000", "--json"], capsys)
    assert code == 1
    (mallory,) = json.loads(out)["learners"]
    raises, floods, raises_megabytes = mallory["notebooks"]
    # Raising cells are reported; the cells after them still ran and were graded.
    assert raises["stopped"] is None
    assert [e[0] for e in raises["errors"]] == [1, 3]
    first, second = raises["exercises"]
    assert (first["check"], first["passed"]) == ("check_copy_after_kernels", False)
    assert first["message"].startswith("Not answered yet")                   # the check's own verdict
    assert second["check"] == "check_race_fix" and "cell 3 raised NameError" in second["message"]
    # Megabytes of output are cut, and the exercise after them still passes.
    assert floods["capped"] == [0] and floods["passed"]
    # An error's message of megabytes is cut short; the report keeps its beginning.
    assert raises_megabytes["exercises"][0]["passed"]
    ((cell, error),) = raises_megabytes["errors"]
    assert cell == 0 and error.startswith("ValueError: yyy") and len(error) < 10_000


def test_an_exercise_the_learner_deleted_fails_as_missing(tmp_path, capsys):
    empty = notebook(tmp_path / "dan" / "08_exercise_layer_cake.ipynb", ["x = 1"])
    code, out = run(["grade", str(empty.parent), "--timeout", "120"], capsys)
    assert code == 1
    assert "FAIL  dan  08_exercise_layer_cake.ipynb  check_layer_cake: missing" in out


def test_bad_paths_are_refused_before_anything_runs(tmp_path, capsys):
    assert main(["grade", str(tmp_path / "nobody.ipynb")]) == 2
    assert "neither a notebook" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["grade", str(tmp_path / "empty")]) == 2
    assert "holds no notebook" in capsys.readouterr().err
    assert main(["grade", str(tmp_path), "--timeout", "0"]) == 2


def test_exercises_are_found_where_the_checks_are_called():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("check_layer_cake(stack) in prose is not a call"),
                nbformat.v4.new_code_cell("def check_mine(x):\n    print('Well done')"),
                nbformat.v4.new_code_cell("try:\n    print(ch.check_layer_cake(stack, loop=f))\nexcept E:\n    pass"),
                nbformat.v4.new_code_cell("ch.exercises.check_race_fix(loop)\nch.check_layer_cake(stack)"),
                nbformat.v4.new_code_cell("check_mine(1)\nmy_check_helper(2)"),
                nbformat.v4.new_code_cell("print('check_capstone (cell 1): passed')  # check_speedup(x)"),
                nbformat.v4.new_code_cell("%time ch.check_ring_depth(5)")]
    # A check the notebook defines itself is no exercise: only the course's checks grade; a check's
    # name in a string or a comment is no call.
    assert grading.find_exercises(nb) == {"check_layer_cake": 2, "check_race_fix": 3, "check_ring_depth": 6}
    assert set(grading.course_checks()) >= {"check_layer_cake", "check_race_fix", "check_capstone"}


def test_a_notebook_binding_a_checks_name_itself_is_seen():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("def check_layer_cake(s):\n    print('Well done')"),
                nbformat.v4.new_code_cell("check_race_fix = lambda loop: 'Right'"),
                nbformat.v4.new_code_cell("from mine import passing as check_capstone"),
                nbformat.v4.new_code_cell("check_speedup(x) == 1\ncheck_mine = 2")]
    assert grading.shadowed_checks(nb) == {"check_layer_cake", "check_race_fix", "check_capstone"}


#: A wrong cake (all zeros), which check_layer_cake refuses.
WRONG_CAKE = "import numpy as np\nimport course_helper as ch\nwrong = np.zeros((3, 8, 8), np.float32)"
#: What a notebook that fakes its grade prints, here and on the grader's own standard output.
FAKE_LINE = "PASS  mallory  a_forges.ipynb  check_layer_cake (cell 1): all 3 layers are correct"


@pytest.fixture(scope="module")
def tampering(tmp_path_factory):
    """One learner whose notebooks each try to pass a wrong cake by tampering with the grading;
    returns (exit status, the text printed)."""
    folder = tmp_path_factory.mktemp("tamper") / "mallory"
    notebook(folder / "a_forges.ipynb", [
        WRONG_CAKE,
        # The added first cell names the record of check calls: write a passing call into it, as the
        # wrappers write theirs (less the key), and print a passing line, also straight to the file
        # descriptor grade's own lines go to.
        "import json, os, re\nlog = re.search(r\"record_checks\\('([^']+)'\", In[1]).group(1)\n"
        "body = json.dumps({'check': 'check_layer_cake', 'passed': True, 'message': 'right', 'changed': []})\n"
        "with open(log, 'a') as f:\n"
        "    f.write(json.dumps({'entry': body, 'sig': '0' * 64}) + '\\n')\n"
        f"print({FAKE_LINE!r})\nos.write(1, {FAKE_LINE!r}.encode() + b'\\n')",
        "try:\n    ch.check_layer_cake(wrong)\nexcept Exception:\n    print('Well done: all layers are correct')"])
    notebook(folder / "b_patches_numpy.ipynb", [WRONG_CAKE, "np.array_equal = lambda *a, **k: True",
                                                "print(ch.check_layer_cake(wrong))"])
    notebook(folder / "c_replaces_the_check.ipynb", [
        WRONG_CAKE, "ch.check_layer_cake = ch.exercises.check_layer_cake = lambda *a, **k: 'all layers are correct'",
        "print(ch.check_layer_cake(wrong))"])
    notebook(folder / "d_defines_the_check.ipynb", [
        WRONG_CAKE, "def check_layer_cake(s):\n    print('Well done: all layers are correct')",
        "check_layer_cake(wrong)"])
    notebook(folder / "e_patches_the_verdict.ipynb", [
        WRONG_CAKE, "ch.exercises.Verdict.passed = property(lambda self: True, lambda self, value: None)",
        "print(ch.check_layer_cake(wrong))"])
    notebook(folder / "f_removes_the_record.ipynb", [
        WRONG_CAKE,
        "import re, shutil\nshutil.rmtree(re.search(r\"record_checks\\('([^']+)/checks\", In[1]).group(1))",
        "print(ch.check_layer_cake(wrong))"])
    out = []
    args = argparse.Namespace(paths=[str(folder)], timeout=120, max_output=grading.DEFAULT_MAX_OUTPUT, json=False)
    code = grading.grade_main(args, say=out.append)
    return code, "\n".join(out)


def test_printed_passes_and_forged_records_do_not_pass(tampering, capfd):
    code, text = tampering
    assert code == 1
    assert FAKE_LINE not in text and FAKE_LINE not in capfd.readouterr().out       # nothing it printed came through
    assert "FAIL  mallory  a_forges.ipynb  check_layer_cake (cell 2): 3 of 3 planes are wrong" in text
    assert ("TAMPER  mallory  a_forges.ipynb: the notebook wrote 1 line(s) into the grader's record of check calls "
            "that no check wrote; it does not pass") in text


def test_replacing_what_a_check_runs_on_is_not_counted(tampering):
    _, text = tampering
    assert ("FAIL  mallory  b_patches_numpy.ipynb  check_layer_cake (cell 2): not counted: before the check ran, "
            "the notebook replaced numpy.array_equal") in text
    assert "TAMPER  mallory  b_patches_numpy.ipynb: the notebook replaced numpy.array_equal; it does not pass" in text
    assert "FAIL  mallory  c_replaces_the_check.ipynb  check_layer_cake (cell 2): not run: the check was never called" \
        in text
    for where in ("course_helper.check_layer_cake", "course_helper.exercises.check_layer_cake"):
        assert f"TAMPER  mallory  c_replaces_the_check.ipynb: the notebook replaced {where}; it does not pass" in text
    assert ("FAIL  mallory  d_defines_the_check.ipynb  check_layer_cake (cell 2): not run: the course's "
            "check_layer_cake was never called (the notebook defines its own") in text
    assert ("FAIL  mallory  e_patches_the_verdict.ipynb  check_layer_cake (cell 2): not counted: before the check "
            "ran, the notebook replaced course_helper.exercises.core.Verdict.passed") in text


def test_a_notebook_that_removes_the_graders_record_is_still_graded(tampering):
    _, text = tampering
    assert "FAIL  mallory  f_removes_the_record.ipynb  check_layer_cake (cell 2)" in text
    assert ("TAMPER  mallory  f_removes_the_record.ipynb: the notebook did not let the grader's closing cell report"
            in text)
    assert "== mallory: 0 of 6 exercises passed in 6 notebook(s) - NOT all passed" in text


def test_exits_forks_and_sleeping_threads_are_contained(tmp_path, capsys):
    folder = tmp_path / "eve"
    notebook(folder / "a_exits.ipynb", [WRONG_CAKE, "import os\nos._exit(0)", "ch.check_layer_cake(wrong)"])
    notebook(folder / "b_sys_exit.ipynb", [WRONG_CAKE, "import sys\nsys.exit(0)", "print(ch.check_layer_cake(wrong))"])
    notebook(folder / "c_forks.ipynb", [
        WRONG_CAKE, "import os, subprocess, threading, time\np = subprocess.Popen(['sleep', '600'])\npid = os.fork()\n"
                    "if pid == 0:\n    time.sleep(600)\n    os._exit(0)\n"
                    "threading.Thread(target=time.sleep, args=(600,)).start()\n"
                    "open('pids.txt', 'w').write(f'{p.pid} {pid}')",
        "print(ch.check_layer_cake(wrong))"])
    code, out = run(["grade", str(folder), "--timeout", "120"], capsys)
    assert code == 1
    assert "STOP  eve  a_exits.ipynb: the notebook lost its kernel in cell 1 (the kernel died or exited)" in out
    assert "FAIL  eve  a_exits.ipynb  check_layer_cake (cell 2): not run: the notebook lost its kernel" in out
    # sys.exit in a cell raises SystemExit there; the next cells run and the check refuses the cake.
    assert "FAIL  eve  b_sys_exit.ipynb  check_layer_cake (cell 2): 3 of 3 planes are wrong" in out
    assert "FAIL  eve  c_forks.ipynb  check_layer_cake (cell 2): 3 of 3 planes are wrong" in out
    # The kernel went with its process group: what the notebook started in the background too.
    pids = [int(p) for p in (folder / "pids.txt").read_text().split()]
    assert len(pids) == 2 and all(process_ends(p) for p in pids)


def test_a_class_folder_gives_one_learner_per_folder(tmp_path, capsys):
    for who in ("ana", "ben"):
        notebook(tmp_path / "submitted" / who / "ps1" / "08_exercise_layer_cake.ipynb", ["x = 1"])
    notebook(tmp_path / "solo" / "mine.ipynb", ["x = 1"])
    # Without --class a folder is one learner, whatever its depth (nbgrader's submitted/ana, say).
    found = grading.learners([tmp_path / "submitted" / "ana", tmp_path / "solo"])
    assert [(name, [p.name for p in paths]) for name, paths in found] == [
        ("ana", ["08_exercise_layer_cake.ipynb"]), ("solo", ["mine.ipynb"])]
    code, out = run(["grade", "--class", str(tmp_path / "submitted"), "--timeout", "120"], capsys)
    assert code == 1
    for who in ("ana", "ben"):
        assert f"FAIL  {who}  08_exercise_layer_cake.ipynb  check_layer_cake: missing" in out
        assert f"== {who}: 0 of 1 exercises passed in 1 notebook(s) - NOT all passed" in out
    assert main(["grade", "--class", str(tmp_path / "solo")]) == 2             # a learner's folder, not a class
    assert "holds no folder with notebooks" in capsys.readouterr().err


def test_notebooks_are_graded_on_the_cpu_backend_whatever_the_environment_asks(tmp_path, capsys, monkeypatch):
    # A GPU machine's environment may ask for the GPU: the graded kernels still run on the modelled one,
    # so a class gets the same verdicts on any machine.
    monkeypatch.setenv("COURSE_HELPER_BACKEND", "gpu")
    cpu = notebook(tmp_path / "cpu.ipynb", ["import course_helper as ch\nassert ch.backend_name() == 'cpu'",
                                            *RIGHT_CAKE])
    code, out = run(["grade", str(cpu), "--timeout", "120", "--json"], capsys)
    (graded,) = json.loads(out)["learners"][0]["notebooks"]
    assert code == 0 and graded["errors"] == [] and graded["passed"], graded
