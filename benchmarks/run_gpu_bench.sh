#!/usr/bin/env bash
# GPU figures, in two parts (~4-8 minutes on an H200; needs torch with CUDA, or XPU with
# DEVICE=xpu, and triton):
#  1. benchmarks/gpu_bench.py: each connector's Triton kernel against the torch path and a
#     device-to-device copy (whole call and kernel launch alone; device and pinned host
#     objects; 256 and 2048 tokens) -> benchmarks/results-gpu.json. Extra arguments go here.
#  2. kvgen bench on the device with the Triton and torch movers: the default connectors,
#     layout-to-layout transfers and model connectors, with the speed-target table
#     -> benchmarks/results-gpu-bench.json.
# Part 2 runs even if part 1 fails; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
status=0
PYTHONPATH=. "$PY" benchmarks/gpu_bench.py --device "$DEVICE" --json benchmarks/results-gpu.json "$@" || status=$?
PYTHONPATH=. "$PY" -m kvgen bench --device "$DEVICE" --backend triton,torch --tokens 256,2048 \
    --json benchmarks/results-gpu-bench.json || { rc=$?; [ "$status" -eq 0 ] && status=$rc; }
exit "$status"
