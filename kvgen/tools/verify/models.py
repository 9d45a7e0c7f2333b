"""`kvgen verify` for model connectors: the package must hold exactly the model connectors the
library plans (one per model and groups object whose groups all have a member), and each one,
both ways, must give what the reference (kvgen.oracle.reference.models) gives for every model scenario."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from kvgen.errors import display_path
from kvgen.tools.paths import rebuild_command
from kvgen.tools.verify.pool import Rows, each


def mismatch(package: ModuleType, plans: Sequence[Any], out: Path, specs: Sequence[Path]) -> str | None:
    """Why the package's model connectors and the planned ones disagree, or None."""
    shown = display_path(out)
    planned = {(p.model.name, p.obj.name) for p in plans}
    have = set(getattr(package, "MODELS", {}))
    extra = sorted(have - planned)
    if extra:
        return (f"the package at {shown} holds {len(extra)} model connectors this library does not plan: "
                f"{', '.join(f'{a}__{b}' for a, b in extra)}; pass the --specs folders it was built with")
    missing = sorted(planned - have)
    if missing:
        return (f"the package at {shown} lacks {len(missing)} model connectors this library plans: "
                f"{', '.join(f'{a}__{b}' for a, b in missing)}; rebuild it with {rebuild_command(out, specs)}")
    return None


def rank(model: Any) -> int:
    """The largest TP every group's heads and every state split divide: the smallest caches
    that still check the declared geometry (the reference works value by value)."""
    values = [g.size("H") for g in model.groups if g.size("H")]
    values += [t.shape[t.split] for s in model.states for t in s.tensors if t.split is not None]
    return math.gcd(*values) if values else 1


def expected_work(plan: Any) -> int:
    """A model row's work, relative to the others': each scenario moves the least common multiple
    of the groups' tokens per slot times its tokens (kvgen.oracle.scenarios.models.in_whole_slots)
    through every layer. DeepSeek-V4's 128 tokens per compressed slot make its rows the longest
    by far, so they start first."""
    groups = plan.model.groups
    return (math.lcm(*(g.tokens_per_slot for g in groups)) if groups else 1) * plan.model.layers


def check(package: ModuleType, library: Any, plan: Any, device: str) -> tuple[bool, bool]:
    # torch: only for a run
    from kvgen.oracle.scenarios.models import SCENARIOS, ModelRun, check_model

    tp = rank(plan.model)
    connector = package.get_model(plan.model.name, plan.obj.name)(device=device, tp=tp)
    store = load = True
    for sc in SCENARIOS.values():
        try:
            s, ld = check_model(package, library, plan.model, plan.obj, sc, ModelRun(device, tp, connector))
        except Exception as exc:  # a wrong connector may raise anything; report it and go on
            print(f"kvgen verify: {plan.module} on {device}, scenario {sc.name}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            s = ld = False
        store, load = store and s, load and ld
    return store, load


def run(rows: Rows, selected: Sequence[Any], everything: Sequence[Any], devices: Sequence[str]) -> tuple[int, int]:
    """Print one row per model connector of `selected` and device (checked by `rows`); (checks, failures)."""
    if not selected:
        return 0, 0
    # torch: only for a run
    from kvgen.oracle.scenarios.models import SCENARIOS

    wide = max([24, *(len(p.model.name) for p in selected)]), max([22, *(len(p.obj.name) for p in selected)])
    print(f"\n{'model':<{wide[0]}} {'object':<{wide[1]}} {'device':<6} {'store ok':<8} load ok")
    failures = 0
    for plan, device, (store, load) in each(rows, "model", selected, everything, devices, expected_work):
        failures += (not store) + (not load)
        print(f"{plan.model.name:<{wide[0]}} {plan.obj.name:<{wide[1]}} {device:<6} {'yes' if store else 'NO':<8} "
              f"{'yes' if load else 'NO'}", flush=True)
    checks = 2 * len(selected) * len(devices)
    print(f"\n{len(selected) * len(devices)} model connector runs ({len(SCENARIOS)} scenarios each, groups and "
          f"state): {checks - failures} checks passed, {failures} failed")
    return checks, failures
