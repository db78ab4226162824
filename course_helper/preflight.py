"""Is this machine ready for the course? ``python -m course_helper preflight``.

Each check tries the real thing, briefly and guarded, within a bounded time: the GPU and its
driver, CuPy, a CUPTI recording, one pinned allocation of the course's largest size and the
locked-memory limit, the copy engines, two MPI ranks, nvCOMP, the store folder's disk and the
Jupyter pieces. On a GPU, each check that calls into the driver, CUPTI or nvCOMP runs in a
process of its own: one that crashes or hangs is reported as missing, and the others still run.
The runtime says what it can do (``predicts_times``: a modelled device; ``compresses_on_device``:
whose compression engine), so a check never compares backend names.

A check ends ``ok`` (runs for real), ``modelled`` (the CPU backend's modelled GPU stands in: the
course runs), ``warn`` (runs, with less: e.g. no CUPTI, so CUDA events time the traces) or
``missing`` (a notebook that needs it cannot run that part; the check gives the one command that
fixes it). Then, per notebook, what will run real, what modelled and what is missing. The exit
status is 0 when the course can run (modelled counts), 1 when something it needs is missing.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: Seconds a check may take before it is reported as timed out (mpiexec gets its own).
CHECK_SECONDS = 20.0
#: Seconds more a check run in a process of its own may take: Python, the package and CuPy start.
CHILD_START_SECONDS = 30.0
#: Seconds two MPI ranks may take to start, say who they are and end.
RANKS_SECONDS = 30.0
#: MiB written (fsync'ed, in 4 MiB files, then removed) to measure the store folder's disk.
DISK_MIB = 32

INSTALL = "python3 -m pip install -e '.[{}]'"
GPU_EXTRA = "cuda13"                     # cuda12 for CUDA 12 drivers (docs/gpu-setup.md)

#: What each notebook needs, by the names of the checks below.
NOTEBOOK_NEEDS = {
    "01": ("gpu", "pinned", "copy_engines", "widgets"),
    "02": ("gpu", "pinned", "cupti"),
    "03": ("gpu", "pinned"),
    "04": ("gpu", "widgets"),
    "05": ("gpu", "pinned", "cupti"),
    "06": ("gpu", "pinned", "cupti"),
    "07": ("gpu", "pinned", "cupti", "copy_engines"),
    "08": ("gpu", "pinned", "cupti"),
    "09": ("gpu", "pinned"),
    "10": ("gpu", "pinned", "cupti"),
    "11": ("gpu", "pinned", "disk", "nvcomp"),
    "12": ("gpu", "mpi"),
    "13": ("gpu", "pinned", "cupti"),
    "14": ("gpu", "pinned", "cupti"),      # "Your own code": shown only when the notebook exists
}
#: Every notebook needs these: the course is opened in JupyterLab.
EVERY_NOTEBOOK = ("jupyterlab",)

__all__ = ["Check", "CHECKS", "run_checks", "notebook_plan", "course_notebooks", "add_preflight_parser",
           "preflight_main", "largest_pinned_mib", "NOTEBOOK_NEEDS", "IN_A_CHILD"]


@dataclasses.dataclass
class Check:
    """One check's finding: ``status`` (``ok``, ``modelled``, ``warn`` or ``missing``), what was
    found (``detail``), the one command that fixes it (``fix``, for ``warn`` and ``missing``)."""

    name: str
    title: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0


# --------------------------------------------------------------------------
# The checks: each returns (status, detail, fix)
# --------------------------------------------------------------------------
def _runtime():
    from . import runtime
    return runtime.get()


def check_gpu() -> tuple[str, str, str]:
    """The GPU and its driver: real when CuPy runs a probe kernel on a device."""
    from .runtime import backend
    rt = _runtime()
    if not rt.predicts_times:
        r = backend.device_report()
        return "ok", f"{r['device']}, driver CUDA {r['driver_version']}, runtime CUDA {r['runtime_version']}", ""
    why = "no usable GPU here" if not backend.gpu_available() else f"the CPU was asked for ({backend.reason()})"
    return "modelled", f"{why}: the CPU backend runs the course on the {rt.device_label}", ""


def check_cupy() -> tuple[str, str, str]:
    """CuPy: importable, and its version."""
    if importlib.util.find_spec("cupy") is None:
        return ("modelled" if _runtime().predicts_times else "missing",
                "CuPy is not installed (on a GPU machine install it; without a GPU it is not needed)",
                INSTALL.format(GPU_EXTRA))
    try:
        cupy = importlib.import_module("cupy")
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install: say what it raised
        return "missing", f"CuPy is installed but does not import ({type(exc).__name__}: {exc})", \
            INSTALL.format(GPU_EXTRA)
    return "ok", f"CuPy {cupy.__version__}", ""


def check_cupti() -> tuple[str, str, str]:
    """CUPTI: can it record a copy here? (tried: one small copy recorded)."""
    from .timelines import cupti_trace
    if _runtime().predicts_times:
        return "modelled", "timelines come from the modelled GPU", ""
    ok, why = cupti_trace.available()
    if not ok:
        return "warn", f"{why}; timelines are timed by CUDA events instead", INSTALL.format("cupti")
    from . import memory, streams
    try:
        session = cupti_trace.ActivitySession().start()
        try:
            memory.to_host(memory.to_device(memory.pinned_empty(1024)))
            streams.synchronize()
        finally:
            session.stop()
    except Exception as exc:  # noqa: BLE001 - any failure to record: the traces fall back to events
        return ("warn", f"CUPTI imports but could not record ({type(exc).__name__}: {exc}); timelines are "
                "timed by CUDA events instead", "export COURSE_HELPER_TIMING=events")
    if not session.records:
        return "warn", "CUPTI recorded nothing of a copy; timelines are timed by CUDA events instead", \
            "export COURSE_HELPER_TIMING=events"
    return "ok", f"CUPTI recorded a copy ({len(session.records)} record(s))", ""


def largest_pinned_mib() -> int:
    """MiB of the course's largest pinned allocation: the output stack a pinned loop allocates at
    the balanced point (``ch.measure.BALANCED_POINT``, run by notebooks 5, 6, 7, 9 and 10: 20 saved
    levels of 3072 x 3072 float32, 720 MiB; the capstone's snapshot stack is as large), as
    :func:`~course_helper.solver.plan_memory` counts it."""
    from . import solver
    from .measure import BALANCED_POINT
    from .wave import WaveProblem
    n, nt, every = BALANCED_POINT
    return -(-solver.plan_memory(WaveProblem(n0=n, n1=n, nt=nt), "sequential-pinned", every=every)["host"] // 2**20)


def check_pinned() -> tuple[str, str, str]:
    """Pinned memory: the locked-memory limit (``ulimit -l``), and on a GPU one pinned allocation
    of the course's largest size, every page touched (the modelled GPU has no pinned memory to
    allocate: it times copies from the course's pinned arrays as pinned)."""
    from . import memory
    limit = "unknown"
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    if _runtime().predicts_times:
        return "modelled", f"the modelled GPU times copies as pinned; ulimit -l is {limit}", ""
    mib = largest_pinned_mib()
    try:
        a = memory.pinned_empty(mib * 2**20 // 4)
        a[::1024] = 0                                  # touch every page... of 4 KiB
        pinned = memory.is_pinned(a)
        del a
    except Exception as exc:  # noqa: BLE001 - the allocation's own error says why
        return ("missing", f"a {mib} MiB pinned allocation failed ({type(exc).__name__}: {exc}); "
                f"ulimit -l is {limit}", "ulimit -l unlimited   (containers: docker run --ulimit memlock=-1)")
    what = f"a {mib} MiB pinned allocation worked; ulimit -l is {limit}"
    return ("ok" if pinned else "warn"), what, ""


def check_copy_engines() -> tuple[str, str, str]:
    """Copy engines: how many copies can run beside a kernel (CuPy's device attributes, or the
    modelled device's profile)."""
    from .runtime import backend, profiles
    if _runtime().predicts_times:
        device = profiles.load(backend.profile_name())["device"]
        return "modelled", f"{device['async_engine_count']} copy engines, concurrent kernels ({device['name']})", ""
    r = backend.device_report()
    engines = r["async_engine_count"]
    detail = f"{engines} copy engine(s), concurrent kernels: {r['concurrent_kernels']}"
    if engines < 1:
        return "warn", detail + "; copies cannot run beside kernels on this device", ""
    return "ok", detail, ""


def check_mpi() -> tuple[str, str, str]:
    """``mpiexec`` and two ranks: start two ranks briefly; rank 0 gathers both ranks' numbers."""
    from .distributed.launch import find_mpiexec, ranks_env
    fix = INSTALL.format("distributed")
    try:
        mpiexec = find_mpiexec()
    except FileNotFoundError as exc:
        return "missing", str(exc), fix
    if importlib.util.find_spec("mpi4py") is None:
        return "missing", f"{mpiexec} is here, but mpi4py is not installed", fix
    # Rank 0 gathers every rank's number and alone prints (two ranks printing at once share one pipe).
    code = ("from mpi4py import MPI; c = MPI.COMM_WORLD; got = c.gather(c.Get_rank(), root=0); "
            "c.Get_rank() or print('ranks', *got, flush=True)")
    try:
        done = _run_bounded([mpiexec, "-n", "2", sys.executable, "-c", code], RANKS_SECONDS, ranks_env("cpu"))
    except subprocess.TimeoutExpired:
        return "missing", f"two ranks under {mpiexec} did not finish within {RANKS_SECONDS:g} s", fix
    except OSError as exc:
        return "missing", f"{mpiexec} could not be started ({exc})", fix
    if done.returncode != 0 or "ranks 0 1" not in done.stdout.splitlines():
        tail = " ".join((done.stderr or done.stdout).split())[-300:]
        return "missing", f"two ranks under {mpiexec} failed (exit {done.returncode}): {tail}", fix
    return "ok", f"two ranks ran under {mpiexec}", ""


def _run_bounded(command: list[str], seconds: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``command`` in a session of its own, its output captured; past ``seconds``, kill the
    whole session (what it started too, such as MPI ranks) and raise ``TimeoutExpired``."""
    import signal
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as child:
        try:
            out, err = child.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            raise
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def check_nvcomp() -> tuple[str, str, str]:
    """nvCOMP: whose engine compresses ``gpu-zstd`` chunks (the model's, or nvCOMP if its library loads)."""
    from .disk import compression
    modelled = _runtime().compresses_on_device("zstd")
    if modelled is not None:
        on_device, why = modelled
        return ("modelled", why, "") if on_device else ("warn", why + "; the host compresses instead", "")
    unusable = compression.nvcomp_unusable()       # the course's own rule: the package imports and its library loads
    if unusable is not None:
        return "warn", f"{unusable}; gpu-zstd compresses on the host", INSTALL.format("nvcomp")
    return "ok", f"nvCOMP {getattr(compression.nvcomp_module(), '__version__', '')} loads", ""


def check_disk(folder: str | None = None) -> tuple[str, str, str]:
    """The store folder's disk: a small fsync'ed write measured (then removed)."""
    from .disk.measuring import measure_disk_bandwidth
    folder = folder or tempfile.gettempdir()
    fix = "export TMPDIR=/a/writable/folder/with/space   (notebook 11's stores go under it)"
    try:
        gbps = measure_disk_bandwidth(folder, mib=DISK_MIB, chunk_mib=4, writers=2)
    except (OSError, ValueError) as exc:
        return "missing", f"cannot write under {folder}: {exc}", fix
    return "ok", f"{folder} wrote {DISK_MIB} MiB (fsync'ed) at {gbps:.2f} GB/s", ""


def check_jupyterlab() -> tuple[str, str, str]:
    """JupyterLab and a Python kernel."""
    fix = INSTALL.format("lab")
    missing = [m for m in ("jupyterlab", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:
        return "missing", f"{' and '.join(missing)} not installed", fix
    from importlib.metadata import version         # importing jupyterlab itself takes seconds
    return "ok", f"JupyterLab {version('jupyterlab')}", ""


#: The JupyterLab extensions the widgets need, by the package that brings each.
LAB_EXTENSIONS = {"ipywidgets": "@jupyter-widgets/jupyterlab-manager", "ipympl": "jupyter-matplotlib"}


def check_widgets() -> tuple[str, str, str]:
    """ipywidgets and ipympl, and their JupyterLab extensions (the slice widget, live figures)."""
    fix = "python3 -m pip install -e ."
    missing = [m for m in LAB_EXTENSIONS if importlib.util.find_spec(m) is None]
    if missing:
        return "missing", f"{' and '.join(missing)} not installed", fix
    from jupyter_core.paths import jupyter_path
    folders = [pathlib.Path(p) for p in jupyter_path("labextensions")]
    absent = [ext for ext in LAB_EXTENSIONS.values() if not any((f / ext).is_dir() for f in folders)]
    if absent:
        return "missing", f"JupyterLab extension(s) {', '.join(absent)} not found in {', '.join(map(str, folders))}", \
            "python3 -m pip install --force-reinstall ipywidgets ipympl jupyterlab_widgets"
    return "ok", "ipywidgets and ipympl with their JupyterLab extensions", ""


#: Every check, in the order printed: name -> (title, function).
CHECKS: dict[str, tuple[str, Callable[..., tuple[str, str, str]]]] = {
    "gpu": ("GPU and driver", check_gpu),
    "cupy": ("CuPy", check_cupy),
    "cupti": ("CUPTI", check_cupti),
    "pinned": ("pinned memory", check_pinned),
    "copy_engines": ("copy engines", check_copy_engines),
    "mpi": ("mpiexec, two ranks", check_mpi),
    "nvcomp": ("nvCOMP", check_nvcomp),
    "disk": ("store folder's disk", check_disk),
    "jupyterlab": ("JupyterLab", check_jupyterlab),
    "widgets": ("ipywidgets, ipympl", check_widgets),
}


def _bounded(fn: Callable[[], tuple[str, str, str]], seconds: float) -> tuple[str, str, str]:
    """``fn()`` in a thread of its own, given up on (reported missing) after ``seconds``."""
    box = []

    def run():
        try:
            box.append(fn())
        except Exception as exc:  # noqa: BLE001 - a check that breaks reports why, the others still run
            box.append(("missing", f"the check raised {type(exc).__name__}: {exc}", ""))

    t = threading.Thread(target=run, daemon=True, name="preflight check")
    t.start()
    t.join(seconds)
    if not box:
        return "missing", f"no answer within {seconds:g} s", ""
    return box[0]


#: The checks that call into the CUDA driver, CUPTI or nvCOMP: on a GPU each runs in a process of
#: its own, so that one that crashes (a driver or library mismatch can end a process) or hangs is
#: reported and the others still run.
IN_A_CHILD = ("gpu", "cupy", "cupti", "pinned", "copy_engines", "nvcomp")
#: What a child prints before its finding, to find it among what importing the package printed.
_MARK = "course_helper preflight finding: "


def _child_main(target: str, *args: str) -> None:
    """In a child process: call ``module:function`` (``args`` as strings) and print its finding."""
    module, function = target.split(":")
    try:
        found = tuple(getattr(importlib.import_module(module), function)(*args))
    except Exception as exc:  # noqa: BLE001 - a check that breaks reports why
        found = ("missing", f"the check raised {type(exc).__name__}: {exc}", "")
    print(_MARK + json.dumps(found), flush=True)


def _in_a_child(target: str, args: tuple[str, ...], seconds: float) -> tuple[str, str, str]:
    """Run ``module:function(*args)`` in a new Python process (this copy of the package; the GPU
    backend where this process runs it, else the environment's choice), killed with what it
    started after ``seconds``; its finding, or why there is none."""
    import signal
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(pathlib.Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if not _runtime().predicts_times:              # the GPU, also where this process asked for it in code
        from .runtime import backend
        env.update(backend.environment_for("gpu"))
    code = f"from course_helper import preflight; preflight._child_main(*{[target, *args]!r})"
    try:
        done = _run_bounded([sys.executable, "-c", code], seconds, env)
    except subprocess.TimeoutExpired:
        return "missing", f"no answer within {seconds:g} s (the check hung and was stopped)", ""
    found = [line[len(_MARK):] for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if found:
        status, detail, fix = json.loads(found[-1])
        return status, detail, fix
    if done.returncode < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-done.returncode).name
            return "missing", f"the check crashed its process ({name})", ""
    tail = " ".join(done.stderr.split())[-300:]
    return "missing", f"the check's process ended (exit {done.returncode}) without a finding: {tail}", ""


def run_checks(store: str | None = None, seconds: float = CHECK_SECONDS,
               isolate: bool | None = None) -> dict[str, Check]:
    """Run every check of :data:`CHECKS`, one after the other, each bounded to ``seconds``
    (two MPI ranks: :data:`RANKS_SECONDS` more); ``store``: the folder whose disk is measured
    (default: the temporary folder, where notebook 11 puts its stores). ``isolate``: run the
    checks of :data:`IN_A_CHILD` each in a process of its own (default: when the GPU runs;
    on the modelled GPU they touch no driver)."""
    from .timing import host_timer, wall_ms
    if isolate is None:
        isolate = not _runtime().predicts_times
    found = {}
    for name, (title, fn) in CHECKS.items():
        call = (lambda fn=fn: fn(store)) if name == "disk" else fn
        bound = seconds + (RANKS_SECONDS if name == "mpi" else 0)
        with host_timer(wall_ms) as took:               # how long the check kept the learner waiting
            if isolate and name in IN_A_CHILD:
                status, detail, fix = _in_a_child(f"{__name__}:{fn.__name__}", (), bound + CHILD_START_SECONDS)
            else:
                status, detail, fix = _bounded(call, bound)
        found[name] = Check(name, title, status, detail, fix if status in ("warn", "missing") else "",
                            round(took.ms / 1e3, 2))
    return found


# --------------------------------------------------------------------------
# Per notebook
# --------------------------------------------------------------------------
def course_notebooks(folder: str | os.PathLike | None = None) -> list[tuple[str, str, str]]:
    """``(number, file name, title)`` of each lesson in ``folder`` (default: the course's
    ``notebooks/``) that :data:`NOTEBOOK_NEEDS` knows: 01 to 13, and 14 when its file exists."""
    import nbformat
    folder = pathlib.Path(folder) if folder else pathlib.Path(__file__).resolve().parent.parent / "notebooks"
    found = []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        number = path.name[:2]
        if number not in NOTEBOOK_NEEDS:
            continue
        nb = nbformat.read(path, as_version=4)
        heading = next((line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()
                        if line.startswith("# ")), path.stem)
        found.append((number, path.name, re.sub(r"^#\s*", "", heading).strip()))
    return found


def notebook_plan(checks: dict[str, Check], notebooks: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """For each notebook: what runs ``real`` (among it, ``with_less``: what runs with less, such as
    timelines timed by CUDA events without CUPTI, with why and its fix), what ``modelled``, what is
    ``missing`` (with why and its fix), and whether it ``runs``."""
    plan = []
    for number, name, title in notebooks:
        needs = [n for n in (*EVERY_NOTEBOOK, *NOTEBOOK_NEEDS[number]) if n in checks]
        by = {s: [checks[n] for n in needs if checks[n].status == s] for s in ("ok", "modelled", "warn", "missing")}
        plan.append({"number": number, "notebook": name, "title": title,
                     "real": [c.title for c in by["ok"] + by["warn"]],
                     "with_less": [{"what": c.title, "why": c.detail, "fix": c.fix} for c in by["warn"]],
                     "modelled": [c.title for c in by["modelled"]],
                     "missing": [{"what": c.title, "why": c.detail, "fix": c.fix} for c in by["missing"]],
                     "runs": not by["missing"]})
    return plan


# --------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------
def add_preflight_parser(sub: Any) -> None:
    """Register ``preflight`` on the command line's subcommands ``sub``."""
    p = sub.add_parser(
        "preflight", help="check this machine for the course, notebook by notebook",
        description="Check this machine for the course: the GPU and driver, CuPy, CUPTI, pinned memory, copy "
                    "engines, two MPI ranks, nvCOMP, the store folder's disk, JupyterLab and the widgets. "
                    "Prints what each notebook will run for real, what on the modelled GPU, and what is "
                    "missing with the command that fixes it. Exits 0 when the course can run (modelled "
                    "counts), 1 when something a notebook needs is missing.")
    p.add_argument("--store", default=None,
                   help="the folder whose disk is measured (default: the temporary folder, where notebook 11 "
                        "puts its stores)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON (for a centre's scripts)")


@contextlib.contextmanager
def _stdout_to_stderr(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):      # the backend's banner and stray prints
        yield


def preflight_main(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    """``preflight``: run the checks, print them and the notebooks' plan; 0 when the course can run."""
    if args.store is not None and not os.path.isdir(args.store):
        raise FileNotFoundError(f"--store {args.store} is not a folder; give the folder the stores will be written to")
    with _stdout_to_stderr(args.json):
        checks = run_checks(args.store)
        plan = notebook_plan(checks, course_notebooks())
    missing = sorted({m["what"] for p in plan for m in p["missing"]})
    ok = not missing
    if args.json:
        say(json.dumps({"can_run": ok, "missing": missing,
                        "checks": {n: dataclasses.asdict(c) for n, c in checks.items()}, "notebooks": plan}, indent=1))
        return 0 if ok else 1
    width = max(len(c.title) for c in checks.values())
    say("checks:")
    for c in checks.values():
        say(f"  {c.status:<8} {c.title:<{width}}  {c.detail}")
        if c.fix:
            say(f"  {'':<8} {'':<{width}}  fix: {c.fix}")
    say("notebooks:")
    for p in plan:
        parts = []
        if p["real"]:
            parts.append("real: " + ", ".join(p["real"]))
        if p["modelled"]:
            parts.append("modelled: " + ", ".join(p["modelled"]))
        for w in p["with_less"]:
            parts.append(f"with less: {w['what']}" + (f" (fix: {w['fix']})" if w["fix"] else ""))
        for m in p["missing"]:
            parts.append(f"MISSING {m['what']} (fix: {m['fix'] or 'see above'})")
        say(f"  {p['title']}: " + "; ".join(parts))
    if ok:
        say("the course can run here" + (" (partly on the modelled GPU)" if any(p["modelled"] for p in plan) else ""))
        return 0
    say(f"the course cannot run whole here: missing {', '.join(missing)} (the fixes are above)")
    return 1
