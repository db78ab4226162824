"""No module of course_helper reads another module's private names.

A name that starts with one underscore is private to the module that defines it: the module may
change it without notice. So a module of the package may use its own private names, and no others:
not ``from .memory import _queue_copy``, not ``backend._state``, and not a private method a class
inherits from a library (``zarr``'s ``LocalStore._open``), which a library upgrade can change. Each
finding names the file, the line and the name, so the fix is to give the name a public home.
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "course_helper"
MODULES = sorted(PACKAGE.rglob("*.py"))

# Private by spelling, public by documentation: CPython's frame access.
ALLOWED = {("sys", "_getframe")}


def _private(name):
    """``_x`` is private; ``__x__`` (Python's protocols) and ``_x_`` (IPython's display protocol,
    such as ``_repr_mimebundle_``) are not."""
    return name.startswith("_") and not name.endswith("_")


def _sets_attribute(call):
    """Whether ``call`` is ``setattr(obj, "_x", v)`` or ``object.__setattr__(obj, "_x", v)``."""
    return (ast.unparse(call.func) in ("setattr", "object.__setattr__") and len(call.args) == 3
            and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str))


def _own_names(tree):
    """Every name the module itself defines: functions, classes, module and class variables,
    attributes it assigns (``self._x = ...``), and the names it binds by import under an alias."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
        elif isinstance(node, ast.Call) and _sets_attribute(node):
            names.add(node.args[1].value)
    return names


def findings(source, filename="<module>"):
    """The lines of ``source`` that use another module's private name, as ``"file:line: what"``."""
    tree = ast.parse(source, filename)
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{filename}:{node.lineno}: imports the private name "
                                 f"{alias.name} from {'.' * node.level}{node.module or ''}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if (base, node.attr) not in ALLOWED:
                found.append(f"{filename}:{node.lineno}: reads {ast.unparse(node)}, a private "
                             f"name the module does not define")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_uses_no_other_module_private_name(path):
    found = findings(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source", [
    "from .memory import _queue_copy\n",
    "from course_helper.runtime.backend import _state as s\n",
    "from . import backend\nbackend._state\n",
    "import zarr\nclass S(zarr.storage.LocalStore):\n    def f(self):\n        return self._is_open\n",
    "class S(Base):\n    async def set(self):\n        await super()._open()\n",
])
def test_the_check_finds_a_private_name_of_another_module(source):
    assert findings(source)


@pytest.mark.parametrize("source", [
    "_cache = {}\ndef f():\n    return _cache\n",
    "class A:\n    def __init__(self):\n        self._n = 0\n    def n(self):\n        return self._n\n",
    "class A:\n    def _step(self):\n        pass\n    def run(self, other):\n        other._step()\n",
    "import sys\nsys._getframe(1)\n",
    "def show(w):\n    return w._repr_mimebundle_()\n",
    "class P:\n    def bump(self):\n        object.__setattr__(self, '_v', 1)\n"
    "    def v(self):\n        return self._v\n",
])
def test_the_check_allows_own_private_names(source):
    assert not findings(source)


# --------------------------------------------------------------------------
# Both runtimes implement the whole Runtime interface
# --------------------------------------------------------------------------
def _class_names(path, cls):
    """The names a class's body defines (methods and class attributes), read from its source:
    the GPU runtime imports CuPy, which a CPU machine does not have."""
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    names = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return names


def test_the_runtime_interface_is_abstract():
    from course_helper.runtime.base import Runtime
    assert {"host_ms", "enqueue", "new_stream", "sync_device", "trace_times"} <= Runtime.__abstractmethods__

    class Partial(Runtime):
        def host_ms(self):
            return 0.0
    with pytest.raises(TypeError, match="abstract"):
        Partial()


@pytest.mark.parametrize("module, cls", [("runtime/model", "ModelRuntime"), ("runtime/gpu", "GpuRuntime")])
def test_each_runtime_implements_every_abstract_method(module, cls):
    from course_helper.runtime.base import Runtime
    missing = Runtime.__abstractmethods__ - _class_names(PACKAGE / f"{module}.py", cls)
    assert not missing, f"{cls} does not implement {sorted(missing)}"


# --------------------------------------------------------------------------
# No duck-typed reach into another module's objects
# --------------------------------------------------------------------------
#: Names that libraries' objects carry and that the package may ask any object for: NumPy's and
#: CuPy's arrays (``shape``, ``ndim``, ``nbytes``, ``flags.writeable``), ``OSError.strerror``,
#: ``cupy.cuda.nccl.available``, a raw stream's ``close`` (the runtime's library's object).
LIBRARY_NAMES = {"shape", "ndim", "nbytes", "writeable", "strerror", "available", "close"}


def _defined_names(tree):
    """The attributes a module gives its objects: its classes' methods and class attributes, and
    every attribute it assigns (``self.x = ...``, ``view.copy_queued = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def _module_name(path):
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


DEFINED = {_module_name(p): _defined_names(ast.parse(p.read_text())) for p in MODULES}


def duck_reaches(source, module, defined=DEFINED):
    """The lines of ``source`` (the module ``module``) that ask an object by name, with ``getattr``
    or ``hasattr``, for an attribute that only other modules of the package give their objects:
    a dependency no import shows (``getattr(dst, "copy_queued", None)`` reaching into a store's
    slots, ``hasattr(target, "wait_event")`` telling a stream from an event). Name the class
    instead: an ``isinstance`` test on a class imported from its (lower) layer.

    A module may ask its own objects for its own names: ``self`` (and what ``self`` holds) and
    its module-level variables (a ``threading.local``). Any other object - a parameter, a
    value returned to it - may be another module's, whatever names the module also defines."""
    tree = ast.parse(source)
    own = _defined_names(tree)
    module_level = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            continue
        name = node.args[1].value
        target = node.args[0]
        while isinstance(target, ast.Attribute):
            target = target.value
        owns_it = isinstance(target, ast.Name) and (target.id == "self" or target.id in module_level)
        if name.startswith("__") or (name in own and owns_it) or name in LIBRARY_NAMES:
            continue
        owners = sorted(m for m, names in defined.items() if name in names and m != module)
        if owners:
            found.append(f"{module}:{node.lineno}: {node.func.id}(..., {name!r}) reaches for what "
                         f"{', '.join(owners)} define(s); test for their class with isinstance")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_reaches_into_no_other_module_by_attribute_name(path):
    found = duck_reaches(path.read_text(), _module_name(path))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source", [
    "def hand_on(dst, stream):\n    f = getattr(dst, 'copy_queued', None)\n",
    "def synced(target):\n    return hasattr(target, 'wait_event')\n",
    # the module's own name, asked of an object handed to it (viewer.py asking a Result or a store)
    "class View:\n    def __init__(self, x):\n        self.copy_queued = x\n"
    "def show(source):\n    return getattr(source, 'copy_queued', None)\n",
])
def test_the_check_finds_a_duck_typed_reach(source):
    assert duck_reaches(source, "memory", {"disk.sink": {"copy_queued"}, "streams": {"wait_event"}})


@pytest.mark.parametrize("source", [
    "def f(a):\n    return getattr(a, 'shape', None)\n",                   # a library's name
    "class A:\n    x = 1\n    def f(self):\n        return getattr(self, 'x', 0)\n",  # the module's own
    "import threading\n_local = threading.local()\ndef f():\n    _local.x = 1\n"
    "def g():\n    return getattr(_local, 'x', None)\n",                    # the module's own variable
    "def f(fn):\n    return getattr(fn, '__name__', '')\n",                 # Python's protocols
])
def test_the_check_allows_library_own_and_python_names(source):
    assert not duck_reaches(source, "memory", {"disk.sink": {"x", "shape"}})


# --------------------------------------------------------------------------
# The copy kinds are spelled in one place
# --------------------------------------------------------------------------
def spelled_copy_kinds(source, filename="<module>"):
    """The lines of ``source`` that spell a copy kind (``"D2H"``, ``"H2D"``, ``"D2D"``) as a string
    of their own, outside docstrings: the kinds belong to ``runtime/ops.py`` (``OpKind``)."""
    from course_helper.runtime.ops import COPY_KINDS
    tree = ast.parse(source, filename)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [f"{filename}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in COPY_KINDS and id(node) not in docstrings]


@pytest.mark.parametrize("path", [p for p in MODULES if p != PACKAGE / "runtime" / "ops.py"],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_takes_the_copy_kinds_from_ops(path):
    found = spelled_copy_kinds(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "spell them OpKind.D2H, ... (course_helper.runtime.ops):\n" + "\n".join(found)


def test_the_check_finds_a_copy_kind_spelled_as_a_string():
    assert spelled_copy_kinds('"""D2H in a docstring is fine."""\nCOPIES = ("D2H", "H2D", "D2D")\n')
    assert not spelled_copy_kinds('"""Copies "D2H" and "H2D"."""\nlink = f"{kind}_pageable"\n')


# --------------------------------------------------------------------------
# Ask the runtime what it can do, never which backend it is
# --------------------------------------------------------------------------
#: The concrete runtimes: only ``runtime/`` itself imports them (``runtime.active`` picks one).
CONCRETE_RUNTIMES = {"runtime.model", "runtime.gpu"}
#: What hands out the active runtime, as a module outside ``runtime/`` spells the call.
RUNTIME_GETTERS = {"runtime.get", "_runtime"}


def _imported_module(node, here):
    """The dotted modules inside the package that the import ``node`` of a module in the package
    ``here`` (a list of folder names) names, with each imported name as a possible submodule."""
    if isinstance(node, ast.Import):
        return [a.name.removeprefix("course_helper.") for a in node.names]
    if node.level:
        base = ".".join(here[:len(here) - (node.level - 1)] + ([node.module] if node.module else []))
    else:
        base = (node.module or "").removeprefix("course_helper").lstrip(".")
    return [base] + [f"{base}.{a.name}".lstrip(".") for a in node.names]


def backend_identity(source, here=(), filename="<module>"):
    """The lines of ``source`` (a module of the package in the folder ``here``) that ask which
    backend runs instead of what the runtime can do: a comparison with ``"gpu"`` or ``"cpu"``,
    the runtime's ``modelled`` or an attribute the :class:`~course_helper.runtime.base.Runtime`
    interface does not declare (``rt.profile``), an import of a concrete runtime, or the backend's
    environment variable (``COURSE_HELPER_BACKEND``, ``backend.ENV_VAR``)."""
    from course_helper.runtime.backend import ENV_VAR
    from course_helper.runtime.base import Runtime
    declared = set(dir(Runtime)) - {"modelled"}     # modelled: kept for the notebooks, asked as predicts_times
    tree = ast.parse(source, filename)
    found = []
    runtime_names = {}        # id(node): the names its function binds to the active runtime (rt = runtime.get())
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            names = {t.id for node in ast.walk(scope) if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) in RUNTIME_GETTERS
                     for t in node.targets if isinstance(t, ast.Name)}
            for node in ast.walk(scope):        # the innermost function's names win (walked last)
                runtime_names[id(node)] = names
    for node in ast.walk(tree):
        runtimes = runtime_names.get(id(node), set())
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(v, ast.Constant) and v.value in ("gpu", "cpu") for v in values):
                    found.append(f"{where}: compares with a backend's name ({ast.unparse(node)}); "
                                 "ask the runtime what it can do (predicts_times, runs_cuda...)")
                    break
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and {"gpu", "cpu"} <= {
                v.value for v in node.elts if isinstance(v, ast.Constant)}:
            found.append(f"{where}: spells the backends ({ast.unparse(node)}); use runtime.backend.CHOICES")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            base = node.value
            is_runtime = (isinstance(base, ast.Name) and base.id in runtimes) or (
                isinstance(base, ast.Call) and ast.unparse(base.func) in RUNTIME_GETTERS)
            if is_runtime and node.attr not in declared:
                found.append(f"{where}: reads {ast.unparse(node)}, which the Runtime interface does not "
                             "declare; declare what is asked on runtime/base.py")
            if node.attr == "ENV_VAR" and ast.unparse(base).endswith("backend"):
                found.append(f"{where}: reads the backend's environment variable; ask runtime.backend")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            named = _imported_module(node, list(here))
            if any(m in CONCRETE_RUNTIMES for m in named) or any(
                    a.name in ("ModelRuntime", "GpuRuntime") for a in node.names):
                found.append(f"{where}: imports a concrete runtime; use runtime.get() and the Runtime interface")
            if isinstance(node, ast.ImportFrom) and any(a.name == "ENV_VAR" for a in node.names) \
                    and any(m.endswith("backend") for m in named):
                found.append(f"{where}: imports the backend's environment variable; ask runtime.backend")
        elif isinstance(node, ast.Constant) and node.value == ENV_VAR:
            found.append(f"{where}: names {ENV_VAR}; ask runtime.backend (requested, request, environment_for)")
        elif isinstance(node, ast.keyword) and node.arg == ENV_VAR:
            found.append(f"{where}: sets {ENV_VAR}; use runtime.backend.environment_for")
    return found


OUTSIDE_RUNTIME = [p for p in MODULES if p.relative_to(PACKAGE).parts[0] != "runtime"]


@pytest.mark.parametrize("path", OUTSIDE_RUNTIME, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_asks_the_runtime_what_it_can_do(path):
    relative = path.relative_to(PACKAGE)
    found = backend_identity(path.read_text(), relative.parts[:-1], str(relative))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, here", [
    ("from .runtime.backend import backend_name\nif backend_name() != 'gpu':\n    pass\n", ()),
    ("def f(b):\n    return b in ('gpu', 'auto')\n", ()),
    ("from .. import runtime\nrt = runtime.get()\nif rt.modelled:\n    x = rt.profile['disk']\n", ("measure",)),
    ("from .. import runtime\ngbps = runtime.get().profile['disk']\n", ("measure",)),
    ("from ..runtime.model import ModelRuntime\n", ("disk",)),
    ("from ..runtime import gpu\n", ("disk",)),
    ("import course_helper.runtime.model\n", ()),
    ("import os\nos.environ.get('COURSE_HELPER_BACKEND', 'auto')\n", ("distributed",)),
    ("import os\nenv = dict(os.environ, COURSE_HELPER_BACKEND='cpu')\n", ("distributed",)),
    ("import os\nfrom .runtime import backend\nos.environ.get(backend.ENV_VAR)\n", ()),
    ("def add(parser):\n    parser.add_argument('--backend', choices=('auto', 'gpu', 'cpu'))\n", ()),
])
def test_the_check_finds_a_question_of_backend_identity(source, here):
    assert backend_identity(source, here)


@pytest.mark.parametrize("source, here", [
    ("from . import runtime\nrt = runtime.get()\nif rt.predicts_times:\n    print(rt.device_label)\n", ()),
    ("from .runtime.backend import backend_name\nprint(f'{backend_name()} backend')\n", ()),
    ("from ..runtime import model_errors\n", ("disk",)),
    ("from .runtime.backend import environment_for\nenv = environment_for('cpu')\n", ()),
    ("import os\nos.environ.get('COURSE_HELPER_PROFILE')\n", ()),
])
def test_the_check_allows_asking_the_runtime(source, here):
    assert not backend_identity(source, here)


# Op kinds are OpKind members, never strings
# --------------------------------------------------------------------------
def op_kinds_as_strings(source, filename="<module>"):
    """The lines of ``source`` that compare an operation's ``.kind`` with a string that is an op
    kind (``op.kind == "kernel"``, ``op.kind in ("memset", ...)``), or build an operation
    (``Op``, ``note_op``, ``_OpInfo``) with one: ``runtime/ops.py``'s ``OpKind`` has a member for each."""
    from course_helper.runtime.ops import OpKind
    kinds = {str(k) for k in OpKind}

    def strings(node):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [e.value for e in node.elts if isinstance(e, ast.Constant)]
        return [node.value] if isinstance(node, ast.Constant) else []

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides):
                found += [f"{filename}:{node.lineno}: {ast.unparse(node)}" for s in sides
                          if set(strings(s)) & kinds][:1]
        elif isinstance(node, ast.Call) and node.args:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("Op", "note_op", "_OpInfo") and set(strings(node.args[0])) & kinds:
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", [p for p in MODULES if p != PACKAGE / "runtime" / "ops.py"],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_names_op_kinds_by_their_members(path):
    found = op_kinds_as_strings(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "spell them OpKind.KERNEL, ... (course_helper.runtime.ops):\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "def f(op):\n    return op.kind == 'kernel'\n",
    "def f(acc):\n    return acc.op.kind in ('let go', 'memset')\n",
    "op = observe.Op('kernel', 'k', s, 0, 0, (), ())\n",
    "observe.note_op('halo', 'h', s, 1, 8)\n",
])
def test_the_check_finds_an_op_kind_spelled_as_a_string(source):
    assert op_kinds_as_strings(source)


def test_the_check_lets_other_kinds_and_members_be():
    assert not op_kinds_as_strings("def f(e, op):\n    return e.kind == 'disk write' or op.kind == OpKind.KERNEL\n")
