"""Adding a layout is one YAML file and `kvgen build`: the README walkthrough, as a test."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from kvgen.runtime import MemoryObj
from kvgen.tools.cli import main

# Heads outermost, slots before blocks, K/V packed inside each head's content: a layout not
# in the library (the README's walkthrough; tests/test_readme_walkthroughs.py checks no
# built-in is the same layout).
SPEC = """\
kvgen: 1
name: my_engine_hkv
kind: paged
summary: Example engine cache, heads outermost, slots before blocks, K/V packed in content.
lists: [L]
dims: [H, N, B, [KV, C]]
sizes: {KV: 2}
lmcache: {format: MY_ENGINE_HKV}
engines: [my-engine/ATTN]
"""


def test_new_layout_builds_imports_and_round_trips(tmp_path: Path, monkeypatch) -> None:
    specs = tmp_path / "myspecs"
    specs.mkdir()
    (specs / "my_engine_hkv.yaml").write_text(SPEC)
    out = tmp_path / "my_connectors"
    assert main(["build", "--specs", str(specs), "--out", str(out)]) == 0
    assert (out / "my_engine_hkv__kv_2ltd.py").exists()
    assert (out / "my_engine_hkv__kv_t2d.py").exists()

    monkeypatch.syspath_prepend(str(tmp_path))
    package = importlib.import_module("my_connectors")
    try:
        Connector = package.get("my_engine_hkv", "kv_2ltd")
        L, H, B, N, C = 2, 3, 6, 4, 5
        cache = [torch.randn(H, N, B, 2 * C) for _ in range(L)]
        slots = torch.tensor([9, 10, 11, 0, 1, 2, 3, 20])
        conn = Connector()
        obj = MemoryObj(torch.zeros(2, L, 8, H * C))
        conn.from_gpu(obj, 0, 8, kvcaches=cache, slot_mapping=slots)
        # value 0 of head 1 of token 3 (slot 0) of layer 1: K then V
        assert obj.tensor[0, 1, 3, 1 * C] == cache[1][1, 0, 0, 0]
        assert obj.tensor[1, 1, 3, 1 * C] == cache[1][1, 0, 0, C]

        fresh = [torch.zeros_like(t) for t in cache]
        conn.to_gpu(obj, 0, 8, kvcaches=fresh, slot_mapping=slots)
        for _t, s in enumerate(slots.tolist()):
            for layer in range(L):
                assert torch.equal(fresh[layer][:, s % N, s // N], cache[layer][:, s % N, s // N])
    finally:
        for name in [m for m in sys.modules if m.startswith("my_connectors")]:
            del sys.modules[name]
