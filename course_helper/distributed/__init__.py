"""Beyond one GPU: the wave problem split into slabs across MPI ranks, one GPU each, with the
halo rows exchanged through NCCL (MPI on the CPU backend) while the interior computes.

``decompose`` splits the grid, ``HaloLink`` moves the halos, ``run_rank`` runs one rank's loop with
one of the ``STRATEGIES``, and ``launch_halo`` starts a whole job under ``mpiexec``.
"""
from .halo import (HALO, STRATEGIES, HaloLink, HaloResult, Team, Window, blocking_step, capture_rank_loop,
                   chrome_trace, decompose, find_mpiexec, gather, halo_bound, launch_halo, merge_traces,
                   overlap_step, owner_of, ranks_backend, run_rank, traces_from_chrome, world)

__all__ = ["HALO", "STRATEGIES", "HaloLink", "HaloResult", "Team", "Window", "blocking_step",
           "capture_rank_loop", "chrome_trace", "decompose", "find_mpiexec", "gather", "halo_bound",
           "launch_halo", "merge_traces", "overlap_step", "owner_of", "ranks_backend", "run_rank",
           "traces_from_chrome", "world"]
