"""Which kvgen layout a KV cache is, from facts only: never a guess.

The facts are the cache's structure (list levels and their lengths), its leaf shape, the
leaf's memory order (strides) and dtype, plus what the engine states (hints). They are
matched against every paged spec of a generated package (its `LAYOUTS` and each layout's
`PagedLayout`: list levels, dims, fixed sizes, dtypes, engines, planes); there is no
shape table here. Exactly one spec must fit. When several fit, the error names them with
the hint that decides; when none fits, it says which fact each spec disagreed with.

Memory order: a spec lists a leaf's dims outermost first, as they lie in memory. A spec
that declares `given` (the order the engine hands a leaf over in: vLLM 0.33's logical
[B, H, N, C] for every KVCacheLayout) is read by its one fixed permutation given -> dims, and
refused when the leaf's strides do not follow dims. For a spec without `given`, an engine may
still hand over a permuted view (vLLM before 0.33 exposed its HND caches in the logical order
[2, B, N, H, C] with HND strides); detection matches the view whose dims are sorted by stride.
Either way `Detection.view` hands the (free) memory-order view to the connector.

Versions: specs say which engine releases they describe (`versions`); detection considers only
those that hold the engine's release (`engine_version=`, for vLLM by default the installed one).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from types import ModuleType
from typing import Any

from kvgen.errors import KVLayoutError
from kvgen.integrations.deciders import deciders, extents
from kvgen.integrations.hints import (
    AXIS_HINTS,
    HINTS,
    ORDERS,
    SYNONYMS,
    VLLM_LAYER_ORDERS,
    VLLM_LAYOUTS_BEFORE,
    declared_vllm_layout,
    describe_hints,
    engine_version,
    family,
    normalize_hints,
)
from kvgen.integrations.quant import quant_mismatch
from kvgen.integrations.sglang import layouts as sglang_layouts
from kvgen.integrations.shapes import (
    CacheShape,
    check_given,
    map_leaves,
    memory_order,
    parse_cache_shape,
    read_structure,
)
from kvgen.integrations.shapes import Mismatch as _Mismatch
from kvgen.versions import version_in

__all__ = ["HINTS", "SYNONYMS", "AmbiguousLayout", "CacheShape", "Detection", "NoLayout", "detect", "detect_shape",
           "layout_facts", "memory_order", "parse_cache_shape", "read_structure"]


@dataclass(frozen=True)
class LayoutFacts:
    """What one paged spec of a generated package says about its caches."""

    name: str
    lists: tuple[str, ...]
    dims: tuple[tuple[str, ...], ...]
    sizes: Mapping[str, int]
    dtypes: tuple[str, ...]
    engines: tuple[str, ...]
    planes: int
    lmcache: str | None
    read_geometry: Callable[[Any], Any]
    aliases: tuple[str, ...] = ()
    #: The order the engine hands a leaf over in (`given`), () when it hands over memory order.
    given: tuple[tuple[str, ...], ...] = ()
    #: Engine family -> the range of its releases the spec describes (`versions`).
    versions: Mapping[str, str] = field(default_factory=dict)
    #: Engine family -> its name for the quantization the cache stores (`quant`, format 3).
    quant: Mapping[str, str] = field(default_factory=dict)
    #: Stored slots per token (`slots_per_token`, format 3): the tensors are the base layout's.
    slots_per_token: int = 1

    def describes(self, engine: str, version: str) -> bool:
        """Whether the spec holds for release `version` of `engine` (no range: every release)."""
        span = self.versions.get(engine)
        return span is None or version_in(version, span)

    def given_permutation(self) -> tuple[int, ...]:
        """For each memory-order dim, the handed-over dim that holds it (singletons in order)."""
        used: set[int] = set()
        perm = []
        for dim in self.dims:
            i = next(j for j, g in enumerate(self.given) if g == dim and j not in used)
            used.add(i)
            perm.append(i)
        return tuple(perm)

    def axis_dim(self, axis: str) -> int | None:
        """The leaf dim that holds `axis` alone, if any."""
        return next((i for i, d in enumerate(self.dims) if d == (axis,)), None)

    def order(self) -> str | None:
        """'NHD' or 'HND': whether slots or heads come first inside a block."""
        n, h = self.axis_dim("N"), self.axis_dim("H")
        if n is None or h is None:
            return None
        return "NHD" if n < h else "HND"

    def block_order(self) -> tuple[str, ...]:
        """The order of the block, head and slot dims in a leaf (e.g. ('B', 'N', 'H'))."""
        return tuple(d[0] for d in self.dims if d in (("B",), ("H",), ("N",)))

    def families(self) -> set[str]:
        return {family(e.split("/")[0]) for e in self.engines}

    def backends(self) -> set[str]:
        """Attention backends named by the spec's engines (FLASH_ATTN, FLASHINFER, ...)."""
        return {e.split("/", 1)[1].upper() for e in self.engines if "/" in e}


@dataclass(frozen=True)
class Detection:
    """The one layout a cache is, the extents read from it, and the leaf permutation that
    turns what the engine handed over into the memory-order view the spec describes."""

    layout: str
    lmcache: str | None
    extents: Mapping[str, int]
    permutation: tuple[int, ...]
    decided_by: tuple[str, ...] = field(default=())

    @property
    def permuted(self) -> bool:
        return self.permutation != tuple(range(len(self.permutation)))

    def view(self, kvcaches: Any) -> Any:
        """`kvcaches` with every tensor permuted into memory order (a view, no copy)."""
        if not self.permuted:
            return kvcaches
        return map_leaves(kvcaches, lambda t: t.permute(*self.permutation))


class AmbiguousLayout(KVLayoutError):
    """Several layouts fit; `candidates` maps each to hints that would select it."""

    def __init__(self, message: str, candidates: Mapping[str, Mapping[str, Any]]):
        super().__init__(message)
        self.candidates = dict(candidates)


class NoLayout(KVLayoutError):
    """No layout fits; `reasons` maps each layout to the fact it disagreed with."""

    def __init__(self, message: str, reasons: Mapping[str, str]):
        super().__init__(message)
        self.reasons = dict(reasons)


def _package(package: ModuleType | str | None) -> ModuleType:
    if package is None:
        package = "kvgen.generated"
    return importlib.import_module(package) if isinstance(package, str) else package


def detectable(facts: dict[str, Any]) -> bool:
    """Whether a layout is told apart by the shape and strides of its tensors: a K/V or MLA
    cache of one tensor tree (spec format 1). Caches of several parts or typed fields (spec
    format 2), and caches that hold K or V alone (heads but one plane), look like others
    from their tensors alone; a deployment names them (`kv_layout=` a spec name or alias)."""
    if "parts" in facts or facts.get("placement", "device") != "device":
        return False  # host pools are never what an engine hands a GPU connector
    has_heads = any("H" in dim for dim in facts["dims"])
    return not (facts.get("planes") == 1 and has_heads)


@lru_cache(maxsize=8)
def _facts_of(package: ModuleType) -> tuple[LayoutFacts, ...]:
    out = []
    for name, facts in package.LAYOUTS.items():
        # Format-3 quantized caches are one tree of fields whose engine names the quantization (`quant`).
        if facts["kind"] != "paged" or not (detectable(facts) or facts.get("parts") == ("",) and "quant" in facts):
            continue
        obj = next((o for (p, o) in package.CONNECTORS if p == name), None)
        if obj is None:
            continue
        cls = package.get(name, obj)
        paged = cls.layout
        out.append(LayoutFacts(name=name, lists=tuple(facts["lists"]), dims=tuple(map(tuple, facts["dims"])),
                               sizes={**dict(paged.sizes), **({"C": facts["row"]} if "row" in facts else {})},
                               dtypes=tuple(paged.dtypes), quant=dict(facts.get("quant", ())),
                               engines=tuple(facts.get("engines", ())), planes=int(facts.get("planes", 2)),
                               lmcache=facts.get("lmcache"), read_geometry=cls.read_geometry,
                               aliases=tuple(facts.get("aliases", ())),
                               given=tuple(map(tuple, facts.get("given", ()))),
                               versions=dict(facts.get("versions", ())),
                               slots_per_token=int(facts.get("slots_per_token", 1))))
    return tuple(out)


def layout_facts(package: ModuleType | str | None = None) -> tuple[LayoutFacts, ...]:
    """The paged specs of `package` (default: kvgen.generated) as detection reads them."""
    return _facts_of(_package(package))


# -- matching one spec ------------------------------------------------------------------

class _Reading(dict[str, int]):
    """The extents read from a cache so far: an axis read in two places must agree."""

    def assign(self, axis: str, value: int, where: str) -> None:
        if self.setdefault(axis, value) != value:
            raise _Mismatch(f"{axis} is {self[axis]} in one place and {value} at {where}")


def _read_plain(f: LayoutFacts, cache: CacheShape, shape: tuple[int, ...], ext: _Reading) -> None:
    """The list levels and the dims of one axis (or a singleton) read from the cache."""
    if len(cache.lists) != len(f.lists):
        levels = " -> ".join(f.lists) or "none"
        raise _Mismatch(f"list levels: the spec has {len(f.lists)} ({levels}), the cache {len(cache.lists)}")
    for axis, n in zip(f.lists, cache.lists, strict=True):
        ext.assign(axis, n, f"list level {axis}")
    if len(shape) != len(f.dims):
        raise _Mismatch(f"rank: the spec's tensors have {len(f.dims)} dims, the cache's {len(shape)}")
    for i, (axes, n) in enumerate(zip(f.dims, shape, strict=True)):
        if not axes and n != 1:
            raise _Mismatch(f"dim {i} must be 1, it is {n}")
        if len(axes) == 1:
            ext.assign(axes[0], n, f"dim {i}")
    for axis, value in f.sizes.items():
        if axis in ext and ext[axis] != value:
            raise _Mismatch(f"{axis} must be {value}, it is {ext[axis]}")
        ext.setdefault(axis, value)


def _read_fused(axes: tuple[str, ...], n: int, i: int, ext: _Reading) -> None:
    """A fused dim of extent `n`: the one axis not known yet is what is left of `n`."""
    product = math.prod(ext[a] for a in axes if a in ext)
    unknown = [a for a in axes if a not in ext]
    if not unknown and product != n:
        raise _Mismatch(f"dim {i} ({' '.join(axes)}) must be {product}, it is {n}")
    if len(unknown) == 1:
        if n % product:
            raise _Mismatch(f"dim {i} ({' '.join(axes)}) = {n} does not split by {product}")
        ext[unknown[0]] = n // product
    elif unknown:
        ext["S"] = n  # a folded slot axis (SGLang's B*N): its parts are not facts


def _fit(f: LayoutFacts, cache: CacheShape, shape: tuple[int, ...]) -> dict[str, int]:
    """The extents `f` reads from a cache whose memory-order leaf shape is `shape`."""
    ext = _Reading()
    _read_plain(f, cache, shape, ext)
    for i, (axes, n) in enumerate(zip(f.dims, shape, strict=True)):
        if len(axes) >= 2:
            _read_fused(axes, n, i, ext)
    for axis in ("KV", "H"):
        ext.setdefault(axis, 1)
    if "S" not in ext:
        ext["S"] = ext.get("B", 1) * ext.get("N", 1)
    if cache.dtype is not None and cache.dtype not in f.dtypes:
        raise _Mismatch(f"dtype {cache.dtype} is not one of {', '.join(f.dtypes)}")
    return dict(ext)


def _check_size_hints(f: LayoutFacts, ext: Mapping[str, int], hints: Mapping[str, Any]) -> None:
    """The extents the engine states (num_kv_heads, block_size, ..., hidden_dim) against those read;
    a block of k slots per token holds block_size tokens of N = block_size * k slots."""
    for axis, hint in AXIS_HINTS:
        if hints.get(hint) is None or axis not in ext:
            continue
        stated = hints[hint] * (f.slots_per_token if axis == "N" else 1)
        if ext[axis] != stated:
            per = f" ({hints[hint]} tokens of {f.slots_per_token} slots)" if stated != hints[hint] else ""
            raise _Mismatch(f"{hint}={hints[hint]}{per}, but read this way {axis} is {ext[axis]}")
    if hints.get("hidden_dim") is not None and ext["H"] * ext["C"] != hints["hidden_dim"]:
        raise _Mismatch(f"hidden_dim={hints['hidden_dim']}, but read this way H*C is {ext['H']}*{ext['C']}")


def _check_kind_hints(f: LayoutFacts, hints: Mapping[str, Any]) -> None:
    """What the engine says the cache is (planes, engine, backend, NHD or HND) against the spec."""
    if hints.get("planes") is not None and f.planes != hints["planes"]:
        what = "an MLA cache (one plane)" if hints["planes"] == 1 else "separate K and V"
        raise _Mismatch(f"the engine says {what}, the spec has {f.planes} plane(s)")
    if (why := quant_mismatch(f.quant, hints)) is not None:
        raise _Mismatch(why)
    if (why := _ratio_mismatch(f.slots_per_token, hints.get("tokens_per_state"))) is not None:
        raise _Mismatch(why)
    engine = hints.get("engine")
    if engine is not None and family(engine) not in f.families():
        raise _Mismatch(f"engine {family(engine)!r}: the spec is for {', '.join(sorted(f.families()))}")
    backend = hints.get("backend")
    if backend is not None and str(backend).upper() not in f.backends():
        raise _Mismatch(f"backend {backend!r}: the spec is for {', '.join(sorted(f.backends())) or 'no backend'}")
    kv_layout = hints.get("kv_layout")
    order = sglang_layouts.pool_order(f)  # f.order(), or the order SGLang's word names for its [slots, H, C] rows
    if kv_layout is not None and str(kv_layout).upper() in ORDERS and order != str(kv_layout).upper():
        raise _Mismatch(f"kv_layout={kv_layout!r}, the spec's order is {order or 'neither NHD nor HND'}")


def _ratio_mismatch(slots_per_token: int, tokens_per_state: Fraction | None) -> str | None:
    """Why a spec of `slots_per_token` is not a cache of vLLM's `tokens_per_state`, or None. A
    cache of several slots per token has its base layout's tensors, so it is never read from them:
    only an engine that states the fraction (Whisper block pooling) gets that spec."""
    wanted = Fraction(1, slots_per_token)
    if tokens_per_state is None:
        if slots_per_token == 1:
            return None
        return (f"the spec stores each token as {slots_per_token} slots, a cache whose tensors are its base "
                f"layout's: only tokens_per_state=Fraction(1, {slots_per_token}) (vLLM's KVCacheSpec) selects it")
    if tokens_per_state != wanted:
        return f"tokens_per_state={tokens_per_state}, the spec stores {wanted} tokens per slot"
    return None


def _check_given_order(f: LayoutFacts, hints: Mapping[str, Any], perm: tuple[int, ...]) -> None:
    """The order the engine handed the dims over in (NHD or HND) against the one `perm` reads."""
    if f.given:
        return  # the spec states the order the engine hands its leaves over in
    given, engine = hints.get("given_order"), hints.get("engine")
    if given is None and engine is not None and family(engine) == "vllm" and perm != tuple(range(len(perm))):
        given = "NHD"  # vLLM permutes a cache only to hand over its logical view: slots (N) before heads (H)
    if given is not None and f.order():
        n, h = perm[f.axis_dim("N")], perm[f.axis_dim("H")]  # type: ignore[index]
        if ("NHD" if n < h else "HND") != str(given).upper():
            raise _Mismatch(f"the dims were handed over in {str(given).upper()} order, but read this way "
                            f"they would be in {'NHD' if n < h else 'HND'} order")


def _check_hints(f: LayoutFacts, ext: Mapping[str, int], hints: Mapping[str, Any],
                 perm: tuple[int, ...]) -> None:
    _check_kind_hints(f, hints)  # what the cache is before its sizes: a pooled spec's N counts its states
    _check_size_hints(f, ext, hints)
    _check_given_order(f, hints, perm)


# -- detection --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Asked:
    """What the caller's hints select before any spec is fitted."""

    engine: str | None
    version: str | None
    #: The vLLM KVCacheLayout the hints declare (kv_layout=KVCacheLayout.BLHNC, ...), or None.
    declared: str | None
    #: A spec the hints name outright (layout=, or a kv_layout that names a spec), or None.
    named: Any
    candidates: tuple[LayoutFacts, ...]


def _asked(hints: dict[str, Any], package: ModuleType | str | None) -> _Asked:
    """The candidates the hints leave; the hints that only select (engine_version, layout, a
    declared KVCacheLayout or spec name) are taken out of `hints`."""
    version = engine_version(hints)
    hints.pop("engine_version", None)
    engine = family(hints["engine"]) if hints.get("engine") is not None else None
    if version is not None and engine is None:
        raise KVLayoutError(f"engine_version={version!r} needs the engine it is a release of (engine='vllm', ...)")
    everything = layout_facts(package)
    facts = everything if version is None else tuple(f for f in everything if f.describes(engine, version))
    named = hints.pop("layout", None)
    sglang_layouts.read_word(hints)  # SGLang's kv_cache_layout words name an order, or are refused
    # With a layout named outright, NHD or HND only checks its in-block order (vLLM 0.33 reads
    # them as LBNHC and LBHNC, which would overrule the name).
    legacy = str(hints.get("kv_layout")).upper() in ORDERS
    declared = None if named is not None and legacy else declared_vllm_layout(hints.get("kv_layout"), engine, version)
    if declared is not None:
        hints.pop("kv_layout")
        facts = _declared(declared, facts, everything, version)
    elif hints.get("kv_layout") is not None and not legacy:
        kv_layout = str(getattr(hints["kv_layout"], "name", hints.pop("kv_layout")))
        named = named or VLLM_LAYOUTS_BEFORE.get(kv_layout.upper(), kv_layout)  # a spec name, alias or format
    if named is not None:
        facts = _named(named, facts, everything, package, engine, version)
    return _Asked(engine, version, declared, named, facts)


Fit = tuple[LayoutFacts, dict[str, int], tuple[int, ...]]


def _fits(asked: _Asked, cache: CacheShape, hints: Mapping[str, Any]) -> tuple[list[Fit], dict[str, str]]:
    """(spec, extents, permutation) of every candidate that reads the cache, and why each other one does not."""
    sorted_perm = memory_order(cache.shape, cache.stride)
    fits, refused = [], {}
    for f in asked.candidates:
        perm = f.given_permutation() if f.given else sorted_perm
        try:
            if f.given:
                check_given(f.given, f.dims, cache, perm)
            ext = _fit(f, cache, tuple(cache.shape[i] for i in perm))
            _check_hints(f, ext, hints, perm)
        except _Mismatch as why:
            refused[f.name] = str(why)
            continue
        fits.append((f, ext, perm))
    shape = tuple(cache.shape[i] for i in sorted_perm)
    fits += [(g, ext, sorted_perm) for g, ext in sglang_layouts.neighbours(
        [(f, ext) for f, ext, _ in fits], asked.candidates, hints, asked.named is not None,
        lambda g, rest: _try_fit(g, cache, shape, rest, sorted_perm))]
    return fits, refused


def _refuse_unless_one(fits: list[Fit], refused: dict[str, str], asked: _Asked, cache: CacheShape,
                       hints: Mapping[str, Any]) -> None:
    """NoLayout when nothing fits, AmbiguousLayout (with the hints that decide) when more than one does."""
    sorted_perm = memory_order(cache.shape, cache.stride)
    shape = tuple(cache.shape[i] for i in sorted_perm)
    where = f"cache {cache.describe()}" + (f" (by stride [{', '.join(map(str, shape))}])"
                                           if sorted_perm != tuple(range(len(sorted_perm))) else "")
    said = describe_hints({**hints, **({"engine_version": asked.version} if asked.version else {}),
                           **({"kv_layout": asked.declared} if asked.declared else {})})
    if not fits:
        raise NoLayout(f"no layout fits the {where} with hints {said}; what disagreed:\n  "
                       + "\n  ".join(f"{name}: {why}" for name, why in refused.items()), refused)
    pairs = [(f, ext) for f, ext, _ in fits]
    if len(fits) > 1 or any(sglang_layouts.needs_word(f, hints, asked.named is not None) for f, _ in pairs):
        decide = {f.name: deciders(f, ext, pairs) for f, ext in pairs}
        raise AmbiguousLayout(f"{len(fits)} layouts fit the {where} with hints {said}; kvgen "
                              "does not guess:\n  " + "\n  ".join(_candidate_lines(pairs, decide)), decide)


def _candidate_lines(pairs: list[tuple[LayoutFacts, dict[str, int]]], decide: Mapping[str, Mapping[str, Any]]
                     ) -> list[str]:
    """Each candidate with its extents and the hints that pick it."""
    lines = [f"{f.name} {extents(ext)} (pass "
             f"{', '.join(f'{k}={v!r}' for k, v in decide[f.name].items())})" for f, ext in pairs]
    if any(sglang_layouts.word_of(f) for f, _ in pairs):
        lines.append(f"an SGLang pool says its layout, its shape does not: pass {sglang_layouts.HINT}")
    return lines


def detect_shape(cache: CacheShape, *, package: ModuleType | str | None = None, **hints: Any) -> Detection:
    """Detection from a CacheShape (no tensors needed); see `detect`."""
    hints = normalize_hints(hints)
    if hints.get("dtype") is not None:
        cache = CacheShape(cache.lists, cache.shape, cache.stride, str(hints.pop("dtype")).removeprefix("torch."))
    asked = _asked(hints, package)
    fits, refused = _fits(asked, cache, hints)
    _refuse_unless_one(fits, refused, asked, cache, hints)
    f, ext, perm = fits[0]
    moved = perm != tuple(range(len(perm)))
    decided = tuple(sorted(set(hints) | ({"kv_layout"} if asked.declared else set()))) + (
        ("given",) if f.given else (("strides",) if moved else ()))
    return Detection(f.name, f.lmcache, ext, perm, decided)


def _declared(layout: str, facts: Sequence[LayoutFacts], everything: Sequence[LayoutFacts],
              version: str | None) -> tuple[LayoutFacts, ...]:
    """The specs a vLLM KVCacheLayout names for this release: the one with that alias, the MLA
    caches (one head slot: the same bytes under every layout), the quantized ones (their strides
    say under which layout) and the pooled ones of the layout's per-layer order; refused in vLLM's
    words when the library has none for the release."""
    own = tuple(f for f in facts if layout in (a.upper() for a in f.aliases))
    if not own:
        raise _no_layout_for(layout, everything, version)
    return own + _under_every_layout(facts, own, layout)


def _under_every_layout(facts: Sequence[LayoutFacts], own: Sequence[LayoutFacts],
                        layout: str) -> tuple[LayoutFacts, ...]:
    """The vLLM specs a KVCacheLayout name does not pick by alias: the MLA caches, the quantized
    ones (their strides say under which layout) and the pooled ones of the layout's per-layer order."""
    vllm = [f for f in facts if "vllm" in f.families() and f not in own]
    mla = tuple(f for f in vllm if f.given and f.planes == 1)
    # their strides decide the layout; a quantized cache of one plane (K and V in one slot) is listed once
    quantized = tuple(f for f in facts if "vllm" in f.quant and f not in own and f not in mla)
    # several slots per token (Whisper block pooling): the layout's order picks the spec, tokens_per_state keeps it
    pooled = tuple(f for f in vllm if f.slots_per_token > 1 and f.block_order() == VLLM_LAYER_ORDERS.get(layout))
    return mla + quantized + pooled


def _no_layout_for(layout: str, everything: Sequence[LayoutFacts], version: str | None) -> NoLayout:
    """The refusal of a KVCacheLayout no spec of this release has, in vLLM's words, naming the specs of others."""
    other = [f"{f.name} (vllm {f.versions.get('vllm', 'any release')})" for f in everything
             if layout in (a.upper() for a in f.aliases)]
    release = f"vLLM {version} " if version else "vLLM "
    return NoLayout(f"{release}KVCacheLayout.{layout}: kvgen has no layout for it in this "
                    f"release{'; ' + ', '.join(other) + ' describe(s) other releases' if other else ''}; "
                    "add a spec with that alias and the release in its versions", {layout: "no spec"})


def _named(named: Any, facts: Sequence[LayoutFacts], everything: Sequence[LayoutFacts],
           package: ModuleType | str | None, engine: str | None, version: str | None) -> tuple[LayoutFacts, ...]:
    name = _package(package).resolve(str(getattr(named, "name", named)))
    kept = tuple(f for f in facts if f.name == name)
    if kept:
        return kept
    known = next((f for f in everything if f.name == name), None)
    if known is not None and str(engine) in known.versions:
        raise NoLayout(f"layout {named!r} ({name}) describes {engine} {known.versions[str(engine)]}, "
                       f"not release {version}; pass engine_version= if the engine is another release",
                       {name: f"not for {engine} {version}"})
    if known is not None:
        left = ", ".join(f.name for f in facts) or "none"
        raise NoLayout(f"layout {named!r} ({name}) is not among the layouts the other hints leave ({left})",
                       {name: "ruled out by the other hints"})
    raise KVLayoutError(f"layout {named!r} is no paged layout detection reads (one tree of K/V or MLA "
                        "tensors); for a cache of several parts or fields, or K or V alone, take its "
                        "connector by name: kvgen.generated.get(layout, object)")


def _try_fit(f: LayoutFacts, cache: CacheShape, shape: tuple[int, ...], hints: Mapping[str, Any],
             perm: tuple[int, ...]) -> dict[str, int] | None:
    try:
        ext = _fit(f, cache, shape)
        _check_hints(f, ext, hints, perm)
    except _Mismatch:
        return None
    return ext


def detect(kvcaches: Any, *, package: ModuleType | str | None = None, **hints: Any) -> Detection:
    """The one kvgen layout `kvcaches` is, or KVLayoutError naming the candidates (and the
    hint that decides) or the facts that disagreed.

    `kvcaches`: the engine's structure (nested lists/tuples of tensors, or one tensor), or
    a CacheShape. Hints: engine ('vllm', 'sglang', 'trtllm' or LMCache's EngineType),
    kv_layout ('NHD', 'HND', or a spec name/alias/LMCache format such as 'BLHNC'),
    num_kv_heads, block_size (tokens_per_block), head_size (head_dim), hidden_dim (H*C),
    num_layers, use_mla, kv_shape (LMCache's metadata.kv_shape), layout (force a spec),
    dtype. `package`: a generated package (default kvgen.generated), for your own specs.
    """
    if isinstance(kvcaches, CacheShape):
        return detect_shape(kvcaches, package=package, **hints)
    cache, _ = read_structure(kvcaches)
    result = detect_shape(cache, package=package, **hints)
    for f in layout_facts(package):
        if f.name == result.layout:
            f.read_geometry(result.view(kvcaches))  # the generated reader agrees, or says why not
    return result

