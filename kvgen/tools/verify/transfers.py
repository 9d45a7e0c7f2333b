"""`kvgen verify` for layout-to-layout transfers: the package must hold exactly the transfers
the transfers files declare, and each one, whole and layer by layer, must leave every scenario's
destination as the element-by-element reference does (kvgen.oracle.scenarios.transfers)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from kvgen.errors import display_path
from kvgen.tools.paths import rebuild_command
from kvgen.tools.verify.pool import Rows, each


def mismatch(package: ModuleType, transfers: Sequence[Any], out: Path, specs: Sequence[Path]) -> str | None:
    """Why the package's transfers and the declared ones disagree, or None."""
    shown = display_path(out)
    declared = {(p.src.name, p.dst.name) for p in transfers}
    have = set(getattr(package, "TRANSFERS", {}))
    rebuild = rebuild_command(out, specs)
    extra = sorted(have - declared)
    if extra:
        return (f"the package at {shown} holds {len(extra)} transfers no transfers file given declares: "
                f"{', '.join(f'{a} -> {b}' for a, b in extra)}; pass the --specs folders it was built with")
    missing = sorted(declared - have)
    if missing:
        return (f"the package at {shown} lacks {len(missing)} declared transfers: "
                f"{', '.join(f'{a} -> {b}' for a, b in missing)}; rebuild it with {rebuild}")
    return None


def check(package: ModuleType, pair: Any, device: str, layerwise: bool) -> bool:
    """Every applicable scenario through one transfer object; a raise counts as a failure."""
    # torch: only for a run
    from kvgen.oracle.scenarios.transfers import SCENARIOS, TransferRun, applies, check_transfer

    transfer = package.transfer(pair.src.name, pair.dst.name)()
    ok = True
    for sc in SCENARIOS.values():
        if not applies(pair.src, pair.dst, sc):
            continue
        try:
            ok &= check_transfer(package, pair.src, pair.dst, device, sc,
                                 TransferRun(transfer=transfer, layerwise=layerwise))
        except Exception as exc:  # a wrong transfer may raise anything; report it and go on
            print(f"kvgen verify: {pair.module} on {device}, scenario {sc.name}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            ok = False
    return ok


def run(rows: Rows, selected: Sequence[Any], everything: Sequence[Any], devices: Sequence[str]) -> tuple[int, int]:
    """Print one row per transfer and device (checked by `rows`); (checks, failures)."""
    if not selected:
        return 0, 0
    # torch: only for a run
    from kvgen.oracle.scenarios.transfers import SCENARIOS

    wide = max([30, *(len(p.src.name) for p in selected)]), max([34, *(len(p.dst.name) for p in selected)])
    print(f"\n{'source':<{wide[0]}} {'destination':<{wide[1]}} {'device':<6} {'whole ok':<8} per layer ok")
    failures = 0
    for pair, device, (whole, layers) in each(rows, "transfer", selected, everything, devices):
        failures += (not whole) + (not layers)
        print(f"{pair.src.name:<{wide[0]}} {pair.dst.name:<{wide[1]}} {device:<6} {'yes' if whole else 'NO':<8} "
              f"{'yes' if layers else 'NO'}", flush=True)
    checks = 2 * len(selected) * len(devices)
    print(f"\n{len(selected) * len(devices)} transfer runs ({len(SCENARIOS)} scenarios each, whole and per layer): "
          f"{checks - failures} checks passed, {failures} failed")
    return checks, failures
