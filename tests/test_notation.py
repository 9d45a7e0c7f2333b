"""The arrow notation: one printer, one parser, each the other's inverse."""

from __future__ import annotations

import pytest
from harness import builtin_library

from kvgen.errors import KVGenError
from kvgen.notation import NotationError, format_layout, parse_layout

LIBRARY = builtin_library()


# Format-2 arrows (parts, fields, packs) are printed for people only: docs/spec-language.md.
@pytest.mark.parametrize("spec", [s for s in LIBRARY.specs if s.is_simple], ids=lambda s: s.name)
def test_print_parse_print_is_identity_for_every_builtin_spec(spec):
    text = spec.arrow()
    lists, dims, extents = parse_layout(text)
    assert (lists, dims, extents) == (spec.lists, tuple(d.axes for d in spec.dims), {})
    assert format_layout(lists, dims) == text


@pytest.mark.parametrize("text, expected", [
    ("L -> [KV B N H C]", (("L",), (("KV",), ("B",), ("N",), ("H",), ("C",)), {})),
    ("[B L KV N H C]", ((), (("B",), ("L",), ("KV",), ("N",), ("H",), ("C",)), {})),
    ("L -> KV -> [B N H C]", (("L", "KV"), (("B",), ("N",), ("H",), ("C",)), {})),
    ("L -> [(B N) 1 C]", (("L",), (("B", "N"), (), ("C",)), {})),
    ("L=4 -> [KV=2 B N=16 (H=8 C)]",
     (("L",), (("KV",), ("B",), ("N",), ("H", "C")), {"L": 4, "KV": 2, "N": 16, "H": 8})),
])
def test_parse_reads_lists_dims_fused_singletons_and_extents(text, expected):
    assert parse_layout(text) == expected
    assert format_layout(expected[0], expected[1], expected[2]) == text


@pytest.mark.parametrize("text", ["L -> KV B", "[(H C]", "[(H) C]", "[h C]", "[]", "L=x -> [C]", "[H=8x C]"])
def test_bad_text_raises_notation_error_a_kvgen_error(text):
    with pytest.raises(NotationError) as info:
        parse_layout(text)
    assert isinstance(info.value, KVGenError)
