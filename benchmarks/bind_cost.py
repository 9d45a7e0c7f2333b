"""What checking a cache costs: each layout's generated `read_geometry`, a first `bind`
of a new cache and a `bind` of an unchanged one (median of 7 repeats, microseconds).

    python benchmarks/bind_cost.py

Caches: bf16, L=32, B=64, N=16, H=8, C=128 (MLA: C=576), in each layout's own containers.
"""

from __future__ import annotations

import importlib
import math
import statistics
import timeit

import torch

from kvgen.oracle.reference.layouts import nest
from kvgen.spec.library import load_library

LAYOUTS = (("vllm_flash_attn_nhd", "kv_2ltd"), ("vllm_kv_tuple", "kv_2ltd"), ("vllm_packed_nhd", "kv_2ltd"),
           ("vllm_cross_layer", "kv_2ltd"), ("sglang_mha", "kv_2ltd"), ("vllm_mla", "kv_mla"))


def cache_for(spec) -> object:
    ext = {"L": 32, "KV": 2, "B": 64, "N": 16, "H": 8, "C": 576 if "mla" in spec.name else 128}
    shape = tuple(ext["B"] * ext["N"] if d.is_slot else math.prod(ext[a] for a in d.axes) for d in spec.dims)
    return nest(spec, ext, lambda _: torch.zeros(shape, dtype=torch.bfloat16))


def median_us(fn, number: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def costs(module, cache) -> tuple[float, float, float]:
    """(read_geometry, bind of a new cache, bind of the same cache again), microseconds."""
    read = median_us(lambda: module.read_geometry(cache), 500)
    fresh = median_us(lambda: module.Connector().bind(cache), 100)
    conn = module.Connector()
    conn.bind(cache)
    same = median_us(lambda: conn.bind(cache), 500)
    return read, fresh, same


def main() -> None:
    library = load_library()
    print(f"{'layout':<22} {'read_geometry us':>17} {'bind new cache us':>18} {'bind same cache us':>19}")
    for layout, obj in LAYOUTS:
        module = importlib.import_module(f"kvgen.generated.{layout}__{obj}")
        read, fresh, same = costs(module, cache_for(library[layout]))
        print(f"{layout:<22} {read:>17.1f} {fresh:>18.1f} {same:>19.1f}")


if __name__ == "__main__":
    main()
