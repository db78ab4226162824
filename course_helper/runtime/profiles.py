"""Device profiles: the measured figures the CPU backend's modelled GPU runs on.

A profile is a JSON file (``course_helper/profiles/<name>.json``, or any path)
holding what ``python -m course_helper calibrate`` measured on a real GPU -
link bandwidths and latencies, kernel times against grid size, the host cost
of each helper call - together with its provenance: the device, driver, CuPy
version, date and how each figure was obtained.

``COURSE_HELPER_PROFILE`` (a name or a path) or ``set_backend("cpu", profile=...)``
picks one; the default is the H200 the course is measured on.
"""
from __future__ import annotations

import json
import math
import numbers
import os
from importlib import resources
from typing import Any

from .ops import OpKind

__all__ = ["ENV_VAR", "DEFAULT", "available", "load", "validate", "printable"]

ENV_VAR = "COURSE_HELPER_PROFILE"
DEFAULT = "h200"

#: what every profile must hold (sections and their keys)
REQUIRED = {
    "device": ("name", "async_engine_count"),
    "links": (OpKind.D2H, OpKind.H2D, f"{OpKind.D2H}_pageable", f"{OpKind.H2D}_pageable", OpKind.D2D),
    "kernels": ("wave2d_4o", "bake", "fill"),
    "host_us": ("launch", "copy", "record", "wait_event", "synchronize", "query", "graph_launch",
                "host_func", "wake"),
    "provenance": ("device", "driver", "cupy", "date", "method"),
}


def available() -> list[str]:
    """Names of the profiles shipped with the package."""
    folder = resources.files("course_helper").joinpath("profiles")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def _path_of(name, origin):
    if os.sep in name or name.endswith(".json"):
        return name
    if name not in available():
        raise ValueError(f"{origin}: no device profile named {name!r}; the package has "
                         f"{', '.join(available())}, or give the path of a JSON file made by "
                         "`python -m course_helper calibrate`")
    return str(resources.files("course_helper").joinpath(f"profiles/{name}.json"))


#: Bounds of a profile's figures. A GPU operation of more than a second, or a link slower than
#: 1 MB/s, is a unit mistake; and the modelled clock counts in ticks of about a nanosecond, so
#: figures far outside these would stop it advancing (a run that never ends).
MAX_US = 1e6
GBPS = (1e-3, 1e5)
MAX_BYTES = 2**50


def _number(where, field, value, low, high, *, above=False, whole=False):
    """``value`` if it is a number (a whole one with ``whole``) from ``low`` to ``high``
    (above ``low`` with ``above``), else a ValueError naming the profile and the field."""
    kind = "a whole number" if whole else "a number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (whole and value != int(value)):
        raise ValueError(f"{where}: {field} must be {kind}, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
        raise ValueError(f"{where}: {field} must be {kind} {'above' if above else 'from'} {low:g} "
                         f"{'and at most' if above else 'to'} {high:g}, got {value!r}")
    return value


def _section(where, doc, field, keys=()):
    """The dict at ``field`` of ``doc`` holding ``keys``, else a ValueError naming what lacks."""
    part = doc.get(field.rsplit(".", 1)[-1])
    if not isinstance(part, dict):
        got = "nothing" if part is None else f"a {type(part).__name__}"
        raise ValueError(f"{where}: {field} must be a section (a JSON object), got {got}")
    missing = [k for k in keys if k not in part]
    if missing:
        raise ValueError(f"{where}: {field} lacks {', '.join(missing)}")
    return part


def _points(where: str, field: str, pts: Any) -> None:
    """Check a list of measured ``[bytes, us]`` pairs (a kernel's, or a link's fitted copy times)."""
    if not isinstance(pts, list) or not pts:
        raise ValueError(f"{where}: {field} must be a list of [bytes, us] pairs, got {pts!r}")
    for i, p in enumerate(pts):
        if not isinstance(p, list) or len(p) != 2:
            raise ValueError(f"{where}: {field}[{i}] must be a pair [bytes, us], got {p!r}")
        _number(where, f"{field}[{i}] bytes", p[0], 0, MAX_BYTES)
        _number(where, f"{field}[{i}] time (us)", p[1], 0, MAX_US, above=True)


def validate(doc: Any, where: str = "profile") -> dict:
    """Check every figure the modelled GPU reads from a profile dict; return it.

    Raises ValueError naming ``where`` (the file) and the field (e.g. ``links.D2H.latency_us``)
    that is missing, of the wrong type or out of range.
    """
    if not isinstance(doc, dict):
        raise ValueError(f"{where} is not a JSON object")
    sections = {name: _section(where, doc, name, keys) for name, keys in REQUIRED.items()}
    device = sections["device"]
    for key in ("name", "short_name"):
        if key in device and (not isinstance(device[key], str) or not device[key]):
            raise ValueError(f"{where}: device.{key} must be the device's name, got {device[key]!r}")
    _number(where, "device.async_engine_count", device["async_engine_count"], 1, 64, whole=True)
    if "copies_per_link" in device:
        _number(where, "device.copies_per_link", device["copies_per_link"], 0, 64, whole=True)
    for name in sections["links"]:
        link = _section(where, sections["links"], f"links.{name}", ("gbps", "latency_us"))
        _number(where, f"links.{name}.gbps", link["gbps"], *GBPS, above=True)
        _number(where, f"links.{name}.latency_us", link["latency_us"], 0, MAX_US)
        if "fitted_us" in link:
            _points(where, f"links.{name}.fitted_us", link["fitted_us"])
    for name in sections["kernels"]:
        _points(where, f"kernels.{name}.points",
                _section(where, sections["kernels"], f"kernels.{name}", ("points",))["points"])
    for key, value in sections["host_us"].items():
        _number(where, f"host_us.{key}", value, 0, MAX_US)
    if "graph" in doc:
        for key, value in _section(where, doc, "graph").items():
            _number(where, f"graph.{key}", value, 0, MAX_US)
    if "compress" in doc:       # measured compression on the device: {codec: {gbps, latency_us}}, or a note
        for codec, spec in _section(where, doc, "compress").items():
            if isinstance(spec, str):
                continue                                  # a note ("note", "provenance"): what was measured, or why not
            spec = _section(where, doc["compress"], f"compress.{codec}", ("gbps", "latency_us"))
            _number(where, f"compress.{codec}.gbps", spec["gbps"], *GBPS, above=True)
            _number(where, f"compress.{codec}.latency_us", spec["latency_us"], 0, MAX_US)
    if "disk" in doc:
        disk = _section(where, doc, "disk", ("gbps", "latency_us"))
        _number(where, "disk.gbps", disk["gbps"], *GBPS, above=True)
        _number(where, "disk.latency_us", disk["latency_us"], 0, MAX_US)
        if "writers" in disk:
            _number(where, "disk.writers", disk["writers"], 1, 256, whole=True)
    return doc


def load(name: str | None = None) -> dict:
    """The profile ``name`` (a shipped name or a path; default: $COURSE_HELPER_PROFILE or h200),
    checked with :func:`validate`."""
    name = name or os.environ.get(ENV_VAR) or DEFAULT
    from_env = name == os.environ.get(ENV_VAR)
    origin = f"${ENV_VAR}={name!r}" if from_env else "the profile asked for"
    if not isinstance(name, str):
        raise TypeError(f"a device profile is a name or a path (a str), got {type(name).__name__}")
    path = _path_of(name, origin)
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{origin}: the device profile {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{origin}: cannot read the device profile {path} "
                         f"({getattr(exc, 'strerror', None) or exc}); give a JSON file") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{origin}: the device profile {path} is not valid JSON ({exc})") from None
    doc = validate(doc, where=f"profile {path}")
    doc.setdefault("name", os.path.basename(path)[:-5] if path.endswith(".json") else name)
    for key in ("name", "short_name"):          # printed in banners, labels and titles
        if key in doc["device"]:
            doc["device"][key] = printable(doc["device"][key])
    return doc


def printable(text: str) -> str:
    """``text`` with every character that is not printable (a terminal's escape codes, a
    newline) written as its Python escape, e.g. ``\\x1b``: a name read from a file is shown, never
    obeyed by the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
