"""Which connectors a bench run measures and on what inputs: the selection of (layout,
object) pairs from the built-in specs plus `--specs` folders, the package of connectors
they come from, cache extents and the chunk's slot mapping. No torch at import time."""

from __future__ import annotations

import importlib
import math
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgen.emit.build import build
from kvgen.errors import KVGenError, KVLayoutError
from kvgen.spec.elements import place_of, split_of
from kvgen.spec.library import REPO_ROOT, Library
from kvgen.spec.transfers import load_transfers

if TYPE_CHECKING:
    import random

    from kvgen.spec.model import Spec

@dataclass(frozen=True)
class BenchContext:
    """What every row of one bench run shares: its options, specs and connectors, the device
    and how to wait for it, the random sources of slot mappings and cache values, and whether
    to print progress."""

    args: Any
    library: Library
    package: Any
    device: Any  # a torch.device (this module imports no torch)
    sync: Callable[[], None]
    rng: random.Random  # slot mappings
    values: Any  # the torch.Generator of cache values, seeded by --seed
    progress: bool


#: Defaults from the issue: every MHA layout against kv_2ltd, the MLA layouts against
#: kv_mla, and each with its layerwise partner (kv_t2d, kv_mla_layer); one cache of several
#: planes (spec format 2: SGLang's K and V of different head sizes) and two quantized ones
#: (format 3: vLLM's NVFP4 pages and INT8 rows with inline scales) against kv_planes.
DEFAULT_LAYOUTS = ("vllm_flash_attn_nhd", "vllm_flash_attn_hnd", "vllm_flashinfer_nhd", "vllm_kv_tuple",
                   "vllm_cross_layer", "sglang_mha", "vllm_mla", "sglang_mla", "sglang_mha_v_head",
                   "vllm_nvfp4", "vllm_int8_per_token_head")
DEFAULT_OBJECTS = ("kv_2ltd", "kv_t2d", "kv_mla", "kv_mla_layer", "kv_planes")
#: 8192 tokens is a 1 GiB object at the default geometry; on a 2-core CPU the full
#: default run would take well over the 3 minutes budgeted, so the default stops at 2048.
DEFAULT_TOKENS = (256, 2048)
#: Content size of MLA layouts (latent 512 + rope 64), which have no heads.
MLA_C = 576


@dataclass(frozen=True)
class Target:
    layout: str
    obj: str
    mode: str


def _installed() -> Any:
    """The generated package: installed as kvgen.generated, else the repository's generated/."""
    for name in ("kvgen.generated", "generated"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            pass
    sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module("generated")


@contextmanager
def connector_package(specs: Sequence[Path] = ()) -> Iterator[Any]:
    """The connectors to measure: the installed package, or with user spec folders a
    fresh build of built-ins plus those specs into a temporary package, removed on exit."""
    if not specs:
        yield _installed()
        return
    # A unique name: Python caches a package by name, and a second run may bring other specs.
    name = f"kvgen_bench_{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="kvgen-bench-") as tmp:
        build(Path(tmp) / name, specs)
        sys.path.insert(0, tmp)
        try:
            yield importlib.import_module(name)
        finally:
            sys.path.remove(tmp)
            for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[module]


def _lookup(library: Library, name: str) -> Spec | None:
    try:
        return library[name]
    except (KeyError, KVGenError):
        return None


def _resolve(library: Library, names: Sequence[str], paged: bool) -> tuple[list[Spec], list[str]]:
    """The specs `names` select (paged layouts or memory objects), and a problem per name that selects none."""
    kind = "paged layout" if paged else "memory object"
    found, problems = [], []
    for name in names:
        spec = _lookup(library, name)
        if spec is None:
            problems.append(f"no {kind} named {name!r}")
        elif spec.is_paged != paged:
            problems.append(f"{name!r} is a {'paged layout' if spec.is_paged else 'memory object'}, not a {kind}")
        elif spec not in found:
            found.append(spec)
    if not names:
        problems.append(f"no {kind}s selected")
    return found, problems


def _valid_names(library: Library) -> str:
    return (f"valid layouts: {', '.join(s.name for s in library.paged)}\n"
            f"valid objects: {', '.join(s.name for s in library.objects)}\n"
            "(user layouts: add their folder with --specs DIR)")


def select_targets(library: Library, package: Any, layouts: Sequence[str], objects: Sequence[str]) -> list[Target]:
    """Every (layout, object) pair of the selection that `package` has a connector for.

    Raises KVLayoutError naming every unknown name and listing the valid ones when a name
    selects nothing or no pair has a connector: a bench that measures nothing is an error."""
    paged, problems = _resolve(library, layouts, paged=True)
    objs, obj_problems = _resolve(library, objects, paged=False)
    problems += obj_problems
    if problems:
        raise KVLayoutError("\n".join([*problems, _valid_names(library)]))
    targets = []
    for spec in paged:
        for obj in objs:
            if _has(package, spec, obj):
                cls = package.get(spec.name, obj.name)
                targets.append(Target(spec.name, obj.name, "layerwise" if cls.layerwise else "whole"))
    if not targets:
        partners = [f"  {s.name}: {', '.join(o.name for o in library.objects if _has(package, s, o)) or 'none'}"
                    for s in paged]
        raise KVLayoutError(f"no generated connector pairs layouts {', '.join(s.name for s in paged)} with objects "
                            f"{', '.join(o.name for o in objs)}; these layouts pair with:\n" + "\n".join(partners))
    return targets


def every_builtin(args: Any, library: Library) -> None:
    """`--all`: select every paged layout and memory object (each pair measured where a
    connector was generated), every declared transfer and every model, in place of the
    short default set (and of any selection given with it)."""
    args.layouts = [s.name for s in library.paged]
    args.objects = [s.name for s in library.objects]
    args.transfers = ",".join(f"{p.src.name}:{p.dst.name}" for p in load_transfers(library, args.specs))
    args.models = ",".join(m.name for m in library.models)


def _has(package: Any, paged: Spec, obj: Spec) -> bool:
    try:
        package.get(paged.name, obj.name)
    except (KeyError, KVGenError):
        return False
    return True


#: The heads of a group where a cache's spec reads that factor from the tensor (SGLang's page_unified).
GROUP_HEADS = 2


def extents(spec: Spec, layers: int, heads: int, head_size: int, block_size: int, num_blocks: int) -> dict[str, int]:
    """Axis extents of a cache of `spec`: MLA layouts (no H axis) get one head of MLA_C values;
    a cache of several parts takes its axes from its parts (a part of fixed width keeps it); a
    block of `slots_per_token` k holds `block_size` tokens in N = block_size * k stored slots; H
    split by a factor read from the tensor (`H%g`, head groups) has groups of GROUP_HEADS heads."""
    if spec.is_simple:
        kv, mla = spec.has("KV"), not spec.has("H")
    else:  # an axis held whole or split
        kv, mla = any(p.has("KV") for p in spec.parts), not any(p.has("H") for p in spec.parts)
    out = {"L": layers, "KV": 2 if kv else 1, "H": 1 if mla else heads,
           "C": MLA_C if mla else head_size, "N": block_size * spec.token_ratio[1], "B": num_blocks}
    if "H" in dict(spec.sizes):  # a layout of a fixed head count (DeepSeek-V4's one head slot) keeps it
        out["H"] = dict(spec.sizes)["H"]
    for part in spec.parts:
        for axis in part.tensor_axes:
            base, _, factor = split_of(axis) or ("", "", 0)
            if isinstance(factor, str):  # the group's place, and the groups (a format-1 tree's shape reads both)
                group = out[place_of(base, factor)] = math.gcd(out[base], GROUP_HEADS)
                out[f"{base}/{factor}"] = out[base] // group
    return out


def slot_mapping(num_tokens: int, num_blocks: int, block_size: int, alloc: str, rng: random.Random) -> list[int]:
    """vLLM-style block table: the chunk fills ceil(T / N) blocks, from block 0 in order
    (contiguous) or a random sample of the cache's blocks in random order (random)."""
    need = -(-num_tokens // block_size)
    blocks = list(range(need)) if alloc == "contiguous" else rng.sample(range(num_blocks), need)
    return [blocks[i // block_size] * block_size + i % block_size for i in range(num_tokens)]
