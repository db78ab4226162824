"""Print the README's headline table from a benchmark sweep (default: benchmarks/bench.json).

    python3 tools/results_table.py [BENCH_JSON]

One row per point: the physical limit B, the three steps of the lesson's ladder (pageable
sequential, sequential-pinned, the events loop with its hidden fraction), and the strategy nearest
B. tests/test_repository.py checks that the README holds exactly this table.
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


if __name__ == "__main__":
    path = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "bench.json"
    print(headline_table(json.loads(path.read_text())))
