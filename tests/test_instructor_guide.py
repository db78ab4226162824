"""docs/instructor-guide.md holds together: every lesson is there with what a centre needs, and the
schedules' clocks add up to the lessons' minutes."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "instructor-guide.md").read_text()
LESSONS = sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _section(title):
    start = GUIDE.index(f"\n## {title}")
    end = GUIDE.find("\n## ", start + 1)
    return GUIDE[start:end if end > 0 else None]


def _minutes_table():
    """{lesson: (estimate, the notebook's own figure or None)} from the table of minutes."""
    rows = re.findall(r"^\| (\d\d) \|(?: \d+ \|){5} (\d+) \| (\d+|-) \|$", _section("How long each lesson takes"),
                      re.MULTILINE)
    return {n: (int(est), None if said == "-" else int(said)) for n, est, said in rows}


def _lesson_minutes():
    """{lesson: minutes} as the schedules take them: the larger of the estimate and the notebook's figure."""
    return {n: max(est, said or 0) for n, (est, said) in _minutes_table().items()}


def _clock(text):
    h, m = map(int, text.split(":"))
    return 60 * h + m


def test_every_lesson_has_a_row_of_minutes_and_a_section_with_everything():
    assert sorted(_minutes_table()) == LESSONS
    for n in LESSONS:
        match = re.search(rf"^### {int(n)}\. .+ \((\d+) min[,)]", GUIDE, re.MULTILINE)
        assert match, f"no section headed with minutes for lesson {n}"
        assert int(match.group(1)) == _lesson_minutes()[n]
        body = GUIDE[match.end():].split("\n### ", 1)[0].split("\n## ", 1)[0]
        for part in ("**Objectives:**", "**Key points:**", "**Mistakes", "**Ask:**"):
            assert part in body, f"lesson {n} has no {part}"


def test_the_schedules_list_the_minutes_of_the_table():
    listed = re.search(r"the notebook's own figure\n\((.+?)minutes:", _section("Schedules"), re.DOTALL).group(1)
    pairs = dict(re.findall(r"(\d\d): (\d+)", listed))
    expected = _lesson_minutes()
    assert {n: int(m) for n, m in pairs.items()} == {n: m for n, m in expected.items() if n in pairs}
    assert sorted(pairs) == [f"{k:02d}" for k in range(1, 14)]
    total = re.search(r"(\d+) h (\d+) min of lessons in all", _section("Schedules"))
    assert 60 * int(total.group(1)) + int(total.group(2)) == sum(int(m) for m in pairs.values())


def _check_day(rows, end):
    """Each row lasts its lesson's minutes, or the minutes it names; the last ends at ``end``."""
    minutes = _lesson_minutes()
    for (start, what), (following, _) in zip(rows, [*rows[1:], (end, "")]):
        lesson = re.match(r"(\d\d) ", what)
        named = re.search(r"\((\d+) min\)", what)
        lasts = minutes[lesson.group(1)] if lesson else int(named.group(1))
        assert _clock(following) - _clock(start) == lasts, f"{start} {what}: lasts {lasts} min"


def test_the_one_day_schedule_adds_up():
    part = _section("Schedules").split("**One day**", 1)[1].split("**Two half days**", 1)[0]
    start, end = re.search(r"\((\d\d:\d\d) to (\d\d:\d\d)\)", part).groups()
    rows = re.findall(r"^\| (\d\d:\d\d) \| (.+?) \|$", part, re.MULTILINE)
    assert rows[0][0] == start
    assert sorted(re.match(r"\d\d", w).group() for _, w in rows if re.match(r"\d\d ", w)) == \
        [f"{k:02d}" for k in range(1, 14)]
    _check_day(rows, end)


@pytest.mark.parametrize("day", [1, 2])
def test_the_two_half_days_add_up(day):
    part = _section("Schedules").split("**Two half days**", 1)[1]
    spans = re.search(r"\((\d\d:\d\d) to (\d\d:\d\d), then (\d\d:\d\d) to (\d\d:\d\d)\)", part).groups()
    table = [line.strip().strip("|").split("|") for line in part.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row] for row in table[2:]]             # past the header and its rule
    rows = [(c[2 * day - 2], c[2 * day - 1]) for c in cells if c[2 * day - 2]]
    assert rows[0][0] == spans[2 * day - 2]
    _check_day(rows, spans[2 * day - 1])
    both = [w for c in cells for w in (c[1], c[3])]
    assert sorted(re.match(r"\d\d", w).group() for w in both if re.match(r"\d\d ", w)) == \
        [f"{k:02d}" for k in range(1, 14)]


def test_the_guide_is_on_the_site_beside_the_glossary():
    toc = (ROOT / "docs" / "_toc.yml").read_text().splitlines()
    glossary = toc.index("      - file: docs/glossary")
    assert toc[glossary + 1] == "      - file: docs/instructor-guide"
