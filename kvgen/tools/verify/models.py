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


#: A model whose groups store more tokens than this per slot runs every scenario at that many
#: times the tokens (chunks must start and end on whole slots): DeepSeek-V4's 128 makes one
#: scenario of its 43 layers (caches of up to 84 M elements) 13 s of CPU, most of it the
#: element-by-element reference, so its two connectors' 7 scenarios would add about 3 minutes.
#: A whole verify leaves such models to `--only` and says so; the suite checks them on one
#: scenario (tests/test_model_connectors.py) and against the engine (tests/test_engine_vllm_dsv4.py).
LONG_SLOTS = 16


def long_slots(model: Any) -> int:
    """The most tokens one slot of the model's groups stores (1: a slot per token)."""
    return max((g.tokens_per_slot for g in model.groups), default=1)


def left_to_only(plans: Sequence[Any]) -> list[Any]:
    """The model connectors a whole verify leaves to `--only` (see LONG_SLOTS)."""
    return [p for p in plans if long_slots(p.model) > LONG_SLOTS]


def rank(model: Any) -> int:
    """The largest TP every group's heads and every state split divide: the smallest caches
    that still check the declared geometry (the reference works value by value)."""
    values = [g.size("H") for g in model.groups if g.size("H")]
    values += [t.shape[t.split] for s in model.states for t in s.tensors if t.split is not None]
    return math.gcd(*values) if values else 1


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


def run(rows: Rows, chosen: Any, everything: Sequence[Any], devices: Sequence[str]) -> tuple[int, int]:
    """Print one row per model connector of `chosen.models` and device (checked by `rows`), and
    a line for each of `chosen.left`; (checks, failures)."""
    for plan in chosen.left:
        k = long_slots(plan.model)
        print(f"kvgen verify: {plan.module} ({k} tokens per slot, so every scenario moves {k}x the tokens) is left "
              f"to `kvgen verify --only {plan.module}`; the suite checks it on one scenario "
              "(tests/test_model_connectors.py)")
    selected = chosen.models
    if not selected:
        return 0, 0
    # torch: only for a run
    from kvgen.oracle.scenarios.models import SCENARIOS

    wide = max([24, *(len(p.model.name) for p in selected)]), max([22, *(len(p.obj.name) for p in selected)])
    print(f"\n{'model':<{wide[0]}} {'object':<{wide[1]}} {'device':<6} {'store ok':<8} load ok")
    failures = 0
    for plan, device, (store, load) in each(rows, "model", selected, everything, devices):
        failures += (not store) + (not load)
        print(f"{plan.model.name:<{wide[0]}} {plan.obj.name:<{wide[1]}} {device:<6} {'yes' if store else 'NO':<8} "
              f"{'yes' if load else 'NO'}", flush=True)
    checks = 2 * len(selected) * len(devices)
    print(f"\n{len(selected) * len(devices)} model connector runs ({len(SCENARIOS)} scenarios each, groups and "
          f"state): {checks - failures} checks passed, {failures} failed")
    return checks, failures
