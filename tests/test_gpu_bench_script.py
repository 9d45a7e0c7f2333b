"""benchmarks/run_gpu_bench.sh is run only when a session is lent a GPU, so its script is kept
working here: the same code on CPU tensors, the kernels in Triton's interpreter, a tiny
geometry, one connector of each kind (whole, layerwise, several planes). The script runs as its
own process: where the tests run Triton's interpreter, a fork of this test process (tests/forked.py),
which has torch and Triton imported already; on a GPU host, a fresh interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forked import run_forked

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the GPU bench runs the generated Triton kernels (pip install triton)")


def test_the_gpu_bench_runs_every_contender_and_its_kernels_match_the_torch_path(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    pairs = "vllm_flash_attn_nhd:kv_2ltd,vllm_flash_attn_hnd:kv_t2d,vllm_fp8_tensor_scales:kv_planes"
    script = ROOT / "benchmarks" / "gpu_bench.py"
    args = ["--device", "cpu", "--tokens", "8", "-L", "2", "--heads", "2", "--head-size", "8", "--block-size", "4",
            "--iters", "1", "--repeats", "1", "--warmup", "0", "--pairs", pairs, "--json", str(out)]
    if os.environ.get("TRITON_INTERPRET") == "1":  # tests/conftest.py, without a GPU: a fork interprets too
        stdout, status = run_forked(script, args, tmp_path / "stderr.txt")
        stderr = (tmp_path / "stderr.txt").read_text()
    else:  # a GPU host: kernels already defined here compile for it, so a fresh interpreter
        done = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=600, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
        stdout, status, stderr = done.stdout, done.returncode, done.stderr
    assert status == 0, stdout[-3000:] + stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["layout"], r["obj"], r["dir"]) for r in rows} == {
        (p.split(":")[0], p.split(":")[1], d) for p in pairs.split(",") for d in ("store", "load")}
    assert all(r["kernel_matches_torch"] for r in rows)
    assert all(set(r["gbps"]) == {"kernel", "kernel_only", "torch", "copy", "pinned_kernel", "pinned_torch",
                                  "pinned_copy"} for r in rows)
