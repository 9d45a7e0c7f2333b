"""`kvgen verify`: run every generated connector, store and load, against the reference."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from kvgen.oracle.scenarios import SCENARIOS, check_connector


def _import_package(out: Path) -> Any:
    out = out.resolve()
    if str(out.parent) not in sys.path:
        sys.path.insert(0, str(out.parent))
    return importlib.import_module(out.name)


def main(args: Any) -> int:
    from kvgen.plan.copy import plan_library
    from kvgen.runtime import available_devices
    from kvgen.spec.library import load_library

    package = _import_package(args.out)
    library = load_library()
    plans = [p for p in plan_library(library) if not args.only or args.only in p.module]
    present = available_devices()
    devices = args.device or present
    missing = [d for d in devices if d not in present]
    if missing:
        print(f"kvgen verify: device {', '.join(missing)} is not available here "
              f"(present: {', '.join(present)})", file=sys.stderr)
        return 1
    scenarios = list(SCENARIOS.values())
    rows, failures = [], 0
    print(f"{'layout':<24} {'object':<13} {'mode':<9} {'device':<6} {'store ok':<8} {'load ok':<8}")
    for device in devices:
        for plan in plans:
            # one connector meets every scenario in turn, as an engine's connector meets its caches
            results = check_connector(package, plan.paged, plan.obj, device, scenarios)
            store_ok = all(r[0] for r in results)
            load_ok = all(r[1] for r in results)
            failures += (not store_ok) + (not load_ok)
            rows.append((plan.paged.name, plan.obj.name, plan.mode, device, store_ok, load_ok))
            print(f"{plan.paged.name:<24} {plan.obj.name:<13} {plan.mode:<9} {device:<6} "
                  f"{'yes' if store_ok else 'NO':<8} {'yes' if load_ok else 'NO':<8}", flush=True)
    print(f"\n{len(rows)} connector runs on {', '.join(devices)} ({len(scenarios)} slot scenarios each): "
          f"{len(rows) * 2 - failures} checks passed, {failures} failed")
    return 1 if failures else 0
