"""Every public function and method of course_helper says what it takes and what it returns.

A reader of ``help(ch.run_strategy)`` or of the source sees the types without reading the body, as
in ``cuda.core``. The check reads each module's source (no import, so the GPU modules are checked on
a machine without CuPy): a function or method is public when its name does not start with ``_`` and
it is defined at module level or in a public class (``__init__`` counts, for its parameters). Each
must annotate every parameter but ``self``/``cls`` and its return (``__init__`` may leave the return
out). A finding names the file, the line and the function, so the fix is one annotation away.
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "course_helper"
MODULES = sorted(PACKAGE.rglob("*.py"))

# annotated in a parallel change: these modules (and timeline.py's write_atomically, which is
# being replaced) are annotated on other branches; the marks go once those are merged.
PENDING = set()


def _public(name):
    return not name.startswith("_")


def _functions(tree):
    """``(node, qualified name)`` of each public function: module level, or a method of a public
    class (nested classes included, when public all the way down)."""
    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _public(node.name) or node.name == "__init__":
                    yield node, prefix + node.name
            elif isinstance(node, ast.ClassDef) and _public(node.name):
                yield from walk(node.body, f"{prefix}{node.name}.")
    yield from walk(tree.body, "")


def _missing(node, in_class):
    """What ``node`` leaves unannotated: the parameter names, and ``"return"``."""
    args = node.args
    params = args.posonlyargs + args.args + args.kwonlyargs
    if in_class and params and params[0].arg in ("self", "cls") and not _is_static(node):
        params = params[1:]
    params += [a for a in (args.vararg, args.kwarg) if a is not None]
    missing = [a.arg for a in params if a.annotation is None]
    if node.returns is None and node.name != "__init__":
        missing.append("return")
    return missing


def _is_static(node):
    return any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)


def findings(source, filename="<module>"):
    """``"file:line name (missing: ...)"`` for each public function that lacks an annotation."""
    tree = ast.parse(source, filename)
    found = []
    for node, name in _functions(tree):
        missing = _missing(node, in_class="." in name)
        if missing:
            found.append(f"{filename}:{node.lineno} {name} (missing: {', '.join(missing)})")
    return found


def _marks(path):
    rel = path.relative_to(PACKAGE)
    if rel.parts[0] in PENDING or rel.as_posix() in PENDING:
        return [pytest.mark.xfail(strict=False, reason="annotated in a parallel change")]
    return []


@pytest.mark.parametrize("path", [pytest.param(p, marks=_marks(p), id=str(p.relative_to(PACKAGE)))
                                  for p in MODULES])
def test_public_functions_are_annotated(path):
    found = findings(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, want", [
    ("def f(x):\n    return x\n", "f (missing: x, return)"),
    ("def f(x: int):\n    return x\n", "f (missing: return)"),
    ("def f(*args, **kw) -> None:\n    pass\n", "f (missing: args, kw)"),
    ("def f(*, n) -> None:\n    pass\n", "f (missing: n)"),
    ("class A:\n    def __init__(self, n):\n        pass\n", "A.__init__ (missing: n)"),
    ("class A:\n    def m(self) :\n        pass\n", "A.m (missing: return)"),
    ("class A:\n    @staticmethod\n    def m(self) -> None:\n        pass\n", "A.m (missing: self)"),
    ("class A:\n    class B:\n        def m(self, x) -> None:\n            pass\n", "A.B.m (missing: x)"),
    ("async def f(x) -> None:\n    pass\n", "f (missing: x)"),
])
def test_the_check_finds_a_missing_annotation(source, want):
    (found,) = findings(source)
    assert found.endswith(want), found
    assert found.startswith("<module>:")


@pytest.mark.parametrize("source", [
    "def _f(x):\n    return x\n",
    "class _A:\n    def m(self, x):\n        return x\n",
    "class A:\n    def _m(self, x):\n        return x\n",
    "class A:\n    def __init__(self, n: int):\n        pass\n",
    "class A:\n    @classmethod\n    def make(cls, n: int) -> 'A':\n        return cls()\n",
    "def f(x: int, *a: int, k: str = '', **kw: float) -> None:\n    def inner(y):\n        pass\n",
])
def test_the_check_allows_private_or_annotated_functions(source):
    assert not findings(source)
