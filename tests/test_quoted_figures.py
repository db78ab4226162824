"""Every figure a notebook's text quotes is one that notebook's stored outputs print.

A time, bandwidth, speed-up or percentage in a markdown cell must appear in the notebook's stored
outputs, or in a committed results file that the same markdown cell names by its path (for example
``benchmarks/bench.json``). A figure matches when an output prints it as written, or prints a
number that rounds to it at the quoted precision (``12.48 ms`` supports "12.5 ms"); a percentage
also matches the fraction it stands for (``0.86`` supports "86%").
"""
import pathlib
import re
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from course_paths import course_notebooks  # noqa: E402
NOTEBOOKS = course_notebooks(ROOT)

# A number followed by a unit of time, bandwidth, speed-up or percent. A speed-up is written with
# the "x" against the number ("1.9x"); "1024 x 1024" is a size, not a figure.
QUOTED = re.compile(r"(?<![\w.^/-])(\d+(?:\.\d+)?)(?:\s*(ms|µs|us|ns|GB/s|GiB/s|TB/s|MB/s)|(x|×|%))(?![\w/])")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
RESULTS_FILE = re.compile(r"`?((?:benchmarks|docs)/[\w./-]+\.(?:json|md))`?")


def quoted_figures(markdown):
    """The ``(number, unit)`` pairs quoted in one markdown cell's text."""
    text = re.sub(r"`[^`]*`", " ", markdown)              # code spans name things, they quote nothing
    text = re.sub(r"\]\([^)]*\)", "]", text)               # nor do link targets
    return [(m.group(1), m.group(2) or m.group(3)) for m in QUOTED.finditer(text)]


def output_text(nb):
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if "text" in out:
                parts.append(out["text"])
            for kind, data in out.get("data", {}).items():
                if kind.startswith("text/") and kind != "text/html" or kind == "text/html":
                    parts.append(data if isinstance(data, str) else "".join(data))
    return "\n".join(parts)


def supported(figure, unit, printed):
    """Whether ``printed`` (text) prints ``figure`` or a number that rounds to it."""
    places = len(figure.split(".")[1]) if "." in figure else 0
    want = float(figure)
    for token in NUMBER.findall(printed):
        value = float(token)
        if round(value, places) == want:
            return True
        if unit == "%" and abs(value) <= 1.5 and round(100 * value, places) == want:
            return True
    return False


def test_the_matcher_accepts_printed_and_rounded_figures_and_nothing_else():
    assert quoted_figures("takes 12.5 ms, 1.9x faster, 86% hidden, at 55 GB/s") == [
        ("12.5", "ms"), ("1.9", "x"), ("86", "%"), ("55", "GB/s")]
    assert quoted_figures("a 1024 x 1024 grid, `every=16` and 2048² levels") == []
    assert supported("12.5", "ms", "events: 12.48 ms")
    assert supported("86", "%", "hidden fraction 0.86")
    assert not supported("12.5", "ms", "events: 12.56 ms")
    assert not supported("86", "%", "hidden fraction 0.84")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_quoted_figure_is_printed_by_the_notebook(path):
    nb = nbformat.read(path, as_version=4)
    printed = output_text(nb)
    missing = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        sources = printed
        for name in RESULTS_FILE.findall(cell.source):
            results = ROOT / name
            assert results.is_file(), f"{path.name} cell {index} names {name}, which is not in the repository"
            sources += "\n" + results.read_text()
        missing += [f"cell {index}: {figure} {unit}" for figure, unit in quoted_figures(cell.source)
                    if not supported(figure, unit, sources)]
    assert not missing, f"{path.name} quotes figures that none of its outputs print: {missing}"
