"""Draw the course's diagrams into images/ as SVG.

Run from the repository root:  python tools/make_diagrams.py
The output is deterministic (fixed hash salt, no date), so re-running it only
changes files whose drawing code changed.
"""
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

plt.rcParams.update({"svg.hashsalt": "course", "font.size": 11, "font.family": "DejaVu Sans"})
OUT = pathlib.Path(__file__).resolve().parents[1] / "images"
KERNEL, COPY, WAIT, IDLE = "#1f77b4", "#ff7f0e", "#7f7f7f", "#eeeeee"


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


def sequential_vs_concurrent():
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    k, c = 1.0, 0.8
    ax = axes[0]
    t = 0
    for n in range(5):
        box(ax, t, 0.55, k, 0.35, KERNEL, f"kernel {n}")
        box(ax, t + k, 0.1, c, 0.35, COPY, f"copy {n}")
        t += k + c
    ax.text(-0.2, 0.72, "stream", ha="right", va="center")
    ax.text(-0.2, 0.27, "(same stream)", ha="right", va="center", fontsize=9)
    ax.set_title("Sequential IO: every copy waits for its kernel, every kernel for the copy before it",
                 fontsize=11, loc="left")
    ax = axes[1]
    for n in range(5):
        box(ax, n * k, 0.55, k, 0.35, KERNEL, f"kernel {n}")
        box(ax, (n + 1) * k, 0.1, c, 0.35, COPY, f"copy {n}")
    ax.text(-0.2, 0.72, "compute stream", ha="right", va="center")
    ax.text(-0.2, 0.27, "IO streams", ha="right", va="center")
    ax.set_title("Concurrent IO: copy n runs while kernel n+1 computes", fontsize=11, loc="left")
    axes[1].annotate("", xy=(5 * k + c, -0.05), xytext=(5 * (k + c), -0.05),
                     arrowprops=dict(arrowstyle="<->", color="green"))
    axes[1].text(5 * k + c + 0.1, -0.2, "time saved", color="green", fontsize=10)
    for ax in axes:
        ax.set_xlim(-0.1, 5 * (k + c) + 0.2)
        ax.set_ylim(-0.3, 1.0)
        ax.axis("off")
    axes[1].annotate("time", xy=(9.1, -0.28), xytext=(8.2, -0.28), arrowprops=dict(arrowstyle="->"),
                     va="center")
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
    fig, ax = plt.subplots(figsize=(10, 3.0))
    m = 5
    level = 12
    labels = {}
    for lv in range(level - 4, level + 1):
        labels[lv % m] = lv
    for b in range(m):
        lv = labels[b]
        if lv == level:
            colour, role = KERNEL, "written by\nthe kernel"
        elif lv >= level - 2:
            colour, role = "#aec7e8", "read by\nthe kernel"
        elif lv == level - 3:
            colour, role = COPY, "inactive:\nbeing copied"
        else:
            colour, role = IDLE, "inactive:\ncopy done,\nfree for reuse"
        x = b * 1.9
        ax.add_patch(FancyBboxPatch((x, 0.5), 1.5, 1.1, boxstyle="round,pad=0.05", facecolor=colour,
                                    edgecolor="black"))
        ax.text(x + 0.75, 1.25, f"U[{b}]", ha="center", fontsize=11, weight="bold",
                color="white" if colour in (KERNEL, COPY) else "black")
        ax.text(x + 0.75, 0.85, f"level {lv}", ha="center", fontsize=10,
                color="white" if colour in (KERNEL, COPY) else "black")
        ax.text(x + 0.75, 0.35, role, ha="center", va="top", fontsize=9)
    ax.set_title(f"Scratch ring of nscratch = {m} wavefields while the kernel computes level {level} "
                 f"(level L lives in U[L % {m}])", fontsize=11, loc="left")
    ax.set_xlim(-0.2, m * 1.9)
    ax.set_ylim(-0.6, 1.8)
    ax.axis("off")
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
    fig, ax = plt.subplots(figsize=(9, 3.2))
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
    ax.text(4.35, 1.45, "copy (IO stream)", ha="center", fontsize=9, color=COPY)
    ax.text(6.95, 0.6, "bake_layer kernel (compute stream)", ha="center", fontsize=9, color=KERNEL)
    ax.set_xlim(0, 9.2)
    ax.set_ylim(0, 2.9)
    ax.axis("off")
    ax.set_title("The layer cake: bake each plane on the device, copy it off while the next one bakes",
                 fontsize=11, loc="left")
    save(fig, "layer_cake.svg")


def staging_ring():
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for b in range(3):
        ax.add_patch(FancyBboxPatch((0.2 + 1.2 * b, 1.6), 1.0, 0.8, boxstyle="round,pad=0.03",
                                    facecolor="#aec7e8" if b else KERNEL, edgecolor="black"))
        ax.text(0.7 + 1.2 * b, 2.0, f"U[{b}]", ha="center", va="center",
                color="white" if b == 0 else "black")
    ax.text(1.9, 2.7, "scratch ring (3 wavefields, compute stream only)", ha="center", fontsize=10)
    for s_ in range(4):
        x = 4.6 + 1.3 * s_
        colour = COPY if s_ == 1 else ("#dbe9f6" if s_ == 0 else IDLE)
        ax.add_patch(FancyBboxPatch((x, 1.5), 1.1, 1.0, boxstyle="round,pad=0.03", facecolor=colour,
                                    edgecolor="black"))
        ax.text(x + 0.55, 2.0, f"S[{s_}]\n{'filling' if s_ == 0 else ('copying' if s_ == 1 else 'free')}",
                ha="center", va="center", fontsize=9)
    ax.text(7.1, 2.7, "staging ring (nstaging buffers of `batch` levels)", ha="center", fontsize=10)
    arrow(ax, (3.7, 2.0), (4.55, 2.0), colour="#9467bd")
    ax.text(4.1, 2.15, "D2D\n(fast)", ha="center", fontsize=8, color="#9467bd")
    ax.add_patch(Rectangle((5.6, 0.2), 3.0, 0.5, facecolor="#f7f7f7", edgecolor="black"))
    ax.text(7.1, 0.45, "pinned host output", ha="center", va="center", fontsize=9)
    arrow(ax, (6.45, 1.45), (6.9, 0.75), colour=COPY)
    ax.text(7.0, 1.05, "D2H on an IO stream (slow)", fontsize=8, color=COPY)
    ax.text(0.2, 0.55, "compute waits only when\nevery staging buffer is\nstill being copied", fontsize=9)
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 3.0)
    ax.axis("off")
    ax.set_title("The staging ring: the scratch ring is freed by a fast device copy, the slow host "
                 "copy runs from the staging buffer", fontsize=11, loc="left")
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
