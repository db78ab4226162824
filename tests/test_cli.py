import argparse
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import course_helper as ch
from course_helper import cli
from course_helper.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_compare_end_to_end_on_the_cpu_backend(tmp_path, capsys):
    out = tmp_path / "results"
    code = main(["compare", "--n", "40", "--nt", "30", "--repeats", "2", "--backend", "cpu",
                 "--out", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "identical images" in text
    for s in ("sequential", "streams", "events"):
        assert s in text
        doc = json.loads((out / f"trace_{s}.json").read_text())
        assert any(e["ph"] == "X" for e in doc["traceEvents"])
        assert (out / f"timeline_{s}.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "timeline_levels.png").read_bytes()[:4] == b"\x89PNG"     # every strategy, one time axis
    assert "levels 15 to 19 of each strategy" in text
    assert not [f for f in os.listdir(out) if f.endswith(".partial")]


def test_module_entry_point_and_progress_bar(tmp_path):
    p = subprocess.run([sys.executable, "-m", "course_helper", "compare", "--n", "32", "--nt", "20",
                        "--repeats", "1", "--strategies", "events", "--backend", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "sequential" in p.stdout and "events" in p.stdout and "streams" not in p.stdout
    # both streams into one file, as `> log 2>&1` does: the bar's last frame ends its line, and the
    # table's header starts a line of its own
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "-m", "course_helper", "compare", "--n", "32", "--nt", "20",
                            "--repeats", "1", "--strategies", "events", "--backend", "cpu"],
                           stdout=f, stderr=subprocess.STDOUT, timeout=300)
    assert p.returncode == 0
    lines = log.read_text().splitlines()
    header = next(line for line in lines if "median ms" in line)
    assert header.split()[0] == "strategy", header
    assert any("runs:" in line and "100%" in line for line in lines), "the bar's last frame is kept in a file"


@pytest.mark.parametrize("args,msg", [
    (["--strategies", "warp-drive"], "unknown strategy"),
    (["--repeats", "0"], "repeats must be at least 1"),
    (["--n", "3"], "padding"),
    (["--every", "0"], "every must be at least 1"),
])
def test_bad_arguments_exit_2_with_a_message(args, msg, capsys):
    code = main(["compare", "--backend", "cpu", "--no-progress", "--nt", "20", *args])
    assert code == 2
    assert msg in capsys.readouterr().err


def test_unwritable_output_folder_is_refused_before_running(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code = main(["compare", "--backend", "cpu", "--no-progress", "--n", "32", "--nt", "20",
                 "--out", str(blocker / "sub")])
    assert code == 2
    err = capsys.readouterr().err
    assert str(blocker / "sub") in err and "--out" in err and "Errno" not in err


@pytest.mark.parametrize("command", ["compare", "bench"])
def test_out_naming_a_file_is_refused_by_name(tmp_path, capsys, command):
    blocker = tmp_path / "results.txt"
    blocker.write_text("keep me")
    code = main([command, "--backend", "cpu", "--no-progress", "--out", str(blocker)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--out {blocker} is a file, not a folder" in err and "Errno" not in err
    assert blocker.read_text() == "keep me"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) for a real full disk")
def test_full_disk_names_the_file_and_what_to_do(tmp_path, capsys, monkeypatch):
    import types

    from course_helper.timelines import timeline

    def dump_onto_a_full_disk(doc, f):
        with open("/dev/full", "w") as full:      # every write there fails with ENOSPC
            json.dump(doc, full)

    monkeypatch.setattr(timeline, "json", types.SimpleNamespace(dump=dump_onto_a_full_disk))
    out = tmp_path / "results"
    code = main(["compare", "--backend", "cpu", "--no-progress", "--n", "32", "--nt", "20",
                 "--repeats", "1", "--strategies", "events", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot write {out / 'trace_'}" in err           # names the trace file it was writing
    assert "No space left on device" in err and "free some space" in err
    assert not [f for f in os.listdir(out) if f.endswith(".partial")]


def test_written_files_are_readable_by_others_under_umask_022(tmp_path):
    previous = os.umask(0o022)
    try:
        code = main(["compare", "--backend", "cpu", "--no-progress", "--n", "32", "--nt", "20",
                     "--repeats", "1", "--strategies", "events", "--out", str(tmp_path)])
    finally:
        os.umask(previous)
    assert code == 0
    written = sorted(os.listdir(tmp_path))
    assert written and all(os.stat(tmp_path / f).st_mode & 0o777 == 0o644 for f in written), written


def test_subcommand_help_describes_strategies_and_columns(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = capsys.readouterr().out
    for name in ch.STRATEGIES:
        assert f"\n  {name} " in text, f"compare --help does not list {name}"
    assert "hidden = " in text and "max diff = " in text
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench_text = capsys.readouterr().out
    assert "efficiency = B / median time" in bench_text
    # no paragraph runs on as one long line, whatever formatter keeps the tables
    for line in (text + bench_text).splitlines():
        assert len(line) <= 100, f"a help line of {len(line)} characters: {line[:60]}..."


def _strategy_entries():
    """``{strategy: its description}`` from --help's table, whose long entries wrap onto indented lines."""
    entries = {}
    for line in cli._strategies_text().splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("   "):
            name, what = line.split(None, 1)
            entries[name] = what
        else:
            entries[name] += " " + line.strip()
    return entries


def test_each_strategy_is_described_in_whole_sentences(monkeypatch):
    """A strategy's line in --help is its ``help`` or, for a strategy without one, the whole
    first sentence of its loop's docstring, however many lines that sentence takes."""
    for name, what in _strategy_entries().items():
        assert what == ch.STRATEGIES[name].help, f"{name}: {what!r}"
    for name, entry in ch.STRATEGIES.items():
        monkeypatch.setitem(ch.STRATEGIES, name, dataclasses.replace(entry, help=""))
    lines = _strategy_entries()
    assert set(lines) == set(ch.STRATEGIES)
    docstring = " ".join(ch.strategies.sequential_pinned.__doc__.split())
    assert "\n" in ch.strategies.sequential_pinned.__doc__.strip()      # a sentence over two lines
    assert lines["sequential-pinned"] == docstring.split(". ")[0] and docstring.startswith(lines["sequential-pinned"])
    assert all(what.endswith(".") for what in lines.values()), lines


def _commands():
    """Every subcommand's parser, by name."""
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_option_of_every_command_says_what_it_does(command):
    parser = _commands()[command]
    silent = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not silent, f"{command} --help has no text for {silent}"
    assert parser.description, f"{command} --help says nothing about the command"


def test_run_prints_the_backend_banner_on_a_line_of_its_own(tmp_path):
    """The backend's line comes before the progress bar starts, not written onto the bar's line
    (stdout and stderr land in one terminal; here in one pipe, unbuffered)."""
    env = dict(os.environ, COURSE_HELPER_BACKEND="cpu", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "course_helper", "run", "--store", str(tmp_path / "s.zarr"),
                        "--n", "32", "--nt", "20"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout
    assert re.search(r"(?:^|\n)course_helper: CPU backend", p.stdout), p.stdout
    assert "levels to disk" in p.stdout                       # the bar did run


def test_compare_table_explains_its_columns(cpu, capsys):
    assert main(["compare", "--n", "24", "--nt", "12", "--repeats", "1", "--no-progress", "--backend", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[3:7]]
    assert rows == list(cli.LADDER) == ["sequential", "sequential-pinned", "streams", "events"], out
    assert "hidden" in out.split("\n", 2)[1] and "hidden = overlap / the shorter of the two" in out
    assert "max diff = largest absolute difference" in out


def test_ctrl_c_ends_the_command_line_with_one_line_and_status_130(tmp_path):
    """A Ctrl-C is the user's own doing: one line saying so (and what the store keeps), exit
    status 130 as a shell reports it, no traceback."""
    import signal
    import time
    store = tmp_path / "s.zarr"
    env = dict(os.environ, COURSE_HELPER_BACKEND="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen([sys.executable, "-m", "course_helper", "run", "--store", str(store), "--n", "96",
                              "--nt", "100000", "--no-progress"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(store.glob("u/c.*")) and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("course_helper: ")]
    assert len(lines) == 1 and lines[0].startswith("interrupted (Ctrl-C)"), err[-3000:]
    assert "Traceback" not in err and f"complete and flagged in 'complete' of the store {store}" in lines[0]


def test_bench_with_an_unsafe_ring_depth_says_what_the_benchmark_takes(capsys):
    assert main(["bench", "--backend", "cpu", "--points", "64x40x1", "--nscratch", "3", "--strategies", "events",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "use ring depths of at least 4" in err and "unsafe=True" not in err


def test_bench_fails_when_every_point_was_skipped(monkeypatch, capsys):
    monkeypatch.setattr(ch.checks, "host_memory_available", lambda: 10_000)
    assert main(["bench", "--backend", "cpu", "--compute", "--points", "64x40x1", "--repeats", "1",
                 "--strategies", "events", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "skipped 64^2x40" in err and "every point was skipped" in err


@pytest.mark.parametrize("args, says", [(["--n", "20"], "8 ranks cannot share 16 interior rows"),
                                        (["--n", "64", "--nt", "10", "--every", "50"], "every=50 is not below nt=10")])
def test_a_halo_job_no_rank_can_run_is_refused_once_on_a_line_of_its_own(args, says):
    pytest.importorskip("mpi4py", reason="python -m pip install -e '.[distributed]' brings mpi4py and MPICH")
    from course_helper.distributed.launch import find_mpiexec, ranks_env
    p = subprocess.run([find_mpiexec(), "-n", "8", sys.executable, "-m", "course_helper", "halo", *args],
                       capture_output=True, text=True, timeout=240, env=ranks_env("cpu"))
    assert p.returncode == 2, p.stdout + p.stderr
    errors = _course_error_lines(p.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: ") and says in errors[0], p.stderr
    assert errors[0].count("error") == 1


def _course_error_lines(stderr):
    """The lines of a halo job's stderr that come from the course's ranks: an ``error...`` line (the
    course's own, or a rank's "error on rank N"), a traceback, or a rank's MPI_Abort (MPICH's
    "application called MPI_Abort", Open MPI's "MPI_ABORT was invoked"). The launcher's own notice
    that the job ended with a non-zero status (Open MPI prints a framed block of it, MPICH nothing)
    is not the course's, and which launcher runs the job is not the test's business."""
    return [line for line in stderr.splitlines()
            if line.startswith(("error", "Traceback")) or "mpi_abort" in line.lower()]


# Open MPI 4.1's mpiexec after one rank returned 2 (the other ranks returned 2 as well).
_OPEN_MPI_NOTICE = """\
-------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
-------------------------------------------------------
--------------------------------------------------------------------------
mpiexec detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[41226,1],0]
  Exit code:    2
--------------------------------------------------------------------------
"""


def test_a_job_s_error_lines_are_the_course_s_whichever_mpiexec_frames_them():
    said = "error: 8 ranks cannot share 16 interior rows\n"
    assert _course_error_lines(said + _OPEN_MPI_NOTICE) == [said.strip()]      # Open MPI
    assert _course_error_lines(said) == [said.strip()]                          # MPICH: nothing added
    # what the refusal must not look like: a rank's error, a traceback, an MPI_Abort, a second line
    for extra in ("error on rank 3: ValueError: no; stopping every rank", "Traceback (most recent call last):",
                  "application called MPI_Abort(MPI_COMM_WORLD, 2) - process 0",
                  "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD", said.strip()):
        assert len(_course_error_lines(said + _OPEN_MPI_NOTICE + extra + "\n")) == 2, extra


def test_a_bad_mpiexec_setting_is_named(monkeypatch, tmp_path):
    from course_helper.distributed.launch import find_mpiexec
    for bad in ("no-such-mpiexec", str(tmp_path)):          # a name found nowhere, a folder
        monkeypatch.setenv("COURSE_HELPER_MPIEXEC", bad)
        with pytest.raises(FileNotFoundError, match=rf"\$COURSE_HELPER_MPIEXEC='{bad}' is not an mpiexec"):
            find_mpiexec()
        with pytest.raises(FileNotFoundError, match="COURSE_HELPER_MPIEXEC"):
            ch.distributed.launch_halo(2, n=32, nt=10)
