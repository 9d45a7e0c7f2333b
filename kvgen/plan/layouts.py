"""The fields of a layout constant in a generated module (a connector's PAGED and OBJECT, a
transfer's SRC and DST): what the runtime's layout dataclasses are built from."""

from __future__ import annotations

from typing import Any

from kvgen.spec.model import DTYPES, Spec

#: A layout constant's fields in the order the runtime's dataclass declares them.
Fields = tuple[tuple[str, Any], ...]


def layout_fields(spec: Spec) -> Fields:
    dims = tuple(d.axes for d in spec.dims)
    if spec.is_paged:
        fields: Fields = (("name", spec.name), ("lists", spec.lists), ("dims", dims), ("sizes", spec.sizes),
                          ("dtypes", spec.dtypes))
        if not spec.is_simple:
            # () for a part of any dtype keeps each part's entry on one line
            parts = tuple((p.name, tuple(d.axes for d in p.dims), () if set(p.dtypes) == set(DTYPES) else p.dtypes)
                          for p in spec.parts)
            fields += (("parts", parts),)
        slots = spec.token_ratio[1]
        if slots > 1:  # format 3: the runtime expands each token's manager slot into its stored slots
            fields += (("slots_per_token", slots),)
        return fields
    fields = (("name", spec.name), ("format", spec.format), ("code", spec.code), ("accepts", spec.accepts),
              ("lists", spec.lists), ("dims", dims))
    return fields + ((("pack", str(spec.pack)),) if spec.pack is not None else ())
