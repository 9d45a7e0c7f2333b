"""Engine release ranges (`versions:` in a spec): one reading for the generator and detection."""

from __future__ import annotations

import pytest

from kvgen.versions import admits_some_release, parse_range, release, version_in


@pytest.mark.parametrize("version, span, inside", [
    ("0.33.0", ">=0.33,<0.34", True),
    ("0.33.7", ">=0.33,<0.34", True),
    ("0.34.0", ">=0.33,<0.34", False),
    ("0.32.9", ">=0.33,<0.34", False),
    ("0.33.0rc1+cu128", "==0.33", True),      # a build or pre-release of a release line is that release
    ("0.5.23", ">=0.5.23", True),
    ("0.5.22", ">=0.5.23", False),
    ("0.5.23", "!=0.5.23", False),
    ("1.0", ">0.99.99", True),
    ("0.10.1", "<=0.10", False),               # 0.10 is 0.10.0
])
def test_a_version_lies_in_a_range_by_its_release_numbers(version: str, span: str, inside: bool) -> None:
    assert version_in(version, span) is inside


def test_release_pads_to_three_numbers() -> None:
    assert release("0.33") == (0, 33, 0)
    assert release("v1.5.1.post2") == (1, 5, 1)
    with pytest.raises(ValueError, match="expected numbers"):
        release("latest")


@pytest.mark.parametrize("span", ["0.33", ">=0.33;<0.34", "~=0.33", ">= latest", ""])
def test_a_range_is_comparisons_only(span: str) -> None:
    with pytest.raises(ValueError, match="expected clauses"):
        parse_range(span)


@pytest.mark.parametrize("span, some", [
    (">=0.33,<0.34", True), (">=0.34,<0.33", False), ("==0.33,!=0.33", False), (">0.33.0,<0.33.1", False),
    ("<0.0.1", True), (">=0.5.23", True),
])
def test_an_empty_range_is_found(span: str, some: bool) -> None:
    assert admits_some_release(span) is some
