"""The modelled GPU against the real one, side by side.

    python -m benchmarks.validate_model GPU_BENCH.json --profile PROFILE.json --out benchmarks/

reads a sweep measured on a GPU (``python -m course_helper bench --every-sweep --out ...``, or
the measured side of an earlier ``model_validation.json``),
predicts every point and strategy with the CPU backend's model of the given profile (times
only: no wavefield is computed), and writes ``model_validation.json``, ``model_validation.png``
(predicted against measured) and ``model_validation.md`` (the table of the README).

With ``--fit-pageable`` it first fits the profile's device-to-host *pageable* link to the
sequential loop's medians of the same sweep, one copy time per level size, and writes it into the
profile file (keeping the direct measurement beside it): a pageable copy's time is no straight line
in its bytes, and the calibration's line over 256 KiB to 64 MiB misses the loop's copies by up to
a third, so that one column of the table is a fit, not a prediction. With ``--fit-host`` it
first fits the two host costs that set a host-bound loop's pace beside the calls' own
(``host_us.loop_turn``, ``host_us.wake``) to the sweep's host-bound points, keeping the calibrated
values beside them (``host_us_fitted``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import course_helper as ch  # noqa: E402
from course_helper import runtime  # noqa: E402


def predict(gpu_doc, profile):
    ch.set_backend("cpu", profile=profile)
    rt = runtime.get()
    rows = []
    with rt.times_only():
        for point in gpu_doc["points"]:
            if "strategies" not in point:
                continue
            problem = ch.WaveProblem(point["n"], point["n"], nt=point["nt"])
            for name, measured in point["strategies"].items():
                if name not in ch.STRATEGIES:         # the plain-CuPy reference row has no model
                    continue
                # The ring depth the measured run used (rows without one used the default).
                depth = measured.get("nscratch") if ch.STRATEGIES[name].ring else None
                modelled = ch.solve(problem, name, every=point["every"], nscratch=depth, trace=False).elapsed_ms
                rows.append({"n": point["n"], "nt": point["nt"], "every": point["every"], "strategy": name,
                             "measured_ms": measured["median_ms"], "modelled_ms": modelled,
                             "ratio": modelled / measured["median_ms"]})
    return rt, rows


def _save_noted(profile, profile_path, note):
    """Write ``profile`` to ``profile_path``, its provenance's method saying once what was fitted."""
    method = profile.setdefault("provenance", {}).get("method", "")
    if note not in method:
        profile["provenance"]["method"] = method + note
    with open(profile_path, "w") as f:
        json.dump(profile, f, indent=1)


def fit_pageable(gpu_doc, profile_path):
    """Fit the pageable device-to-host link of the profile file ``profile_path`` to the sequential
    loop's medians in ``gpu_doc``; rewrite the file and return the largest relative error.

    The sequential loop is serial in the model (the host waits for each pageable copy), so its
    time is the rest of the loop plus one pageable copy per saved level: one model run per point at
    the directly measured link gives the rest. A real pageable copy is no straight line in its
    bytes (it goes through the driver's staging buffers; on the H200 a 16 MiB level moved at 9-10
    GB/s and a 64 MiB one at 15), so the fit is one copy time per level size of the sweep
    (``fitted_us``, interpolated between sizes by the model), each the time with the smallest
    largest relative error over that size's points. The straight line with the smallest largest
    error is kept beside it (``gbps``, ``latency_us``) for the reader."""
    with open(profile_path) as f:
        profile = json.load(f)
    link = profile["links"]["D2H_pageable"]
    direct = link.get("direct_measurement") or {k: link[k] for k in ("gbps", "latency_us", "points_us") if k in link}
    profile["links"]["D2H_pageable"] = dict(direct)
    with open(profile_path, "w") as f:
        json.dump(profile, f, indent=1)
    doc = {"points": [{**p, "strategies": {"sequential": p["strategies"]["sequential"]}}
                      for p in gpu_doc["points"] if "sequential" in p.get("strategies", {})]}
    _, rows = predict(doc, profile_path)
    saved = np.array([len(range(0, r["nt"], r["every"])) for r in rows], float)
    level_bytes = np.array([r["n"] * r["n"] * 4 for r in rows], float)
    measured = np.array([r["measured_ms"] for r in rows])
    per_copy = direct["latency_us"] * 1e-3 + level_bytes / (direct["gbps"] * 1e6)
    rest = np.array([r["modelled_ms"] for r in rows]) - saved * per_copy
    lat = np.arange(0.0, 120.0, 0.5)[:, None, None] * 1e-3                 # ms
    gbps = np.arange(4.0, 40.0, 0.05)[None, :, None]
    error = np.abs((rest + saved * (lat + level_bytes / (gbps * 1e6))) / measured - 1).max(axis=2)
    i, j = np.unravel_index(np.argmin(error), error.shape)
    best_lat, best_gbps, line_worst = float(lat[i, 0, 0] * 1e3), float(gbps[0, j, 0]), float(error[i, j])
    fitted, worst = [], 0.0
    for size in sorted(set(level_bytes)):
        at = level_bytes == size
        exact = (measured[at] - rest[at]) / saved[at]                  # ms per copy that fits each point
        grid = np.linspace(exact.min(), exact.max(), 201) if exact.size > 1 else exact
        err = np.abs((rest[at][None, :] + saved[at][None, :] * grid[:, None]) / measured[at][None, :] - 1).max(axis=1)
        k = int(np.argmin(err))
        fitted.append([int(size), round(float(grid[k]) * 1e3, 3)])
        worst = max(worst, float(err[k]))
    profile["links"]["D2H_pageable"] = {
        "gbps": round(best_gbps, 2), "latency_us": round(best_lat, 2),
        "fitted_us": fitted,
        "fitted_to": (f"the sequential loop's median times of the bench sweep measured with this profile "
                      f"({len(rows)} points): one copy time per level size (fitted_us, largest relative error "
                      f"{100 * worst:.1f}%), which the model interpolates between sizes; gbps and latency_us are "
                      f"the best straight line, kept for the reader (largest error {100 * line_worst:.1f}%) "
                      "(benchmarks/validate_model.py --fit-pageable)"),
        "direct_measurement": direct}
    _save_noted(profile, profile_path, " Exception: the device-to-host pageable link is fitted to the sequential "
                "loop of the bench sweep (links.D2H_pageable.fitted_to); its direct measurement is kept beside "
                "it, in links.D2H_pageable.direct_measurement.")
    print(f"pageable D2H link fitted to the sequential loop: {len(fitted)} level sizes, largest error "
          f"{100 * worst:.1f}% (the best straight line, {best_lat:.1f} us + {best_gbps:.2f} GB/s, "
          f"{100 * line_worst:.1f}%; directly measured {direct['latency_us']:.1f} us, {direct['gbps']:.2f} GB/s)")
    return worst


#: The host costs that set a host-bound loop's pace beside the calls' own (the Python of a loop's
#: turn, the wake-up after a wait that blocked), and the values --fit-host tries for each (us).
HOST_GRID = {"loop_turn": (1.0, 1.5, 2.0, 2.5, 3.0), "wake": (2.0, 3.0, 4.0, 5.0, 6.0, 7.5, 10.0)}
#: A point is host-bound where the events loop took this much longer than its bound B, or more.
HOST_BOUND = 1.05


def fit_host(gpu_doc, profile_path):
    """Fit ``host_us.loop_turn`` and ``host_us.wake`` of the profile file ``profile_path`` to the
    sweep's host-bound points (the events loop at least :data:`HOST_BOUND` x B): the pair of
    :data:`HOST_GRID` with the smallest largest relative error over every strategy but the
    pageable sequential one (its link is fitted on its own, :func:`fit_pageable`). A host's speed
    changes from minute to minute, so the calibration's own measurements of these two (minutes
    apart from the sweep, in loops of their own) can miss the sweep's by a few microseconds, which
    at 256² is a fifth of a level. Rewrites the file and returns the largest relative error."""
    with open(profile_path) as f:
        profile = json.load(f)
    points = [{**p, "strategies": {k: v for k, v in p["strategies"].items() if k != "sequential"}}
              for p in gpu_doc["points"] if "strategies" in p
              and p["strategies"]["events"]["median_ms"] >= HOST_BOUND * p["bound_ms"]]
    calibrated = {k: profile["host_us"][k] for k in HOST_GRID}
    best = None
    for turn in HOST_GRID["loop_turn"]:
        for wake in HOST_GRID["wake"]:
            profile["host_us"].update(loop_turn=turn, wake=wake)
            with open(profile_path, "w") as f:
                json.dump(profile, f, indent=1)
            _, rows = predict({"points": points}, profile_path)
            worst = max(abs(r["ratio"] - 1) for r in rows)
            if best is None or worst < best[0]:
                best = (worst, turn, wake)
    worst, turn, wake = best
    profile["host_us"].update(loop_turn=turn, wake=wake)
    where = ", ".join(f"{p['n']}² every {p['every']}" for p in points)
    profile["host_us_fitted"] = {
        "loop_turn": turn, "wake": wake, "calibrated": calibrated,
        "fitted_to": (f"the bench sweep's host-bound points ({where}), every strategy but the pageable "
                      f"sequential one: the pair with the smallest largest relative error ({100 * worst:.1f}%) "
                      "on a grid (benchmarks/validate_model.py --fit-host)")}
    _save_noted(profile, profile_path, " Exception: host_us.loop_turn and host_us.wake are fitted to the host-bound "
                "points of the bench sweep (host_us_fitted, with the calibrated values).")
    print(f"host costs fitted to the sweep's host-bound points ({where}): loop_turn {turn} us, wake {wake} us "
          f"(largest error {100 * worst:.1f}%; calibrated {calibrated['loop_turn']} and {calibrated['wake']} us)")
    return worst


def markdown(rows, label, device):
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    points = list(dict.fromkeys((r["n"], r["nt"], r["every"]) for r in rows))
    cell = {(r["n"], r["nt"], r["every"], r["strategy"]): r for r in rows}
    lines = ["| point | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for p in points:
        cells = []
        for name in names:
            r = cell.get((*p, name))
            cells.append("" if r is None else f"{r['measured_ms']:.1f} / {r['modelled_ms']:.1f} "
                                              f"({100 * (r['ratio'] - 1):+.0f}%)")
        lines.append(f"| {p[0]}²×{p[1]} every {p[2]} | " + " | ".join(cells) + " |")
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    lines.append("")
    lines.append(f"Median ms measured on the {device} / {label} (difference). Largest difference: "
                 f"{100 * (worst['ratio'] - 1):+.0f}% ({worst['strategy']} at {worst['n']}²×{worst['nt']} "
                 f"every {worst['every']}).")
    return "\n".join(lines)


def plot(rows, label, device, path):
    fig, ax = plt.subplots(figsize=(5.2, 5))
    for name in dict.fromkeys(r["strategy"] for r in rows):
        sel = [r for r in rows if r["strategy"] == name]
        ax.scatter([r["measured_ms"] for r in sel], [r["modelled_ms"] for r in sel], label=name, s=22)
    lo = min(min(r["measured_ms"], r["modelled_ms"]) for r in rows) * 0.8
    hi = max(max(r["measured_ms"], r["modelled_ms"]) for r in rows) * 1.25
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.12,
                    label="±15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"measured on the {device} (ms, median)")
    ax.set_ylabel(f"{label} (ms)")
    ax.set_title("the CPU backend's model against the GPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _as_bench(validation):
    """The measured medians of a ``model_validation.json``, shaped like a bench document."""
    points = {}
    for r in validation["rows"]:
        p = points.setdefault((r["n"], r["nt"], r["every"]),
                              {"n": r["n"], "nt": r["nt"], "every": r["every"], "strategies": {}})
        p["strategies"][r["strategy"]] = {"median_ms": r["measured_ms"]}
    m = validation["measured"]
    return {"machine": m["machine"], "created": m.get("created"), "repeats": m.get("repeats"),
            "points": list(points.values())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gpu_bench", help="bench.json measured on the GPU")
    ap.add_argument("--profile", default="h200", help="profile name or path (default h200)")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--fit-pageable", action="store_true",
                    help="first fit the profile file's pageable device-to-host link to the sequential loop")
    ap.add_argument("--fit-host", action="store_true",
                    help="first fit the profile file's loop_turn and wake host costs to the sweep's host-bound "
                         "points (before --fit-pageable)")
    args = ap.parse_args(argv)
    with open(args.gpu_bench) as f:
        gpu_doc = json.load(f)
    if "rows" in gpu_doc:                       # an earlier validation: re-predict its measurements
        gpu_doc = _as_bench(gpu_doc)
    if (args.fit_pageable or args.fit_host) and not os.path.isfile(args.profile):
        ap.error("--fit-pageable and --fit-host rewrite the profile: give --profile as a file path")
    if args.fit_host:
        fit_host(gpu_doc, args.profile)
    if args.fit_pageable:
        fit_pageable(gpu_doc, args.profile)
    rt, rows = predict(gpu_doc, args.profile)
    device = gpu_doc["machine"]["device"]
    doc = {"measured": {"machine": gpu_doc["machine"], "created": gpu_doc.get("created"),
                        "repeats": gpu_doc.get("repeats")},
           "modelled": {"label": rt.device_label, "profile": rt.profile["provenance"]}, "rows": rows}
    with open(os.path.join(args.out, "model_validation.json"), "w") as f:
        json.dump(doc, f, indent=1)
    table = markdown(rows, rt.device_label, device)
    with open(os.path.join(args.out, "model_validation.md"), "w") as f:
        f.write(table + "\n")
    plot(rows, rt.device_label, device, os.path.join(args.out, "model_validation.png"))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
