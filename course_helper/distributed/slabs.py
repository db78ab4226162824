"""Cutting the grid into slabs: which rows each rank computes and holds, and the windows of a slab
that its kernels run on. Pure arithmetic: no MPI, no device.

The grid is cut along dimension 0 into one slab per rank. A rank computes the rows it *owns* and
holds two more rows on each inner side, the *halo*: copies of the neighbour's edge rows, which the
4th-order stencil reaches into.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import checks
from ..wave import PAD, WaveProblem

__all__ = ["HALO", "Slab", "Window", "decompose", "owner_of"]

HALO = PAD                  #: halo rows on each inner side: the stencil's reach


@dataclass(frozen=True)
class Slab:
    """The rows of the global grid one rank works on.

    ``first``..``stop`` (one past the end) are the global rows this rank
    computes; it holds ``lo``..``hi``, two more rows on each side: the halo
    from a neighbour on an inner side, the zero wall rows on a global edge.
    """
    rank: int
    ranks: int
    first: int
    stop: int

    @property
    def lo(self) -> int:
        """First global row held locally (the upper halo or wall rows)."""
        return self.first - HALO

    @property
    def hi(self) -> int:
        """One past the last global row held locally."""
        return self.stop + HALO

    @property
    def rows(self) -> int:
        """Rows held locally (owned rows plus two on each side)."""
        return self.hi - self.lo

    @property
    def owned(self) -> int:
        """Rows this rank computes."""
        return self.stop - self.first

    @property
    def up(self) -> int | None:
        """Rank holding the rows above (smaller indices), or None at the global edge."""
        return self.rank - 1 if self.rank > 0 else None

    @property
    def down(self) -> int | None:
        """Rank holding the rows below, or None at the global edge."""
        return self.rank + 1 if self.rank < self.ranks - 1 else None

    def owns(self, row: int) -> bool:
        """Whether this rank computes global row ``row``."""
        return self.first <= row < self.stop


def decompose(n0: int, ranks: int) -> list[Slab]:
    """Split the interior rows ``PAD .. n0-PAD-1`` into ``ranks`` balanced slabs.

    The first ``(n0 - 2 PAD) % ranks`` slabs get one row more. Every slab owns
    at least ``2 HALO`` rows, so that the boundary rows of its two inner sides
    never overlap.

    >>> [(s.first, s.stop) for s in decompose(20, 3)]
    [(2, 8), (8, 13), (13, 18)]
    """
    n0 = checks.positive_int("n0", n0, minimum=2 * PAD + 1)
    ranks = checks.positive_int("ranks", ranks)
    interior = n0 - 2 * PAD
    if interior < 2 * HALO * ranks:
        raise ValueError(f"{ranks} ranks cannot share {interior} interior rows: every rank needs at least "
                         f"{2 * HALO} (its boundary rows on each side); use n0 >= {2 * HALO * ranks + 2 * PAD} "
                         "or fewer ranks")
    base, extra = divmod(interior, ranks)
    slabs, first = [], PAD
    for r in range(ranks):
        stop = first + base + (1 if r < extra else 0)
        slabs.append(Slab(r, ranks, first, stop))
        first = stop
    return slabs


def owner_of(n0: int, ranks: int, row: int) -> int:
    """The rank whose slab owns global row ``row`` (e.g. the source's row)."""
    row = checks.positive_int("row", row, minimum=0)
    for s in decompose(n0, ranks):
        if s.owns(row):
            return s.rank
    raise ValueError(f"row {row} is a wall row (outside {PAD}..{n0 - PAD - 1}); no rank computes it")


class Window(WaveProblem):
    """Global rows ``a``..``b`` as a problem of their own: ``b - a`` computed rows plus two rows of
    context on each side, with the global problem's time step, spacing and wavelet.

    The source term is the global one where the window holds the source cell; elsewhere the kernel
    adds ``-0.0``, which leaves every float32 unchanged bit for bit (IEEE 754: x + (-0) == x, also
    for x = -0), so a window without the source computes exactly what the full grid computes there.
    """

    def __init__(self, problem: WaveProblem, a: int, b: int):
        p0, p1 = problem.source
        self.holds_source = a <= p0 < b
        # Uniform velocity vmax: gives the same dt, fm and td (the kernel reads the slab's own V).
        super().__init__(n0=b - a + 2 * PAD, n1=problem.n1, dx=(problem.dx0, problem.dx1),
                         velocity=problem.vmax, cfl=problem.cfl, nt=problem.nt,
                         source=(p0 - a + PAD, p1) if self.holds_source else (PAD, PAD),
                         points_per_wavelength=problem.points_per_wavelength)
        if (self.dt, self.fm, self.td) != (problem.dt, problem.fm, problem.td):
            raise RuntimeError("a slab window does not reproduce the problem's time step; cannot decompose")
        self.parent = problem

    def source_amplitude(self, n: int) -> np.float32:
        return self.parent.source_amplitude(n) if self.holds_source else np.float32(-0.0)
