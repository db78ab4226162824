"""Session-wide test settings for the whole course (unit tests, browser test, notebooks)."""
import collections
import importlib.util
import os

import pytest

#: The most memory a notebook's kernel may reach on the CPU backend (the README's promise):
#: $COURSE_NOTEBOOK_MEMORY_MIB, or 2 GiB.
NOTEBOOK_MEMORY_MIB = float(os.environ.get("COURSE_NOTEBOOK_MEMORY_MIB", 2048))

_last_cells = {}          # notebook (nbval's file item) -> its last cell collected
_peaks = {}               # notebook path -> its kernel's peak resident memory, MiB


def pytest_collection_modifyitems(items):
    for item in items:
        if hasattr(item.parent, "kernel"):                  # a cell of a notebook run by nbval
            _last_cells[item.parent] = item


def _cpu_backend():
    """Whether the notebooks' kernels run on the CPU backend (they inherit this environment):
    asked for, or chosen because CuPy is not installed. Decided without importing the course
    here, so that the test process never opens a GPU of its own."""
    asked = os.environ.get("COURSE_HELPER_BACKEND", "auto")
    return asked == "cpu" or (asked == "auto" and importlib.util.find_spec("cupy") is None)


def _kernel_peak_mib(notebook):
    """The peak resident memory (VmHWM) of the kernel running ``notebook``, in MiB; None where
    the system does not say (not Linux) or the kernel has gone."""
    try:
        pid = notebook.kernel.km.provisioner.pid
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (AttributeError, OSError, StopIteration, ValueError):
        return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After a notebook's last cell, read its kernel's peak memory (before nbval stops the
    kernel); on the CPU backend a notebook that went over :data:`NOTEBOOK_MEMORY_MIB` fails
    there, saying how much it took."""
    outcome = yield
    if call.when != "call" or _last_cells.get(item.parent) is not item:
        return
    peak = _kernel_peak_mib(item.parent)
    if peak is None:
        return
    _peaks[item.parent.nodeid] = peak
    report = outcome.get_result()
    if _cpu_backend() and peak > NOTEBOOK_MEMORY_MIB and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.parent.nodeid} took {peak:,.0f} MiB of memory at its peak on the CPU backend, "
                           f"more than the {NOTEBOOK_MEMORY_MIB:,.0f} MiB a learner's machine is promised "
                           "(README, Quick start): keep runs that are only timed inside ch.timing_only(), and "
                           "drop large results once they are used")


def pytest_terminal_summary(terminalreporter):
    """List the skipped tests' reasons with a count each, so that "175  no working CUDA GPU
    here" stands out instead of one line per test; and each notebook's peak memory."""
    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skipped tests, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.line(f"{count:5d}  {reason}")
    if _peaks:
        held = (f"each at most {NOTEBOOK_MEMORY_MIB:,.0f} MiB on the CPU backend" if _cpu_backend()
                else "not held to a limit: the kernels ran on the GPU backend")
        terminalreporter.section(f"peak memory of each notebook's kernel ({held})")
        for name, peak in _peaks.items():
            terminalreporter.line(f"{peak:7,.0f} MiB  {name}")
