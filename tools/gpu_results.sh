#!/usr/bin/env bash
# Re-measure the course's stored GPU results on one NVIDIA GPU, from the repository root.
#
#   bash tools/gpu_results.sh measure OUT     # profile, benchmark sweep, model check, timelines, host cost
#   bash tools/gpu_results.sh tests OUT       # the unit tests on the GPU backend
#   bash tools/gpu_results.sh notebooks OUT   # every notebook executed in place
#   bash tools/gpu_results.sh timelines OUT   # the CUPTI check of the timelines and the host cost
#
# "measure" writes OUT/results.tar: the calibrated profile (h200.json), bench.json/png,
# model_validation.{json,md,png}, trace_check.json and host_cost.json, each with its log.
# Copy them into course_helper/profiles/ and benchmarks/ to update the stored figures.
# "tests" writes OUT/gpu_tests.txt; "notebooks" writes OUT/notebooks.tar (the executed notebooks).
set -euo pipefail
what=${1:?measure or notebooks}
out=${2:?output folder}
mkdir -p "$out/work"
export COURSE_HELPER_BACKEND=gpu PYTHONUNBUFFERED=1
case "$what" in
measure)
    w="$out/work"
    python3 -m course_helper calibrate --out "$w/h200.json" 2>&1 | tail -n 3 | tee "$w/calibrate.log"
    python3 -m course_helper bench --every-sweep --repeats 5 --no-progress --out "$w" 2>&1 | tee "$w/bench.log"
    COURSE_HELPER_BACKEND=cpu python3 -m benchmarks.validate_model "$w/bench.json" --profile "$w/h200.json" --fit-pageable \
        --out "$w" 2>&1 | tee "$w/validate.log"
    python3 -m benchmarks.trace_check --out "$w/trace_check.json" 2>&1 | tail -n 40 | tee "$w/trace_check.log"
    python3 -m benchmarks.host_cost --repeats 11 --out "$w/host_cost.json" 2>&1 | tail -n 20 | tee "$w/host_cost.log"
    tar -C "$w" -cf "$out/results.tar" .
    ;;
tests)
    python3 -m pytest tests -m "not e2e" -q -p no:cacheprovider --timeout 300 -x 2>&1 | tail -n 40 \
        | tee "$out/gpu_tests.txt"
    ;;
notebooks)
    python3 tools/execute_notebooks.py 2>&1 | tee "$out/notebooks.log"
    tar -cf "$out/notebooks.tar" notebooks
    ;;
timelines)       # the CUPTI check of the timelines and the host cost alone
    python3 -m benchmarks.trace_check --out "$out/trace_check.json" 2>&1 | tail -n 40 > "$out/trace_check.log"
    python3 -m benchmarks.host_cost --repeats 11 --out "$out/host_cost.json" 2>&1 | tail -n 20 | tee "$out/host_cost.log"
    ;;
*)
    echo "usage: $0 measure|tests|notebooks|timelines OUT" >&2
    exit 2
    ;;
esac
