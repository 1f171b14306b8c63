"""Each row's argmax in two kernels, with torch's semantics (the first index of the
largest value; a NaN is larger than any number, so the first NaN wins; -0.0 equals 0.0).

Pass 1, one program per (row, block of BLOCK logits): the block's largest key and the
first index holding it. Pass 2, one program per row: the largest of the blocks' keys and
the first index holding it (blocks run in index order, so the smallest index is the
first). A key is the value's float32 bits mapped to an int32 that orders as the values
do: non-negative bits as they are, negative bits with the magnitude bits flipped, every
NaN the largest int32 and -0.0 made 0.0 first. The vocabulary is read once, spread over
rows x blocks programs, where torch's reduce gives a row to one block of threads
(measured: lab/notebook/2026-11-28-h200-greedy-argmax-two-triton-kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 4
_INT32_MIN: tl.constexpr = tl.constexpr(-(2**31))  # below every key: the masked lanes


@triton.jit
def _keys(x):
    """int32 keys ordered as the float32 values x, NaN largest, -0.0 as 0.0."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    keys = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, keys)


@triton.jit
def _first_of_largest(keys, idx, BIG: tl.constexpr):
    """(the largest key, the smallest index holding it)."""
    best = tl.max(keys, axis=0)
    return best, tl.min(tl.where(keys == best, idx, BIG), axis=0)


@triton.jit
def _block_argmax_kernel(
    X,
    stride_x,
    BlockKeys,
    BlockIdx,
    V: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(X + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    keys = tl.where(mask, _keys(x), _INT32_MIN)
    best, first = _first_of_largest(keys, offs, V)
    tl.store(BlockKeys + row * NUM_BLOCKS + block, best)
    tl.store(BlockIdx + row * NUM_BLOCKS + block, first)


@triton.jit
def _row_argmax_kernel(
    BlockKeys,
    BlockIdx,
    Out,
    V: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
):
    row = tl.program_id(0)
    blocks = tl.arange(0, BLOCKS_POW2)
    mask = blocks < NUM_BLOCKS
    keys = tl.load(BlockKeys + row * NUM_BLOCKS + blocks, mask=mask, other=_INT32_MIN)
    idx = tl.load(BlockIdx + row * NUM_BLOCKS + blocks, mask=mask, other=V)
    _, first = _first_of_largest(keys, idx, V)
    tl.store(Out + row, first.to(tl.int64))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """[rows] int64: `logits.argmax(dim=-1)` of 2-D logits of any float dtype with a
    contiguous last dim."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"argmax_triton takes 2-D float logits with a contiguous last dim, got "
            f"{tuple(logits.shape)} {logits.dtype}"
        )
    rows, vocab = logits.shape
    if vocab == 0 or vocab >= 2**31 - 1:
        raise ValueError(f"argmax_triton takes 1 to 2**31 - 2 logits a row, got {vocab}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_blocks = triton.cdiv(vocab, BLOCK)
    # Each block's key, then its first index: one allocation for both.
    block_keys, block_idx = torch.empty(
        2, rows, num_blocks, dtype=torch.int32, device=logits.device
    ).unbind()
    _block_argmax_kernel[(rows, num_blocks)](
        logits,
        logits.stride(0),
        block_keys,
        block_idx,
        V=vocab,
        NUM_BLOCKS=num_blocks,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    _row_argmax_kernel[(rows,)](
        block_keys,
        block_idx,
        out,
        V=vocab,
        NUM_BLOCKS=num_blocks,
        BLOCKS_POW2=max(2, triton.next_power_of_2(num_blocks)),
        num_warps=1,
    )
    return out
