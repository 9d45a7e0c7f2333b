"""Transfer scenarios shared by the tests and `kvgen verify`: coordinate-coded source and
destination caches of their own extents, pairs of slot mappings, and one transfer run through
a generated class and through the reference (kvgen.oracle.reference.transfers).

Source elements carry the code of their coordinates (layer, kv, slot, head, c), destination
elements codes of theirs with a salt, so an element written from the wrong place, or written
when it should not be, shows; comparisons are bitwise. The scenarios cover whole blocks onto
whole blocks (in order and consecutive), partial blocks at both ends, random slots, -1 on
either side, block sizes that differ, head ranges in both directions, and caches whose strides
or storage offsets forbid wide copy words.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch

from kvgen.oracle import reference
from kvgen.oracle.reference import transfers
from kvgen.oracle.scenarios.common import allocate, clone_tree, same_bits
from kvgen.oracle.scenarios.layouts import NAMED_FACTOR
from kvgen.runtime.ops import bits
from kvgen.spec.elements import split_extents
from kvgen.spec.model import Spec
from kvgen.tp import HeadRanges

#: Source extents: 2 layers, 2 heads, 4 values per head (16-byte words at float32), 12 blocks
#: of 4 slots. Equal extents hide nothing: every element's value encodes its coordinates.
SRC_EXT = {"L": 2, "KV": 2, "H": 2, "C": 4, "N": 4, "B": 12}
#: Destination extents: another block count, so a B/N mix-up lands elsewhere.
DST_EXT = {**SRC_EXT, "B": 10}
#: Destination salt: its codes never equal a source code (float32 and 16-bit types).
DST_SALT = 10000

Mapping2 = tuple[list[int], list[int]]
MakeMapping = Callable[[random.Random, Mapping[str, int], Mapping[str, int]], Mapping2]


def block_table(rng: random.Random, ext: Mapping[str, int], tokens: int, first: int = 0) -> list[int]:
    """vLLM-style: `tokens` tokens from position `first` of a block table of random blocks."""
    n = ext["N"]
    blocks = rng.sample(range(ext["B"]), -(-(first + tokens) // n))
    return [blocks[i // n] * n + i % n for i in range(first, first + tokens)]


def _blocks(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    return block_table(rng, s, 12), block_table(rng, d, 12)


def _consecutive_blocks(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    return list(range(2 * s["N"], 5 * s["N"])), list(range(5 * d["N"], 5 * d["N"] + 3 * s["N"]))


def _into_consecutive_blocks(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    """Random source blocks into consecutive destination blocks (a gather straight into them)."""
    return block_table(rng, s, 12), list(range(4 * d["N"], 4 * d["N"] + 12))


def _from_consecutive_blocks(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    return list(range(6 * s["N"], 6 * s["N"] + 12)), block_table(rng, d, 12)


def _partial_ends(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    """Both sides start one slot into a block: a partial block, whole blocks, a partial block."""
    return block_table(rng, s, 14, 1), block_table(rng, d, 14, 1)


def _partial_minus1(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    """Partial blocks at both ends, whole blocks between, a -1 inside a whole block on each side
    (so those blocks fall back to single tokens) and a -1 on both sides at once."""
    src, dst = _partial_ends(rng, s, d)
    src[5], dst[9], src[12], dst[12] = -1, -1, -1, -1
    return src, dst


def _misaligned(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    return block_table(rng, s, 9, 2), block_table(rng, d, 9)


def _random(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    return rng.sample(range(s["B"] * s["N"]), 12), rng.sample(range(d["B"] * d["N"]), 12)


def _minus1(side: int) -> MakeMapping:
    """Whole-block mappings with -1 on one side: first token, inside a block, last token."""
    def make(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
        maps = list(_blocks(rng, s, d))
        for i in (0, 5, 11):
            maps[side][i] = -1
        maps[1 - side][7] = -1  # and one on the other side
        return maps[0], maps[1]
    return make


def _consecutive_slots(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    """Runs of consecutive slots (rows of a folded axis move as one slice)."""
    return list(range(5, 21)), list(range(2 * d["N"], 2 * d["N"] + 16))


def _all_skipped(rng: random.Random, s: Mapping[str, int], d: Mapping[str, int]) -> Mapping2:
    src, dst = _blocks(rng, s, d)
    return [-1] * 6 + src[6:], dst[:6] + [-1] * 6


@dataclass(frozen=True)
class TransferScenario:
    name: str
    mapping: MakeMapping
    src_ext: Mapping[str, int] = field(default_factory=lambda: SRC_EXT)
    dst_ext: Mapping[str, int] = field(default_factory=lambda: DST_EXT)
    src_heads: tuple[int, int] | None = None
    dst_heads: tuple[int, int] | None = None
    #: How each side's leaves are stored: "" contiguous, "strided" permuted views into a larger
    #: buffer (no dims merge, the last dim is not contiguous), "odd" one element into their
    #: storage (no wide word fits).
    src_storage: str = ""
    dst_storage: str = ""

    @property
    def needs_heads(self) -> bool:
        return self.src_heads is not None or self.dst_heads is not None

    @property
    def heads(self) -> HeadRanges | None:
        """What the transfer call takes as `heads=` (None: every head of both sides)."""
        return HeadRanges(self.src_heads, self.dst_heads) if self.needs_heads else None


SCENARIOS = {sc.name: sc for sc in (
    TransferScenario("whole_blocks", _blocks),
    TransferScenario("consecutive_blocks", _consecutive_blocks),
    TransferScenario("into_consecutive_blocks", _into_consecutive_blocks),
    TransferScenario("from_consecutive_blocks", _from_consecutive_blocks),
    TransferScenario("partial_ends", _partial_ends),
    TransferScenario("partial_minus1", _partial_minus1),
    TransferScenario("misaligned", _misaligned),
    TransferScenario("random_slots", _random),
    TransferScenario("minus1_src", _minus1(0)),
    TransferScenario("minus1_dst", _minus1(1)),
    TransferScenario("all_skipped", _all_skipped),
    TransferScenario("consecutive_slots", _consecutive_slots),
    TransferScenario("larger_dst_blocks", _partial_ends, dst_ext={**SRC_EXT, "N": 8, "B": 6}),
    TransferScenario("smaller_dst_blocks", _blocks, dst_ext={**SRC_EXT, "N": 2, "B": 24}),
    TransferScenario("head_subset", _partial_ends, src_ext={**SRC_EXT, "H": 4}, src_heads=(1, 3)),
    TransferScenario("heads_into_wider", _blocks, dst_ext={**DST_EXT, "H": 4}, dst_heads=(2, 4)),
    TransferScenario("heads_shifted", _random, src_ext={**SRC_EXT, "H": 3}, dst_ext={**DST_EXT, "H": 3},
                     src_heads=(0, 2), dst_heads=(1, 3)),
    TransferScenario("strided_src_odd_dst", _partial_ends, src_storage="strided", dst_storage="odd"),
    TransferScenario("odd_src_strided_dst", _misaligned, src_storage="odd", dst_storage="strided"),
)}


@cache
def _template(spec: Spec, ext: tuple[tuple[str, int], ...], dtype: torch.dtype, salt: int) -> Any:
    """A coded cache, filled once (the reference fills it element by element); never written to."""
    extents = dict(ext)
    shape = reference.layouts.leaf_shape(spec, extents)
    tree = reference.layouts.nest(spec, extents, lambda path: torch.zeros(shape, dtype=dtype))
    reference.layouts.fill_cache(spec, extents, tree, dtype, salt)
    return tree


def make_cache(spec: Spec, ext: Mapping[str, int], dtype: torch.dtype, device: str, salt: int = 0, *,
               storage: str = "plain") -> Any:
    """Fresh leaves holding the coded template of `spec` at extents `ext`; `storage` "strided"
    (permuted views into a larger buffer) or "odd" (one element into their storage) as a
    scenario names it."""
    template = _template(spec, tuple(sorted(ext.items())), dtype, salt)
    shape = reference.layouts.leaf_shape(spec, ext)

    def make(path: tuple[int, ...]) -> torch.Tensor:
        if not spec.is_simple:  # a tree of head groups moves its rows as bytes: strided, its last dim stays dense
            t = reference.planes.allocate_part(shape, dtype, device, storage == "strided", storage == "odd", 1)
        else:
            t = allocate(shape, dtype, device, storage == "strided", storage == "odd")
        bits(t).copy_(bits(reference.leaf(template, path)))
        return t

    return reference.layouts.nest(spec, ext, make)


def applies(src: Spec, dst: Spec, scenario: TransferScenario) -> bool:
    """Head-range scenarios need heads on both sides (an MLA latent has none), and whole head
    groups where a side groups its heads (their ranges cut groups: tests/test_transfer_groups.py
    moves whole groups)."""
    if not scenario.needs_heads:
        return True
    return src.has("H") and dst.has("H") and not (src.head_groups or dst.head_groups)


def fitted_extents(specs: Sequence[Spec], exts: Sequence[Mapping[str, int]]) -> list[dict[str, int]]:
    """The extents of caches that exchange KV, where any groups its heads: groups of NAMED_FACTOR
    heads, at least two groups on every cache (so each moves the others' head count), and the
    split axes' extents."""
    out = [dict(ext) for ext in exts]
    if not any(spec.head_groups for spec in specs):
        return out
    for spec, ext in zip(specs, out, strict=True):
        ext["H"] = max(ext["H"], 2 * NAMED_FACTOR) // NAMED_FACTOR * NAMED_FACTOR
        if spec.head_groups:  # (tile, place): the place's extent is the group's size
            ext[spec.head_groups[1]] = NAMED_FACTOR
        ext.update(split_extents(spec.axes, ext))
    return out


def run_transfer(transfer: Any, src: tuple[Any, torch.Tensor], dst: tuple[Any, torch.Tensor], *,
                 layerwise: bool = False, heads: HeadRanges | None = None) -> int:
    """One call from src (cache, slots) to dst (cache, slots), whole or layer by layer; the
    number of generator steps (0 when whole)."""
    if not layerwise:
        transfer.copy(*src, *dst, heads=heads)
        return 0
    return sum(1 for _ in transfer.copy_layers(*src, *dst, heads=heads))


@dataclass(frozen=True)
class TransferRun:
    """How check_transfer runs a scenario: the caches' dtype, a transfer object to reuse (None:
    a fresh one) and whether it copies layer by layer."""

    dtype: torch.dtype = torch.float32
    transfer: Any = None
    layerwise: bool = False


def check_transfer(package: Any, src: Spec, dst: Spec, device: str, scenario: TransferScenario,
                   run: TransferRun = TransferRun()) -> bool:
    """Whether one generated transfer leaves the destination exactly as the reference does and
    the source untouched."""
    rng = random.Random(f"{src.name}/{dst.name}/{scenario.name}")
    src_ext, dst_ext = fitted_extents((src, dst), (scenario.src_ext, scenario.dst_ext))
    src_map, dst_map = scenario.mapping(rng, src_ext, dst_ext)
    transfer = run.transfer if run.transfer is not None else package.transfer(src.name, dst.name)()
    src_cache = make_cache(src, src_ext, run.dtype, device, storage=scenario.src_storage)
    dst_cache = make_cache(dst, dst_ext, run.dtype, device, DST_SALT, storage=scenario.dst_storage)
    src_before, want = clone_tree(src_cache), clone_tree(dst_cache)
    run_transfer(transfer, (src_cache, torch.tensor(src_map, device=device)),
                 (dst_cache, torch.tensor(dst_map, device=device)), layerwise=run.layerwise, heads=scenario.heads)
    transfers.transfer(
        transfers.TransferSide(src, src_ext, src_before, src_map, scenario.src_heads),
        transfers.TransferSide(dst, dst_ext, want, dst_map, scenario.dst_heads))
    return same_bits(dst_cache, want) and same_bits(src_cache, src_before)
