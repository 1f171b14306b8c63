"""Mixture-of-experts MLP: routing, the experts' SiLU-gated MLPs, the weighted sum over top-k.

`fused_moe` runs the Triton grouped GEMMs on CUDA (triton_ops/fused_moe.py, SGLang's /
vLLM's `fused_moe` shape: the (token, expert) pairs sorted by expert with each
expert's run padded to the GEMM's block rows, kernels/moe_align.py) and elsewhere
the torch reference, Hugging Face's loop over the experts hit, op for op.

Expert weights are stacked: `w13` [experts, 2 * n, hidden] (each expert's gate rows,
then its up rows) and `w2` [experts, hidden, n]; under tensor parallelism n is this
rank's share of the intermediate rows and the result is this rank's partial sum.
Either may be FP8 (model/quantization.py): a stacked `Fp8Weight`, data [experts, rows,
k] float8_e4m3fn and scale [experts, rows] float32, row r of expert e being data[e, r]
* scale[e, r]. The Triton kernels multiply its codes by the tokens' (quantized per row)
on the FP8 tensor cores; the reference dequantizes each expert hit for the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.engine.kernels import dispatch
from radixserve.engine.kernels.activation import silu_and_mul_torch
from radixserve.engine.kernels.fp8 import Fp8Weight, dequantize

# The dtypes the Triton experts take (float32 too, at full precision: a float32 engine
# on CUDA stays on the capturable kernels).
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weight_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in `weight_dtype`, expert ids [tokens, top_k] int64): the
    top_k of the float32 softmax over the router's logits, renormalised to sum to 1 when
    asked (Mixtral always, Qwen's norm_topk_prob), as Hugging Face's routers do."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype), ids


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for x [tokens, hidden],
    each expert down(silu(gate(x)) * up(x)); -> [tokens, hidden] in x's dtype. w13 / w2
    16-bit (x's dtype) or FP8."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    if dispatch.use_triton(x) and x.dtype in TRITON_DTYPES:
        from radixserve.engine.kernels.triton_ops.fused_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_torch(x, w13, w2, topk_weights, topk_ids)


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference: for each expert hit, its tokens through its MLP, scaled by their
    routing weights, added into the output in x's dtype in expert order (Hugging Face's
    MixtralExperts / Qwen2MoeExperts)."""
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        act = silu_and_mul_torch(F.linear(x[token], _expert(w13, expert, x.dtype)))
        down = F.linear(act, _expert(w2, expert, x.dtype)) * topk_weights[token, slot, None]
        out.index_add_(0, token, down.to(x.dtype))
    return out


def _expert(stacked: torch.Tensor | Fp8Weight, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's weight in `dtype`: an FP8 one dequantized (correctness only)."""
    if isinstance(stacked, Fp8Weight):
        return dequantize(Fp8Weight(stacked.data[expert], stacked.scale[expert]), dtype)
    return stacked[expert]


def _check_shapes(
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    tokens, hidden = x.shape
    experts, width, k = w13.shape
    scales_fit = all(
        tuple(w.scale.shape) == tuple(w.shape[:2]) and w.scale.dtype == torch.float32
        for w in (w13, w2)
        if isinstance(w, Fp8Weight)
    )
    if (
        not scales_fit
        or width % 2
        or k != hidden
        or tuple(w2.shape) != (experts, hidden, width // 2)
        or topk_ids.dim() != 2
        or topk_ids.shape[0] != tokens
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
            f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)} "
            "do not fit [T, H], [E, 2N, H], [E, H, N], [T, K], [T, K] (FP8 weights with "
            "float32 scales [E, rows])"
        )
