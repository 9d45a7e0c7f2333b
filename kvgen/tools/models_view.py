"""How `kvgen explain MODEL` and `kvgen list` show model specs: every group with its layout,
layers, geometry, parts, fields and planes, every state group with its tensors, and the
connectors a build generates for the model. Plain text; no torch."""

from __future__ import annotations

from kvgen.oracle.address import explain_lines
from kvgen.plan.models import plan_models
from kvgen.plan.package import plan_connectors
from kvgen.spec.library import Library
from kvgen.spec.model import Spec
from kvgen.spec.models import Group, ModelSpec


def layer_text(layers: tuple[int, ...]) -> str:
    """Indices as people read them: `1, 3, ..., 35 (every 2nd from 1)` or runs `0-2, 4-6`."""
    n = len(layers)
    if n > 4:
        step = layers[1] - layers[0]
        if all(b - a == step for a, b in zip(layers, layers[1:], strict=False)):
            if step == 1:
                return f"{layers[0]}-{layers[-1]}"
            nth = {2: "2nd", 3: "3rd"}.get(step, f"{step}th")
            return f"{layers[0]}, {layers[1]}, ..., {layers[-1]} (every {nth} from {layers[0]})"
    runs: list[str] = []
    start = prev = layers[0]
    for i in (*layers[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else (f"{start}, {prev}" if prev == start + 1 else f"{start}-{prev}"))
        if i is not None:
            start = prev = i
    return ", ".join(runs)


def _extents(group: Group, layout: Spec) -> dict[str, int]:
    out = {**dict(layout.sizes), "L": len(group.layers)}
    out.update((k, v) for k, v in group.sizes if "." not in k)
    return out


def _group_lines(group: Group, layout: Spec) -> list[str]:
    window = f", sliding window {group.window} tokens" if group.window else ""
    out = [f"  group {group.name}: {layout.name}, {_layers(len(group.layers))}{window}",
           f"    layers:   {layer_text(group.layers)}",
           f"    layout:   {layout.arrow(_extents(group, layout))}"]
    fixed = ", ".join(f"{k} = {v}" for k, v in group.sizes) or "none (all read from the tensors)"
    tp = " (at TP 1; a rank of TP t holds H / t heads)" if group.size("H") else ""
    out.append(f"    sizes:    {fixed}{tp}")
    dtypes = group.dtypes or layout.dtypes
    out.append(f"    dtypes:   {', '.join(dtypes)}")
    # The layout's parts, fields and planes, indented under the group.
    out += ["  " + line for line in explain_lines(layout)]
    return out


def _state_lines(model: ModelSpec) -> list[str]:
    out = []
    for s in model.states:
        out.append(f"  state {s.name}: {_layers(len(s.layers))}, each a tuple of {len(s.tensors)} tensors "
                   "indexed by request slot S")
        out.append(f"    layers:   {layer_text(s.layers)}")
        total = 0
        for t in s.tensors:
            shape = " ".join(str(n) for n in t.shape)
            split = (f", TP splits dim {t.split + 1} ({t.shape[t.split]})" if t.split is not None
                     else ", not split by TP")
            nbytes = t.nbytes(t.dtypes[0])
            total += nbytes
            out.append(f"    {t.name:<10} [S {shape}] {'|'.join(t.dtypes)}{split}; {nbytes} bytes per request "
                       f"({t.dtypes[0]})")
        out.append(f"    per request: {total} bytes per layer, {total * len(s.layers)} bytes in all (at TP 1)")
    return out


def explain_model(model: ModelSpec, library: Library, connectors: list[tuple[str, str]] | None = None) -> list[str]:
    """Every line `kvgen explain MODEL` prints. `connectors`: (module, what it moves) of the
    model's generated connectors."""
    out = [f"{model.name} (model): {model.summary}"]
    if model.config:
        out.append(f"  config:   {model.config}")
    out.append(f"  source:   {model.origin}")
    owners = ", ".join(f"{len(g.layers)} in {g.name}" for g in (*model.groups, *model.states))
    out.append(f"  cache list: {model.layers} entries in the engine's order ({owners}); one slot mapping per "
               "group, one state slot per request")
    by_name = {s.name: s for s in library.specs}
    for group in model.groups:
        layout = by_name.get(group.layout) or library[group.layout]
        out += _group_lines(group, layout)
    out += _state_lines(model)
    if connectors is not None:
        out.append("  connectors:" if connectors else "  connectors: none")
        out += [f"    {module}: {what}" for module, what in connectors]
    if model.engines:
        out.append(f"  engines:  {', '.join(model.engines)}")
    return out


def model_connectors(model: ModelSpec, library: Library) -> list[tuple[str, str]]:
    """(module, what it moves) of each connector a build generates for `model`, and the
    groups objects it leaves out with why."""
    plans, skipped = plan_models(library, plan_connectors(library))
    out = []
    for p in plans:
        if p.model is model:
            members = ", ".join(f"{g} as {m}" for g, m in p.members)
            carries = p.obj.carries
            state = ", ".join(carries.pick(carries.state, model.state_names)) if carries else ""
            out.append((p.module, f"{p.obj.format}: {members}" + (f"; state {state}" if state else "")))
    out += [(f"{m}__{o}", f"not generated: {why}") for m, o, why in skipped if m == model.name]
    return out


def model_rows(library: Library) -> list[tuple[str, str, str]]:
    """(name, groups, state) of every model, for `kvgen list`."""
    rows = []
    for m in library.models:
        groups = ", ".join(f"{g.name} {g.layout} x{len(g.layers)}" for g in m.groups)
        state = ", ".join(f"{s.name} ({'+'.join(t.name for t in s.tensors)}) x{len(s.layers)}" for s in m.states)
        rows.append((m.name, groups, state or "-"))
    return rows


def print_models(library: Library) -> None:
    """The models table of `kvgen list` (nothing when the build has no models)."""
    rows = model_rows(library)
    if not rows:
        return
    header = ("MODEL", "GROUPS (LAYOUT x LAYERS)", "STATE")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


__all__ = ["explain_model", "layer_text", "model_rows", "print_models"]


def _layers(n: int) -> str:
    return f"{n} layer{'s' if n != 1 else ''}"

