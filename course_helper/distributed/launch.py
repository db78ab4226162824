"""Starting ranks from Python (a notebook): ``mpiexec -n R python -m course_helper halo ...`` as a
subprocess, with the environment the ranks need, stopped with every rank on an interrupt or a
timeout.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from .. import checks
from .. import runtime
from ..runtime.backend import CHOICES, cupy_module, environment_for
from ..wave import WaveProblem, save_interval
from .loops import STRATEGIES
from .results import HaloResult
from .slabs import decompose

__all__ = ["find_mpiexec", "launch_halo", "ranks_backend", "ranks_env", "check_job", "MPIEXEC_VAR"]

MPIEXEC_VAR = "COURSE_HELPER_MPIEXEC"


def check_job(problem: WaveProblem, ranks: int, every: int) -> int:
    """Refuse a job that no rank could run, before any rank starts work: ``problem``'s rows
    split over ``ranks`` (:func:`decompose`) and an ``every`` below ``nt``. Returns ``every``.
    Every rank finds the same mistake, so under ``mpiexec`` rank 0 alone says it."""
    decompose(problem.n0, ranks)
    return save_interval(every, problem.nt)


def find_mpiexec() -> str:
    """The ``mpiexec`` to start ranks with: ``$COURSE_HELPER_MPIEXEC``, the one next to this
    Python (the ``mpich`` wheel installs it in the environment's ``bin``), else the one on PATH."""
    env = os.environ.get(MPIEXEC_VAR)
    if env:
        found = shutil.which(env)       # a path, or a name on PATH; an executable file either way
        if found is None:
            raise FileNotFoundError(f"${MPIEXEC_VAR}={env!r} is not an mpiexec that can be run (no executable "
                                    f"file of that name or path); set it to mpiexec's path, or unset it to use "
                                    "the mpiexec next to this Python or on PATH")
        return found
    here = pathlib.Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec found: python -m pip install -e '.[distributed]' installs "
                                "mpi4py and MPICH (its mpiexec lands next to python)")
    return found


def ranks_env(backend: str) -> dict[str, str]:
    """The environment for ranks started from this process: this copy of ``course_helper`` first
    on the path, the chosen backend, and (as root, e.g. in a container) Open MPI's consent to run
    as root, which MPICH ignores."""
    env = dict(os.environ, **environment_for(backend))
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[2]),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def ranks_backend(ranks: int) -> str:
    """The backend ``ranks`` ranks on this machine get: the GPU when this process uses the GPU
    backend and there is one GPU per rank, else the CPU."""
    if runtime.get().runs_cuda and cupy_module().cuda.runtime.getDeviceCount() >= ranks:
        return "gpu"
    return "cpu"


def launch_halo(ranks: int = 2, n: int = 256, nt: int | None = None, strategy: str = "overlap", every: int = 1,
                check: bool = False, trace: bool = True, backend: str | None = None, timeout: float = 300,
                mpiexec_args: Sequence[str] = ()) -> HaloResult:
    """Run ``mpiexec -n ranks python -m course_helper halo ...`` and return a :class:`HaloResult`.

    The ranks run in their own processes (as they would on several GPUs); this
    process only waits for them and reads back what rank 0 wrote. ``backend``
    defaults to :func:`ranks_backend` (the GPU only with one GPU per rank).
    ``mpiexec_args`` is a list of extra arguments for ``mpiexec`` (e.g.
    ``["-bind-to", "core"]``; split a command-line string with ``shlex.split``).
    Every argument is checked before ``mpiexec`` starts. An interrupt (Ctrl-C,
    a notebook's stop button) or ``timeout`` (seconds) stops every rank before
    this function raises.
    """
    ranks = checks.positive_int("ranks", ranks)
    checks.one_of("strategy", strategy, tuple(STRATEGIES))
    problem = WaveProblem(n0=n, n1=n, nt=nt)         # the ranks' checks, made here first
    every = check_job(problem, ranks, every)
    check, trace = checks.flag("check", check), checks.flag("trace", trace)
    timeout = checks.positive_float("timeout (s)", timeout)
    if isinstance(mpiexec_args, (str, bytes)):
        raise TypeError(f"mpiexec_args must be a list of arguments, e.g. ['-bind-to', 'core'], not the string "
                        f"{mpiexec_args!r}; split a command line with shlex.split")
    mpiexec_args = list(mpiexec_args)
    if not all(isinstance(a, str) for a in mpiexec_args):
        raise TypeError(f"mpiexec_args must hold strings, got {mpiexec_args!r}")
    backend = checks.one_of("backend", backend, CHOICES) if backend else ranks_backend(ranks)
    with tempfile.TemporaryDirectory(prefix="halo-") as out:
        cmd = [find_mpiexec(), *mpiexec_args, "-n", str(ranks), sys.executable, "-m", "course_helper", "halo",
               "--n", str(n), "--nt", str(problem.nt), "--strategy", strategy, "--every", str(every),
               "--out", out]
        if check:
            cmd.append("--check")
        if trace:
            cmd.append("--trace")
        returncode, stderr = _run_ranks(cmd, timeout, ranks_env(backend))
        summary = pathlib.Path(out) / "summary.json"
        doc = json.loads(summary.read_text()) if summary.exists() else None
        # Exit status 1 with a summary that reports a difference is the check's verdict; any
        # other failure (a rank's error, a crash) is the ranks failing.
        if doc is None or returncode not in (0, 1) or (returncode == 1 and doc.get("identical") is not False):
            raise RuntimeError(f"the ranks failed (exit {returncode}):\n{stderr.strip()[-2000:]}")
        return HaloResult(out, doc)


def _run_ranks(cmd, timeout, env):
    """Run ``mpiexec`` and return its exit status and stderr. On an interrupt or a timeout,
    stop it and every rank before raising: MPICH's mpiexec passes a first Ctrl-C on to the
    ranks (each aborts the job) and force-kills them on a second; killing mpiexec ends its
    proxies, which end the ranks."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)     # a terminal's Ctrl-C reaches this process only
    try:
        _, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stderr
    except BaseException as exc:
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            proc.kill()
            proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise TimeoutError(f"the ranks ran longer than timeout={timeout:g} s and were stopped; "
                               "give a larger timeout, or a smaller n or nt") from None
        raise
