"""The package's folders are its layers, and imports only run down them.

From the bottom up: ``runtime/`` (the backends and the modelled device, with the argument checks
every layer shares), the primitives a learner calls (streams, memory, graphs, the race sanitizer),
``timelines/`` (recording and drawing what ran), the running example, the IO
strategies and ``disk/``, what runs them (the solver, several GPUs in ``distributed/``, the views),
``measure/`` (the benchmark, comparisons, calibration) and ``exercises/`` (each exercise's kernel and
checker: a checker runs the solver), and the command line on top. The argument
checks and the atomic file writer sit with the runtime at the bottom: every layer uses them. A module may
import its own layer and the layers below it, never one above: so a layer can be read, tested and
changed knowing only what is under it. Imports made inside a function count too; those under
``if TYPE_CHECKING:`` do not (they name a type for the reader and the type checker, and never run).
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "course_helper"

#: Layer of each subpackage, and of each top-level module (``__init__`` is the face of its folder).
LAYERS = {
    "runtime": 0, "checks": 0, "files": 0,
    "streams": 1, "memory": 1, "graphs": 1, "sanitizer": 1, "host_watch": 1, "kernels": 1, "timing": 1,
    "timelines": 2,
    "wave": 3, "raw_cupy": 3,
    "strategies": 4, "disk": 4,
    "solver": 5, "distributed": 5, "viewer": 5,
    "measure": 6, "exercises": 6,
    "cli": 7, "__main__": 7, "__init__": 7, "preflight": 7, "grading": 7,
}


def layer_of(module):
    """The layer of a module named by its dotted path inside the package (``disk.sink``)."""
    head = module.split(".")[0]
    if head not in LAYERS:
        raise KeyError(f"course_helper.{head} has no layer: give it one in LAYERS (tests/test_layer_order.py) "
                       "and in docs/helper-package.md")
    return LAYERS[head]


def imports(path):
    """``(line, dotted module inside the package)`` for every package import of the file at ``path``."""
    relative = path.relative_to(PACKAGE).with_suffix("")
    here = list(relative.parts[:-1])                  # the package the module sits in
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree)
                 if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                 for n in ast.walk(block)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[:len(here) - (node.level - 1)]
            if node.module:
                found.append((node.lineno, ".".join(base + node.module.split("."))))
            else:                                     # from . import a, b: each name is a module
                found += [(node.lineno, ".".join(base + [a.name])) for a in node.names]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(node.lineno, n[len("course_helper."):]) for n in names if n.startswith("course_helper.")]
    return sorted(found)


def upward_imports(path):
    """The imports of ``path`` that reach a higher layer, as ``"file:line: a (layer i) imports b (layer j)"``."""
    name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    own = layer_of(name)
    bad = []
    for line, target in imports(path):
        if target and layer_of(target) > own:
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name} (layer {own}) imports "
                       f"{target} (layer {layer_of(target)})")
    return bad


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_run_down_the_layers(path):
    bad = upward_imports(path)
    assert not bad, "\n".join(bad)


def test_every_module_has_a_layer():
    for path in MODULES:
        layer_of(".".join(path.relative_to(PACKAGE).with_suffix("").parts))


def test_an_upward_import_is_found(tmp_path, monkeypatch):
    """The check sees an upward import, a lazy one inside a function, and one spelled absolutely."""
    fake = tmp_path / "course_helper"
    (fake / "runtime").mkdir(parents=True)
    (fake / "runtime" / "model.py").write_text(
        "from ..disk import store\n"
        "def f():\n    from ..strategies import ring_depth\n"
        "import course_helper.measure.bench\n"
        "from . import observe\n"
        "if TYPE_CHECKING:\n    from ..solver import Run\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    bad = upward_imports(fake / "runtime" / "model.py")
    assert [b.split(" imports ")[1] for b in bad] == ["disk (layer 4)", "strategies (layer 4)",
                                                       "measure.bench (layer 6)"]


def test_a_module_without_a_layer_is_named():
    with pytest.raises(KeyError, match="course_helper.plugins has no layer"):
        layer_of("plugins.x")
