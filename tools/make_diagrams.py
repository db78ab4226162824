"""Draw the course's diagrams into images/ as SVG.

Run from the repository root:  python tools/make_diagrams.py
The output is deterministic (fixed hash salt, no date), so re-running it only
changes files whose drawing code changed.
"""
import json
import math
import pathlib
import sys

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from course_helper.strategies import COPY_LAG, ring_depth  # noqa: E402

plt.rcParams.update({"svg.hashsalt": "course", "font.size": 11, "font.family": "DejaVu Sans"})
OUT = pathlib.Path(__file__).resolve().parents[1] / "images"
KERNEL, COPY, WAIT, IDLE = "#1f77b4", "#ff7f0e", "#7f7f7f", "#eeeeee"
#: One level's kernel and copy at the balanced point, as measured on the GPU by
#: benchmarks/ring_sweep.py (events timed around a busy stream; see strategies.level_times).
_BALANCED = json.loads((pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ring_sweep.json")
                       .read_text())["points"][0]
KERNEL_MS, COPY_MS = _BALANCED["kernel_ms"], _BALANCED["copy_ms"]
GRID, DEVICE = _BALANCED["n0"], _BALANCED["times_from"].removeprefix("measured on ").removeprefix("NVIDIA ")


def save(fig, name):
    OUT.mkdir(exist_ok=True)
    fig.savefig(OUT / name, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


def box(ax, x, y, w, h, colour, text="", tc="white", fs=10):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="white", lw=1))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", color=tc, fontsize=fs)


def arrow(ax, a, b, colour="black", style="-|>", rad=0.0, ls="-"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=12, color=colour,
                                 connectionstyle=f"arc3,rad={rad}", linestyle=ls, lw=1.3))


def events_schedule(nt, every, m, kernel_ms=KERNEL_MS, copy_ms=COPY_MS):
    """Device ``(start, end)`` of every kernel and copy of ``strategies.with_events`` with ``m``
    buffers, from the dependencies its loop queues, where the device keeps pace with the host
    (turn L is queued as kernel L can start; the derivation of ``strategies.ring_depth``):

    * kernel L after kernel L-1 and after ``copied[L % m]``: the copy of level L-m, if saved;
    * the copy of level S, queued in turn S + COPY_LAG, after ``ready`` (kernel S) and after
      the copy before it (the H200 runs one device-to-host copy at a time).
    """
    kern, copy, link_free = {}, {}, 0.0
    for level in range(nt + COPY_LAG):
        if 2 <= level < nt:
            start = kern[level - 1][1] if level - 1 in kern else 0.0
            if level - m in copy:
                start = max(start, copy[level - m][1])
            kern[level] = (start, start + kernel_ms)
        old = level - COPY_LAG
        if 0 <= old < nt and old % every == 0:
            queued = kern[level][0] if level in kern else max(e for _, e in kern.values())
            start = max(queued, kern[old][1] if old in kern else 0.0, link_free)
            copy[old] = (start, start + copy_ms)
            link_free = start + copy_ms
    return kern, copy


def pinned_schedule(nt, every, kernel_ms=KERNEL_MS, copy_ms=COPY_MS):
    """``strategies.sequential_pinned``: one stream, the host waits for each copy."""
    kern, copy, t = {}, {}, 0.0
    for level in range(nt):
        if level >= 2:
            kern[level] = (t, t + kernel_ms)
            t += kernel_ms
        if level % every == 0:
            copy[level] = (t, t + copy_ms)
            t += copy_ms
    return kern, copy


def lanes(ax, y, kern, copy, label, every, until, one_stream=False):
    """Draw a compute lane at ``y`` and the copies below it (``one_stream``: in it, the host
    waiting for each); grey where compute waits for a copy on another stream."""
    ax.text(-0.02 * until, y + 0.17, label, ha="right", va="center", fontsize=10)
    ax.text(-0.02 * until, y - 0.25, "host waits for each copy" if one_stream else "IO streams",
            ha="right", va="center", fontsize=8, color=WAIT if one_stream else COPY)
    ends = sorted(kern.values())
    for (_, b), (c, _) in zip(ends, ends[1:]):
        if c - b > 1e-9 and c <= until and not one_stream:
            box(ax, b, y, c - b, 0.34, IDLE)
            ax.text((b + c) / 2, y + 0.17, "waits for a\nfree buffer", ha="center", va="center", fontsize=7)
    for level, (a, b) in kern.items():
        if b <= until:
            box(ax, a, y, b - a, 0.34, KERNEL)
            if level % every == 0:
                ax.text((a + b) / 2, y + 0.42, f"{level}", ha="center", fontsize=7, color=KERNEL)
    for level, (a, b) in copy.items():
        if a < until:
            if one_stream:
                box(ax, a, y, min(b, until) - a, 0.34, COPY, f"copy {level}", fs=8)
                box(ax, a, y - 0.42, min(b, until) - a, 0.34, WAIT, "host waits", fs=7)
            else:
                box(ax, a, y - 0.42, min(b, until) - a, 0.34, COPY, f"copy {level}", fs=8)
    return max(b for _, b in kern.values())


def sequential_vs_concurrent():
    """Three loops at the balanced point (every 16th level saved), in measured proportions.
    Notebook 1 shows it before any of the loops' names (nscratch, copied[b]) exist, so its words
    are plain: buffers, a ring, waiting for a free buffer."""
    nt, every = 52, 16
    until = 90 * KERNEL_MS                   # about 90 kernels: a few saved levels at every depth
    deep = ring_depth(KERNEL_MS, COPY_MS)
    rows = [("sequential-pinned", pinned_schedule(nt, every)),
            ("events, a ring of 5 buffers", events_schedule(nt, every, 5)),
            (f"events, a ring of {deep} buffers", events_schedule(nt, every, deep))]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for i, (label, (kern, copy)) in enumerate(rows):
        y = 3.0 - 1.35 * i
        lanes(ax, y, kern, copy, label + (" (one stream)" if i == 0 else ""), every, until, one_stream=i == 0)
    kern, copy = rows[2][1]
    k19 = kern[16 + COPY_LAG]
    ax.annotate(f"queued {COPY_LAG} turns later: starts with kernel {16 + COPY_LAG}",
                xy=(copy[16][0], 0.3 - 0.42 + 0.34), xytext=(copy[16][0] + 0.05, -0.55), fontsize=8,
                color=COPY, arrowprops=dict(arrowstyle="->", color=COPY))
    ax.axvline(k19[0], ymin=0.12, ymax=0.3, color="#999999", lw=0.8, ls=":")
    ax.set_title(f"Saving every {every}th {GRID}\u00b2 level on an {DEVICE}: kernel {KERNEL_MS * 1e3:.0f} \u00b5s, "
                 f"copy {COPY_MS * 1e3:.0f} \u00b5s (the copy of level L-{COPY_LAG} is queued beside kernel L)",
                 fontsize=10, loc="left")
    ax.text(until, -0.95, "ms", ha="left", fontsize=8, color="#666666")
    for t in np.arange(0, until, 1.0 if until > 3 else 0.5):
        ax.text(t, -0.95, f"{t:g}", ha="center", fontsize=8, color="#666666")
    ax.text(0, -1.3, "blue: one kernel per level (numbers: saved levels); orange: a saved level's copy.",
            fontsize=8, color="#444444")
    ratio = math.floor(COPY_MS / KERNEL_MS)
    ax.text(0, -1.6, f"A ring of {COPY_LAG} + floor(copy / kernel) + 1 = {COPY_LAG} + {ratio} + 1 = {deep} buffers "
            "never makes compute wait (ring_depth, notebook 6).", fontsize=8, color="#444444")
    ax.set_xlim(-0.32 * until, until + 0.05)
    ax.set_ylim(-1.75, 3.65)
    ax.axis("off")
    save(fig, "sequential_vs_concurrent.svg")


def problem_setup():
    fig, ax = plt.subplots(figsize=(5.2, 5.2))
    n = 16
    ax.add_patch(Rectangle((0, 0), n, n, facecolor="#dddddd", edgecolor="black"))
    ax.add_patch(Rectangle((2, 2), n - 4, n - 4, facecolor="#f4f8ff", edgecolor="black"))
    for r in (1.5, 3.0, 4.5):
        ax.add_patch(plt.Circle((n / 2, n / 2), r, fill=False, color=KERNEL, lw=1.5, alpha=0.9 - r / 8))
    ax.plot(n / 2, n / 2, marker="*", color="red", ms=16)
    ax.text(n / 2, n / 2 - 1.2, "Ricker source\n(centre cell)", ha="center", va="top", fontsize=9, color="red")
    ax.text(n / 2, 0.9, "2 padding cells held at 0 = reflecting wall", ha="center", va="center", fontsize=9)
    ax.text(n / 2, n - 3, "interior: V = 343 m/s\nwave2d_4o updates every cell", ha="center", va="center",
            fontsize=9)
    arrow(ax, (0, -0.7), (n, -0.7), style="<|-|>")
    ax.text(n / 2, -1.3, "N1 = 256 cells, dx1 = 1 m", ha="center", va="top", fontsize=9)
    arrow(ax, (-0.7, 0), (-0.7, n), style="<|-|>")
    ax.text(-1.3, n / 2, "N0 = 256 cells, dx0 = 1 m", ha="right", va="center", rotation=90, fontsize=9)
    ax.set_xlim(-3, n + 0.5)
    ax.set_ylim(-3, n + 0.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("A firework in a box")
    save(fig, "problem_setup.svg")


def scratch_ring():
    """The ring of ``with_events`` while kernel L runs, and one buffer's life in measured proportions."""
    m, level = 5, 12
    fig, (ax, lo) = plt.subplots(2, 1, figsize=(10, 5.4), gridspec_kw={"height_ratios": [1.15, 1]})
    for lv in range(level - m + 1, level + 1):
        b = lv % m
        if lv == level:
            colour, role = KERNEL, "written by\nkernel L"
        elif lv >= level - 2:
            colour, role = "#aec7e8", "read by\nkernel L"
        elif lv == level - COPY_LAG:
            colour, role = COPY, f"copy queued this\nturn (L-{COPY_LAG}), after\nready[{b}]"
        else:
            colour, role = "#fdd0a2", (f"copy queued last turn;\nnot free until compute\n"
                                       f"waits on copied[{b}]\n(turn {lv + m})")
        x = b * 1.9
        ax.add_patch(FancyBboxPatch((x, 0.5), 1.5, 1.1, boxstyle="round,pad=0.05", facecolor=colour,
                                    edgecolor="black"))
        ax.text(x + 0.75, 1.25, f"U[{b}]", ha="center", fontsize=11, weight="bold",
                color="white" if colour in (KERNEL, COPY) else "black")
        ax.text(x + 0.75, 0.85, f"level {lv}", ha="center", fontsize=10,
                color="white" if colour in (KERNEL, COPY) else "black")
        ax.text(x + 0.75, 0.35, role, ha="center", va="top", fontsize=8)
    ax.set_title(f"Scratch ring of nscratch = {m} while kernel L = {level} runs (level L lives in U[L % {m}])",
                 fontsize=11, loc="left")
    ax.set_xlim(-0.2, m * 1.9)
    ax.set_ylim(-0.75, 1.8)
    ax.axis("off")
    # One buffer's life at the balanced point, from the loop's dependencies (events_schedule).
    saved = 16
    b = saved % m
    kern, copy = events_schedule(saved + m + 2, 16, m)
    t0 = kern[saved][0]
    for lv in range(saved, saved + m + 1):
        a, e = kern[lv]
        role = KERNEL if lv in (saved, saved + m) else ("#aec7e8" if lv <= saved + 2 else "#dddddd")
        box(lo, a - t0, 1.0, e - a, 0.4, role)
        lo.text((a + e) / 2 - t0, 1.5, f"{lv}", ha="center", fontsize=7)
    wait_from, wait_to = kern[saved + m - 1][1], kern[saved + m][0]
    box(lo, wait_from - t0, 1.0, wait_to - wait_from, 0.4, IDLE)
    lo.text((wait_from + wait_to) / 2 - t0, 1.2, f"compute waits on copied[{b}]", ha="center", va="center",
            fontsize=8)
    a, e = copy[saved]
    box(lo, a - t0, 0.35, e - a, 0.4, COPY, f"copy of level {saved} out of U[{b}] (io[{b}])", fs=8)
    lo.axvline(e - t0, ymin=0.1, ymax=0.85, color="green", lw=1.5)
    lo.text(e - t0 + 0.004, 0.2, f"U[{b}] is free only here:\nkernel {saved + m} may overwrite it",
            color="green", fontsize=8, va="center")
    lo.text(-0.004, 1.2, "compute", ha="right", va="center", fontsize=9)
    lo.text(-0.004, 0.55, "copy", ha="right", va="center", fontsize=9, color=COPY)
    lo.set_title(f"U[{b}] at the balanced point (kernel {KERNEL_MS * 1e3:.0f} \u00b5s, copy "
                 f"{COPY_MS * 1e3:.0f} \u00b5s): written by kernel {saved}, read by {saved + 1} and {saved + 2}, "
                 f"copied from turn {saved + COPY_LAG}", fontsize=10, loc="left")
    lo.set_xlim(-0.06, e - t0 + 0.12)
    lo.set_ylim(0.0, 1.7)
    lo.axis("off")
    save(fig, "scratch_ring.svg")


def workflow(kind):
    """One loop turn for level L, drawn from the loop's code (course_helper/strategies.py).

    b = L % m is the buffer the kernel writes; c = (L-3) % m holds level L-3, the newest level
    no kernel touches any more, whose copy runs on io[c] after waiting on ready[c], the event
    the compute stream recorded three turns earlier, after the kernel that made level L-3.
    """
    fig, ax = plt.subplots(figsize=(11, 4.6))
    lanes = {"host": 4.0, "compute": 3.0, "io[b]": 2.0, "io[c]": 1.0}
    for name, y in lanes.items():
        ax.plot([0, 10.6], [y, y], color="#cccccc", lw=1, zorder=0)
        ax.text(-0.2, y, name, ha="right", va="center", fontsize=11)
    green, ghost = "#2ca02c", "#c7e9c0"
    ax.axvspan(-0.05, 1.35, color="#f4f4f4", zorder=-1)
    ax.text(0.65, 4.55, "earlier turns", ha="center", fontsize=9, color="#666666")
    # Turn L-3: the kernel that made level L-3 recorded ready[c] on the compute stream.
    box(ax, 0.1, 2.85, 1.15, 0.3, ghost, "record ready[c]\n(turn L-3)", tc="black", fs=7)
    if kind == "streams":
        # Turn L-m+3 queued the copy of level L-m, the last reader of U[b], on io[b].
        box(ax, 0.1, 1.75, 1.15, 0.5, "#fdd0a2", "copy L-m\n(U[b])", tc="black", fs=8)
        box(ax, 1.6, 3.75, 2.1, 0.5, WAIT, "io[b].synchronize()", fs=9)
        arrow(ax, (1.25, 2.0), (1.9, 3.75), colour=WAIT, ls="--")
        ax.text(1.4, 3.5, "host blocks until that copy ends", fontsize=8, color=WAIT)
        box(ax, 3.9, 2.75, 2.6, 0.5, KERNEL, "kernel: level L -> U[b]", fs=9)
        arrow(ax, (3.7, 4.0), (4.1, 3.25))
        box(ax, 6.6, 2.8, 0.9, 0.4, green, "record\nready[b]", fs=7)
        box(ax, 6.9, 0.75, 1.0, 0.5, green, "wait\nready[c]", fs=8)
        box(ax, 8.0, 0.75, 2.4, 0.5, COPY, "copy level L-3 (U[c])", fs=9)
        arrow(ax, (1.25, 2.95), (7.0, 1.25), colour=green, rad=0.12)
        title = "Stream synchronisation: the host waits on the IO stream that last read U[b]"
    else:
        # Turn L-m+3 recorded copied[b] on io[b] after copying level L-m out of U[b].
        box(ax, 0.05, 1.75, 1.25, 0.5, "#fdd0a2", "copy L-m (U[b]),\nrecord copied[b]", tc="black", fs=7)
        box(ax, 1.6, 2.75, 1.2, 0.5, green, "wait\ncopied[b]", fs=8)
        arrow(ax, (1.25, 2.1), (1.9, 2.75), colour=green, rad=0.2)
        box(ax, 2.95, 2.75, 2.6, 0.5, KERNEL, "kernel: level L -> U[b]", fs=9)
        box(ax, 5.65, 2.8, 0.9, 0.4, green, "record\nready[b]", fs=7)
        box(ax, 6.4, 0.75, 1.0, 0.5, green, "wait\nready[c]", fs=8)
        box(ax, 7.5, 0.75, 1.6, 0.5, COPY, "copy L-3 (U[c])", fs=9)
        box(ax, 9.2, 0.8, 0.9, 0.4, green, "record\ncopied[c]", fs=7)
        arrow(ax, (1.25, 2.95), (6.5, 1.25), colour=green, rad=0.12)
        ax.text(1.6, 4.0, "host: only queues work - it never waits inside the loop", fontsize=10,
                va="center")
        title = "Event synchronisation: streams wait on events, the host runs ahead"
    x_ready = 7.05 if kind == "streams" else 6.1
    ax.annotate("waited on by the copy\nof level L, turn L+3", xy=(x_ready, 2.85), xytext=(x_ready + 0.9, 2.0),
                fontsize=8, color=green, arrowprops=dict(arrowstyle="<|-", color=green, lw=1.1))
    ax.set_title(title, fontsize=11, loc="left")
    ax.text(0, 0.3, "one loop turn for level L (m scratch buffers): b = L % m, c = (L-3) % m; "
            "arrows are the dependencies the loop queues; pale boxes were queued on earlier turns",
            fontsize=9, color="#444444")
    ax.set_xlim(-1.6, 10.7)
    ax.set_ylim(0.15, 4.7)
    ax.axis("off")
    save(fig, f"workflow_{kind}.svg")


def layer_cake():
    """The exercise: plane k bakes in buf[k % 3] on the compute stream and is copied on io[b]."""
    fig, (ax, lo) = plt.subplots(2, 1, figsize=(10, 5.4), gridspec_kw={"height_ratios": [1, 1]})
    for k in range(6):
        y = 0.2 + 0.35 * k
        ax.add_patch(Rectangle((0.2 + 0.15 * k, y), 2.2, 0.3, facecolor=plt.cm.viridis(k / 6),
                               edgecolor="black"))
        ax.text(2.55 + 0.15 * k, y + 0.15, f"plane {k}", va="center", fontsize=9)
    ax.text(1.5, 2.6, "host stack (pinned)", ha="center")
    for b in range(3):
        ax.add_patch(Rectangle((5.2 + 1.3 * b, 1.0), 1.0, 0.6, facecolor="#aec7e8", edgecolor="black"))
        ax.text(5.7 + 1.3 * b, 1.3, f"buf[{b}]", ha="center", va="center")
    ax.text(6.95, 2.0, "device buffers, reused: plane k bakes in buf[k % 3]", ha="center", fontsize=10)
    arrow(ax, (5.1, 1.3), (3.6, 1.3))
    ax.text(4.35, 1.45, "copy (io[b])", ha="center", fontsize=9, color=COPY)
    ax.text(6.95, 0.6, "bake_layer kernel (compute stream)", ha="center", fontsize=9, color=KERNEL)
    ax.set_xlim(0, 9.2)
    ax.set_ylim(0, 2.9)
    ax.axis("off")
    ax.set_title("The layer cake: bake each plane on the device, copy it off while the next one bakes",
                 fontsize=11, loc="left")
    # The goal, not the answer: when each bake and copy could run, with no stream's calls drawn
    # (the waits and records that make it safe are the exercise). A bake takes 3/4 of a copy
    # (bake_layer's oven); one copy to the host at a time; plane k reuses buf[k % 3].
    bake, copy, nbuf = 0.75, 1.0, 3
    lane = {"compute": 2.3, "io[0]": 1.55, "io[1]": 0.95, "io[2]": 0.35}
    for name, y in lane.items():
        lo.plot([0, 8.6], [y + 0.2] * 2, color="#cccccc", lw=1, zorder=0)
        lo.text(-0.15, y + 0.2, name, ha="right", va="center", fontsize=10)
    bake_end, copy_end = [], []
    for k in range(7):
        start = max(bake_end[-1] if bake_end else 0.0, copy_end[k - nbuf] if k >= nbuf else 0.0)
        bake_end.append(start + bake)
        box(lo, start, lane["compute"], bake, 0.4, KERNEL, f"bake {k}", fs=8)
        c0 = max(bake_end[k], copy_end[-1] if copy_end else 0.0)
        copy_end.append(c0 + copy)
        box(lo, c0, lane[f"io[{k % nbuf}]"], copy, 0.4, COPY, f"copy {k}", fs=8)
    lo.text(0, -0.05, "The goal: plane k bakes in buf[k % 3] on compute and is copied out of it on io[k % 3] while "
            "later planes bake.\nWhich waits make that safe, and on which stream, is the exercise.",
            fontsize=8, color="#444444")
    lo.set_xlim(-1.0, 8.8)
    lo.set_ylim(-0.25, 2.8)
    lo.axis("off")
    save(fig, "layer_cake.svg")


def queue_row(ax, y, items):
    """Boxes ``(x, width, colour, text)`` in one stream's lane at ``y``, in the order the loop queues them."""
    for x, w, colour, text in items:
        box(ax, x, y, w, 0.5, colour, text, tc="black" if colour in (IDLE, "#c7e9c0") else "white", fs=8)


def staging_ring():
    """``strategies.staged`` with batch = 2 and 2 staging buffers, every level saved: what its loop
    queues on the compute stream and on io[s], and the events between them."""
    fig, ax = plt.subplots(figsize=(11, 3.6))
    green, d2d = "#2ca02c", "#9467bd"
    lane = {"compute": 2.2, "io[0]": 1.2, "io[1]": 0.4}
    for name, y in lane.items():
        ax.plot([0, 12.4], [y + 0.25] * 2, color="#cccccc", lw=1, zorder=0)
        ax.text(-0.15, y + 0.25, name, ha="right", va="center", fontsize=10)
    compute = []
    x = 0.0
    for k in range(4):                                   # saved levels 0..3: slot j = k % 2 of S[s]
        s_, j = (k // 2) % 2, k % 2
        if j == 0 and k >= 2:
            compute.append((x, 0.9, green, f"wait\ncopied[{s_}]"))
            x += 1.0
        compute.append((x, 0.9, KERNEL, f"kernel {k}"))
        compute.append((x + 0.95, 0.8, d2d, f"D2D \u2192\nS[{s_}][{j}]"))
        x += 1.8
        if j == 1:
            compute.append((x, 0.8, green, f"record\nfilled[{s_}]"))
            io = 1.2 if s_ == 0 else 0.4
            queue_row(ax, io, [(x + 0.1, 0.8, green, f"wait\nfilled[{s_}]"),
                               (x + 0.95, 1.6, COPY, f"D2H S[{s_}]\nlevels {k - 1}, {k}"),
                               (x + 2.6, 0.85, green, f"record\ncopied[{s_}]")])
            arrow(ax, (x + 0.4, 2.2), (x + 0.5, io + 0.5), colour=green)
            x += 0.9
    queue_row(ax, 2.2, compute)
    ax.text(0, -0.15, "Only compute touches the 3 scratch wavefields: each saved level leaves them by a fast "
            "device-to-device copy on the compute stream; the slow device-to-host copy reads the staging "
            "buffer.\nCompute waits (copied[s]) only before refilling a staging buffer whose copy may still run.",
            fontsize=8, color="#444444")
    ax.set_title("The staging ring (staged, batch = 2, nstaging = 2): events between the compute stream "
                 "and the IO streams", fontsize=11, loc="left")
    ax.set_xlim(-1.0, 12.5)
    ax.set_ylim(-0.45, 2.9)
    ax.axis("off")
    save(fig, "staging_ring.svg")


if __name__ == "__main__":
    staging_ring()
    sequential_vs_concurrent()
    problem_setup()
    scratch_ring()
    workflow("streams")
    workflow("events")
    layer_cake()
    print("wrote", sorted(p.name for p in OUT.glob("*.svg")))
