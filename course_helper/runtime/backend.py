"""Which backend runs the course: a CUDA GPU through CuPy, or NumPy on the CPU.

The choice is made once, on first use:

* ``COURSE_HELPER_BACKEND=auto`` (the default) takes the GPU when CuPy imports
  **and** a tiny real kernel compiles and runs on a device; anything else (no
  CuPy, no device, a driver without NVRTC...) falls back to the CPU backend;
* ``COURSE_HELPER_BACKEND=gpu`` insists on the GPU and raises
  :class:`BackendUnavailable` saying why when it cannot have it;
* ``COURSE_HELPER_BACKEND=cpu`` always uses NumPy.

On the CPU backend the work runs in NumPy on a *modelled* GPU (see
:mod:`course_helper.runtime.model`): results are the GPU's, times are modelled on a
device profile (``COURSE_HELPER_PROFILE``, default the H200).

:func:`set_backend` switches in the same process (the tests use it).
"""
from __future__ import annotations

import os
import platform
import sys
import threading
from types import ModuleType
from typing import TextIO

import numpy as np

from .. import checks
from . import profiles

ENV_VAR = "COURSE_HELPER_BACKEND"
CHOICES = ("auto", "gpu", "cpu")

__all__ = ["BackendUnavailable", "backend_name", "set_backend", "gpu_available", "profile_name",
           "device_report", "print_device_report", "CHOICES", "request", "requested", "may_use_gpu",
           "reason", "environment_for"]


class BackendUnavailable(RuntimeError):
    """The GPU backend was asked for but cannot run here."""


class _State:
    name = None          # "gpu" or "cpu" once chosen
    reason = ""          # why that backend, in words
    announced = False
    probe = None         # (ok: bool, why: str), cached
    profile = None       # the CPU backend's device profile (name or path); None: env or default
    requested = None     # a backend asked for in code (request) before the choice; None: the environment's
    generation = 0       # incremented by every set_backend (lets callers cache what depends on the choice)
    lock = threading.RLock()


_state = _State()

_PROBE_SOURCE = r"""
extern "C" __global__ void course_helper_probe(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 2.0f * x[i] + 1.0f;
}
"""


def _probe_gpu():
    """Try CuPy for real: import it, find a device, compile and run a kernel."""
    if _state.probe is not None:
        return _state.probe
    try:
        import cupy
    except ImportError:
        _state.probe = (False, "CuPy is not installed")
        return _state.probe
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install: the GPU is unavailable, and why
        _state.probe = (False, f"CuPy could not be imported ({type(exc).__name__}: {exc})")
        return _state.probe
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - whatever the driver raises, there is no usable device
        _state.probe = (False, f"no CUDA device found ({exc})")
        return _state.probe
    if count < 1:
        _state.probe = (False, "no CUDA device found")
        return _state.probe
    try:
        kernel = cupy.RawKernel(_PROBE_SOURCE, "course_helper_probe")
        x = cupy.arange(8, dtype=cupy.float32)
        kernel((1,), (32,), (x, np.int32(8)))
        got = cupy.asnumpy(x)
        if not np.array_equal(got, 2 * np.arange(8, dtype=np.float32) + 1):
            raise RuntimeError(f"probe kernel returned wrong values {got}")
    except Exception as exc:  # noqa: BLE001 - any failure of the probe means the GPU cannot run
        _state.probe = (False, f"the probe kernel failed to run ({type(exc).__name__}: {exc})")
        return _state.probe
    _state.probe = (True, "CuPy ran a probe kernel on the device")
    return _state.probe


def gpu_available() -> bool:
    """True when CuPy can compile and run a kernel on a CUDA device here."""
    return _probe_gpu()[0]


def _choose(requested, from_env=True):
    """The backend to use and why, for a request read from the environment (``from_env``) or made
    in code (:func:`set_backend`, a command's ``--backend``): an error names where the request
    came from, so that it never blames a variable nobody set."""
    requested = (requested or "auto").strip().lower()
    if requested not in CHOICES:
        asked = f"{ENV_VAR}={requested!r}" if from_env else repr(requested)
        raise ValueError(
            f"{asked} is not a backend; use one of {', '.join(CHOICES)} "
            "(auto picks the GPU when one works, else the CPU)")
    if requested == "cpu":
        return "cpu", f"{ENV_VAR}=cpu" if from_env and os.environ.get(ENV_VAR) else "asked for the CPU"
    ok, why = _probe_gpu()
    if ok:
        return "gpu", why
    if requested == "gpu":
        remedy = (f"Unset {ENV_VAR} (or set it to auto or cpu) to use the CPU backend." if from_env else
                  "Ask for 'auto' or 'cpu' instead (set_backend('auto'), or --backend auto on the command line) "
                  "to use the CPU backend.")
        raise BackendUnavailable(f"the GPU backend was requested but cannot run here: {why}. {remedy}")
    return "cpu", why


def _announce():
    if _state.announced:
        return
    _state.announced = True
    if _state.name == "gpu":
        print(f"course_helper: GPU backend on {gpu_name()} ({_state.reason})")
    else:
        device = profiles.load(profile_name())["device"]["name"]
        print(f"course_helper: CPU backend ({_state.reason}) - results are identical, "
              f"times are modelled on {device} (profile {profiles.printable(profile_name())})")


def backend_name() -> str:
    """The active backend, ``"gpu"`` or ``"cpu"``; chooses it on first call.

    The first call prints one line saying which backend is active and why. The name is for
    display: to decide what to do, ask the runtime what it can do
    (:attr:`~course_helper.runtime.base.Runtime.predicts_times`, ``runs_cuda``...).
    """
    with _state.lock:
        if _state.name is None:
            if _state.requested is not None:
                _state.name, _state.reason = _choose(_state.requested, from_env=False)
            else:
                _state.name, _state.reason = _choose(os.environ.get(ENV_VAR))
        _announce()
        return _state.name


def requested() -> str:
    """The backend asked for, one of :data:`CHOICES`, without choosing one (nothing is probed):
    the active one once chosen, else what :func:`request` asked for, else
    ``$COURSE_HELPER_BACKEND``, else ``"auto"``. What a command passes on when it switches the
    profile only (``set_backend(requested(), profile=...)``)."""
    with _state.lock:
        if _state.name is not None:
            return _state.name
        if _state.requested is not None:
            return _state.requested
        return (os.environ.get(ENV_VAR) or "auto").strip().lower()


def request(name: str) -> None:
    """Ask for the backend ``name`` (one of :data:`CHOICES`) without choosing it yet: the choice
    is made on first use, as for ``$COURSE_HELPER_BACKEND``, which the request overrides. For a
    process that must pick its GPU before any CUDA call (an MPI rank: see
    :class:`course_helper.distributed.link.Team`); once a backend is chosen this switches it,
    as :func:`set_backend` does."""
    if not isinstance(name, str) or name.strip().lower() not in CHOICES:
        raise ValueError(f"{name!r} is not a backend; use one of {', '.join(CHOICES)}")
    with _state.lock:
        if _state.name is not None:
            set_backend(name)
        else:
            _state.requested = name.strip().lower()


def may_use_gpu() -> bool:
    """Whether the backend asked for can turn out to be the GPU, answered without choosing it (the
    choice runs a probe kernel on the current device): False once the CPU is chosen or asked for
    (:func:`set_backend`, :func:`request`, ``$COURSE_HELPER_BACKEND=cpu``)."""
    return requested() != "cpu"


def reason() -> str:
    """Why the active backend was chosen, in words (e.g. ``"asked for the CPU"``); chooses it on
    first call."""
    backend_name()
    return _state.reason


def environment_for(name: str) -> dict[str, str]:
    """The environment variables that make a process started from this one choose the backend
    ``name`` (one of :data:`CHOICES`)."""
    if name not in CHOICES:
        raise ValueError(f"{name!r} is not a backend; use one of {', '.join(CHOICES)}")
    return {ENV_VAR: name}


def set_backend(name: str, profile: str | None = None) -> str:
    """Switch the backend for the rest of the process (``"auto"``, ``"gpu"`` or ``"cpu"``).

    ``profile`` picks the device profile the CPU backend models (a shipped
    name such as ``"h200"`` or the path of a calibrated JSON file); None
    keeps ``$COURSE_HELPER_PROFILE`` or the default H200.

    Streams, events and arrays made before the switch belong to the old
    backend; make new ones after switching. Returns the active backend name.
    """
    if not isinstance(name, str):
        raise TypeError(f"set_backend takes a string, one of {CHOICES}, not {type(name).__name__}")
    if profile is not None:
        if not isinstance(profile, str):
            raise TypeError(f"profile must be a profile name or path, not {type(profile).__name__}")
        profiles.load(profile)              # a bad profile is refused before anything changes
    with _state.lock:
        chosen, reason = _choose(name, from_env=False)      # raises before changing anything
        if chosen != _state.name or profile != _state.profile:
            _state.announced = False
        _state.name, _state.reason, _state.profile = chosen, reason, profile
        _state.generation += 1
        _announce()
        return chosen


def generation() -> int:
    """A number that changes whenever :func:`set_backend` is called."""
    return _state.generation


def profile_name() -> str:
    """The device profile the CPU backend models (a name or a path)."""
    return _state.profile or os.environ.get(profiles.ENV_VAR) or profiles.DEFAULT


def cupy_module() -> ModuleType:
    """CuPy, imported (only call on the GPU backend)."""
    import cupy
    return cupy


def gpu_name() -> str:
    """The current CUDA device's name, e.g. ``"NVIDIA H200"`` (only call on the GPU backend).
    CUDA hands it over as bytes, as a C string."""
    cupy = cupy_module()
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


# --------------------------------------------------------------------------
# Device report
# --------------------------------------------------------------------------
_NA = "n/a (CPU backend)"


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_report(print_it: bool = False) -> dict:
    """What a learner needs to reason about overlap on this machine.

    Returns a dict with ``backend``, ``device``, ``memory_gib``,
    ``multiprocessors``, ``compute_capability``, ``async_engine_count`` (how
    many copies can run beside a kernel), ``concurrent_kernels``,
    ``runtime_version``, ``driver_version``, ``times`` (measured on the GPU,
    or modelled on which profiled GPU on the CPU backend), ``cpu``, ``cores``
    and ``numpy``. GPU-only fields read ``"n/a (CPU backend)"`` on
    the CPU. With ``print_it=True`` it also prints the report as a table.
    """
    print_it = checks.flag("print_it", print_it)
    report = {"backend": backend_name(), "python": platform.python_version(),
              "numpy": np.__version__}
    if report["backend"] == "gpu":
        cupy = cupy_module()
        rt = cupy.cuda.runtime
        dev = cupy.cuda.Device().id
        props = rt.getDeviceProperties(dev)
        report.update(
            device=gpu_name(),
            memory_gib=round(props["totalGlobalMem"] / 2**30, 1),
            multiprocessors=int(props["multiProcessorCount"]),
            compute_capability=f"{props['major']}.{props['minor']}",
            async_engine_count=int(props["asyncEngineCount"]),
            concurrent_kernels=bool(props["concurrentKernels"]),
            runtime_version=_cuda_version(rt.runtimeGetVersion()),
            driver_version=_cuda_version(rt.driverGetVersion()),
            cupy=cupy.__version__, cpu=_cpu_model(), cores=os.cpu_count())
        report["times"] = f"measured on {report['device']}"
    else:
        profile = profiles.load(profile_name())
        report.update(
            device=f"CPU: {_cpu_model()}", memory_gib=_NA, multiprocessors=_NA,
            compute_capability=_NA, async_engine_count=_NA, concurrent_kernels=_NA,
            runtime_version=_NA, driver_version=_NA, cupy=_NA,
            cpu=_cpu_model(), cores=os.cpu_count())
        report["times"] = f"modelled on {profile['device']['name']} (profile {profiles.printable(profile_name())})"
    if print_it:
        print_device_report(report)
    return report


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def print_device_report(report: dict | None = None, file: TextIO | None = None) -> None:
    """Print :func:`device_report` as a two-column table."""
    report = device_report() if report is None else report
    width = max(len(k) for k in report)
    for key, value in report.items():
        print(f"{key:<{width}}  {value}", file=file or sys.stdout)
