"""The lessons stay readable: word counts of each notebook's lesson flow and of the README.

A notebook's *lesson flow* is its markdown, less the closing "In practice" section (the
measurement notes, proofs and caveats a learner may skip: from a markdown cell that starts with
``## In practice`` up to the next ``## `` heading). Run with ``-s`` to see the counts.
"""
import pathlib
import re

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LESSON_WORDS = 1000          # each notebook's lesson flow
COURSE_WORDS = 10500         # all lesson flows together (13 lessons under 10000, and lesson 14, the doctor)
README_WORDS = 1200


def words(markdown):
    """Words a reader reads (a code span counts as one): link targets, image links and HTML tags left out."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`]*`", " code ", text)                 # a code span reads as one word
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"<[^>]+>", " ", text)
    return len(re.findall(r"[A-Za-z0-9][\w'’.-]*", text))


def lesson_flow(nb):
    """The markdown cells of the lesson, without the "In practice" section."""
    kept, aside = [], False
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        if cell.source.startswith("## "):
            aside = cell.source.startswith("## In practice")
        if not aside:
            kept.append(cell.source)
    return kept


def test_words_counts_what_a_reader_reads():
    assert words("Copy `U[b]` into [the ring](images/x.svg) while the kernel runs.") == 9
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title\nOne two."),
                                         nbformat.v4.new_markdown_cell("## In practice\nA long note."),
                                         nbformat.v4.new_markdown_cell("More of the note."),
                                         nbformat.v4.new_markdown_cell("## Summary\nShort.")])
    assert lesson_flow(nb) == ["# Title\nOne two.", "## Summary\nShort."]


@pytest.fixture(scope="module")
def counts():
    found = {path.name: sum(words(s) for s in lesson_flow(nbformat.read(path, as_version=4))) for path in LESSONS}
    print("\nlesson-flow words per notebook:")
    for name, n in found.items():
        print(f"  {name:40s} {n:5d}")
    print(f"  {'all notebooks':40s} {sum(found.values()):5d}")
    return found


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_each_lesson_flow_is_at_most_a_thousand_words(counts, path):
    assert counts[path.name] <= LESSON_WORDS, \
        f"{path.name}: {counts[path.name]} words of lesson flow; move notes to its '## In practice' section or docs/"


def test_the_course_stays_near_ten_thousand_words(counts):
    assert sum(counts.values()) < COURSE_WORDS


def test_the_readme_is_a_front_door():
    n = words((ROOT / "README.md").read_text())
    print(f"\nREADME: {n} words")
    assert n <= README_WORDS, f"README has {n} words; move detail to docs/"
