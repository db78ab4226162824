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
import os
from importlib import resources

__all__ = ["ENV_VAR", "DEFAULT", "available", "load", "validate"]

ENV_VAR = "COURSE_HELPER_PROFILE"
DEFAULT = "h200"

#: what every profile must hold (sections and their keys)
REQUIRED = {
    "device": ("name", "async_engine_count"),
    "links": ("D2H", "H2D", "D2H_pageable", "H2D_pageable", "D2D"),
    "kernels": ("wave2d_4o", "bake", "fill"),
    "host_us": ("launch", "copy", "record", "wait_event", "synchronize", "query", "graph_launch",
                "host_func", "wake"),
    "provenance": ("device", "driver", "cupy", "date", "method"),
}


def available():
    """Names of the profiles shipped with the package."""
    folder = resources.files("course_helper").joinpath("profiles")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def _path_of(name):
    if os.sep in name or name.endswith(".json"):
        return name
    if name not in available():
        raise ValueError(f"no device profile named {name!r}; the package has {', '.join(available())}, "
                         f"or give the path of a JSON file made by `python -m course_helper calibrate`")
    return str(resources.files("course_helper").joinpath(f"profiles/{name}.json"))


def validate(doc, where="profile"):
    """Raise ValueError naming what is missing or wrong in a profile dict; return it."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where} is not a JSON object")
    for section, keys in REQUIRED.items():
        part = doc.get(section)
        if not isinstance(part, dict):
            raise ValueError(f"{where} has no {section!r} section")
        missing = [k for k in keys if k not in part]
        if missing:
            raise ValueError(f"{where}: section {section!r} lacks {', '.join(missing)}")
    for name, link in doc["links"].items():
        if not (link.get("gbps", 0) > 0 and link.get("latency_us", -1) >= 0):
            raise ValueError(f"{where}: link {name!r} needs gbps > 0 and latency_us >= 0")
    for name, k in doc["kernels"].items():
        pts = k.get("points")
        if not pts or any(len(p) != 2 or p[0] < 0 or p[1] <= 0 for p in pts):
            raise ValueError(f"{where}: kernel {name!r} needs points [[bytes, us], ...] with times > 0")
    if int(doc["device"]["async_engine_count"]) < 1:
        raise ValueError(f"{where}: async_engine_count must be at least 1")
    return doc


def load(name=None):
    """The profile ``name`` (a shipped name or a path; default: $COURSE_HELPER_PROFILE or h200)."""
    name = name or os.environ.get(ENV_VAR) or DEFAULT
    path = _path_of(name)
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"the device profile {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the device profile {path} is not valid JSON ({exc})") from None
    doc = validate(doc, where=f"profile {path}")
    doc.setdefault("name", os.path.basename(path)[:-5] if path.endswith(".json") else name)
    return doc
