"""What an operation is: its kind, and what it costs the device, as types.

Every operation the helper queues has one :class:`OpKind`, and hands the runtime one cost: a
:class:`KernelCost` (a kernel's shape and the bytes it moves), a :class:`CopyCost` (a copy's
direction, its arrays and whether its host side is pageable), a :class:`FillCost` (a memset)
or a :class:`LinkCost` (bytes over a link of no engine of this device: a halo exchange with
another device). A runtime dispatches on the cost's type; the modelled device reads its
duration from the profile by it (:mod:`.costs`). Nothing here knows a backend.

>>> CopyCost(OpKind.D2H).kind in COPY_KINDS, OpKind.HOST_FUNC
(True, 'host func')
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Union

__all__ = ["OpKind", "COPY_KINDS", "D2H", "H2D", "D2D", "COLOURS",
           "KernelCost", "CopyCost", "FillCost", "LinkCost", "Cost", "label"]

# The costs are plain (not frozen) slotted dataclasses: one is built per queued operation, and
# a frozen one's __init__ (object.__setattr__ per field) costs about four times a dict's.


class OpKind(enum.StrEnum):
    """The kinds of queued work. Each is also its plain name (``OpKind.D2H == "D2H"``), as
    timelines, the sanitizer's messages and CUPTI's records spell it."""
    KERNEL = "kernel"
    D2H = "D2H"            #: a copy from the device to the host
    H2D = "H2D"            #: a copy from the host to the device
    D2D = "D2D"            #: a copy on the device
    MEMSET = "memset"      #: a fill (zeros)
    HALO = "halo"          #: an exchange of rows with another device
    HOST_FUNC = "host func"  #: a host function queued on a stream
    LET_GO = "let go"      #: memory handed back to its pool (the race sanitizer notes it as a write)

    def __repr__(self) -> str:
        # Shown as its plain name in the reprs of what holds one (an Op, a timeline's event).
        return repr(self.value)


#: The copies, in the one place they are spelled.
COPY_KINDS = (OpKind.D2H, OpKind.H2D, OpKind.D2D)
# The copies again as module names, for the paths every level takes (a copy's queueing): in
# Python 3.11 reading a member through its class (``OpKind.D2H``) costs about 0.1 µs, a global
# about a tenth of that.
D2H, H2D, D2D = COPY_KINDS

#: The colour each kind is drawn in, the one table of them: the course's timelines
#: (:data:`course_helper.timelines.timeline.KINDS`, in this order) and the NVTX ranges Nsight
#: Systems shows (:mod:`.nvtx_ranges`). "host wait", "disk write" and "compress" (a chunk's
#: compression on the device) are a timeline's entries that are no queued work.
COLOURS = {OpKind.KERNEL: "#1f77b4", OpKind.D2H: "#ff7f0e", OpKind.H2D: "#2ca02c", OpKind.D2D: "#9467bd",
           OpKind.MEMSET: "#8c564b", "host wait": "#7f7f7f", OpKind.HALO: "#d62728", "disk write": "#17becf",
           "compress": "#e377c2"}


@dataclass(slots=True)
class KernelCost:
    """A kernel of ``shape`` (a name in the profile's ``kernels``) moving ``nbytes``; ``hold_us``:
    time it spends by design on top of its work (the layer cake's oven)."""
    shape: str
    nbytes: float
    hold_us: float = 0.0


@dataclass(slots=True)
class CopyCost:
    """A copy of ``kind`` (one of :data:`COPY_KINDS`) from ``src`` into ``dst``; ``pageable``:
    its host side is pageable (staged by the driver); ``host_ptr``: the host side's address
    when the caller has read it already."""
    kind: OpKind
    dst: Any = None
    src: Any = None
    pageable: bool = False
    host_ptr: int | None = None


@dataclass(slots=True)
class FillCost:
    """Zeros written into ``dst``."""
    dst: Any


@dataclass(slots=True)
class LinkCost:
    """``nbytes`` over the link ``link`` alone (e.g. ``"peer"``: a halo exchange with another
    device, which no engine of this device runs)."""
    link: str
    nbytes: float


Cost = Union[KernelCost, CopyCost, FillCost, LinkCost]


def label(kind: str, level: int | None) -> str:
    """An operation's name on timelines: its kind, and its level where it has one
    (``"D2H level 12"``)."""
    return str(kind) if level is None else f"{kind} level {level}"
