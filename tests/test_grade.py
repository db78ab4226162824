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
    code, out = run(["grade", str(folder), "--timeout", "300", "--max-output", "10000", "--json"], capsys)
    assert code == 1
    (mallory,) = json.loads(out)["learners"]
    raises, floods = mallory["notebooks"]
    # Raising cells are reported; the cells after them still ran and were graded.
    assert raises["stopped"] is None
    assert [e[0] for e in raises["errors"]] == [1, 3]
    first, second = raises["exercises"]
    assert (first["check"], first["passed"]) == ("check_copy_after_kernels", False)
    assert first["message"].startswith("Not answered yet")                   # the check's own verdict
    assert second["check"] == "check_race_fix" and "cell 3 raised NameError" in second["message"]
    # Megabytes of output are cut, and the exercise after them still passes.
    assert floods["capped"] == [0] and floods["passed"]


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
                nbformat.v4.new_code_cell("check_mine(1)\nmy_check_helper(2)")]
    assert grading.find_exercises(nb) == {"check_layer_cake": (2, False), "check_race_fix": (3, False),
                                          "check_mine": (4, True)}
    assert set(grading.course_checks()) >= {"check_layer_cake", "check_race_fix", "check_capstone"}
