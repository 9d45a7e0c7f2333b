"""`kvgen verify`: run every connector of a generated package, store and load, against the
reference, for every connector that the library (built-ins plus --specs) plans.

The package and the library must agree: a connector in the package whose spec verify was not
given, or one the library plans that the package lacks, is an error rather than a skip, so a
user's layouts are never silently left unchecked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvgen.errors import KVGenError, display_path
from kvgen.tools.paths import rebuild_command

if TYPE_CHECKING:
    from kvgen.oracle.scenarios import Scenario

_PREFIX = "_kvgen_verified_"


def import_package(out: Path) -> ModuleType:
    """The package at `out`, imported under a name of its own: the folder's name need not be
    an identifier, and two packages with the same folder name never shadow each other."""
    shown = display_path(out)
    if not out.exists():
        raise KVGenError(f"--out {shown} does not exist; write a package there with `kvgen build --out {shown}`")
    if not out.is_dir():
        raise KVGenError(f"--out {shown} is not a folder; give the folder `kvgen build --out` wrote")
    init = out / "__init__.py"
    if not init.is_file():
        raise KVGenError(f"--out {shown} is not a Python package (no __init__.py); "
                         "give the folder `kvgen build --out` wrote")
    out = out.resolve()
    name = _PREFIX + hashlib.sha256(str(out).encode()).hexdigest()[:16]
    for stale in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[stale]  # a package rebuilt since it was last verified in this process
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(out)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise KVGenError(f"cannot import the package at {shown}: {type(exc).__name__}: {exc}") from None
    if not isinstance(getattr(module, "CONNECTORS", None), dict) or not callable(getattr(module, "get", None)):
        raise KVGenError(f"--out {shown} is not a package written by kvgen build (it has no CONNECTORS table)")
    return module


def _mismatch(package: ModuleType, library: Any, plans: list[Any], out: Path, specs: list[Path]) -> str | None:
    """Why the package and the library disagree, or None."""
    shown = display_path(out)
    planned = {(p.paged.name, p.obj.name) for p in plans}
    have = set(package.CONNECTORS)
    rebuild = rebuild_command(out, specs)
    extra = sorted(have - planned)
    if extra:
        layouts = sorted({layout for layout, _ in extra})
        return (f"the package at {shown} holds {len(extra)} connectors of layouts this library does not have: "
                f"{', '.join(layouts)}; pass the --specs folders it was built with")
    missing = sorted(planned - have)
    if missing:
        return (f"the package at {shown} lacks {len(missing)} connectors this library plans: "
                f"{', '.join(f'{a}__{b}' for a, b in missing)}; rebuild it with {rebuild}")
    layouts = getattr(package, "LAYOUTS", {})
    changed = sorted(s.name for s in library.specs
                     if s.name in layouts and layouts[s.name].get("arrow", s.arrow()) != s.arrow())
    if changed:
        return (f"the package at {shown} was built from other specs for {', '.join(changed)} "
                f"(the layout differs); rebuild it with {rebuild}")
    return None


def _check(package: ModuleType, plan: Any, device: str, scenarios: list[Scenario],
           backend: str | None = None) -> list[tuple[bool, bool]]:
    """(store ok, load ok) per scenario, all through one connector, as an engine keeps one
    for every cache it meets; a scenario whose transfer raises counts as failing both."""
    from kvgen.oracle.scenarios import check_pair

    connector = package.get(plan.paged.name, plan.obj.name)(device=device, backend=backend)
    results = []
    for scenario in scenarios:
        try:
            results.append(check_pair(package, plan.paged, plan.obj, device, scenario, connector=connector))
        except Exception as exc:  # a wrong connector may raise anything; report it and go on
            print(f"kvgen verify: {plan.module} on {device}, scenario {scenario.name}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
            results.append((False, False))
    return results


def _check_facts(library: Any) -> int:
    """Built-in specs against the engines' own facts (kvgen.oracle.facts): a wrong spec
    would otherwise verify, since the reference reads the same spec as the generator."""
    from kvgen.oracle.facts import FACTS, Geometry, disagreement
    from kvgen.oracle.facts_groups import GROUPS_FACTS
    from kvgen.oracle.facts_parts import PACKED_FACTS, PARTS_FACTS
    from kvgen.oracle.facts_quant import UNITS, units_disagreement

    geometry = Geometry(L=3, B=5, N=4, H=6, C=7, T=9)  # no two extents equal
    tables = (FACTS, PARTS_FACTS, PACKED_FACTS, GROUPS_FACTS)
    checked = [s for s in library.specs if any(s.name in t for t in tables)]
    wrong = [(s.name, why) for s in checked if (why := disagreement(s, geometry)) is not None]
    # Format 3: which nibble comes first and which scale scales which values (facts_quant.UNITS).
    wrong += [(s.name, why) for s in checked if s.name in UNITS and (why := units_disagreement(s)) is not None]
    for name, why in wrong:
        print(f"kvgen verify: spec {name} disagrees with the engine's facts: {why}", file=sys.stderr)
    print(f"{len(checked) - len(wrong)} of {len(checked)} built-in specs agree with the engines' facts")
    return len(wrong) + _check_model_facts(library)


def _check_model_facts(library: Any) -> int:
    """Built-in model specs against the models' published configs (kvgen.oracle.facts_models);
    a model spec without facts counts as wrong."""
    from kvgen.oracle.facts_models import model_disagreement
    from kvgen.spec.library import BUILTIN_SPECS

    builtin = BUILTIN_SPECS.resolve()
    models = [m for m in library.models if builtin in Path(m.source).resolve().parents]
    wrong = [(m.name, why) for m in models if (why := model_disagreement(m)) is not None]
    for name, why in wrong:
        print(f"kvgen verify: model {name} disagrees with its published config: {why}", file=sys.stderr)
    print(f"{len(models) - len(wrong)} of {len(models)} built-in model specs agree with their configs")
    return len(wrong)


def _prepare_triton(devices: list[str]) -> None:
    """--backend triton: CPU runs go through Triton's interpreter, which must be switched on
    before any kernel module is imported; it cannot run GPU kernels in the same process."""

    if importlib.util.find_spec("triton") is None:
        raise KVGenError("--backend triton needs triton: pip install 'kvgen[triton]'")
    if "cpu" in devices:
        if len(devices) > 1:
            raise KVGenError("--backend triton runs CPU tensors in Triton's interpreter, which cannot run GPU "
                             "kernels in the same process: verify --device cpu and the GPU devices separately")
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main(args: Any) -> int:
    from kvgen.plan.models import plan_models
    from kvgen.plan.package import plan_connectors as plan_library
    from kvgen.spec.library import load_library
    from kvgen.spec.transfers import load_transfers
    from kvgen.tools import verify_engines, verify_models, verify_transfers

    library = load_library(args.specs)
    plans = plan_library(library)
    transfers = load_transfers(library, args.specs)
    model_plans = plan_models(library, plans)[0]
    package = import_package(args.out)
    problem = _mismatch(package, library, plans, args.out, args.specs) or \
        verify_transfers.mismatch(package, transfers, args.out, args.specs) or \
        verify_models.mismatch(package, model_plans, args.out, args.specs)
    if problem:
        raise KVGenError(problem)
    selected = [p for p in plans if not args.only or args.only in p.module]
    moves = [t for t in transfers if not args.only or args.only in t.module]
    model_runs = [p for p in model_plans if not args.only or args.only in p.module]
    if not selected and not moves and not model_runs:
        raise KVGenError(f"--only {args.only!r} matches no connector of the {len(plans)} in "
                         f"{display_path(args.out)} and no transfer (it is a part of a module name such as "
                         f"{plans[0].module} or xfer__SOURCE__DESTINATION; `kvgen list` shows them)")
    from kvgen.runtime import available_devices

    present = available_devices()
    devices = args.device or present
    missing = [d for d in devices if d not in present]
    if missing:
        print(f"kvgen verify: device {', '.join(missing)} is not available here "
              f"(present: {', '.join(present)})", file=sys.stderr)
        return 1
    if args.backend == "triton":
        _prepare_triton(devices)
        if not selected:
            raise KVGenError("--backend triton: the selected modules are transfers or model connectors, which have "
                             "no Triton kernels of their own")
        moves = model_runs = []  # transfers have no kernels; model connectors move through their members
    from kvgen.oracle.scenarios import SCENARIOS  # torch: only once the inputs are known good
    from kvgen.runtime import kernels

    scenarios = list(SCENARIOS.values())
    rows, failures = 0, _check_facts(library) + verify_engines.run()
    wide = max([24, *(len(p.paged.name) for p in selected)]), max([13, *(len(p.obj.name) for p in selected)])
    print(f"{'layout':<{wide[0]}} {'object':<{wide[1]}} {'mode':<9} {'device':<6} {'store ok':<8} {'load ok':<8}")
    for device in devices:
        for plan in selected:
            launches = kernels.stats["launches"]
            results = _check(package, plan, device, scenarios, args.backend)
            store_ok = all(r[0] for r in results)
            load_ok = all(r[1] for r in results)
            if args.backend == "triton" and kernels.stats["launches"] == launches:
                print(f"kvgen verify: {plan.module} on {device}: the Triton kernel never ran", file=sys.stderr)
                store_ok = load_ok = False
            failures += (not store_ok) + (not load_ok)
            rows += 1
            print(f"{plan.paged.name:<{wide[0]}} {plan.obj.name:<{wide[1]}} {plan.mode:<9} {device:<6} "
                  f"{'yes' if store_ok else 'NO':<8} {'yes' if load_ok else 'NO':<8}", flush=True)
    print(f"\n{rows} connector runs on {', '.join(devices)} ({len(scenarios)} slot scenarios each"
          + (f", backend {args.backend}" if args.backend else "") + "): "
          f"{rows * 2 - failures} checks passed, {failures} failed")
    failures += verify_transfers.run(package, moves, devices)[1]
    failures += verify_models.run(package, library, model_runs, devices)[1]
    return 1 if failures else 0
