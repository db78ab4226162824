"""What each operation costs the modelled device, read from a device profile
(:mod:`course_helper.runtime.profiles`): a kernel's or a fill's duration, a copy's link and
bytes, a transfer to another device. The rules are in :mod:`course_helper.runtime.model`."""
from __future__ import annotations

import bisect
from typing import Any

from .ops import CopyCost, Cost, FillCost, KernelCost, LinkCost, OpKind
from .scheduler import ticks

__all__ = ["interpolate_us", "kernel_us", "link_ms", "alone_ms", "timing"]


def interpolate_us(pts: list, nbytes: float) -> float:
    """A time (µs) at ``nbytes`` from measured ``[bytes, µs]`` points, interpolated linearly in
    bytes (extrapolated with the slope of the last segment; the first point's time below it)."""
    pts = sorted(pts)
    xs = [p[0] for p in pts]
    i = bisect.bisect_left(xs, nbytes)
    if i == 0:
        return float(pts[0][1])
    if i == len(pts):
        if len(pts) == 1:
            return float(pts[0][1])
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    if x1 == x0:
        return float(y1)
    return float(max(pts[0][1], y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)))


def kernel_us(profile: dict, shape: str, nbytes: float) -> float:
    """Modelled duration (µs) of one kernel of ``shape`` moving ``nbytes``: the
    profile's measured points, interpolated (:func:`interpolate_us`)."""
    return interpolate_us(profile["kernels"][shape]["points"], nbytes)


def link_ms(profile: dict, link: str, nbytes: float) -> float:
    """Modelled time (ms) of one copy of ``nbytes`` alone on ``link``: latency + bytes / bandwidth,
    or, where the link carries ``fitted_us`` (per-copy times fitted to a measured loop, as the
    pageable device-to-host link's are), those times interpolated."""
    spec = profile["links"][link]
    if "fitted_us" in spec:
        return interpolate_us(spec["fitted_us"], nbytes) * 1e-3
    return spec["latency_us"] * 1e-3 + nbytes / (spec["gbps"] * 1e6)


def alone_ms(profile: dict, cost: Cost) -> float | None:
    """Modelled time (ms) of the operation ``cost`` alone on the device (no graph, nothing
    sharing its engine or link), or None where ``profile`` has no figure for it. A copy's or a
    fill's bytes are those of its arrays (``src``, ``dst``)."""
    match cost:
        case KernelCost(shape=shape):
            if shape not in profile["kernels"]:
                return None
            return (kernel_us(profile, shape, cost.nbytes) + cost.hold_us) * 1e-3
        case FillCost(dst=dst):
            return kernel_us(profile, "fill", dst.nbytes) * 1e-3
        case CopyCost(kind=kind, src=src):
            link = kind + ("_pageable" if cost.pageable else "")
            return link_ms(profile, link, src.nbytes) if link in profile["links"] else None
        case LinkCost(link=link):
            return link_ms(profile, link, cost.nbytes) if link in profile["links"] else None
    raise TypeError(f"no modelled cost for a {type(cost).__name__}; pass a KernelCost, CopyCost, "
                    "FillCost or LinkCost (course_helper.runtime.ops)")


def timing(profile: dict, op: Any, cost: Cost, replaying: bool) -> dict:
    """The engine, link and duration of an operation (the keyword arguments of a
    :class:`~course_helper.runtime.scheduler.Task`); ``replaying``: it is a node of a graph's
    replay, which adds the profile's per-node cost.

    A copy's latency is link time: it is turned into the bytes the link
    would have moved meanwhile, so that a copy alone takes latency +
    bytes / bandwidth, and copies sharing a link share all of it."""
    graph = profile.get("graph", {}) if replaying else {}
    match cost:
        case CopyCost(kind=kind):
            name = kind + ("_pageable" if cost.pageable else "")
            spec = profile["links"][name]
            peak = spec["gbps"] * 1e6
            node_ms = graph.get("copy_node_us", 0.0) * 1e-3
            if "fitted_us" in spec:     # the copy alone takes its fitted time: as bytes at the link's peak
                nbytes = (link_ms(profile, name, op.nbytes) + node_ms) * peak
            else:
                nbytes = op.nbytes + (spec["latency_us"] * 1e-3 + node_ms) * peak
            return dict(engine="compute" if kind == OpKind.D2D else "copy", link=str(kind), peak=peak,
                        nbytes=nbytes)
        case LinkCost(link=link):
            # A transfer to or from another device (a halo exchange): no engine of this device,
            # the profile's link where it has one (else it takes no modelled time).
            spec = profile["links"].get(link)
            return dict(duration=ticks(link_ms(profile, link, cost.nbytes)) if spec else 0.0)
        case FillCost():
            us = kernel_us(profile, "fill", op.nbytes) + graph.get("kernel_node_us", 0.0)
        case KernelCost():
            # hold_us: time a kernel spends by design on top of its work (the layer cake's oven).
            us = kernel_us(profile, cost.shape, cost.nbytes) + cost.hold_us + graph.get("kernel_node_us", 0.0)
        case _:
            raise TypeError(f"no modelled cost for a {type(cost).__name__}; pass a KernelCost, CopyCost, "
                            "FillCost or LinkCost (course_helper.runtime.ops)")
    return dict(engine="compute", duration=ticks(us * 1e-3))
