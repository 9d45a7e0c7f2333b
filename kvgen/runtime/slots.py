"""Per-chunk slot work, done once per chunk and shared by every layer's copy.

A chunk's tokens split into a *block path* (a run of whole, in-order blocks, moved a
block at a time) and a *token path* (everything else: partial blocks at either end,
scattered slots, folded slot axes). Tokens with slot < 0, and tokens a load is told to
skip, are in neither and are never touched.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.runtime import native
from kvgen.runtime.errors import KVLayoutError


def signed_integers(dtype: torch.dtype) -> bool:
    """Whether slot tensors of `dtype` say what the docs promise (signed integers, < 0 to
    skip): unsigned ones (uint8 to uint64) cannot hold -1, and a uint64 slot of 2**63 or
    more reads as a negative one, skipping its token unsaid."""
    return dtype.is_signed and not dtype.is_floating_point and not dtype.is_complex


@dataclass(frozen=True)
class Chunk:
    """What one chunk moves. Token-path fields are None when the path is empty."""

    num_tokens: int
    #: How many tokens the chunk moves (the rest have slot < 0 or are skipped).
    moved: int
    #: Token path: positions in the chunk (None: all of 0..num_tokens-1, in order) and slots.
    tok: torch.Tensor | None
    #: (a slice when a folded slot axis gets consecutive slots: one plain copy)
    slots: torch.Tensor | slice | None
    blk: torch.Tensor | None
    off: torch.Tensor | None
    #: Block path: chunk tokens [block_start, block_start + block_tokens) fill `block_ids`,
    #: a slice when the blocks are consecutive (one plain copy), else an index tensor.
    block_ids: torch.Tensor | slice | None
    block_start: int
    block_tokens: int

    @property
    def covers_all(self) -> bool:
        return self.moved == self.num_tokens

    @property
    def has_tokens(self) -> bool:
        return self.slots is not None

    @property
    def has_blocks(self) -> bool:
        return self.block_ids is not None


def _aligned_run(slots: torch.Tensor, lo: int, hi: int, n: int, first_slot: int
                 ) -> tuple[int, int, torch.Tensor | slice] | None:
    """The longest run of whole in-order blocks in tokens [lo, hi), if the tokens are
    consecutive slots within each block: (first token, token count, block ids), the ids a
    slice when the blocks themselves are consecutive."""
    first = lo + (-first_slot % n)
    count = (hi - first) // n
    if count <= 0:
        return None
    run = slots[first:first + count * n].view(count, n)
    ids = run[:, 0] // n
    # Block b holds slots b*N .. b*N + N-1, in order: one comparison covers every token.
    steps = torch.arange(n, device=slots.device, dtype=slots.dtype)
    if not torch.equal(run, ids[:, None] * n + steps):
        return None
    first_id, last_id = int(ids[0]), int(ids[-1])
    if last_id - first_id == count - 1 and torch.equal(ids, torch.arange(first_id, last_id + 1, device=ids.device)):
        return first, count * n, slice(first_id, last_id + 1)
    return first, count * n, ids


def _check_window(have: int, start: int, end: int, offset: int, skip: int) -> None:
    """Tokens [start, end) and their `skip` prefix fit a slot mapping of `have` entries from token `offset` on."""
    n, lo_map, hi_map = end - start, start - offset, end - offset
    if n < 0:
        raise KVLayoutError(f"a chunk must have start <= end, got start {start} and end {end}")
    if lo_map < 0 or hi_map > have:
        where = (f"start {start} is before the first token the mapping holds ({offset})" if lo_map < 0
                 else f"end {end} is beyond the last token the mapping holds ({offset + have - 1})")
        raise KVLayoutError(
            f"tokens [{start}, {end}) with offset {offset} need slot_mapping[{lo_map}:{hi_map}], "
            f"but slot_mapping has {have} entries: {where}")
    if not 0 <= skip <= n:
        raise KVLayoutError(f"skip_prefix_n_tokens must be in [0, {n}] for a chunk of {n} tokens, got {skip}")


@dataclass(frozen=True)
class SlotFacts:
    """What a chunk's slots say before any index tensor is made: their range, which tokens move,
    and the longest run of whole in-order blocks (kvgen_slots in csrc/kvcopy.c says it in one
    pass on the CPU; `_torch_facts` with tensor ops anywhere)."""

    low: int
    high: int
    #: Tokens that move (slot >= 0, not skipped), the first of them, and whether they are consecutive.
    moved: int
    first: int
    one_run: bool
    #: (first token, token count, block ids: a slice when consecutive), or None.
    run: tuple[int, int, torch.Tensor | slice] | None


def _moved(slots: torch.Tensor, low: int, skip: int) -> tuple[int, int, bool]:
    """(how many tokens move, the first, whether they are one run)."""
    n = slots.shape[0]
    if low >= 0 and not skip:  # the common case: every token moves
        return n, 0, True
    valid = _valid(slots, skip)
    count = int(valid.sum())
    if count == 0:
        return 0, 0, True
    lo = int(valid.to(torch.int8).argmax())
    return count, lo, bool(valid[lo:lo + count].all())


def _valid(slots: torch.Tensor, skip: int) -> torch.Tensor:
    """Which tokens move: those with a slot, after the first `skip`."""
    valid = slots >= 0
    if skip:
        valid[:skip] = False
    return valid


def _torch_facts(slots: torch.Tensor, skip: int, block_size: int | None) -> SlotFacts:
    low, high = torch.stack(torch.aminmax(slots)).tolist()  # one host sync
    count, lo, contiguous = _moved(slots, low, skip)
    run = None
    if count and contiguous and block_size:
        run = _aligned_run(slots, lo, lo + count, block_size, int(slots[lo]))
    return SlotFacts(low, high, count, lo, contiguous, run)


def _native_facts(lib: Any, slots: torch.Tensor, skip: int, block_size: int | None) -> SlotFacts:
    """SlotFacts from kvgen_slots; `slots` contiguous int64 (slot_facts checks)."""
    out = array.array("q", bytes(8 * 9))
    lib.kvgen_slots(slots.data_ptr(), slots.shape[0], skip, block_size or 0, out.buffer_info()[0])
    low, high, count, lo, contiguous, first, tokens, consecutive, first_slot = out
    run: tuple[int, int, torch.Tensor | slice] | None = None
    if first >= 0:
        n = block_size or 1
        first_id = first_slot // n
        # the run's slots are >= 0, so truncating divides as flooring would (and skips a wrapper)
        ids: torch.Tensor | slice = slice(first_id, first_id + tokens // n) if consecutive \
            else torch.div(slots[first:first + tokens:n], n, rounding_mode="trunc")
        run = (first, tokens, ids)
    return SlotFacts(low, high, count, lo, bool(contiguous), run)


def slot_facts(slots: torch.Tensor, skip: int, block_size: int | None) -> SlotFacts:
    """SlotFacts of a chunk's int64 contiguous slots: in one C pass where the compiled kernel is
    loaded and the slots are on the CPU, else with tensor ops (the same facts; tests compare them)."""
    if slots.dtype != torch.int64 or not slots.is_contiguous():  # the C pass reads n packed int64
        raise ValueError(f"slot_facts takes contiguous int64 slots, got {slots.dtype} strides {slots.stride()}")
    if slots.device.type == "cpu":
        lib = native.library()
        if lib is not None:
            return _native_facts(lib, slots, skip, block_size)
    return _torch_facts(slots, skip, block_size)


def _token_slots(slots: torch.Tensor, token_pos: torch.Tensor | None, every: bool,
                 span: tuple[int, int], block_size: int | None) -> tuple[Any, Any, Any]:
    """The token path's (slots, blocks, offsets in block): None where no token takes it, a slice
    for a folded axis's consecutive slots (`span`: the lowest and highest slot)."""
    low, high = span
    n = slots.shape[0]
    if token_pos is not None and token_pos.numel() == 0:
        return None, None, None
    if block_size is None and every and high - low == n - 1 and torch.equal(
            slots, torch.arange(low, high + 1, device=slots.device)):
        return slice(low, high + 1), None, None
    tok_slots = slots if token_pos is None else slots[token_pos]
    if not block_size:
        return tok_slots, None, None
    return tok_slots, tok_slots // block_size, tok_slots % block_size


def plan_chunk(slot_mapping: torch.Tensor, start: int, end: int, cache: Any, *, offset: int = 0,
               skip: int = 0) -> Chunk:
    """Slots of tokens [start, end) of a sequence in a cache of `cache.S` slots and blocks of
    `cache.N` (None: no blocks); `slot_mapping[i - offset]` holds token i's slot (SGLang passes
    a partial mapping and its offset); the first `skip` tokens of the chunk are left alone
    (vLLM's skip_prefix_n_tokens)."""
    num_slots, block_size = cache.S, cache.N
    _check_window(slot_mapping.shape[0], start, end, offset, skip)
    n = end - start
    slots = slot_mapping[start - offset:end - offset]
    if slots.dtype != torch.int64:
        slots = slots.to(torch.int64)
    slots = slots.contiguous()  # what every kernel indexes with
    empty = Chunk(n, 0, None, None, None, None, None, 0, 0)
    if n == 0:
        return empty
    facts = slot_facts(slots, skip, block_size)
    low, high, count, lo = facts.low, facts.high, facts.moved, facts.first
    if high >= num_slots:
        raise KVLayoutError(f"slot {high} is outside the cache, which has {num_slots} slots "
                            f"(valid slots: 0..{num_slots - 1}, or < 0 to skip a token)")
    if count == 0:
        return empty
    every = low >= 0 and not skip  # no token is skipped
    if facts.run is None:
        token_pos = None if every or count == n else _valid(slots, skip).nonzero().squeeze(1)
        block_ids, block_start, block_tokens = None, 0, 0
    else:
        block_start, block_tokens, block_ids = facts.run
        ranges = [(lo, block_start), (block_start + block_tokens, lo + count)]
        parts = [torch.arange(a, b, device=slots.device) for a, b in ranges if b > a]
        if not parts:  # whole blocks only: no token takes the token path
            return Chunk(n, count, None, None, None, None, block_ids, block_start, block_tokens)
        token_pos = torch.cat(parts)
    tok_slots, blk, off = _token_slots(slots, token_pos, every, (low, high), block_size)
    return Chunk(n, count, token_pos, tok_slots, blk, off, block_ids, block_start, block_tokens)


def plan_pooled_chunk(slot_mapping: torch.Tensor, span: tuple[int, int], cache: Any, k: int, *,
                      offset: int = 0, skip: int = 0) -> Chunk:
    """plan_chunk for a layout of `slots_per_token` k > 1 (vLLM's Whisper block pooling): the
    mapping holds the engine manager's slot s of each token of `span` (start, end), whose k stored
    slots are s * k .. s * k + k - 1, and the chunk moves k object rows per token."""
    start, end = span
    _check_window(slot_mapping.shape[0], start, end, offset, skip)
    stored = pooled_slots(slot_mapping[start - offset:end - offset].to(torch.int64), k, cache.S)
    return plan_chunk(stored, 0, stored.shape[0], cache, skip=skip * k)


def pooled_slots(slots: torch.Tensor, k: int, num_slots: int) -> torch.Tensor:
    """A chunk's manager slots (one per token, < 0 to skip) as the stored slots they stand for:
    s -> s * k + j for j < k, in order, a skipped token's k entries -1 (the expansion vLLM's
    Whisper attention builder makes before its cache write). A slot beyond the cache is refused
    in the manager's terms, before anything is expanded."""
    if slots.numel() and int(slots.max()) * k >= num_slots:
        high = int(slots.max())
        raise KVLayoutError(f"slot {high} is outside the cache, which has {num_slots // k} slots of "
                            f"{k} stored slots each (valid slots: 0..{num_slots // k - 1}, or < 0 to skip a token)")
    steps = torch.arange(k, dtype=torch.int64, device=slots.device)
    expanded = torch.where(slots[:, None] >= 0, slots[:, None] * k + steps, -1)
    return expanded.reshape(-1)
