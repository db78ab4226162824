"""Grading learners' notebooks on the CPU backend: ``python -m course_helper grade PATH...``.

Each notebook runs in a fresh Jupyter kernel (nbclient) on the CPU backend, the modelled GPU, so a
grading machine needs no GPU. Before the learner's first cell, one added cell wraps every check of
:mod:`course_helper.exercises` (the names ``check_*`` it exports) so that each call writes what
the check said to a file: a passing :class:`~course_helper.exercises.Verdict`, a refused one, or
the :class:`~course_helper.exercises.ExerciseError` (or any other error) it raised. A notebook that
catches the refusal and prints "Not yet: ..." is graded the same as one that lets it raise, and
nothing the notebook prints counts: the kernel's output never reaches grade's own lines.

The grading trusts only what the wrapped checks wrote, and the notebook runs in the same process:
- each line is signed with a key that only the wrappers hold (read from a file that is then
  removed), so a line the notebook writes into the record itself does not count, and the notebook
  fails as tampered;
- before and after each call, the wrapper looks whether the notebook replaced a function or
  class of ``course_helper`` or NumPy (``np.array_equal = lambda *a: True``, a check's helper, a
  check itself): such a call is not counted, and the notebook fails as tampered;
- a function the notebook defines under a check's name is not the check: its calls grade nothing;
- one added cell after the learner's last writes a closing record with a secret no learner's
  cell saw; a notebook that ran to its end without it fails as tampered.
A learner set on it can still defeat this (the code runs with the grader's rights and can read
its memory); grade is made for a class's exercises, not for an exam: see docs/instructor-guide.md.

An *exercise* is one of the course's checks that the notebook calls, at the first cell that calls
it. It passes when a call of it passed (the solutions call a check again with wrong loops, to show
what it refuses); its line quotes the check's own sentence: the passing one, else the last refusal.
A notebook named like a course notebook (``08_...``) is also expected to call the checks that the
course notebook calls: one it no longer calls fails as missing.

A notebook is contained: it has ``timeout`` seconds in all (kernel start included), a cell that
raises is recorded and the next cells still run, a cell's output beyond ``max_output`` bytes is
left out, a kernel that dies ends that notebook only, and the kernel is killed at the end with its
process group (what the notebook started in the background). It is not a sandbox: the kernel runs
as the grader's user, in the notebook's folder, and can write wherever that user can.

Learners are named by what is given: a notebook file by its name, a folder by its name (every
notebook under it is that learner's); with ``--class``, a folder holds one folder per learner
(nbgrader's ``submitted/``), each named by its folder.
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
import secrets
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

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_MAX_OUTPUT", "Exercise", "NotebookGrade", "course_checks",
           "record_checks", "find_exercises", "shadowed_checks", "grade_notebook", "learners", "add_grade_parser",
           "grade_main"]


def course_checks() -> tuple[str, ...]:
    """The names of the course's checks: what :mod:`course_helper.exercises` exports as ``check_*``."""
    from . import exercises
    return tuple(name for name in exercises.__all__ if name.startswith("check_"))


# --------------------------------------------------------------------------
# Inside the kernel: record every check call
# --------------------------------------------------------------------------
#: The modules whose functions and classes the checks run on: a notebook that replaces one of them
#: (``np.array_equal = lambda *a: True``, ``ch.exercises.layer_cake.some_helper = ...``) changes what a
#: check sees, so a check called after such a change is not counted.
WATCHED = ("course_helper", "numpy")


def _watched(name: str) -> bool:
    return name in WATCHED or name.startswith(WATCHED[0] + ".")


def _is_code(member: Any) -> bool:
    """A class member that runs when used: a function, a descriptor (property, static or class
    method, slot) or any callable."""
    return callable(member) or hasattr(type(member), "__get__")


def _callables(module: Any) -> dict[str, tuple[Any, Any]]:
    """``{"module.name[.member]": (object, its code or None)}`` for every callable a module holds,
    and every function or descriptor of the classes it defines (properties, static and class
    methods included): what a check calls when it runs."""
    import types
    found = {}
    prefix = module.__name__ + "."
    for attr, value in list(vars(module).items()):
        if not callable(value) or isinstance(value, types.ModuleType):
            continue
        found[prefix + attr] = (value, getattr(value, "__code__", None))
        if isinstance(value, type) and value.__module__ == module.__name__:
            for key, member in list(vars(value).items()):
                if _is_code(member):
                    function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                    found[f"{prefix}{attr}.{key}"] = (member, getattr(function, "__code__", None))
    return found


def _foreign(module: Any) -> list[str]:
    """The functions of a module first seen after grading began that a notebook's cell (or a
    string given to ``exec``) defined, not the module's file: ``module.name`` for each."""
    import types
    return [f"{module.__name__}.{attr}" for attr, value in list(vars(module).items())
            if isinstance(value, types.FunctionType)
            and (value.__module__ == "__main__"
                 or (value.__module__ == module.__name__ and not os.path.isfile(value.__code__.co_filename)))]


class _Watch:
    """What the checks run on, as it was when grading began, and what a notebook changed since."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, tuple[Any, Any]]] = {}    # module -> its callables when first seen
        self.changed: list[str] = []
        self.look(first=True)

    def _change(self, where: str) -> None:
        if where not in self.changed:
            self.changed.append(where)

    def look(self, first: bool = False) -> list[str]:
        """Every change found so far: a module's function or class replaced, removed or given other
        code, or a class given a new method or property."""
        for name, module in list(sys.modules.items()):
            if module is None or not _watched(name):
                continue
            now = _callables(module)
            if name not in self.seen:                # imported since: its functions must be its own
                self.seen[name] = now
                for where in [] if first else _foreign(module):
                    self._change(where)
                continue
            seen = self.seen[name]
            for where, (obj, code) in seen.items():
                current = now.get(where)
                if current is None or current[0] is not obj or current[1] is not code:
                    self._change(where)
            classes = {w for w, (obj, _) in seen.items() if isinstance(obj, type)}
            for where in now.keys() - seen.keys():
                if where.rsplit(".", 1)[0] in classes:   # a member added to one of the module's classes
                    self._change(where)
        return self.changed


def record_checks(path: str, keyfile: str) -> None:
    """Wrap every course check (wherever the package exposes it: ``ch.check_layer_cake``,
    ``ch.exercises.check_race_fix``, ...) so that each call appends one signed JSON line to
    ``path``: ``check``, ``passed``, ``message`` and, when it raised, ``error`` (the exception's
    type) and ``refused`` (True for an :class:`~course_helper.exercises.ExerciseError`); and
    ``changed``, the course's or NumPy's functions the notebook had replaced before the call.
    The call itself behaves as before. Run by the cell that ``grade`` adds before the learner's first.

    Each line is signed with the key read from ``keyfile``, which is then removed: the key lives
    only in these wrappers, so a line the notebook writes itself does not verify. The cell that
    ``grade`` adds after the learner's last calls :func:`_finish` with a second secret, which
    writes the last line: whether the notebook changed the course's code by then."""
    import hashlib
    import hmac

    from . import exercises
    key = pathlib.Path(keyfile).read_bytes()
    os.remove(keyfile)
    dumps, new_mac, sha256 = json.dumps, hmac.new, hashlib.sha256

    def append(entry):                               # local names: replacing json or hmac later changes nothing
        body = dumps(entry, sort_keys=True)
        line = dumps({"entry": body, "sig": new_mac(key, body.encode(), sha256).hexdigest()})
        # One line per call, on disk before the cell ends. A record the notebook removed loses the line (and
        # the closing one, so the notebook fails as tampered); the check's call goes on as if recorded.
        with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    modules = [m for name, m in list(sys.modules.items())
               if name == "course_helper" or name.startswith("course_helper.")]
    watch_box: list[_Watch] = []
    for name in course_checks():
        original = getattr(exercises, name)
        recorded = _recorded(original, name, append, exercises.ExerciseError, exercises.Verdict, watch_box)
        for module in modules:
            if getattr(module, name, None) is original:
                setattr(module, name, recorded)

    def finish(secret: str) -> None:
        append({"end": secret, "changed": watch_box[0].look()[:20]})

    globals()["_finish"] = finish
    watch_box.append(_Watch())                        # after the wrappers and _finish are in place


def _finish(secret: str) -> None:
    """Replaced by :func:`record_checks` in a graded kernel; outside one there is nothing to finish."""
    raise RuntimeError("only a notebook run by `python -m course_helper grade` has checks to finish recording")


def _recorded(check, name, append, refusal, verdict_type, watch_box):
    @functools.wraps(check)
    def recorded(*args, **kwargs):
        before = watch_box[0].look()[:20] if watch_box else []
        try:
            verdict = check(*args, **kwargs)
        except Exception as exc:
            after = watch_box[0].look()[:20] if watch_box else []
            append({"check": name, "passed": False, "message": str(exc)[:MESSAGE_CHARS], "changed": after,
                    "error": type(exc).__name__, "refused": isinstance(exc, refusal)})
            raise
        after = watch_box[0].look()[:20] if watch_box else before
        # A check returns a Verdict (passed or not) or, for those that refuse by raising, a plain sentence.
        append({"check": name, "passed": verdict.passed if isinstance(verdict, verdict_type) else True,
                "message": str(verdict)[:MESSAGE_CHARS], "changed": after})
        return verdict
    return recorded


# --------------------------------------------------------------------------
# Finding the exercises of a notebook
# --------------------------------------------------------------------------
_CALL = re.compile(r"(?<![\w.])(?:[\w.]+\.)?(check_\w+)\s*\(")
#: A name bound by the notebook itself: ``def check_x(``, ``check_x = ...``, ``import ... as check_x``.
_BOUND = re.compile(r"^\s*(?:def\s+(check_\w+)\s*\(|(check_\w+)\s*=[^=]|.*\bimport\b.*\bas\s+(check_\w+))",
                    re.MULTILINE)


def _called(source: str) -> list[str]:
    """The names ``source`` calls, in order: a name followed by ``(``, outside strings and
    comments, not after ``def`` (IPython's magics and shell lines are read as Python would be; a
    cell Python cannot read is searched as text)."""
    import io
    import tokenize
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                  if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT,
                                    tokenize.DEDENT)]
    except (tokenize.TokenError, SyntaxError):
        return _CALL.findall(re.sub(r"^\s*def\s+\w+\s*\(", "", source, flags=re.MULTILINE))
    return [t.string for k, t in enumerate(tokens[:-1])
            if t.type == tokenize.NAME and tokens[k + 1].string == "(" and (k == 0 or tokens[k - 1].string != "def")]


def find_exercises(nb: Any) -> dict[str, int]:
    """``{check name: cell index}`` for every course check (:func:`course_checks`) the notebook
    ``nb`` (an nbformat notebook) calls, each at the first code cell that calls it. A function
    the notebook defines itself is no exercise, even under a check's name: only the course's
    checks grade."""
    known = set(course_checks())
    found = {}
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        for name in _called(c.source):
            if name in known and name not in found:
                found[name] = i
    return found


def shadowed_checks(nb: Any) -> set[str]:
    """The course checks' names that the notebook ``nb`` binds itself (defines, assigns or imports
    under): its calls of that name may not reach the course's check."""
    known = set(course_checks())
    return {name for c in nb.cells if c.cell_type == "code" for m in _BOUND.findall(c.source)
            for name in m if name in known}


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
    notebook), whether it ``passed``, the check's own ``message``, and how many ``calls`` of the
    check were recorded."""

    check: str
    cell: int | None
    passed: bool
    message: str
    calls: int = 0


@dataclasses.dataclass
class NotebookGrade:
    """What grading one notebook found: its exercises, the cells that raised
    (``errors``: ``(cell, "NameError: ...")``), why it stopped early (``stopped``), its wall time,
    the cells whose output was cut at ``max_output`` bytes (``capped``), and what the notebook
    did to the grading (``tampered``: the course's or NumPy's functions it replaced, records of
    check calls that no check wrote); a notebook that tampered does not pass."""

    learner: str
    path: str
    exercises: list[Exercise]
    errors: list[tuple[int, str]]
    stopped: str | None
    seconds: float
    capped: list[int] = dataclasses.field(default_factory=list)
    tampered: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when it ran to its end without tampering and every exercise passed (a notebook
        without exercises: when no cell raised unexpectedly)."""
        if self.stopped or self.tampered:
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
            if "ename" in content:                    # an error is always kept, its message cut short
                content["evalue"] = str(content.get("evalue", ""))[:MESSAGE_CHARS]
                content["traceback"] = [str(t)[:MESSAGE_CHARS] for t in content.get("traceback", [])[-20:]]
                return super().output(outs, msg, display_id, cell_index)
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
    exercises: dict[str, int | None] = dict(find_exercises(nb))
    shadowed = shadowed_checks(nb)
    expected = _course_notebook(path)
    if expected is not None and expected.resolve() != path.resolve():
        for name in find_exercises(nbformat.read(expected, as_version=4)):
            exercises.setdefault(name, None)
    # ignore_cleanup_errors: a notebook may have removed this folder itself
    with tempfile.TemporaryDirectory(prefix="grade-", ignore_cleanup_errors=True) as work:
        log, keyfile = pathlib.Path(work) / "checks.jsonl", pathlib.Path(work) / "key"
        key, closing = secrets.token_bytes(32), secrets.token_hex(16)
        log.touch()
        keyfile.touch(mode=0o600)
        keyfile.write_bytes(key)
        # Before the learner's first cell: wrap the checks (the key file is read and removed);
        # after the last: the closing record, with a secret the learner's cells never saw.
        nb.cells.insert(0, nbformat.v4.new_code_cell(
            f"from course_helper import grading\ngrading.record_checks({str(log)!r}, {str(keyfile)!r})"))
        nb.cells.append(nbformat.v4.new_code_cell(f"from course_helper import grading\ngrading._finish({closing!r})"))
        owner = {}                                  # line of the log -> the learner's cell that wrote it
        state = {"cell": None, "lines": 0}

        def claim(cell_index):
            lines = _read_log(log)
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
            # killed, not asked to stop: the kernel's process group goes too (processes the notebook started)
            shutdown_kernel="immediate",
            resources={"metadata": {"path": str(path.parent.resolve())}})
        client.max_output, client.output_used, client.output_capped = max_output, {}, set()
        stopped = None
        try:
            # The kernel's own output (its start-up warnings, a cell writing to file descriptor 1 or 2)
            # is not the learner's report: left out, so nothing the notebook prints reaches grade's lines.
            client.execute(env=ranks_env("cpu"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except CellTimeoutError:
            stopped = f"ran past its {timeout:g} s timeout {_where(state['cell'], len(nb.cells))}"
        except DeadKernelError:
            stopped = f"lost its kernel {_where(state['cell'], len(nb.cells))} (the kernel died or exited)"
        if state["cell"] is not None:
            claim(state["cell"])
        calls, tampered, closed = _verified(_read_log(log), key, closing)
    seconds = (wall_ms() - t0) / 1e3
    cells = nb.cells[1:-1]
    setup_error = [o for o in nb.cells[0].get("outputs", []) if o.get("output_type") == "error"]
    if setup_error and stopped is None:          # the checks could not be watched: nothing can be graded
        stopped = (f"could not be graded: the added cell raised {setup_error[0].get('ename')}: "
                   f"{setup_error[0].get('evalue')} (is course_helper importable by the kernel?)")
    if stopped is None and not closed:
        tampered.append("did not let the grader's closing cell report (it changed course_helper.grading, or "
                        "removed the grader's record of the checks)")
    errors = [(i, f"{o.get('ename')}: {str(o.get('evalue'))[:MESSAGE_CHARS]}") for i, c in enumerate(cells)
              if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"
              and "raises-exception" not in c.get("metadata", {}).get("tags", [])]
    graded = [_grade(name, cell, [(owner.get(k), c) for k, c in enumerate(calls) if c and c.get("check") == name],
                     errors, stopped, name in shadowed)
              for name, cell in sorted(exercises.items(), key=lambda kv: (kv[1] is None, kv[1] or 0))]
    return NotebookGrade(learner, str(path), graded, errors, stopped, seconds,
                         sorted(i - 1 for i in client.output_capped if 0 < i < len(nb.cells) - 1), tampered)


#: Bytes of the record of check calls read back at most (a notebook could write gigabytes to it).
LOG_BYTES = 20_000_000


def _read_log(log: pathlib.Path) -> list[str]:
    """The lines of the record of check calls; none when the notebook removed or replaced it."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            return f.read(LOG_BYTES).splitlines()
    except OSError:
        return []


def _verified(lines: list[str], key: bytes, closing: str) -> tuple[list[dict | None], list[str], bool]:
    """The check calls the record holds (``None`` for a line that is no signed record, so that
    the lines keep their numbers), what the notebook tampered with, and whether the closing
    record came."""
    import hashlib
    import hmac
    calls: list[dict | None] = []
    changed: list[str] = []
    forged, closed = 0, False
    for line in lines:
        try:
            signed = json.loads(line)
            body = signed["entry"]
            good = hmac.compare_digest(signed["sig"], hmac.new(key, body.encode(), hashlib.sha256).hexdigest())
            entry = json.loads(body) if good else None
        except (ValueError, KeyError, TypeError, AttributeError):
            entry = None
        if entry is None:
            forged += 1
            calls.append(None)
            continue
        changed += [w for w in entry.get("changed", []) if w not in changed]
        if "end" in entry:
            closed = closed or entry["end"] == closing
            calls.append(None)
        else:
            calls.append(entry)
    tampered = [f"replaced {w}" for w in changed]
    if forged:
        tampered.append(f"wrote {forged} line(s) into the grader's record of check calls that no check wrote")
    return calls, tampered, closed


def _where(cell_index, cells):
    """Where a notebook stopped, given the index nbclient ran (the added cells are the first and
    the last of ``cells``)."""
    if not cell_index:
        return "before its first cell (starting the kernel and the grading took the whole time)"
    if cell_index == cells - 1:
        return "after its last cell"
    return f"in cell {cell_index - 1}"


def _grade(name, cell, calls, errors, stopped, shadowed):
    if cell is None:
        return Exercise(name, None, False, f"missing: the notebook no longer calls {name} (the course's notebook does)")
    if calls:
        counted = [c for _, c in calls if not c.get("changed")]
        passing = [c for c in counted if c["passed"]]
        if not counted:
            changed = ", ".join(calls[-1][1]["changed"][:3])
            return Exercise(name, cell, False, f"not counted: before the check ran, the notebook replaced {changed} "
                            "(the course's code must run as shipped)", len(calls))
        chosen = passing[0] if passing else counted[-1]
        message = chosen["message"]
        if not chosen["passed"] and chosen.get("error") and not chosen.get("refused"):
            message = f"{chosen['error']}: {message}"
        return Exercise(name, cell, bool(passing), message, len(calls))
    raised = [e for i, e in errors if i == cell]
    why = (f"cell {cell} raised {raised[0]} before the check ran" if raised else
           f"the notebook {stopped} before the check ran" if stopped else
           f"the course's {name} was never called (the notebook defines its own {name}; only the course's "
           "check grades)" if shadowed else "the check was never called")
    return Exercise(name, cell, False, f"not run: {why}")


# --------------------------------------------------------------------------
# Learners and the command line
# --------------------------------------------------------------------------
def _notebooks_under(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(q for q in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)


def learners(paths: Sequence[str | os.PathLike], classes: bool = False) -> list[tuple[str, list[pathlib.Path]]]:
    """``(learner, notebooks)`` for each learner the paths give: a notebook file is a learner
    named by the file's name; a folder is a learner named by the folder's name, with every
    notebook under it. With ``classes``, each folder given is a class instead: every folder in it
    that holds notebooks is a learner, named by that folder (nbgrader's
    ``submitted/<learner>/<assignment>/``). Checkpoints are left out. Raises
    ``FileNotFoundError`` for a path that is none of these."""
    found = []
    for p in map(pathlib.Path, paths):
        if p.is_file() and p.suffix == ".ipynb":
            found.append((p.stem, [p]))
        elif p.is_dir():
            if not _notebooks_under(p):
                raise FileNotFoundError(f"the folder {p} holds no notebook (.ipynb); give a learner's folder "
                                        "or notebook files")
            if not classes:
                found.append((p.resolve().name, _notebooks_under(p)))
                continue
            each = [(q.name, _notebooks_under(q)) for q in sorted(p.iterdir())
                    if q.is_dir() and q.name != ".ipynb_checkpoints" and _notebooks_under(q)]
            if not each:
                raise FileNotFoundError(f"--class: the folder {p} holds no folder with notebooks; give the folder "
                                        "that holds one folder per learner")
            found += each
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
                    "(named by the folder; every notebook under it; with --class, every folder in it). Exits 0 "
                    "only when every exercise passed. See docs/instructor-guide.md.")
    g.add_argument("paths", nargs="+", metavar="NOTEBOOK_OR_FOLDER", help="learners' notebooks or folders")
    g.add_argument("--class", dest="classes", action="store_true",
                   help="each folder given holds one folder per learner (e.g. nbgrader's submitted/): grade each "
                        "of those as a learner")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds each notebook may run in all (default {DEFAULT_TIMEOUT})")
    g.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT,
                   help=f"bytes of output kept per cell (default {DEFAULT_MAX_OUTPUT})")
    g.add_argument("--json", action="store_true", help="print the report as JSON instead of lines")


def _one_line(text):
    """The first line of ``text`` with control characters (terminal escapes) shown as ``?``:
    a check's sentence may quote what a learner's loop raised."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return "".join(ch if ch.isprintable() else "?" for ch in (lines[0] if lines else ""))


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
    who = learners(args.paths, classes=getattr(args, "classes", False))
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
                for what in grade.tampered:
                    say(f"TAMPER  {learner}  {path.name}: the notebook {_one_line(what)}; it does not pass")
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
