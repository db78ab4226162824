"""The ranks and the wire between them: MPI's communicator, one GPU per rank, and the halo
exchange as one operation on the halo stream (:class:`HaloLink`).

On the GPU backend NCCL (``cupy.cuda.nccl``) sends and receives the halo rows, device to device;
on the CPU backend the modelled device runs the same operation, its NumPy work moving the rows
with MPI (``Isend``/``Irecv``), timed by the profile's ``peer`` link where the profile has one.
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import numpy as np

from .. import runtime
from ..runtime import observe
from ..runtime.backend import backend_name, cupy_module, gpu_name, may_use_gpu
from ..runtime.ops import LinkCost, OpKind
from ..streams import create_events
from .slabs import HALO

if TYPE_CHECKING:                   # names for the type hints only (CuPy is not installed everywhere)
    import cupy
    from mpi4py import MPI

    from ..runtime.base import CpuDeviceArray
    from ..streams import Event, Stream
    from .slabs import Slab

    #: ``(neighbour's rank, rows)`` pairs: the rows sent to each neighbour, or filled from it.
    Rows = list[tuple[int, cupy.ndarray | CpuDeviceArray]]

__all__ = ["HaloLink", "Team", "one_core_note", "world"]

_TAG = 18                   # MPI tag of halo messages: one tag will do, MPI keeps each pair's messages in order


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise ImportError("the distributed course needs mpi4py and an MPI: "
                          "python -m pip install -e '.[distributed]'") from None
    return MPI


def world() -> MPI.Intracomm:
    """MPI's world communicator (all the ranks ``mpiexec`` started)."""
    return _mpi().COMM_WORLD


class Team:
    """The ranks of one MPI communicator, ready to exchange halos.

    On the GPU backend each rank takes the GPU ``local rank % device count``
    (call this before anything else touches the GPU) and the team opens an
    NCCL communicator, its unique id broadcast through MPI. On the CPU backend
    the halos travel through MPI itself.
    """

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        MPI = _mpi()
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.nccl = None
        if self.size > 1:
            _warn_if_on_one_core(self.rank)
        if may_use_gpu():              # before the backend's choice, whose probe runs on the current GPU
            _pick_gpu(self.comm)
        self.backend = backend_name()
        if runtime.get().runs_cuda:
            cupy = cupy_module()
            self.device = gpu_name()
            if self.size > 1:
                sharing = self.comm.Split_type(_mpi().COMM_TYPE_SHARED).Get_size()
                if sharing > cupy.cuda.runtime.getDeviceCount():
                    raise RuntimeError(f"{sharing} ranks share this node's {cupy.cuda.runtime.getDeviceCount()} "
                                       "GPU(s); NCCL needs one GPU per rank. Start fewer ranks, or run them "
                                       "on the CPU backend (COURSE_HELPER_BACKEND=cpu)")
                from cupy.cuda import nccl
                if not getattr(nccl, "available", True):
                    raise RuntimeError("the GPU backend exchanges halos with NCCL, but this CuPy has no NCCL")
                uid = nccl.get_unique_id() if self.rank == 0 else None
                self.nccl = nccl.NcclCommunicator(self.size, self.comm.bcast(uid, root=0), self.rank)
        else:
            import platform
            self.device = f"CPU ({platform.processor() or platform.machine()})"

    def split(self, ranks: int) -> Team | None:
        """A team of the first ``ranks`` ranks (the others get None), e.g. for a 1-GPU baseline."""
        sub = self.comm.Split(0 if self.rank < ranks else _mpi().UNDEFINED, self.rank)
        return None if sub == _mpi().COMM_NULL else Team(sub)

    def max(self, value: float) -> float:
        """The largest ``value`` over the team's ranks (every rank gets it)."""
        return self.comm.allreduce(value, op=_mpi().MAX)


def one_core_note() -> str | None:
    """What to change where this process, a rank, may run on one core only of a machine with more
    (``mpiexec`` bound it to a core: Open MPI does so by default for one or two ranks); None
    otherwise."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:          # no affinity to read on this system (macOS, Windows)
        return None
    if cores > 1 or (os.cpu_count() or 1) < 2:
        return None
    return ("this rank may run on one core only (mpiexec bound it to a core): every thread it starts shares "
            "that core with the Python thread that queues the work, NCCL's proxy thread on a GPU included. "
            "Start the ranks with `mpiexec --bind-to none` (Open MPI binds each of one or two ranks to a "
            "core by default)")


_warned = []


def _warn_if_on_one_core(rank):
    note = one_core_note()
    if note and not _warned:
        _warned.append(rank)
        warnings.warn(f"rank {rank}: {note}", RuntimeWarning, stacklevel=3)


def _pick_gpu(comm):
    """One GPU per rank on a node: the rank's index among the ranks sharing its node."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:   # no CuPy or no device: the backend choice will say why  # noqa: BLE001
        return
    if count > 0:
        local = comm.Split_type(_mpi().COMM_TYPE_SHARED).Get_rank()
        cupy.cuda.Device(local % count).use()


class HaloLink:
    """The halo exchange as device work: one operation on the halo stream that sends this rank's
    edge rows and receives the neighbours' into the halo rows.

    On the GPU backend it is NCCL's send/recv (``cupy.cuda.nccl``), device to device, queued
    like a kernel (and captured into a CUDA graph like one). On the CPU backend the modelled
    device runs it as any operation: when it starts, its NumPy work moves the rows with MPI
    (``Isend``/``Irecv``, then waiting for both), and it takes the profile's ``peer`` link time
    (latency + bytes / bandwidth; none where the profile has no ``peer`` link). Either way the
    streams order it with events, and the sanitizer sees what it reads and writes.
    """

    def __init__(self, team: Team, slab: Slab, halo_stream: Stream) -> None:
        self.comm, self.nccl, self.slab, self.stream = team.comm, team.nccl, slab, halo_stream
        self.done = create_events(1)[0]
        self._edges = {}            # id(U) -> (U, sends, recvs): the rows of a ring buffer, sliced once

    def _edges_of(self, U):
        """``_edges(slab, U)``, kept per buffer: a loop exchanges the same few buffers every level."""
        hit = self._edges.get(id(U))
        if hit is None or hit[0] is not U:
            hit = self._edges[id(U)] = (U, *_edges(self.slab, U))
        return hit[1], hit[2]

    def exchange(self, U: cupy.ndarray | CpuDeviceArray, level: int, after: Event | None = None) -> None:
        """Queue the swap of ``U``'s edge rows on the halo stream (after event ``after``, if given:
        the edge rows' kernels ran on another stream); returns at once."""
        if after is not None:
            self.stream.wait_event(after)
        sends, recvs = self._edges_of(U)
        if sends and not runtime.wants_op(self.stream):
            # CuPy with nobody watching: straight to NCCL, as launch_wave2d goes straight to the kernel.
            self.nccl_swap(sends, recvs)
            if observe.journaling():
                observe.note_op(OpKind.HALO, f"halo level {level}", self.stream, level, sum(a.nbytes for _, a in sends))
        elif sends:
            nbytes = sum(a.nbytes for _, a in sends)
            op = observe.Op(OpKind.HALO, f"halo level {level}", self.stream, level, nbytes,
                            tuple(a for _, a in sends), tuple(b for _, b in recvs))
            runtime.submit(self.stream, op, cuda=lambda raw: self.nccl_swap(sends, recvs),
                           numpy=lambda *rows: self.mpi_swap(sends, recvs, rows), cost=LinkCost("peer", nbytes))
        self.stream.record(self.done)

    def nccl_swap(self, sends: Rows, recvs: Rows) -> None:
        """GPU: the sends and receives to both neighbours in one group, so that NCCL runs them
        together and two ranks never wait for each other."""
        nccl = cupy_module().cuda.nccl
        ptr = self.stream.raw.ptr
        nccl.groupStart()
        for (peer, a), (_, b) in zip(sends, recvs):
            self.nccl.send(a.data.ptr, a.size, nccl.NCCL_FLOAT32, peer, ptr)
            self.nccl.recv(b.data.ptr, b.size, nccl.NCCL_FLOAT32, peer, ptr)
        nccl.groupEnd()

    def mpi_swap(self, sends: Rows, recvs: Rows, rows: list[np.ndarray]) -> None:
        """CPU backend: post every receive (into ``rows``, the halo rows the operation writes
        when it ends) and every send, then wait for all of them."""
        reqs = [self.comm.Irecv(out, source=peer, tag=_TAG) for (peer, _), out in zip(recvs, rows)]
        reqs += [self.comm.Isend(a.view(np.ndarray), dest=peer, tag=_TAG) for peer, a in sends]
        _mpi().Request.Waitall(reqs)

    def join(self, stream: Stream) -> None:
        """Make ``stream`` wait until the halo rows have arrived (device-side)."""
        stream.wait_event(self.done)

    def sent_bytes(self, U: cupy.ndarray | CpuDeviceArray) -> int:
        """Bytes one exchange of ``U`` sends from this rank (to both neighbours together)."""
        return sum(a.nbytes for _, a in self._edges_of(U)[0])


def _edges(slab, U):
    """``([(peer, rows to send)], [(peer, halo rows to fill)])`` of the local array ``U``."""
    sends, recvs = [], []
    if slab.up is not None:
        sends.append((slab.up, U[HALO:2 * HALO]))
        recvs.append((slab.up, U[:HALO]))
    if slab.down is not None:
        sends.append((slab.down, U[-2 * HALO:-HALO]))
        recvs.append((slab.down, U[-HALO:]))
    return sends, recvs
