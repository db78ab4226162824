"""Print the README's results tables from the committed benchmark files.

    python3 tools/results_table.py [BENCH_JSON]       # one GPU (default: benchmarks/bench.json)
    python3 tools/results_table.py --halo [HALO_JSON]  # two GPUs (default: benchmarks/halo.json)

One GPU: one row per point: the physical limit B, the three steps of the lesson's ladder (pageable
sequential, sequential-pinned, the events loop with its hidden fraction), and the strategy nearest
B. Two GPUs: one row per grid size per GPU (weak scaling): the time on one GPU, the distributed
bound on two, and each halo strategy's time with its weak-scaling efficiency (one GPU's time over
two GPUs' time) and its efficiency against the bound. tests/test_repository.py checks that the
README and the docs hold exactly these tables.
"""
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LADDER = ("sequential", "sequential-pinned", "events")


def headline_table(doc):
    """The markdown table of ``doc`` (a bench.json document), as a string."""
    lines = ["| grid × levels, saved | B (ms) | sequential (ms) | sequential-pinned (ms) "
             "| events (ms, hidden) | best strategy | best (ms, efficiency) |",
             "|---|---|---|---|---|---|---|"]
    for p in doc["points"]:
        rows = p["strategies"]
        seq, pinned, events = (rows[name] for name in LADDER)
        best_name = min((n for n in rows if "median_ms" in rows[n] and not n.startswith("raw")),
                        key=lambda n: rows[n]["median_ms"])
        best = rows[best_name]
        lines.append(f"| {p['n']}² × {p['nt']}, every {p['every']} | {p['bound_ms']:.2f} | {seq['median_ms']:.1f} "
                     f"| {pinned['median_ms']:.1f} | {events['median_ms']:.1f} ({events['hidden_fraction']:.0%}) "
                     f"| {best_name} | {best['median_ms']:.2f} ({best['efficiency']:.2f}) |")
    return "\n".join(lines)


HALO_STRATEGIES = ("blocking", "overlap", "overlap-graph")


def halo_table(doc):
    """The markdown weak-scaling table of ``doc`` (a halo.json document), as a string."""
    lines = ["| grid per GPU | 1 GPU (ms) | B on 2 GPUs (ms) | " + " | ".join(HALO_STRATEGIES) + " |",
             "|---|---|---|" + "---|" * len(HALO_STRATEGIES)]
    one = {p["n1"]: p for p in doc["weak"] if p["ranks"] == 1}
    for two in (p for p in doc["weak"] if p["ranks"] == 2):
        single = one[two["n1"]]["strategies"]["blocking"]["ms"]
        cells = []
        for name in HALO_STRATEGIES:
            row = two["strategies"][name]
            cells.append(f"{row['ms']:.1f} ({single / row['ms']:.2f}, {row['bound_efficiency']:.2f})")
        lines.append(f"| {two['n1']}² | {single:.1f} | {two['bound_ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--halo"]:
        path = pathlib.Path(args[1]) if len(args) > 1 else ROOT / "benchmarks" / "halo.json"
        print(halo_table(json.loads(path.read_text())))
    else:
        path = pathlib.Path(args[0]) if args else ROOT / "benchmarks" / "bench.json"
        print(headline_table(json.loads(path.read_text())))
