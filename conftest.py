"""Session-wide test settings for the whole course (unit tests, browser test, notebooks)."""
import collections
import importlib.util
import os

import pytest

#: The most memory a notebook's kernel may reach on the CPU backend (the README's promise):
#: $COURSE_NOTEBOOK_MEMORY_MIB, or 2 GiB.
NOTEBOOK_MEMORY_MIB = float(os.environ.get("COURSE_NOTEBOOK_MEMORY_MIB", 2048))

#: The most workers the suite starts by itself (see pytest_cmdline_main): more would mostly share
#: one GPU, and each runs a notebook's kernel of up to NOTEBOOK_MEMORY_MIB beside its own process.
MAX_WORKERS = 4
#: The name under which a notebook's peak memory travels in its last cell's report
#: (``report.user_properties``: from an xdist worker to the process that prints the summary).
PEAK_PROPERTY = "course_notebook_peak_mib"

#: The test files that ran longest (on a shared 2-core machine, one folder at a time): workers
#: start them right after the notebooks, so that the run does not end with one worker still in one
#: of them while the others wait. Only the order: a file not named here runs all the same, later.
LONGEST_FILES = ("tests/disk/test_store.py", "tests/distributed/test_halo.py", "tests/exercises/test_exercise.py",
                 "tests/exercises/test_capstone.py", "tests/e2e/test_jupyterlab_widget.py", "tests/e2e/test_site.py",
                 "tests/distributed/test_halo_sanitize.py", "tests/test_failure_modes.py")

_last_cells = {}          # notebook (nbval's file item) -> its last cell collected
_peaks = {}               # notebook path -> its kernel's peak resident memory, MiB


def default_workers(cpus=None, gpu=None):
    """How many workers the suite runs on when the command line does not say: one more than the
    CPUs this process may use, at most :data:`MAX_WORKERS` (the browser tests and the notebooks
    spend much of their time waiting for a browser, a Jupyter server or a kernel: on 2 cores, a
    third worker keeps both busy meanwhile); 0 (no worker: the tests run in this process)
    where the CPUs are one, and where the GPU backend runs (``gpu``; by default: unless the CPU
    backend is asked for or CuPy is missing), because tests and notebooks that time the GPU
    (notebook 3's check of pinned copies' speed-up, the overlap a timeline shows) would share it
    and time each other. ``$COURSE_TEST_WORKERS`` sets another number."""
    if os.environ.get("COURSE_TEST_WORKERS"):
        return int(os.environ["COURSE_TEST_WORKERS"])
    if gpu if gpu is not None else not _cpu_backend():
        return 0
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cpus + 1, MAX_WORKERS) if cpus > 1 else 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Spread the tests over parallel workers (pytest-xdist, in the test extra), each notebook and
    each test file whole in one worker (``--dist loadfile``: nbval runs a notebook's cells in order
    in one kernel, and a file's tests share its module's set-up). ``-n N`` sets the number
    (``-n 0``: none, everything in this process); without pytest-xdist the tests run in this
    process as before. A debugger (--pdb) or --collect-only keeps them here too."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.option.numprocesses is None and not (config.option.usepdb or config.option.collectonly):
        config.option.numprocesses = default_workers()
    if config.option.numprocesses and config.option.dist == "no":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False      # files in the order below, not by their number of tests


def pytest_collection_modifyitems(config, items):
    for item in items:
        if hasattr(item.parent, "kernel"):                  # a cell of a notebook run by nbval
            _last_cells[item.parent] = item
    if hasattr(config, "workerinput"):
        # Workers take whole files in this order: the notebooks, the longest, first, then
        # LONGEST_FILES, so that the run does not end waiting on one of them while the other
        # workers are idle. (Every worker sorts its collection the same way: they must agree.)
        items.sort(key=lambda item: _start_order(item.nodeid.split("::", 1)[0], hasattr(item.parent, "kernel")))


def _start_order(path, notebook):
    """Where a file's tests come in the workers' queue (lower first); files of equal rank keep
    their collection order (the sort is stable)."""
    if notebook:
        return 0
    return 1 + LONGEST_FILES.index(path) if path in LONGEST_FILES else 1 + len(LONGEST_FILES)


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
    report = outcome.get_result()
    report.user_properties.append((PEAK_PROPERTY, (item.parent.nodeid, peak)))
    if _cpu_backend() and peak > NOTEBOOK_MEMORY_MIB and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.parent.nodeid} took {peak:,.0f} MiB of memory at its peak on the CPU backend, "
                           f"more than the {NOTEBOOK_MEMORY_MIB:,.0f} MiB a learner's machine is promised "
                           "(README, Quick start): keep runs that are only timed inside ch.timing_only(), and "
                           "drop large results once they are used")


def pytest_runtest_logreport(report):
    """Keep each notebook's peak memory for the summary, from the report of its last cell (made
    here, or by an xdist worker and sent here)."""
    for name, value in report.user_properties:
        if name == PEAK_PROPERTY:
            notebook, peak = value
            _peaks[notebook] = peak


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
        for name, peak in sorted(_peaks.items()):
            terminalreporter.line(f"{peak:7,.0f} MiB  {name}")
