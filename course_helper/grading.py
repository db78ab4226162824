"""Grading learners' notebooks on the CPU backend: ``python -m course_helper grade PATH...``.

Each notebook runs in a fresh Jupyter kernel (nbclient) on the CPU backend, the modelled GPU, so a
grading machine needs no GPU. Before the learner's first cell, one added cell wraps every check of
:mod:`course_helper.exercises` (the names ``check_*`` it exports) so that each call writes what
the check said to a file of its own: a passing :class:`~course_helper.exercises.Verdict`, a
refused one, or the :class:`~course_helper.exercises.ExerciseError` (or any other error) it
raised. A notebook that catches the refusal and prints "Not yet: ..." is graded the same as one
that lets it raise, and nothing depends on what the notebook prints.

An *exercise* is one of the course's checks that the notebook calls, at the first cell that calls
it. It passes when a call of it passed (the solutions call a check again with wrong loops, to show
what it refuses); its line quotes the check's own sentence: the passing one, else the last refusal.
A notebook named like a course notebook (``08_...``) is also expected to call the checks that the
course notebook calls: one it no longer calls fails as missing. A check the notebook defines itself
(a ``check_*`` function of its own; the course's notebooks have none) is read from what its cell
prints: "Well done" passes.

A notebook is contained: it has ``timeout`` seconds in all (kernel start included), a cell that
raises is recorded and the next cells still run, a cell's output beyond ``max_output`` bytes is
left out, and a kernel that dies ends that notebook only.

Learners are named by what is given: a notebook file by its name, a folder by its name (every
notebook under it is that learner's).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

#: Seconds a notebook may run in all, by default (the slowest course notebook took about two
#: minutes on the CPU backend; see docs/instructor-guide.md).
DEFAULT_TIMEOUT = 600
#: Bytes of output kept per cell, by default (a cell printing more keeps this much and a note).
DEFAULT_MAX_OUTPUT = 1_000_000
#: Characters of a check's message kept in the report.
MESSAGE_CHARS = 4000
#: The words with which a notebook's own check says it passed (a ``check_*`` it defines itself).
OWN_CHECK_PASSED = "Well done"

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_MAX_OUTPUT", "Exercise", "NotebookGrade", "course_checks",
           "record_checks", "find_exercises", "grade_notebook", "learners", "add_grade_parser", "grade_main"]


def course_checks() -> tuple[str, ...]:
    """The names of the course's checks: what :mod:`course_helper.exercises` exports as ``check_*``."""
    from . import exercises
    return tuple(name for name in exercises.__all__ if name.startswith("check_"))


# --------------------------------------------------------------------------
# Inside the kernel: record every check call
# --------------------------------------------------------------------------
def record_checks(path: str) -> None:
    """Wrap every course check (wherever the package exposes it: ``ch.check_layer_cake``,
    ``ch.exercises.check_race_fix``, ...) so that each call appends one JSON line to ``path``:
    ``check``, ``passed``, ``message`` and, when it raised, ``error`` (the exception's type)
    and ``refused`` (True for an :class:`~course_helper.exercises.ExerciseError`). The call
    itself behaves as before. Run by the cell that ``grade`` adds before the learner's first."""
    from . import exercises
    modules = [m for name, m in list(sys.modules.items())
               if name == "course_helper" or name.startswith("course_helper.")]
    for name in course_checks():
        original = getattr(exercises, name)
        recorded = _recorded(original, name, path, exercises.ExerciseError)
        for module in modules:
            if getattr(module, name, None) is original:
                setattr(module, name, recorded)


def _recorded(check, name, path, refusal):
    from .exercises import Verdict

    @functools.wraps(check)
    def recorded(*args, **kwargs):
        try:
            verdict = check(*args, **kwargs)
        except Exception as exc:
            _append(path, {"check": name, "passed": False, "message": str(exc)[:MESSAGE_CHARS],
                           "error": type(exc).__name__, "refused": isinstance(exc, refusal)})
            raise
        # A check returns a Verdict (passed or not) or, for those that refuse by raising, a plain sentence.
        _append(path, {"check": name, "passed": verdict.passed if isinstance(verdict, Verdict) else True,
                       "message": str(verdict)[:MESSAGE_CHARS]})
        return verdict
    return recorded


def _append(path, entry):
    with open(path, "a", encoding="utf-8") as f:     # one line per call, on disk before the cell ends
        f.write(json.dumps(entry) + "\n")


# --------------------------------------------------------------------------
# Finding the exercises of a notebook
# --------------------------------------------------------------------------
_CALL = re.compile(r"(?<![\w.])(?:[\w.]+\.)?(check_\w+)\s*\(")
_DEF = re.compile(r"^\s*def\s+(check_\w+)\s*\(", re.MULTILINE)


def find_exercises(nb: Any) -> dict[str, tuple[int, bool]]:
    """``{check name: (cell index, own)}`` for every check the notebook ``nb`` (an nbformat
    notebook) calls: the course's checks, and (``own=True``) those the notebook defines itself;
    each at the first code cell that calls it."""
    sources = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    own = {name for _, src in sources for name in _DEF.findall(src)}
    known = set(course_checks())
    found = {}
    for i, src in sources:
        calls = _CALL.findall(_DEF.sub("", src))
        for name in calls:
            if (name in known or name in own) and name not in found:
                found[name] = (i, name in own)
    return found


def _course_notebook(path):
    """The course notebook numbered as ``path`` is (``08_...``), or None."""
    number = re.match(r"(\d\d)_", pathlib.Path(path).name)
    folder = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
    if not number or not folder.is_dir():
        return None
    return next(iter(sorted(folder.glob(number.group(1) + "_*.ipynb"))), None)


# --------------------------------------------------------------------------
# Running one notebook
# --------------------------------------------------------------------------
@dataclasses.dataclass
class Exercise:
    """One exercise's grade: the ``check`` called, its ``cell`` (index in the learner's
    notebook), whether it ``passed``, and the check's own ``message``."""

    check: str
    cell: int | None
    passed: bool
    message: str
    calls: int = 0


@dataclasses.dataclass
class NotebookGrade:
    """What grading one notebook found: its exercises, the cells that raised
    (``errors``: ``(cell, "NameError: ...")``), why it stopped early (``stopped``), its wall time,
    and the cells whose output was cut at ``max_output`` bytes (``capped``)."""

    learner: str
    path: str
    exercises: list[Exercise]
    errors: list[tuple[int, str]]
    stopped: str | None
    seconds: float
    capped: list[int] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when it ran to its end and every exercise passed (a notebook without exercises:
        when no cell raised unexpectedly)."""
        if self.stopped:
            return False
        if not self.exercises:
            return not self.errors
        return all(e.passed for e in self.exercises)


def _client_class():
    from nbclient import NotebookClient

    class CappedClient(NotebookClient):
        """nbclient, keeping at most ``max_output`` bytes of each cell's output."""

        def output(self, outs, msg, display_id, cell_index):
            content = msg.get("content", {})
            size = len(content.get("text", "")) + sum(len(str(v)) for v in content.get("data", {}).values())
            used = self.output_used.get(cell_index, 0) + size
            self.output_used[cell_index] = used
            if used > self.max_output:
                if cell_index not in self.output_capped:
                    import nbformat
                    self.output_capped.add(cell_index)
                    outs.append(nbformat.v4.new_output(
                        "stream", name="stderr", text=f"\n[grade: output beyond {self.max_output} bytes left out]\n"))
                return None
            return super().output(outs, msg, display_id, cell_index)

    return CappedClient


def grade_notebook(path: str | os.PathLike, learner: str, timeout: float = DEFAULT_TIMEOUT,
                   max_output: int = DEFAULT_MAX_OUTPUT) -> NotebookGrade:
    """Run the notebook at ``path`` on the CPU backend in a fresh kernel and grade its exercises
    (see the module's docstring). The file is not modified."""
    import nbformat
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    from .distributed.launch import ranks_env      # a child's environment: this package first on its path
    from .timing import wall_ms

    path = pathlib.Path(path)
    nb = nbformat.read(path, as_version=4)
    exercises = find_exercises(nb)
    expected = _course_notebook(path)
    if expected is not None and expected.resolve() != path.resolve():
        for name, (_, own) in find_exercises(nbformat.read(expected, as_version=4)).items():
            exercises.setdefault(name, (None, own))
    with tempfile.TemporaryDirectory(prefix="grade-") as work:
        log = pathlib.Path(work) / "checks.jsonl"
        log.touch()
        setup = nbformat.v4.new_code_cell(f"from course_helper import grading\ngrading.record_checks({str(log)!r})")
        nb.cells.insert(0, setup)
        owner = {}                                  # line of the log -> the learner's cell that wrote it
        state = {"cell": None, "lines": 0}

        def claim(cell_index):
            lines = log.read_text(encoding="utf-8").splitlines()
            for k in range(state["lines"], len(lines)):
                owner[k] = cell_index - 1           # the added cell is index 0
            state["lines"] = len(lines)

        def started(cell, cell_index):
            state["cell"] = cell_index

        def executed(cell, cell_index, execute_reply):
            claim(cell_index)

        t0 = wall_ms()                                    # the notebook's run on this machine
        deadline = t0 + timeout * 1e3
        client = _client_class()(
            nb, timeout_func=lambda cell: max(1, int((deadline - wall_ms()) / 1e3)), kernel_name="python3",
            allow_errors=True, record_timing=False, on_cell_start=started, on_cell_executed=executed,
            resources={"metadata": {"path": str(path.parent.resolve())}})
        client.max_output, client.output_used, client.output_capped = max_output, {}, set()
        stopped = None
        try:
            # The kernel's own log (its start-up warnings) is not the learner's: left out.
            client.execute(env=ranks_env("cpu"), stderr=subprocess.DEVNULL)
        except CellTimeoutError:
            stopped = f"ran past its {timeout:g} s timeout {_where(state['cell'])}"
        except DeadKernelError:
            stopped = f"its kernel died {_where(state['cell'])}"
        if state["cell"] is not None:
            claim(state["cell"])
        calls = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    seconds = (wall_ms() - t0) / 1e3
    cells = nb.cells[1:]
    setup_error = [o for o in nb.cells[0].get("outputs", []) if o.get("output_type") == "error"]
    if setup_error and stopped is None:          # the checks could not be watched: nothing can be graded
        stopped = (f"could not be graded: the added cell raised {setup_error[0].get('ename')}: "
                   f"{setup_error[0].get('evalue')} (is course_helper importable by the kernel?)")
    errors = [(i, f"{o.get('ename')}: {o.get('evalue')}") for i, c in enumerate(cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"
              and "raises-exception" not in c.get("metadata", {}).get("tags", [])]
    graded = [_grade(name, cell, own, [(owner.get(k), c) for k, c in enumerate(calls) if c["check"] == name],
                     cells, errors, stopped)
              for name, (cell, own) in sorted(exercises.items(), key=lambda kv: (kv[1][0] is None, kv[1][0]))]
    return NotebookGrade(learner, str(path), graded, errors, stopped, seconds,
                         sorted(i - 1 for i in client.output_capped))


def _where(cell_index):
    """Where a notebook stopped, given the index nbclient ran (the added cell is index 0)."""
    if not cell_index:
        return "before its first cell (starting the kernel and the grading took the whole time)"
    return f"in cell {cell_index - 1}"


def _grade(name, cell, own, calls, cells, errors, stopped):
    if cell is None:
        return Exercise(name, None, False, f"missing: the notebook no longer calls {name} (the course's notebook does)")
    if own:
        return _own_check(name, cell, cells[cell])
    if calls:
        passing = [c for _, c in calls if c["passed"]]
        chosen = passing[0] if passing else calls[-1][1]
        message = chosen["message"]
        if not chosen["passed"] and chosen.get("error") and not chosen.get("refused"):
            message = f"{chosen['error']}: {message}"
        return Exercise(name, cell, bool(passing), message, len(calls))
    raised = [e for i, e in errors if i == cell]
    why = (f"cell {cell} raised {raised[0]} before the check ran" if raised else
           f"the notebook {stopped} before the check ran" if stopped else "the check was never called")
    return Exercise(name, cell, False, f"not run: {why}")


def _own_check(name, cell, source_cell):
    text = "".join(o.get("text", "") for o in source_cell.get("outputs", []) if o.get("output_type") == "stream")
    lines = [line for line in text.splitlines() if line.strip()]
    if not source_cell.get("outputs") and source_cell.get("execution_count") is None:
        return Exercise(name, cell, False, "not run")
    passed = any(line.startswith(OWN_CHECK_PASSED) for line in lines)
    said = next((line for line in lines if line.startswith(OWN_CHECK_PASSED)),
                lines[-1] if lines else "printed nothing")
    return Exercise(name, cell, passed, said, 1)


# --------------------------------------------------------------------------
# Learners and the command line
# --------------------------------------------------------------------------
def learners(paths: Sequence[str | os.PathLike]) -> list[tuple[str, list[pathlib.Path]]]:
    """``(learner, notebooks)`` for each path given: a notebook file is a learner named by the
    file's name; a folder is a learner named by the folder's name, with every notebook under it
    (checkpoints left out). Raises ``FileNotFoundError`` for a path that is neither."""
    found = []
    for p in map(pathlib.Path, paths):
        if p.is_file() and p.suffix == ".ipynb":
            found.append((p.stem, [p]))
        elif p.is_dir():
            notebooks = sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
            if not notebooks:
                raise FileNotFoundError(f"the folder {p} holds no notebook (.ipynb); give a learner's folder "
                                        "or notebook files")
            found.append((p.resolve().name, notebooks))
        else:
            raise FileNotFoundError(f"{p} is neither a notebook (.ipynb) nor a folder; give learners' notebooks "
                                    "or their folders")
    return found


def add_grade_parser(sub: Any) -> None:
    """Register ``grade`` on the command line's subcommands ``sub``."""
    g = sub.add_parser(
        "grade", help="run learners' notebooks on the CPU backend and grade their exercises",
        description="Run each notebook in a fresh kernel on the CPU backend (the modelled GPU: no GPU "
                    "needed) and print one line per exercise, PASS or FAIL with the check's own sentence, "
                    "then a summary per learner. A learner is a notebook (named by its file) or a folder "
                    "(named by the folder; every notebook under it). Exits 0 only when every exercise "
                    "passed. See docs/instructor-guide.md.")
    g.add_argument("paths", nargs="+", metavar="NOTEBOOK_OR_FOLDER", help="learners' notebooks or folders")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds each notebook may run in all (default {DEFAULT_TIMEOUT})")
    g.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT,
                   help=f"bytes of output kept per cell (default {DEFAULT_MAX_OUTPUT})")
    g.add_argument("--json", action="store_true", help="print the report as JSON instead of lines")


def _one_line(text):
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


@contextlib.contextmanager
def _quiet_stdout(on: bool) -> Iterator[None]:
    """Send stray prints to stderr while the JSON report owns stdout."""
    if not on:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def grade_main(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    """``grade``: grade every learner's notebooks; returns 0 when all passed, else 1."""
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.max_output <= 0:
        raise ValueError(f"--max-output must be a positive number of bytes, got {args.max_output}")
    who = learners(args.paths)
    report = []
    if not args.json:
        say(f"grading on the CPU backend (the modelled GPU; no GPU needed), each notebook in a fresh kernel, "
            f"at most {args.timeout:g} s each")
    for learner, notebooks in who:
        grades = []
        for path in notebooks:
            with _quiet_stdout(args.json):
                grade = grade_notebook(path, learner, timeout=args.timeout, max_output=args.max_output)
            grades.append(grade)
            if not args.json:
                for e in grade.exercises:
                    where = f" (cell {e.cell})" if e.cell is not None else ""
                    say(f"{'PASS' if e.passed else 'FAIL'}  {learner}  {path.name}  {e.check}{where}: "
                        f"{_one_line(e.message)}")
                if not grade.exercises:
                    ran = ("no exercise; every cell ran" if not grade.errors else
                           f"no exercise; cell {grade.errors[0][0]} raised {_one_line(grade.errors[0][1])}")
                    say(f"{'PASS' if grade.passed else 'FAIL'}  {learner}  {path.name}  {ran}")
                if grade.capped:
                    say(f"NOTE  {learner}  {path.name}: output beyond {args.max_output} bytes left out in cell(s) "
                        f"{', '.join(map(str, grade.capped))}")
                if grade.stopped:
                    say(f"STOP  {learner}  {path.name}: the notebook {grade.stopped}; later cells did not run")
        exercises = [e for g in grades for e in g.exercises]
        passed = sum(e.passed for e in exercises)
        ok = all(g.passed for g in grades)
        report.append({"learner": learner, "passed": ok, "exercises_passed": passed, "exercises": len(exercises),
                       "notebooks": [dict(dataclasses.asdict(g), passed=g.passed) for g in grades]})
        if not args.json:
            say(f"== {learner}: {passed} of {len(exercises)} exercises passed in {len(grades)} notebook(s)"
                f"{'' if ok else ' - NOT all passed'} ({sum(g.seconds for g in grades):.0f} s)")
    every = all(r["passed"] for r in report)
    if args.json:
        say(json.dumps({"backend": "cpu", "note": "graded on the CPU backend (the modelled GPU; no GPU needed)",
                        "timeout_s": args.timeout, "passed": every, "learners": report}, indent=1))
    return 0 if every else 1
