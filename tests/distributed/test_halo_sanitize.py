"""The halo loops under the race sanitizer: the correct loops are clean on 2 and 3 ranks, and
removing any one wait or record from them is reported.

Each rank's program is checked by its own sanitizer (as each rank is its own process). The
mutants run in this process, one rank at a time, on the CPU backend in times-only mode: the
sanitizer reasons about what is queued, so no data and no MPI message needs to move. The clean
loops also run for real, under mpiexec, with the halos moved by MPI."""
import __future__
import ast
import dataclasses
import inspect
import subprocess
import sys
import textwrap

import pytest

import course_helper as ch
from course_helper import distributed, runtime
from course_helper.distributed.launch import ranks_env
from course_helper.distributed.rank import RankRun

RANKS = (2, 3)
PROBLEM = dict(n0=40, n1=24, nt=16)     # 16 levels: the ring of 5 buffers wraps twice
ORDERING_CALLS = ("wait_event", "record", "join")


class _Comm:
    """The part of an MPI communicator a rank's loop touches, for one rank of a team that runs
    in this process (no message is sent in times-only mode)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Barrier(self):
        pass


class _Team:
    def __init__(self, rank, size):
        self.comm, self.rank, self.size = _Comm(rank, size), rank, size
        self.nccl, self.backend, self.device = None, "cpu", "CPU"


def _run_every_rank(size, strategy, every=1):
    """Run each rank of a ``size``-rank team under a sanitizer of its own; the errors that caught a
    missing order: the RaceErrors raised, and, in a captured step, the capture's refusal of a wait on
    an event recorded outside it (what a missing wait turns the next wait into, as CUDA refuses it)."""
    races = []
    for rank in range(size):
        with runtime.get().times_only():
            try:
                with ch.sanitize():
                    distributed.run_rank(_Team(rank, size), ch.WaveProblem(**PROBLEM), strategy, every=every)
            except (ch.RaceError, ch.graphs.UncapturedDependency) as err:
                races.append(err)
    return races


#: The functions that order a halo step's work: the two steps, the save of a level, the wait for
#: a buffer's copy, the link.
STEPS = ("blocking", "overlap")
ORDERED = {"blocking": distributed.blocking_step, "overlap": distributed.overlap_step, "save": RankRun.save,
           "wait_until_copied": RankRun.wait_until_copied, "exchange": distributed.HaloLink.exchange,
           "join": distributed.HaloLink.join}
#: Ordering calls a strategy never reaches: the overlap step computes the edge rows on the halo
#: stream itself, so its exchange has no other stream's event to wait for.
UNREACHED = {("overlap", "HaloLink.exchange without `self.stream.wait_event(after)`")}


def _mutants(fn):
    """``(description, function)`` for every variant of ``fn`` with one ordering call (a
    ``wait_event``, a ``record`` or a link's ``join`` as a statement) replaced by ``pass``."""
    source = textwrap.dedent(inspect.getsource(fn))
    calls = [node for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
             and getattr(node.value.func, "attr", None) in ORDERING_CALLS]
    out = []
    for call in calls:
        lineno = call.lineno
        tree = ast.parse(source)

        class Drop(ast.NodeTransformer):
            def visit_Expr(self, node):
                return ast.copy_location(ast.Pass(), node) if node.lineno == lineno else node

        tree = ast.fix_missing_locations(Drop().visit(tree))
        namespace = dict(vars(inspect.getmodule(fn)))    # the globals of fn's own module
        # compiled as its module is (with postponed annotations: the hints name types it imports only for checkers)
        exec(compile(tree, inspect.getsourcefile(fn), "exec", flags=__future__.annotations.compiler_flag), namespace)
        out.append((f"{fn.__qualname__} without `{ast.unparse(call)}`", namespace[fn.__name__]))
    return out


def _patch(monkeypatch, where, fn):
    if where in STEPS:                                  # every strategy that runs this step
        for name, entry in distributed.STRATEGIES.items():
            if entry.step is ORDERED[where]:
                monkeypatch.setitem(distributed.STRATEGIES, name, dataclasses.replace(entry, step=fn))
    else:
        owner = RankRun if ORDERED[where].__qualname__.startswith("RankRun.") else distributed.HaloLink
        monkeypatch.setattr(owner, where, fn)


#: (strategy, what is patched, description, mutant): each strategy with every mutant that concerns it.
MUTANTS = [(strategy, where, what, fn)
           for where, original in ORDERED.items() for what, fn in _mutants(original)
           for strategy, entry in distributed.STRATEGIES.items() if where not in STEPS or entry.step is original
           if (entry.step.__name__.removesuffix("_step"), what) not in UNREACHED]


def test_every_ordering_call_of_the_halo_loops_has_a_mutant():
    assert {s for s, _, _, _ in MUTANTS} == set(distributed.STRATEGIES)
    described = {what for _, _, what, _ in MUTANTS}
    assert any("overlap_step without `halo.wait_event(run.ready[(level - 1) % run.m])`" == d for d in described)
    assert any("HaloLink.join without" in d for d in described)
    counts = {where: len(_mutants(fn)) for where, fn in ORDERED.items()}
    assert counts == {"blocking": 3, "overlap": 3, "save": 2, "wait_until_copied": 1, "exchange": 2, "join": 1}, counts
    assert {what for _, what in UNREACHED} <= described


@pytest.mark.parametrize("strategy", distributed.STRATEGIES)
@pytest.mark.parametrize("size", RANKS)
@pytest.mark.parametrize("every", [1, 3])
def test_each_halo_loop_is_race_free_on_every_rank(cpu, size, strategy, every):
    """Every level saved, so that every step waits for a copy; and every third, so that most steps
    write a buffer no copy is reading and queue no wait for one."""
    assert _run_every_rank(size, strategy, every) == []


@pytest.mark.parametrize("size", RANKS)
@pytest.mark.parametrize("strategy,where,what,fn", MUTANTS, ids=[f"{s}: {w}" for s, _, w, _ in MUTANTS])
def test_removing_any_wait_or_record_is_a_race_on_every_rank(cpu, monkeypatch, size, strategy, where, what, fn):
    _patch(monkeypatch, where, fn)
    races = _run_every_rank(size, strategy)
    assert len(races) == size, f"{what}: only {len(races)} of {size} ranks reported a race"
    monkeypatch.undo()
    assert _run_every_rank(size, strategy) == []        # the process stays usable


def test_the_kernel_declares_the_rows_it_writes_not_its_context_rows(cpu):
    """The windows of one slab share context rows: the kernel writes only the rows inside its
    padding, so two windows on two streams, written side by side, do not race."""
    p = ch.WaveProblem(n0=40, n1=24, nt=10)
    U = [ch.device_zeros(p.shape) for _ in range(3)]
    V = ch.to_device(p.velocity)
    a, b = ch.create_streams(2)
    with ch.sanitize():
        for (lo, hi), stream in (((2, 10), a), ((10, 38), b)):
            rows = slice(lo - 2, hi + 2)
            ch.launch_wave2d(U[0][rows], U[1][rows], U[2][rows], V[rows], distributed.Window(p, lo, hi), 3, stream)
        ch.synchronize()
    with pytest.raises(ch.RaceError, match="race on"):        # rows that do overlap still race
        with ch.sanitize():
            for (lo, hi), stream in (((2, 11), a), ((10, 38), b)):
                rows = slice(lo - 2, hi + 2)
                ch.launch_wave2d(U[0][rows], U[1][rows], U[2][rows], V[rows], distributed.Window(p, lo, hi), 3, stream)


_SANITIZED_RANKS = """
import course_helper as ch
from course_helper import distributed
team = distributed.Team()
for strategy in distributed.STRATEGIES:
    with ch.sanitize():
        res = distributed.run_rank(team, ch.WaveProblem(n0=40, n1=24, nt=16), strategy, every=1)
    print(f"rank {team.rank} {strategy} clean")
"""


@pytest.mark.parametrize("size", RANKS)
def test_the_real_ranks_run_clean_under_the_sanitizer(size):
    try:
        mpiexec = distributed.find_mpiexec()
        import mpi4py  # noqa: F401
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"no MPI here ({exc})")
    p = subprocess.run([mpiexec, "-n", str(size), sys.executable, "-c", _SANITIZED_RANKS], capture_output=True,
                       text=True, timeout=240, env=ranks_env("cpu"))
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in range(size):
        for strategy in distributed.STRATEGIES:
            assert f"rank {rank} {strategy} clean" in p.stdout
