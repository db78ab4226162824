"""Minutes per lesson for docs/instructor-guide.md: the notebook's length plus its measured execution.

Run from the repository root:

    python tools/lesson_minutes.py --measure times.json     # execute each lesson on the CPU backend, one at a time
    python tools/lesson_minutes.py --times times.json       # print the guide's table from those times

Measuring runs every lesson notebook in a fresh kernel (nbclient) with COURSE_HELPER_BACKEND=cpu,
one after the other, and records its wall time and the CPU time its kernel used (with the processes
it started: notebook 12's ranks, notebook 11's child), read by one cell added at the end; the
notebooks are not modified. On a busy machine the wall time grows with the load and the CPU time
does not, so the estimate takes the CPU time:

    minutes = markdown words / WORDS_PER_MINUTE + code lines / CODE_LINES_PER_MINUTE
              + kernel CPU seconds / 60 + EXERCISE_MINUTES per exercise

rounded up to 5 minutes. The two reading rates and the exercise allowance are choices, stated
here and in the guide, not measurements.
"""
import argparse
import json
import math
import os
import pathlib
import re
import sys
import time

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 150          # careful reading of technical prose with figures
CODE_LINES_PER_MINUTE = 10      # reading a cell, running it, looking at what it printed
EXERCISE_MINUTES = 10           # per exercise: writing and re-running one's own answer
#: The cell added at the end of each notebook: the kernel's CPU seconds, its children's included.
CPU_CELL = ("import resource as _r\n"
            "print('CPU-SECONDS', sum(getattr(_r.getrusage(w), f) for w in (_r.RUSAGE_SELF, _r.RUSAGE_CHILDREN) "
            "for f in ('ru_utime', 'ru_stime')))")
EXERCISE = re.compile(r"(?<![\w.])(?:[\w.]+\.)?(check_\w+)\s*\(")


def lessons():
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def measure(out):
    from nbclient import NotebookClient
    times = json.loads(out.read_text()) if out.exists() else {}
    env = dict(os.environ, COURSE_HELPER_BACKEND="cpu", PYTHONPATH=str(ROOT))
    for path in lessons():
        if path.name in times:
            continue
        nb = nbformat.read(path, as_version=4)
        nb.cells.append(nbformat.v4.new_code_cell(CPU_CELL))
        t0 = time.time()
        NotebookClient(nb, timeout=1200, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute(env=env)
        wall = time.time() - t0
        said = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("output_type") == "stream")
        errors = [f"{o.ename}: {o.evalue}"[:200] for c in nb.cells[:-1] if c.cell_type == "code" for o in c.outputs
                  if o.output_type == "error" and "raises-exception" not in c.metadata.get("tags", [])]
        times[path.name] = {"seconds": round(wall, 1), "cpu_seconds": round(float(said.split()[-1]), 1),
                            "errors": errors, "load_average": os.getloadavg()[0]}
        out.write_text(json.dumps(times, indent=1))
        print(path.name, times[path.name], flush=True)


def table(times):
    rows = ["| notebook | markdown words | code lines | exercises | kernel CPU (s) | wall (s) | estimate (min) "
            "| the notebook says |", "|---|---|---|---|---|---|---|---|"]
    for path in lessons():
        nb = nbformat.read(path, as_version=4)
        words = sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
        code = [c.source for c in nb.cells if c.cell_type == "code"]
        lines = sum(len(s.splitlines()) for s in code)
        defined = {m for s in code for m in re.findall(r"def\s+(check_\w+)", s)}
        exercises = len({m for s in code for m in EXERCISE.findall(re.sub(r"def\s+check_\w+", "", s))} | defined)
        seconds, wall = times[path.name]["cpu_seconds"], times[path.name]["seconds"]
        minutes = (words / WORDS_PER_MINUTE + lines / CODE_LINES_PER_MINUTE + seconds / 60
                   + EXERCISE_MINUTES * exercises)
        prose = "".join(c.source for c in nb.cells if c.cell_type == "markdown")
        said = re.search(r"About \*\*(\d+) minutes\*\*", prose)
        rows.append(f"| {path.stem[:2]} | {words} | {lines} | {exercises} | {seconds:.0f} | {wall:.0f} "
                    f"| {5 * math.ceil(minutes / 5)} | {said.group(1) if said else '-'} |")
    return "\n".join(rows)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", type=pathlib.Path, help="execute the lessons and write their times here")
    p.add_argument("--times", type=pathlib.Path, help="print the table from these times")
    args = p.parse_args(argv)
    if args.measure:
        measure(args.measure)
    if args.times or args.measure:
        print(table(json.loads((args.times or args.measure).read_text())))
    else:
        p.error("give --measure FILE or --times FILE")


if __name__ == "__main__":
    main(sys.argv[1:])
