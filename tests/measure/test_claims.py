"""A notebook's claims about its own run: printed when the run supports them, refused when not."""
import numpy as np
import pytest

import course_helper as ch
from course_helper.measure import ClaimRefuted, claim, faster


def test_a_supported_claim_prints_its_sentence_and_no_number(capsys):
    line = claim("events beats sequential-pinned", 16.15 < 30.0, "events 16.15 ms, sequential-pinned 30.0 ms")
    assert capsys.readouterr().out == "✓ events beats sequential-pinned\n" == line + "\n"


def test_a_claim_the_run_contradicts_fails_and_names_the_numbers(capsys):
    with pytest.raises(ClaimRefuted, match=r"'events beats streams'.*events 19.43 ms, streams 19.41 ms"):
        claim("events beats streams", 19.43 < 19.41, "events 19.43 ms, streams 19.41 ms")
    assert capsys.readouterr().out == ""
    assert issubclass(ClaimRefuted, AssertionError)        # nbval and pytest count it as a failed check


def test_numpy_comparisons_are_claims_too_and_anything_else_is_refused():
    assert claim("more than half hidden", np.float64(0.9) > 0.5)
    with pytest.raises(ClaimRefuted):
        claim("more than half hidden", np.float64(0.4) > 0.5)
    with pytest.raises(TypeError, match="holds must be True or False"):
        claim("more than half hidden", 0.9)
    with pytest.raises(TypeError, match="sentence"):
        claim("  ", True)


def test_faster_asks_for_a_margin_so_a_tie_is_no_win():
    assert faster(16.15, 30.0)
    assert not faster(19.41, 19.43)                         # 0.1% apart: a tie
    assert not faster(30.0, 16.15)
    assert faster(19.0, 20.0, by=0.04) and not faster(19.0, 20.0, by=0.05)
    with pytest.raises(ValueError, match="share"):
        faster(1.0, 2.0, by=1.5)


def test_the_claims_are_reached_through_ch_measure():
    assert ch.measure.claim is claim and ch.measure.ClaimRefuted is ClaimRefuted


# -- the claim cells of the course's notebooks --------------------------------------------------

def _claim_cells():
    import pathlib
    import sys

    import nbformat
    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tools"))
    from course_paths import course_notebooks
    for path in course_notebooks(root):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and "ch.measure.claim(" in cell.source:
                yield path.relative_to(root), i, cell


def test_every_claim_cell_is_compared_by_nbval_and_stores_the_lines_it_prints():
    """A claim cell's output is compared under nbval (no nbval-ignore-output tag), and its stored
    output is one "✓ sentence" line per claim: the run that stored it supported each sentence."""
    import ast
    cells = list(_claim_cells())
    assert len(cells) >= 20, "the notebooks state their comparisons as claims"
    for where, i, cell in cells:
        assert "nbval-ignore-output" not in cell.metadata.get("tags", []), f"{where} cell {i}"
        calls = [n for n in ast.walk(ast.parse(cell.source)) if isinstance(n, ast.Call)
                 and ast.unparse(n.func) == "ch.measure.claim"]
        sentences = [ast.literal_eval(c.args[0]) for c in calls]
        for c in calls:      # the comparison is computed from the run, never typed in
            assert not isinstance(c.args[1], ast.Constant), f"{where} cell {i}: a claim's truth typed in"
        printed = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
        assert printed == "".join(f"✓ {s}\n" for s in sentences), f"{where} cell {i}"


def test_a_run_that_contradicts_a_claim_fails_the_notebook_under_nbval(tmp_path):
    """The same two cells under nbval: the stored run's numbers support the claim and the notebook
    passes; measured the other way round (the two times swapped), the claim cell fails it."""
    import json
    import os
    import subprocess
    import sys
    pytest.importorskip("nbval")

    def notebook(events_ms, pinned_ms):
        measure = f"events_ms, pinned_ms = {events_ms}, {pinned_ms}\nprint(events_ms, pinned_ms)"
        claim_src = ("import course_helper as ch\n_ = ch.measure.claim('events beats sequential-pinned', "
                     "ch.measure.faster(events_ms, pinned_ms), f'{events_ms} against {pinned_ms} ms')")
        cells = [{"cell_type": "code", "execution_count": 1, "id": "m", "source": measure,
                  "metadata": {"tags": ["nbval-ignore-output"]},
                  "outputs": [{"output_type": "stream", "name": "stdout", "text": "16.15 30.0\n"}]},
                 {"cell_type": "code", "execution_count": 2, "id": "c", "source": claim_src, "metadata": {},
                  "outputs": [{"output_type": "stream", "name": "stdout",
                               "text": "✓ events beats sequential-pinned\n"}]}]
        return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}

    (tmp_path / "right.ipynb").write_text(json.dumps(notebook(16.15, 30.0)))
    (tmp_path / "swapped.ipynb").write_text(json.dumps(notebook(30.0, 16.15)))
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    env = {**os.environ, "COURSE_HELPER_BACKEND": "cpu", "COURSE_TEST_WORKERS": "0"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--nbval", "-p", "no:randomly", "-q",
                           "right.ipynb", "swapped.ipynb"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout
    assert "FAILED swapped.ipynb::Cell 1" in out and "right.ipynb::Cell" not in out.split("short test summary")[-1], out
    assert "ClaimRefuted" in out and "30.0 against 16.15 ms" in out, out
