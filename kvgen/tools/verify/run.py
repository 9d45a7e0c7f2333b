"""`kvgen verify`: run every connector of a generated package, store and load, against the
reference, for every connector that the library (built-ins plus --specs) plans.

The package and the library must agree: a connector in the package whose spec verify was not
given, or one the library plans that the package lacks, is an error rather than a skip, so a
user's layouts are never silently left unchecked.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kvgen.errors import KVGenError, display_path
from kvgen.oracle.facts.groups import GROUPS_FACTS
from kvgen.oracle.facts.models import model_disagreement
from kvgen.oracle.facts.quant import UNITS, units_disagreement
from kvgen.spec.library import BUILTIN_SPECS
from kvgen.tools.paths import rebuild_command
from kvgen.tools.verify import connectors as verify_connectors
from kvgen.tools.verify import engines as verify_engines
from kvgen.tools.verify import models as verify_models
from kvgen.tools.verify import transfers as verify_transfers
from kvgen.tools.verify.heap import keep_freed_memory
from kvgen.tools.verify.pool import Context, Inputs, Rows, Task, by_cost, default_jobs, load, tasks_of


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


def _check_facts(library: Any) -> int:
    """Built-in specs against the engines' own facts (kvgen.oracle.facts.layouts): a wrong spec
    would otherwise verify, since the reference reads the same spec as the generator."""
    # torch (through the agreement checks): only once the selection is known good
    from kvgen.oracle.facts.layouts import FACTS, EngineGeometry, disagreement
    from kvgen.oracle.facts.planes import PACKED_FACTS, PARTS_FACTS

    geometry = EngineGeometry(L=3, B=5, N=4, H=6, C=7, T=9)  # no two extents equal
    tables = (FACTS, PARTS_FACTS, PACKED_FACTS, GROUPS_FACTS)
    checked = [s for s in library.specs if any(s.name in t for t in tables)]
    wrong = [(s.name, why) for s in checked if (why := disagreement(s, geometry)) is not None]
    # Format 3: which nibble comes first and which scale scales which values (facts.quant.UNITS).
    wrong += [(s.name, why) for s in checked if s.name in UNITS and (why := units_disagreement(s)) is not None]
    for name, why in wrong:
        print(f"kvgen verify: spec {name} disagrees with the engine's facts: {why}", file=sys.stderr)
    print(f"{len(checked) - len(wrong)} of {len(checked)} built-in specs agree with the engines' facts")
    return len(wrong) + _check_model_facts(library)


def _check_model_facts(library: Any) -> int:
    """Built-in model specs against the models' published configs (kvgen.oracle.facts.models);
    a model spec without facts counts as wrong."""
    builtin = BUILTIN_SPECS.resolve()
    models = [m for m in library.models if builtin in Path(m.source).resolve().parents]
    wrong = [(m.name, why) for m in models if (why := model_disagreement(m)) is not None]
    for name, why in wrong:
        print(f"kvgen verify: model {name} disagrees with its published config: {why}", file=sys.stderr)
    print(f"{len(models) - len(wrong)} of {len(models)} built-in model specs agree with their configs")
    return len(wrong)


def _check_builtins(library: Any, only: str | None, backend: str | None) -> int:
    """The built-in specs against the engines' facts and their live code: a whole verify's
    share (tens of seconds, vLLM's import among them), left out of an --only run, which looks
    at the connectors it names, and of a --backend run, as they do not depend on how
    connectors move data."""
    if only or backend:
        flag = "--only" if only else "--backend"
        print(f"{flag}: the built-in specs' fact and engine checks are left to a whole `kvgen verify`")
        return 0
    return _check_facts(library) + verify_engines.run()


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


@dataclass(frozen=True)
class _Selection:
    """What a verify run checks: the connectors, transfers and model connectors --only leaves."""

    connectors: list[Any]
    transfers: list[Any]
    models: list[Any]


def _select(args: Any, ctx: Context) -> _Selection:
    """--only's share of the build's plans; refused when the package is not what they generate."""
    library, plans, transfers, model_plans, package = ctx.library, ctx.plans, ctx.transfers, ctx.models, ctx.package
    problem = _mismatch(package, library, plans, args.out, args.specs) or \
        verify_transfers.mismatch(package, transfers, args.out, args.specs) or \
        verify_models.mismatch(package, model_plans, args.out, args.specs)
    if problem:
        raise KVGenError(problem)
    chosen = _Selection(*([p for p in found if not args.only or args.only in p.module]
                          for found in (plans, transfers, model_plans)))
    if not chosen.connectors and not chosen.transfers and not chosen.models:
        raise KVGenError(f"--only {args.only!r} matches no connector of the {len(plans)} in "
                         f"{display_path(args.out)} and no transfer (it is a part of a module name such as "
                         f"{plans[0].module} or xfer__SOURCE__DESTINATION; `kvgen list` shows them)")
    return chosen


def check_row(ctx: Context, task: Task) -> tuple[bool, ...]:
    """One row of verify, by its kind: (store ok, load ok, a Triton kernel launched, scenarios
    run) for a connector, (whole ok, per layer ok) for a transfer, (store ok, load ok) for a model connector."""
    kind, index, device = task
    if kind == "connector":
        return verify_connectors.check(ctx.package, ctx.plans[index], device, ctx.inputs.backend)
    if kind == "transfer":
        pair = ctx.transfers[index]
        return (verify_transfers.check(ctx.package, pair, device, False),
                verify_transfers.check(ctx.package, pair, device, True))
    return verify_models.check(ctx.package, ctx.library, ctx.models[index], device)


def main(args: Any) -> int:
    keep_freed_memory()  # for the rows checked in this process (--jobs 1, or a kind with one row)
    ctx = load(Inputs(args.out, tuple(args.specs), args.backend))
    chosen = _select(args, ctx)
    # torch: only once the selection is known good
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
        if not chosen.connectors:
            raise KVGenError("--backend triton: the selected modules are transfers or model connectors, which have "
                             "no Triton kernels of their own")
        # transfers have no kernels; model connectors move through their members
        chosen = _Selection(verify_connectors.with_kernels(chosen.connectors), [], [])
    with Rows(ctx, args.jobs if args.jobs is not None else default_jobs(), check_row) as rows:
        # Every row goes to the workers first: they check rows while this process runs the
        # built-in checks (vLLM's import among them).
        rows.submit(tasks_of("connector", chosen.connectors, ctx.plans, devices))
        rows.submit(tasks_of("transfer", chosen.transfers, ctx.transfers, devices))
        rows.submit(tasks_of("model", chosen.models, ctx.models, devices),
                    by_cost(ctx.models, verify_models.expected_work))
        failures = _check_builtins(ctx.library, args.only, args.backend)
        failures += verify_connectors.run(rows, chosen.connectors, ctx.plans, devices, args.backend)
        failures += verify_transfers.run(rows, chosen.transfers, ctx.transfers, devices)[1]
        failures += verify_models.run(rows, chosen.models, ctx.models, devices)[1]
    return 1 if failures else 0
