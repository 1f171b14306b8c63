"""moe_align_block_size: the fused MoE's (token, slot) pairs grouped by expert, each
expert's run padded to whole blocks of the grouped GEMM's rows (vLLM's / SGLang's op),
in torch ops of fixed sizes: no host sync, nothing sized by the data, so CUDA graphs
capture it (kernels/triton_ops/fused_moe.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlignedRoutes:
    """The (token, slot) pairs grouped by expert for the grouped GEMM, each expert's run
    padded to a multiple of `block` rows. Sizes are the largest any routing can need
    (max_padded_rows), so nothing depends on the data: no host sync, CUDA-graph safe."""

    # [max_padded] indices into the flattened topk_ids (token * top_k + slot); padding
    # rows hold topk_ids.numel(), which the kernel masks.
    sorted_ids: torch.Tensor
    # [max_padded / block] the expert of each block; blocks past the used rows hold the
    # last expert and are skipped by the kernel (num_padded).
    block_experts: torch.Tensor
    num_padded: torch.Tensor  # [1] rows in use: the sum of the padded runs
    block: int


def max_padded_rows(pairs: int, num_experts: int, block: int) -> int:
    """Rows the padded runs can take: each of at most min(pairs, experts) non-empty runs
    pads by fewer than `block` rows; rounded up to whole blocks."""
    rows = pairs + min(pairs, num_experts) * (block - 1)
    return -(-rows // block) * block


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block: int) -> AlignedRoutes:
    """Sort the pairs of topk_ids [tokens, top_k] by expert (stable: in pair order within
    an expert), each expert's run starting at a multiple of `block`."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts  # each expert's first pair, unpadded
    order = torch.sort(flat, stable=True).indices
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=device) - run_start[sorted_experts]
    dest = padded_end[sorted_experts] - padded[sorted_experts] + rank
    rows = max_padded_rows(pairs, num_experts, block)
    sorted_ids = torch.full((rows,), pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, rows, block, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = block_experts.clamp_(max=num_experts - 1).to(torch.int32)
    return AlignedRoutes(sorted_ids, block_experts, padded_end[-1:].to(torch.int32), block)
