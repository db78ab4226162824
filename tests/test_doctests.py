"""The docstring examples of course_helper run, on the CPU backend, and print what they show.

Examples that need a GPU or take long are marked ``# doctest: +SKIP`` in the docstring. The
backend is chosen (and its one-line banner printed) before the examples run, as it is in a
notebook after its first cell.
"""
import doctest
import importlib
import io
import pathlib

import pytest

import course_helper as ch

PACKAGE = pathlib.Path(ch.__file__).parent
MODULES = sorted(".".join(("course_helper", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
                 for p in PACKAGE.rglob("*.py") if p.stem != "__main__")
# Examples that must run here (not skipped): a docstring that loses them fails the check below.
MUST_RUN = {"course_helper.distributed.slabs.decompose", "course_helper.streams.create_streams",
            "course_helper.wave.WaveProblem"}


def _run(name):
    """``(tests run, failures, report)`` of the module's docstring examples."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            pytest.skip(f"{name} imports CuPy, which is not installed here")
        raise
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    ran = set()
    for test in doctest.DocTestFinder().find(module, name):
        result = runner.run(test, out=report.write)
        if result.attempted:                 # examples run, skipped ones not counted
            ran.add(test.name)
    return ran, runner.failures, report.getvalue()


def test_every_module_of_every_layer_is_read_and_every_must_run_example_is_in_one():
    assert {"course_helper.runtime.model", "course_helper.timelines.timeline", "course_helper.disk"} <= set(MODULES)
    for name in MUST_RUN:
        assert name.rpartition(".")[0] in MODULES, f"{name}: no such module any more"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    ch.set_backend("cpu")            # the conftest puts the session's backend back afterwards
    ran, failures, report = _run(name)
    assert failures == 0, report
    want = {t for t in MUST_RUN if t.rpartition(".")[0] == name}
    assert want <= ran, f"these examples no longer run: {sorted(want - ran)}"
