"""The tile moves every generated Triton kernel shares (imported only by the generated
`*_triton` modules, so kvgen runs without Triton installed).

A generated kernel works out, for one program along grid axis 1, where its (layer, kv, ...)
part starts in the cache (`c_base`) and in the object (`o_base`), and the offsets of one
token's row in each (`c_row`, `o_row`, every value the two sides keep in the same order).
`move_chunk` then moves the chunk's tokens as tiles of [tokens, row]:

* programs [0, num_blocks) each move one whole block of the chunk's run of whole blocks:
  cache addresses come from the block id alone (token n of the block is at n * cs_n), so
  a block whose rows lie back to back in the cache is one contiguous stretch;
* the programs after them move the token path, TILE tokens each: the position in the
  object (`tok`, or the program's own when all tokens move) and the slot; a slot < 0 is
  masked, never written or read.

Offsets are in copy words (the widest integer both sides allow, at most 8 bytes), so the
row's innermost, unit-stride run loads and stores as wide vectors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _move(ptrs, offsets, rows, masks, STORE: tl.constexpr, VA: tl.constexpr):  # noqa: ANN001
    """Move a tile of [tokens, row]: ptrs (cache, obj); offsets (cache, object) of each token's
    row start; rows (cache, object) offsets of the words of a row; masks (tokens, row words)."""
    c_off = offsets[0]
    o_off = offsets[1]
    if VA > 1:
        # Every token's row starts at a multiple of VA words (the launch checked the strides).
        # Rounding down changes no valid offset and shows the compiler the alignment, which
        # lets it use vector accesses; a tl.multiple_of hint does not survive canonicalization.
        c_off = (c_off // VA) * VA
        o_off = (o_off // VA) * VA
    mask = masks[0][:, None] & masks[1][None, :]
    c_ptr = ptrs[0] + (c_off[:, None] + rows[0][None, :])
    o_ptr = ptrs[1] + (o_off[:, None] + rows[1][None, :])
    if STORE:
        tl.store(o_ptr, tl.load(c_ptr, mask=mask), mask=mask)
    else:
        tl.store(c_ptr, tl.load(o_ptr, mask=mask), mask=mask)


@triton.jit
def _in_block(n, steps):  # noqa: ANN001
    """The cache offset of slot `n` of a block: n * cs_n, or for a slot split into a tile and a
    place (steps[3:]: the place's stride and its extent P; cs_n the tile's) n // P tiles and
    n % P places."""
    if len(steps) > 3:
        return (n // steps[4]) * steps[1] + (n % steps[4]) * steps[3]
    else:
        return n * steps[1]


@triton.jit
def move_chunk(ptrs, part, chunk, steps, SIZES: tl.constexpr, FLAGS: tl.constexpr):  # noqa: ANN001
    """Move one chunk for one grid-axis-1 program.

    ptrs: (cache, obj). part: (c_base, o_base, c_row, o_row, row_mask), where the program's
    part starts on each side and the offsets of a row's words. chunk: (ids, slots, tok,
    first_id, first_slot, block_start, num_blocks, num_tokens). steps: (cs_b, cs_n, os_t), the
    cache's block and slot strides and the object's token stride. SIZES: (BN, TILE, VA).
    FLAGS: (IDS, SLOTS, TOK, STORE).

    IDS / SLOTS / TOK: block ids, slots and token positions come from tensors; otherwise they
    count up from first_id, first_slot and 0 (the chunk's consecutive blocks, a folded axis's
    consecutive slots, all tokens). BN: slots per block (1 for a folded slot axis, whose slot
    is its own row index). VA: a power of two (in words) that every token row's start is a
    multiple of, for strides the compiler cannot see are (82 8-byte words: a 656-byte row).
    A block slot split into a tile and a place (`N/8`, `N%8`) has steps (cs_b, cs_n, os_t, cs_p,
    P): cs_n the tile's stride, cs_p the place's and P its extent."""
    BN: tl.constexpr = SIZES[0]
    TILE: tl.constexpr = SIZES[1]
    VA: tl.constexpr = SIZES[2]
    STORE: tl.constexpr = FLAGS[3]
    c_base = part[0]
    o_base = part[1]
    rows = (part[2], part[3])
    ids = chunk[0]
    num_blocks = chunk[6]
    cs_b = steps[0]
    os_t = steps[2]
    pid = tl.program_id(0)
    n = tl.arange(0, TILE)
    if pid < num_blocks:
        if FLAGS[0]:
            block = tl.load(ids + pid).to(tl.int64)
        else:
            block = (chunk[3] + pid).to(tl.int64)
        c_block = c_base + block * cs_b
        t_block = (chunk[5] + pid * BN).to(tl.int64)
        for n0 in range(0, BN, TILE):
            k = n0 + n
            c_slot = c_block + _in_block(k, steps)
            _move(ptrs, (c_slot, o_base + (t_block + k) * os_t), rows, (k < BN, part[4]), STORE, VA)
    else:
        i = (pid - num_blocks) * TILE + n
        inside = i < chunk[7]
        if FLAGS[1]:
            slot = tl.load(chunk[1] + i, mask=inside, other=-1).to(tl.int64)
        else:
            slot = (chunk[4] + i).to(tl.int64)
        inside = inside & (slot >= 0)
        if FLAGS[2]:
            t = tl.load(chunk[2] + i, mask=inside, other=0).to(tl.int64)
        else:
            t = i.to(tl.int64)
        c_off = c_base + (slot // BN) * cs_b + _in_block(slot % BN, steps)
        _move(ptrs, (c_off, o_base + t * os_t), rows, (inside, part[4]), STORE, VA)
