"""Parts, fields, planes and pack of a format-2 or format-3 spec as plain data (`kvgen list
--json`)."""

from __future__ import annotations

from kvgen.spec.model import Field, Part, Spec


def _field(f: Field) -> dict[str, object]:
    out: dict[str, object] = {"name": f.name, "dtype": f.dtype, "count": f.count, "offset": f.offset}
    if f.packing is not None:
        out["packing"] = str(f.packing)
    if f.scales is not None:
        out.update(scales=f.scales, group=f.group)
    return out


def format2_facts(spec: Spec) -> dict[str, object]:
    """Parts, fields, planes and pack of a format-2 spec as plain data (`kvgen list --json`)."""
    def dims(part: Part) -> list[object]:
        return [list(d.axes) if d.is_fused else (d.axes[0] if d.axes else 1) for d in part.dims]

    out: dict[str, object] = {"version": spec.version}
    if spec.is_paged:
        out["parts"] = [{"name": p.name, "dims": dims(p), "sizes": dict(p.sizes), "dtypes": list(p.dtypes),
                         "fields_in": str(p.fields_in) if p.fields_in else None,
                         "fields": [_field(f) for f in p.fields]} for p in spec.parts]
        out["moved_planes"] = [{"name": pl.name, "part": pl.part.name, "field": pl.field.name if pl.field else None,
                          "dtype": pl.dtype, "count": pl.field.count if pl.field else None,
                          "slots": pl.has_slots, "axes": list(pl.axes)} for pl in spec.moved_planes()]
    if spec.pack is not None:
        out["pack"] = str(spec.pack)
    if spec.carries is not None:
        out["members"] = list(spec.members)
        out["carries"] = {k: v if isinstance(v, str) else list(v)
                          for k, v in (("groups", spec.carries.groups), ("state", spec.carries.state))}
    return out
