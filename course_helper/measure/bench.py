"""The benchmark: how close does each strategy get to the physical limit?

For one run, no overlap strategy can beat

    B = max(compute-only time, output bytes / peak pinned device-to-host bandwidth)

both measured in the same process on the same device. ``efficiency = B / time``.
Run it with::

    python -m course_helper bench --out benchmarks/

It writes ``bench.json`` (the machine, every point, every repeat) and
``bench.png`` (efficiency and speedup per strategy per size). Timings belong
here, not in tests: the tests only check that the numbers are well formed.

Each strategy's row also says how much of its work overlapped, from its traced
runs (CUPTI on a GPU, the model on the CPU; :meth:`Trace.overlap`): compute and
device-to-host copy busy times, the time both ran at once, and the hidden
fraction (overlap / the shorter of the two). ``--nscratch 5,8,12`` repeats every
point at each ring depth, e.g. the balanced point's ring sweep::

    python -m course_helper bench --points 3072x320x16 --nscratch 5,8,12,16,20,24 --out benchmarks/ring

Its parts: :mod:`.limit` (B), :mod:`.sweep` (the strategies timed at each point),
:mod:`.disk_sweep` (runs streamed to a disk) and :mod:`.report` (the table, the figure, the
results file); their names are gathered here.
"""
from .disk_sweep import DISK_POINTS, check_disk_folder, disk_bandwidth, disk_point
from .limit import compute_only_ms, peak_d2h_gbps, physical_limit
from .report import machine_info, plot_bench, table, write_json
from .sweep import (BALANCED_POINT, DEFAULT_POINTS, EVERY_POINTS, QUICK_POINTS, RAW_ROW, add_trace_cost, bench_point,
                    measure_trace_cost, paired_ratio, parse_nscratch, run_bench)

__all__ = ["DEFAULT_POINTS", "BALANCED_POINT", "EVERY_POINTS", "QUICK_POINTS", "peak_d2h_gbps", "parse_nscratch",
           "compute_only_ms", "physical_limit", "bench_point", "run_bench", "plot_bench", "DISK_POINTS", "disk_point",
           "RAW_ROW", "paired_ratio", "add_trace_cost", "measure_trace_cost", "check_disk_folder", "disk_bandwidth",
           "machine_info", "table", "write_json"]
