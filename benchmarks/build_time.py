"""`kvgen build` wall time against the start-up of `python -c "import yaml, jinja2, jsonschema"`.

Usage: python benchmarks/build_time.py [runs]   (median of runs, default 9; each a fresh process)
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def median_seconds(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    kvgen = shutil.which("kvgen") or sys.exit("kvgen is not on PATH: pip install -e . first")
    with tempfile.TemporaryDirectory() as tmp:
        base = median_seconds([sys.executable, "-c", "import yaml, jinja2, jsonschema"], runs)
        build = median_seconds([kvgen, "build", "--out", f"{tmp}/generated"], runs)
        torch_free = subprocess.run(
            [sys.executable, "-c", "import sys; from kvgen.emit.build import render; render(); "
             "print('torch' in sys.modules)"], capture_output=True, text=True, check=True).stdout.strip()
    print(f"import yaml, jinja2, jsonschema: {base:.3f} s (median of {runs})")
    print(f"kvgen build (whole library):      {build:.3f} s = {build / base:.2f} x")
    print(f"torch imported by a build:        {torch_free}")


if __name__ == "__main__":
    main()
