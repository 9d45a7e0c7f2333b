"""Model connectors of specs outside the built-in library, rendered into a small package of a
test's own: only the model modules and the member connectors they use (a full build would
render every connector of the library)."""

from __future__ import annotations

import hashlib
import importlib
import sys
import types
from collections.abc import Sequence
from pathlib import Path

from kvgen.emit.render import render_connector, render_model, seal
from kvgen.plan.models import plan_models
from kvgen.plan.package import connector_plan, plan_connectors
from kvgen.spec.library import Library, load_library

SPECS = Path(__file__).resolve().parent / "specs_models"


def build_models(out: Path, spec_dirs: Sequence[Path] = (SPECS,), *, builtin: bool = True,
                 library: Library | None = None) -> types.SimpleNamespace:
    """Render and import the model connectors of `spec_dirs`: a namespace with the package's
    CONNECTORS (member pairs), get_model(model, object), the library and the plans."""
    library = library or load_library(list(spec_dirs), builtin=builtin)
    connectors = plan_connectors(library)
    plans, skipped = plan_models(library, connectors)
    needed = {dict(g)["module"] for p in plans for g in p.groups}
    name = "_kvgen_models_" + hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("")
    for c in connectors:
        if c.module in needed:
            (folder / f"{c.module}.py").write_text(seal(c.module, render_connector(connector_plan(c))))
    for p in plans:
        (folder / f"{p.module}.py").write_text(seal(p.module, render_model(p)))
    if str(out) not in sys.path:
        sys.path.insert(0, str(out))
    for stale in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[stale]
    importlib.invalidate_caches()
    package = importlib.import_module(name)
    by_pair = {(p.model.name, p.obj.name): p.module for p in plans}

    def get_model(model: str, obj: str) -> type:
        return importlib.import_module(f"{name}.{by_pair[(model, obj)]}").Connector

    return types.SimpleNamespace(CONNECTORS={(c.paged.name, c.obj.name): c.module for c in connectors},
                                 get_model=get_model, library=library, plans=plans, skipped=skipped,
                                 package=package)
