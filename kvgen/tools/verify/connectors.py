"""`kvgen verify` for connectors: each one, store and load, through one connector object over
every slot scenario, against the element-by-element reference (kvgen.oracle.scenarios)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from types import ModuleType
from typing import Any

from kvgen.plan.kernel import plan_refusal
from kvgen.tools.verify import interpreter
from kvgen.tools.verify.pool import Rows, each

#: Layers of the cache in Triton's interpreter (CPU, --backend triton), which runs every program
#: instance of a launch in Python, one per (layer, K/V, block or token tile): two layers
#: instead of three cut that pass by a third and still move every layer's own table entry,
#: layerwise one launch per layer.
INTERPRETER_LAYERS = 2


def interpreted(backend: str | None, device: str) -> bool:
    """Connectors run their Triton kernels in Triton's interpreter: every program instance in Python."""
    return backend == "triton" and device == "cpu"


def scenarios(backend: str | None, device: str) -> list[Any]:
    """The slot scenarios a connector runs: all of them, on fewer layers in Triton's interpreter."""
    # torch: only for a run
    from kvgen.oracle.scenarios import SCENARIOS

    if interpreted(backend, device):
        return [replace(s, ext={**s.ext, "L": INTERPRETER_LAYERS}) for s in SCENARIOS.values()]
    return list(SCENARIOS.values())


def launch_paths(connector: Any, plan: Any, scenario: Any) -> set[tuple[Any, ...]]:
    """The kernel paths (kvgen.runtime.kernels.launch_path) of one scenario's store and load,
    from a rehearsal: the connector plans and launches, the launches run nothing."""
    # torch: only for a run
    from kvgen.oracle.scenarios import move_pair
    from kvgen.runtime import kernels

    with kernels.rehearsed() as paths:
        move_pair(connector, plan.paged, plan.obj, scenario)
    return paths


def distinct_launches(connector: Any, plan: Any, candidates: Sequence[Any]) -> list[Any]:
    """Of `candidates`, in order, each scenario whose store or load launches a kernel path
    (`launch_paths`: the kernel, its constexprs and flags, which kinds of programs the grid
    has, its tensors' dtypes, contiguity and alignment) that no scenario before it launched.
    The others would run the same instructions of the kernel on other slot values; the
    default verify runs every scenario through the connector's own path, whose slot planning
    is what they vary. A scenario whose rehearsal raises is kept."""
    chosen: list[Any] = []
    seen: set[tuple[Any, ...]] = set()
    for scenario in candidates:
        try:
            paths = launch_paths(connector, plan, scenario)
        except Exception:  # the real run reports it
            paths = {("raised", scenario.name)}
        if not paths <= seen:
            chosen.append(scenario)
            seen |= paths
    return chosen


def check(package: ModuleType, plan: Any, device: str, backend: str | None) -> tuple[bool, bool, bool, int]:
    """(store ok, load ok, a Triton kernel launched, scenarios run) of one connector over the slot
    scenarios, all through one connector, as an engine keeps one for every cache it meets; a
    scenario whose copy raises counts as failing both. In Triton's interpreter, the scenarios
    of distinct launches (`distinct_launches`)."""
    # torch: only for a run
    from kvgen.oracle.scenarios import check_pair
    from kvgen.runtime import kernels

    connector = package.get(plan.paged.name, plan.obj.name)(device=device, backend=backend)
    chosen = scenarios(backend, device)
    if interpreted(backend, device):
        interpreter.quicken()
        chosen = distinct_launches(connector, plan, chosen)
    launches = kernels.stats["launches"]
    store = load = True
    for scenario in chosen:
        try:
            s, ld = check_pair(connector, plan.paged, plan.obj, scenario)
        except Exception as exc:  # a wrong connector may raise anything; report it and go on
            print(f"kvgen verify: {plan.module} on {device}, scenario {scenario.name}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
            s = ld = False
        store, load = store and s, load and ld
    return store, load, kernels.stats["launches"] > launches, len(chosen)


def with_kernels(selected: Sequence[Any]) -> list[Any]:
    """The connectors that have a Triton kernel; each one whose twin refuses named and left out."""
    kept = []
    for plan in selected:
        why = plan_refusal(plan)
        if why is None:
            kept.append(plan)
        else:
            print(f"kvgen verify: {plan.module}: no Triton kernel ({why}), left out", file=sys.stderr)
    return kept


def run(rows: Rows, selected: Sequence[Any], everything: Sequence[Any], devices: Sequence[str],
        backend: str | None) -> int:
    """Print one row per connector and device (checked by `rows`); the number of failed checks."""
    # torch: only for a run
    from kvgen.oracle.scenarios import SCENARIOS

    count = failures = ran = 0
    wide = max([24, *(len(p.paged.name) for p in selected)]), max([13, *(len(p.obj.name) for p in selected)])
    print(f"{'layout':<{wide[0]}} {'object':<{wide[1]}} {'mode':<9} {'device':<6} {'store ok':<8} {'load ok':<8}")
    for plan, device, (store_ok, load_ok, launched, runs) in each(rows, "connector", selected, everything, devices):
        ran += runs
        if backend == "triton" and not launched:
            print(f"kvgen verify: {plan.module} on {device}: the Triton kernel never ran", file=sys.stderr)
            store_ok = load_ok = False
        failures += (not store_ok) + (not load_ok)
        count += 1
        print(f"{plan.paged.name:<{wide[0]}} {plan.obj.name:<{wide[1]}} {plan.mode:<9} {device:<6} "
              f"{'yes' if store_ok else 'NO':<8} {'yes' if load_ok else 'NO':<8}", flush=True)
    layers = ""
    if any(interpreted(backend, d) for d in devices):
        layers = (f", {INTERPRETER_LAYERS} layers in Triton's interpreter, which ran the scenarios of distinct "
                  f"kernel launches: {ran} of {count * len(SCENARIOS)}")
    print(f"\n{count} connector runs on {', '.join(devices)} ({len(SCENARIOS)} slot scenarios each"
          + (f", backend {backend}" if backend else "") + layers + "): "
          f"{count * 2 - failures} checks passed, {failures} failed")
    return failures
