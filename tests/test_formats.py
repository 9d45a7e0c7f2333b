"""The generated format table and transition check."""

from __future__ import annotations

import enum

import pytest

from kvgen.generated import formats
from kvgen.runtime import KVLayoutError


class LMCacheMemoryFormat(enum.Enum):  # a stand-in for LMCache's own enum
    UNDEFINED = 0
    KV_2LTD = 1
    KV_T2D = 2
    KV_MLA_FMT = 6


def test_codes_match_lmcache() -> None:
    assert formats.MemoryFormat.KV_2LTD == 1
    assert formats.MemoryFormat.KV_T2D == 2
    assert formats.MemoryFormat.KV_2TD == 3
    assert formats.MemoryFormat.KV_MLA_FMT == 6


@pytest.mark.parametrize("current,target", [
    (None, formats.MemoryFormat.KV_2LTD),
    (formats.MemoryFormat.UNDEFINED, formats.MemoryFormat.KV_T2D),
    (LMCacheMemoryFormat.KV_T2D, LMCacheMemoryFormat.KV_MLA_FMT),
    (LMCacheMemoryFormat.KV_MLA_FMT, formats.MemoryFormat.KV_MLA_FMT),
])
def test_allowed(current, target) -> None:
    formats.check_transition(current, target)


@pytest.mark.parametrize("current,target", [
    (formats.MemoryFormat.KV_2LTD, formats.MemoryFormat.KV_MLA_FMT),
    (LMCacheMemoryFormat.KV_MLA_FMT, LMCacheMemoryFormat.KV_2LTD),
])
def test_refused(current, target) -> None:
    with pytest.raises(ValueError, match=f"cannot re-label a {current.name} object as {target.name}"):
        formats.check_transition(current, target)


def test_not_a_format() -> None:
    with pytest.raises(KVLayoutError, match="must be None or have a .name"):
        formats.check_transition("KV_2LTD", formats.MemoryFormat.KV_2LTD)
