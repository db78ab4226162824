"""Measuring: the benchmark sweep against the physical limit B, side-by-side comparisons, and the
calibration that fits the modelled device's profile to a real GPU; and the claims a notebook
makes about its own run, checked against it.
"""
from . import bench  # noqa: F401 - the module: the benchmark's names, gathered from its parts below
from .limit import compute_only_ms, peak_d2h_gbps, physical_limit
from .report import plot_bench
from .sweep import BALANCED_POINT, measure_trace_cost, paired_ratio, run_bench
from . import calibrate  # noqa: F401 - the module: calibrate.calibrate() fits a profile
from .compare import Comparison, compare_strategies
from .claims import ClaimRefuted, claim, faster

__all__ = ["BALANCED_POINT", "compute_only_ms", "measure_trace_cost", "paired_ratio", "peak_d2h_gbps",
           "physical_limit", "plot_bench", "run_bench", "Comparison",
           "compare_strategies", "ClaimRefuted", "claim", "faster"]
