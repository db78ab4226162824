"""Beyond one GPU: the wave problem split across ranks, with the halo exchange overlapped.

The grid is cut along dimension 0 into one slab per rank (one MPI process per GPU). A rank
computes the rows it *owns* and holds two more rows on each inner side, the *halo*: copies of the
neighbour's edge rows, which the 4th-order stencil reaches into. After every step the neighbours
swap those rows.

Each rank runs the very same update as the single-device solve: the ``wave2d_4o`` kernel (or its
NumPy twin) launched through :func:`~course_helper.wave.launch_wave2d` on a *window* of its slab -
a few rows plus two rows of context on each side - described by a sub-problem with the same time
step, spacing and wavelet. So every cell sees the same arithmetic, and the gathered result is bit
for bit the single-device one.

The layers, each a module:

* ``slabs``: :func:`decompose` splits the grid, :class:`Window` is a few rows of a slab as a problem;
* ``link``: the :class:`Team` of ranks and the :class:`HaloLink` that moves the halo rows (NCCL
  between GPUs, MPI on the CPU backend);
* ``rank``: one rank's buffers, windows, streams and events (``RankRun``);
* ``loops``: the :data:`STRATEGIES` (:func:`blocking_step`, :func:`overlap_step`, the loop
  captured by :func:`capture_rank_loop`) and :func:`run_rank`, one rank's run;
* ``results``: :func:`gather`, :func:`merge_traces`, :func:`chrome_trace`, and :func:`halo_bound`
  with the parts it is made of (:func:`measure_parts`);
* ``launch``: :func:`launch_halo` starts a whole job under ``mpiexec``::

    mpiexec -n 2 python -m course_helper halo --n 256 --strategy overlap --check
"""
from .launch import find_mpiexec, launch_halo, ranks_backend
from .link import HaloLink, Team, world
from .loops import STRATEGIES, blocking_step, capture_rank_loop, overlap_step, run_rank
from .results import (HaloResult, chrome_trace, exchange_hidden, gather, halo_bound, link_note, measure_parts,
                      merge_traces, traces_from_chrome)
from .slabs import HALO, Window, decompose, owner_of

__all__ = ["HALO", "STRATEGIES", "HaloLink", "HaloResult", "Team", "Window", "blocking_step",
           "capture_rank_loop", "chrome_trace", "decompose", "exchange_hidden", "find_mpiexec", "gather", "halo_bound",
           "launch_halo", "link_note", "measure_parts", "merge_traces", "overlap_step", "owner_of",
           "ranks_backend", "run_rank", "traces_from_chrome", "world"]
