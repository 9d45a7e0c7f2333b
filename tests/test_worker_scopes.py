"""Which tests share an xdist worker (tests/conftest.py, scope_of): the modules that load vLLM,
the modules that parse every source file, and the modules that hold a serial test each form one
scope; every other module is a scope of its own. The scopes are read off the test ids alone, so
they hold whatever pytest and xdist make of marks (xdist's own groups vanish under pytest 9.2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SERIAL_MARK, SERIAL_SCOPE, SHARED_SCOPES, module_scope, scope_of

TESTS = Path(__file__).resolve().parent
MODULES = sorted(f"tests/{p.name}" for p in TESTS.glob("test_*.py"))

#: What a module's text shows when its tests load vLLM: a lazy vLLM module (harness.vllm_module),
#: a vLLM module asked for by name, or LMCache's engine script, which builds its caches with vLLM.
LOADS_VLLM = re.compile(r"vllm_module\(|importorskip\(\s*\"vllm|lmcache_engine\.py")
#: ... when they parse the package's sources (tests/code_rules.py).
PARSES_SOURCES = re.compile(r"\bsource_(?:tree|nodes)\(")


def _text(module: str) -> str:
    return (TESTS.parent / module).read_text(encoding="utf-8")


@pytest.mark.parametrize(("scope", "loads"), [("vllm", LOADS_VLLM), ("source_trees", PARSES_SOURCES)])
def test_the_modules_that_load_a_costly_thing_share_its_scope_and_no_others_do(scope: str, loads: re.Pattern) -> None:
    loading = {m for m in MODULES if loads.search(_text(m))}
    assert loading, f"no module matches {loads.pattern}: the rule no longer finds them"
    assert {m for m in MODULES if module_scope(m) == scope} == loading


def test_every_shared_scope_pattern_names_a_module() -> None:
    names = [Path(m).name for m in MODULES]
    for scope, patterns in SHARED_SCOPES.items():
        for pattern in patterns:
            assert any(Path(n).match(pattern) for n in names), f"{scope}: {pattern} matches no test module"


def test_the_modules_holding_serial_tests_share_one_scope() -> None:
    serial = {m for m in MODULES if SERIAL_MARK in _text(m)}
    assert "tests/test_serial_pass.py" in serial
    assert {m for m in MODULES if module_scope(m) == SERIAL_SCOPE} == serial


def test_any_other_test_is_scoped_by_its_module_whatever_its_id_holds() -> None:
    assert scope_of("tests/test_connectors.py::test_store_matches_reference[vllm_mla__kv_mla-default-cpu]") \
        == "tests/test_connectors.py"
    assert scope_of("tests/test_cli.py::test_x[a@b]") == "tests/test_cli.py"  # an @ in a parameter id
    assert scope_of("tests/test_engine_vllm_quant.py::test_x[fp8]") == "vllm"
    assert scope_of("tests/test_architecture.py::test_no_importcycles") == "source_trees"
