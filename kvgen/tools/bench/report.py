"""What a bench run prints and writes: the machine's facts, the figures table with the
memcpy-stability flag, the check-cost table and the JSON document (plot.py draws it)."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvgen import __version__
from kvgen.tools.bench.measure import MEMCPY_VARIATION_LIMIT, CheckCost, Row
from kvgen.tools.bench.models import text as model_text
from kvgen.tools.bench.targets import MLA_C
from kvgen.tools.bench.text_table import table
from kvgen.tools.bench.transfers import text as transfer_text

if TYPE_CHECKING:
    from kvgen.tools.bench.run import Result

HEADERS = ("layout", "object", "mode", "backend", "tokens", "dir", "GB/s", "memcpy GB/s", "x memcpy min-med-max",
           "naive GB/s", "x naive min-med-max", "memcpy var", "peak MiB", "naive==kvgen")
#: Marks a row whose memcpy baseline varied more than MEMCPY_VARIATION_LIMIT.
UNSTABLE_MARK = "!"


def machine_facts(device: str) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    facts = {"platform": platform.platform(), "python": platform.python_version(), "cpu_model": cpu,
             "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
             "device": device, "kvgen": __version__,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return facts


def row_cells(row: Row) -> tuple[str, ...]:
    var = f"{row.memcpy_variation * 100:.0f}%" + (f" {UNSTABLE_MARK}" if row.memcpy_unstable else "  ")
    peak = "-" if row.peak_bytes is None else f"{row.peak_bytes / (1 << 20):.1f}"
    naive = row.x_naive
    return (row.layout, row.obj, row.mode, row.backend, str(row.tokens), row.dir, f"{row.gbps():.2f}",
            f"{row.gbps('memcpy'):.2f}", row.x_memcpy.cell(), f"{row.gbps('naive'):.2f}" if naive else "-",
            naive.cell() if naive else "-", var, peak,
            "-" if row.naive_matches is None else "yes" if row.naive_matches else "NO")


def check_table(checks: Sequence[CheckCost]) -> str:
    """One row per connector, one column per named timing (in first-seen order)."""
    names = list(dict.fromkeys(name for c in checks for name in c.us))
    cells = [(c.layout, c.obj, *(f"{c.us[n]:.2f}" if n in c.us else "-" for n in names)) for c in checks]
    return table(("layout", "object", *(f"{n} us" for n in names)), cells)


def stability_warning(rows: Sequence[Row]) -> str | None:
    flagged = [r for r in rows if r.memcpy_unstable]
    if not flagged:
        return None
    worst = max(r.memcpy_variation for r in flagged)
    return (f"WARNING: the memcpy baseline varied by more than {MEMCPY_VARIATION_LIMIT:.0%} (max/min - 1) on "
            f"{len(flagged)} of {len(rows)} rows (marked {UNSTABLE_MARK}, worst {worst:.0%}): the machine was busy "
            "or changed speed during those rows, so their figures are not reliable; run again on a quiet machine")


def as_json(result: Result, machine: dict[str, Any]) -> dict[str, Any]:
    rows = [r.as_dict() for r in result.rows]
    return {"machine": machine, "config": result.config, "rows": rows,
            "check_costs": [c.as_dict() for c in result.checks],
            "memcpy_variation_limit": MEMCPY_VARIATION_LIMIT,
            "memcpy_unstable_rows": sum(1 for r in result.rows if r.memcpy_unstable),
            "transfers": [r.as_dict() for r in result.transfers],
            "models": [r.as_dict() for r in result.models]}


def text(result: Result, machine: dict[str, Any]) -> str:
    """Everything `kvgen bench` prints on stdout, but the lines about written files."""
    c = result.config
    out = [f"kvgen bench: {machine['device']}, {machine['cpu_model']}, {machine['cpu_count']} CPUs, "
           f"torch {machine['torch']}; L={c['layers']} H={c['heads']} C={c['head_size']} (MLA: C={MLA_C}) "
           f"N={c['block_size']} {c['dtype']}, {c['alloc']} blocks, {c['repeats']} repeats (warmup {c['warmup']}) "
           "in rotated order; GB/s from median seconds, x columns paired per repeat"
           + ("; a busy neighbour process ran torch work on every core" if c.get("busy") else ""), ""]
    out.append(table(HEADERS, [row_cells(r) for r in result.rows]))
    out.append("x memcpy = memcpy seconds / kvgen seconds and x naive = naive seconds / kvgen seconds, each of "
               "the same repeat; memcpy var = max/min - 1 of the memcpy repeats; backend = what the connector "
               "moved data with; peak MiB = extra resident memory of one kvgen call at its peak")
    warning = stability_warning(result.rows)
    if warning:
        out += ["", warning]
    out += ["", "Input-check cost per call (median microseconds): bind on a fresh connector, bind again "
            "with the same cache (cached), plan_chunk per chunk, the alias checks of a chunk's objects "
            "(apart from each other and the cache) and of a load's slots (each written once)",
            check_table(result.checks), ""]
    checked = [r for r in result.rows if r.naive_matches is not None]
    bad = sum(1 for r in checked if not r.naive_matches)
    if bad:
        out.append(f"naive baseline DISAGREED with the connector on {bad} of {len(checked)} rows")
    elif checked:
        out.append(f"naive baseline agreed bit for bit with the connector on all {len(checked)} rows")
    if len(checked) < len(result.rows):
        out.append(f"{len(result.rows) - len(checked)} rows have no naive baseline (caches of several planes or of "
                   "several slots per token: `kvgen verify` checks those connectors against the reference)")
    if result.transfers:
        out += transfer_text(result.transfers)
    if result.models:
        out += model_text(result.models)
    return "\n".join(out)
