#!/usr/bin/env bash
# The default `kvgen bench` on the CPU: every default connector at 256 and 2048 tokens,
# figures and machine facts into benchmarks/results-cpu.json. Extra arguments are passed
# on (e.g. --tokens 256,2048,8192, --plot benchmarks/results-cpu.png).
# No pass/fail on speed: the figures depend on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m kvgen bench --device cpu --json benchmarks/results-cpu.json "$@"
