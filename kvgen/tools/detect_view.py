"""`kvgen detect`: which spec describes a cache given by its shape (and strides, dtype,
engine hints), and how to view it; the facts that decided it."""

from __future__ import annotations

import argparse
import difflib
import json
from types import ModuleType

from kvgen.errors import KVGenError
from kvgen.integrations.detect import detect, parse_cache_shape
from kvgen.spec.model import DTYPES
from kvgen.tools.packages import import_package
from kvgen.tools.paths import temporary_build


def _dtype_name(text: str) -> str:
    """--dtype: one of the dtype names specs use, refused in one line otherwise."""
    if text not in DTYPES:
        close = difflib.get_close_matches(text, DTYPES, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KVGenError(f"unknown dtype {text!r}{hint}; dtypes: {', '.join(DTYPES)}")
    return text


def detect_main(args: argparse.Namespace) -> int:
    """Detect among the built-in layouts, or with --specs among those and the user's (built
    into a temporary package for the call)."""
    if args.dtype is not None:
        _dtype_name(args.dtype)
    if not args.specs:
        return _detect(args, None)
    with temporary_build(args.specs) as out:
        return _detect(args, import_package(out))


def _detect(args: argparse.Namespace, package: ModuleType | None) -> int:
    cache = parse_cache_shape(args.shape, args.stride, args.dtype)
    hints = {k: getattr(args, k) for k in ("engine", "engine_version", "backend", "kv_layout", "given_order",
                                           "num_kv_heads", "block_size", "head_size", "num_layers", "num_blocks",
                                           "layout")}
    hints["use_mla"] = args.mla
    found = detect(cache, package=package, **hints)
    facts = {"layout": found.layout, "lmcache": found.lmcache, "extents": dict(found.extents),
             "permutation": list(found.permutation), "decided_by": list(found.decided_by)}
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    print(f"{found.layout} (LMCache format: {found.lmcache or '-'})")
    print(f"  extents: {' '.join(f'{k}={v}' for k, v in found.extents.items())}")
    view = f"permute{found.permutation} (the strides' memory order)" if found.permuted else "as given"
    print(f"  view:    {view}")
    used = ["list levels", "shape", *(["dtype"] if cache.dtype else []), *found.decided_by]
    print(f"  facts:   {', '.join(used)}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The cache and the hints `kvgen detect` takes."""
    p.add_argument("shape", metavar="SHAPE",
                   help="list lengths then the tensor shape: 32x[2,1000,16,8,128], 2x32x[4096,8,128], [B,L,2,H,N,C]")
    p.add_argument("--stride", metavar="S,S,...", help="the tensor's strides in elements (memory order is a fact)")
    p.add_argument("--dtype", metavar="NAME", help="the tensor's dtype, e.g. bfloat16")
    p.add_argument("--engine", metavar="NAME", help="the serving engine: vllm, sglang or trtllm")
    p.add_argument("--engine-version", metavar="X.Y.Z",
                   help="the engine's release: only specs whose versions hold it (vllm: the installed one)")
    p.add_argument("--backend", metavar="NAME", help="the engine's attention backend, e.g. FLASHINFER")
    p.add_argument("--kv-layout", metavar="NAME",
                   help="vLLM's KVCacheLayout (LBNHC, ...), SGLang's kv_cache_layout (nhd, hnd), NHD or HND, "
                        "or a layout name")
    p.add_argument("--given-order", choices=("NHD", "HND"),
                   help="the order the engine handed the slot and head dims in (vLLM: NHD)")
    p.add_argument("--num-kv-heads", type=int, metavar="H", help="KV heads per layer (this rank)")
    p.add_argument("--block-size", type=int, metavar="N", help="tokens per block (page size)")
    p.add_argument("--head-size", type=int, metavar="C", help="values per head (MLA: the latent width)")
    p.add_argument("--num-layers", type=int, metavar="L", help="number of layers")
    p.add_argument("--num-blocks", type=int, metavar="B", help="number of blocks in the cache")
    p.add_argument("--mla", action=argparse.BooleanOptionalAction, default=None,
                   help="whether the model uses MLA (one latent plane instead of K and V)")
    p.add_argument("--layout", metavar="NAME", help="check the cache against this one layout only")
