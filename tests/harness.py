"""Test helpers: the machinery lives in kvgen.oracle.scenarios, shared with `kvgen verify`."""

import copy
import gc
import importlib
import importlib.util
import os
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
import yaml

from kvgen.emit.render import render_connector
from kvgen.oracle.scenarios import (  # noqa: F401
    EXT,
    SCENARIOS,
    Scenario,
    allocate,
    at_odd_offsets,
    block_table_mapping,
    clone_tree,
    connector_load,
    connector_store,
    fitted,
    make_cache,
    make_objects,
    manager_extents,
    obj_tensors,
    reference_load,
    reference_store,
    same_bits,
    tensors_of,
)
from kvgen.plan.package import connector_plan, plan_connectors
from kvgen.spec.library import Library, load_library


@cache
def builtin_library() -> Library:
    """The built-in specs, loaded and checked once per test process and shared by the modules
    that read them at import (a Library and its specs are frozen). A load reads and
    schema-checks every YAML file: ~0.2 s, paid by each of ~35 modules at collection, in
    each xdist worker. Tests of loading itself call load_library."""
    return load_library()


@cache
def builtin_plans() -> tuple[Any, ...]:
    """The connector plans of the built-in specs (plan_connectors), made once per test process
    for the modules that parametrize over them at import (~0.3 s each)."""
    return tuple(plan_connectors(builtin_library()))


def spec_data(path: Path) -> Any:
    """A spec file's YAML data, read with libyaml's parser where PyYAML has it, as kvgen's loader
    reads specs (the pure-Python parser is several times slower over the built-ins)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(Path(path).read_text("utf-8"), Loader=loader)  # noqa: S506 - a safe loader


def spec_text(data: dict[str, Any]) -> str:
    """A spec's YAML text from its data, in the order given, as the mutation tests write each
    mutant: libyaml's emitter where PyYAML has it (a quarter of the pure-Python one's time, over
    thousands of mutants), and no anchors (a copy: a mutant shares parts with its original,
    and a spec may hold no aliases)."""
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(copy.deepcopy(data), Dumper=dumper, sort_keys=False, default_flow_style=None)


#: Test-only specs with split (tiled) axes, beside the built-in ones (sglang_mha_vectorized_5d,
#: sglang_mha_mxfp8_interleaved); the folder may be absent.
TILED_SPECS = Path(__file__).parent / "specs_tiled"


@cache
def tiled_library() -> Library:
    return load_library([TILED_SPECS] if TILED_SPECS.is_dir() else [])


@cache
def tiled_plans() -> dict[tuple[str, str], Any]:
    """The connector plans of tiled_library by (layout, object), made once per test process: a
    plan of every pair took ~50 ms, asked for by each of the split connectors' tests."""
    return {(p.paged.name, p.obj.name): p for p in plan_connectors(tiled_library())}


def tiled_connector(layout: str, obj: str, edit: tuple[str, str] | None = None) -> Any:
    """The connector class of a pair of tests/specs_tiled, rendered from its plan and run from its
    text (with `edit`, (old, new), applied: old must occur)."""
    plan = tiled_plans()[layout, obj]
    text = render_connector(connector_plan(plan))
    if edit is not None:
        assert edit[0] in text, edit[0]
        text = text.replace(edit[0], edit[1])
    space = types.ModuleType(plan.module)
    exec(compile(text, plan.module, "exec"), space.__dict__)
    return space.Connector


# -- LMCache ------------------------------------------------------------------------------------------

LMCACHE_MISSING = "lmcache 0.5.6 is not installed (scripts/dev test installs it)"


def need_lmcache() -> None:
    """Skips the calling module where lmcache is not installed. An installed lmcache that does not
    import fails the module's imports instead of skipping it: scripts/dev's set-up reads only its
    metadata, so a broken install must show here."""
    if importlib.util.find_spec("lmcache") is None:
        pytest.skip(LMCACHE_MISSING, allow_module_level=True)


# -- SGLang, in its own venv ---------------------------------------------------------------------------

#: Set by scripts/dev where it runs the SGLang tests in .venv-sglang: there SGLang must import.
SGLANG_REQUIRED = "KVGEN_REQUIRE_SGLANG"


def sglang_absent(exc: Exception, what: str) -> NoReturn:
    """Skips the calling module, whose import of SGLang's `what` failed with `exc`: this Python
    has no working SGLang (the main one never has). Where scripts/dev runs these tests in the venv
    it set up (SGLANG_REQUIRED), a failing import is raised instead: set-up reads only SGLang's
    metadata, so a broken install must show here."""
    if os.environ.get(SGLANG_REQUIRED):
        raise exc
    module = sys._getframe(1).f_globals["__name__"]  # the skip's reported place is this helper
    pytest.skip(f"{module}: sglang's {what} do not import here ({type(exc).__name__}: {exc}); "
                "`scripts/dev engines` runs these tests in .venv-sglang (sglang 0.5.23, torch 2.14.1)",
                allow_module_level=True)


# -- vLLM, imported by the tests that use it, not at collection ------------------------------------

VLLM_MISSING = "vllm 0.33.0 is not installed (scripts/dev installs it unless KVGEN_NO_ENGINES=1)"


class _LazyModule:
    """A module imported at its first read of a public attribute. pytest's collection asks every
    module-level object for private and dunder attributes (fixture markers, __test__): those
    are not the module's and import nothing."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if self._name in sys.modules:
            return getattr(sys.modules[self._name], attr)
        module = importlib.import_module(self._name)
        # What importing vLLM built (half a million objects) lives until the process ends: out of
        # the cyclic collector's reach, as tests/conftest.py puts what collection built
        # (keep_the_collected_heap_out_of_gc), each full pass is 0.3 s shorter.
        gc.freeze()
        return getattr(module, attr)


def vllm_module(name: str) -> Any:
    """vLLM's module `name`, imported when a test first reads from it: every xdist worker collects
    every test module, and importing vLLM at collection cost each ~10 s. Where vLLM is not
    installed the calling module is skipped, as pytest.importorskip did (find_spec of the top
    package imports nothing)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(VLLM_MISSING, allow_module_level=True)
    return _LazyModule(name)


def tile_codes(layer: int, kv: int, tokens: list[int], heads: int, width: int, store: torch.dtype) -> torch.Tensor:
    """[tokens, heads, width] bit patterns of a storage dtype for the tiled (SHUFFLE) caches' engine
    tests: nonzero bytes for uint8 storage, else int16 patterns of positive normal bf16 / fp16 values
    (0x2000 + a code below 0x4000); each position of a row, and a step of any other coordinate, gives
    another pattern."""
    t = torch.tensor(tokens).reshape(-1, 1, 1)
    h = torch.arange(heads).reshape(1, -1, 1)
    c = torch.arange(width).reshape(1, 1, -1)
    mixed = 7 * c + 1031 * h + 97 * t + 4099 * kv + 211 * layer
    if store == torch.uint8:
        return (mixed % 255 + 1).to(torch.uint8)
    return (0x2000 + mixed % 0x4000).to(torch.int16)
