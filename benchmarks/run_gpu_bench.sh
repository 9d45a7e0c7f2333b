#!/usr/bin/env bash
# GPU figures of the generated Triton kernels (kernel vs torch path vs device copy, device and
# pinned host objects, 256 and 2048 tokens) into benchmarks/results-gpu.json; ~2-4 minutes on
# an H200. Needs torch with CUDA (or XPU: --device xpu) and triton. Extra arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=. exec "${PYTHON:-python3}" benchmarks/gpu_bench.py --json benchmarks/results-gpu.json "$@"
