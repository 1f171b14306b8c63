"""Linear layers of a few tokens (GEMV): one token with the op before it fused in, and
2-32 tokens on the tensor cores (`gemv_rows_triton`, after the op's own kernel; its
single pass over each weight serves every token, with no split-K reduce kernel).

At one token a projection is a stream over its weight, so the RMSNorm (with the residual
add) before qkv and gate_up is folded into the GEMV's read of its input instead of
running as a kernel of its own: each program recomputes the normalised input slice by
slice from L2, which costs little next to its slice of the weight. SiLU x mul, after
gate_up, is gate_up's epilogue (`gated`): each program streams a block of gate rows
and the matching up rows, so down reads its input as it is. One program per BLOCK_N
output rows, no split over K (no reduce kernel); the products accumulate in float32 per
lane and are summed once. On
Hopper each GEMV is launched as a programmatic dependent: it waits for the kernel
before it, and releases the next one as soon as its own loop is done (the few-token
GEMV of up to EARLY_TRIGGER_MAX_ROWS tokens as soon as its programs have waited).

FP8 weights (kernels/fp8.py: float8_e4m3fn rows with a float32 scale each): the
one-token GEMV takes them with `weight_scale`, widens each weight tile to float32 in
registers and scales each row's sum once (the activations stay 16-bit);
`gemv_rows_fp8_triton` takes the tokens quantized per row too and multiplies codes by
codes on the FP8 tensor cores (W8A8), both scales applied to the float32 sums. The
16-bit kernels compile as before (constexpr switches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.triton_ops.common import (
    INTERPRETED,
    interpreted_rows,
    programmatic_launch,
)
from radixserve.engine.kernels.dispatch import GEMV_MAX_ROWS, TENSOR_CORE_DTYPES
from radixserve.engine.kernels.fp8_format import FP8_DTYPE
from radixserve.engine.kernels.triton_ops.activation import silu_mul
from radixserve.engine.kernels.triton_ops.norm import weighted_norm

# Up to this many tokens the few-token GEMV releases the next kernel's launch as soon as
# its programs have all passed their wait for the kernel before, not after their loops:
# shorter steps up to 16 tokens, longer at 32; the one-token GEMV gained nothing so and
# keeps its trigger after the loop (measured: lab/notebook/2026-11-28-few-token-gemv-launches-split-over.md).
EARLY_TRIGGER_MAX_ROWS = 16

# What the kernel reads as its input row.
PLAIN = 0  # x as it is
NORM = 1  # rms_norm(x) * norm_weight
ADD_NORM = 2  # rms_norm(x + residual) * norm_weight; x + residual also stored


@triton.jit
def _input_slice(
    X,
    Residual,
    NormW,
    ks,
    kmask,
    rstd,
    PROLOGUE: tl.constexpr,
):
    """The input's elements `ks` in float32, rounded where the unfused ops round."""
    dtype = X.dtype.element_ty
    x = tl.load(X + ks, mask=kmask, other=0.0).to(tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        if PROLOGUE == 2:
            x = (x + tl.load(Residual + ks, mask=kmask, other=0.0).to(tl.float32)).to(dtype)
            x = x.to(tl.float32)
        w = tl.load(NormW + ks, mask=kmask, other=0.0).to(tl.float32)
        x = weighted_norm(x, rstd, w, dtype).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(
    X,
    Residual,
    ResidualOut,
    NormW,
    W,
    WScale,  # with W_SCALE: float32 per row of W (FP8 weights)
    Bias,
    Out,
    N,  # output rows (with GATED, W holds 2N: N gate rows, then N up rows)
    eps,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    GATED: tl.constexpr,  # out = silu(gate) * up, rounded as the unfused ops round
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    dtype = X.dtype.element_ty
    if PDL:
        # Launched as a programmatic dependent (Hopper on): this program may start while
        # the kernel before drains, so it waits for that kernel's writes before it reads
        # or writes anything.
        tl.extra.cuda.gdc_wait()
    rstd = 0.0
    if PROLOGUE == 1 or PROLOGUE == 2:
        # The norm's scale needs the whole row first (K elements, read from L2).
        offs = tl.arange(0, ROW_BLOCK)
        omask = offs < K
        row = tl.load(X + offs, mask=omask, other=0.0).to(tl.float32)
        if PROLOGUE == 2:
            r = tl.load(Residual + offs, mask=omask, other=0.0).to(tl.float32)
            summed = (row + r).to(dtype)
            if pid == 0:
                tl.store(ResidualOut + offs, summed, mask=omask)
            row = summed.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(row * row, axis=0) / K + eps)
    w_rows = W + rows[:, None].to(tl.int64) * K
    up_rows = W + (rows[:, None] + N).to(tl.int64) * K  # read with GATED only
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = _input_slice(X, Residual, NormW, ks, kmask, rstd, PROLOGUE)
        wmask = rmask[:, None] & kmask[None, :]
        w = tl.load(w_rows + ks[None, :], mask=wmask, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if GATED:
            w_up = tl.load(up_rows + ks[None, :], mask=wmask, other=0.0)
            acc_up += w_up.to(tl.float32) * x[None, :]
    if PDL:
        # Let the next kernel's programs launch while this one's last ones finish.
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if W_SCALE:
        y *= tl.load(WScale + rows, mask=rmask, other=0.0)
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=rmask, other=0.0).to(tl.float32)
    if GATED:
        # gate and up rounded to the dtype as the projection's output would be, then
        # SiLU x mul as its kernel computes it (triton_ops/activation.py).
        up = tl.sum(acc_up, axis=1)
        if W_SCALE:
            up *= tl.load(WScale + N + rows, mask=rmask, other=0.0)
        if HAS_BIAS:
            up += tl.load(Bias + N + rows, mask=rmask, other=0.0).to(tl.float32)
        gate = y.to(dtype).to(tl.float32)
        y = silu_mul(gate, up.to(dtype).to(tl.float32), dtype, LIBDEVICE_EXP).to(tl.float32)
    tl.store(Out + rows, y.to(dtype), mask=rmask)


def _config(k: int, prologue: int, gated: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for a weight of rows of k.

    From sweeps over the Llama-3.1-8B shapes with the engine's prologues: rows of 4096
    after a norm stream best as 4 rows x 2048 with 8 warps (gated: 2 gate rows and their
    2 up rows): each program of a norm prologue first reads the whole input row for its
    norm, so fewer rows a program cost more. Plain rows need no such read: o (k = 4096)
    as 1 row x 1024, down (k = 14336) as 2 rows x 1024 (measured:
    lab/notebook/2026-11-28-h200-gate-silu-token-gemv-epilogue.md).
    """
    if k > 8192:
        return 2, 1024, 8, 4
    if prologue == PLAIN and not gated:
        return 1, min(1024, triton.next_power_of_2(k)), 8, 4
    return (2 if gated else 4), min(2048, triton.next_power_of_2(k)), 8, 3


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prologue: int = PLAIN,
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    out: torch.Tensor | None = None,
    gated: bool = False,
    weight_scale: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """weight @ f(x) (+ bias) for one token x ([1, k]) -> [1, n], written into `out` when
    given. `gated`: weight (and bias) hold 2n rows, gate then up, and the output is
    silu(gate) * up. `weight_scale` (float32, one per row of `weight`): weight holds FP8
    rows, each times its scale. `config` (BLOCK_N, BLOCK_K, warps, stages) overrides the
    launch options (benchmarks)."""
    n, k = weight.shape
    if x.shape != (1, k) or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(
            f"gemv takes one contiguous [1, {k}] row and a contiguous weight, "
            f"got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    _check_scale(weight, weight_scale)
    if gated:
        if n % 2:
            raise ValueError(f"a gated gemv takes gate and up rows alike, got {n} rows")
        n //= 2
    if prologue in (NORM, ADD_NORM) and norm_weight is None:
        raise ValueError("a norm prologue needs norm_weight")
    if prologue == ADD_NORM and not all(
        t is not None and t.shape == x.shape and t.is_contiguous() and t is not x
        for t in (residual, residual_out)
    ):
        raise ValueError("ADD_NORM needs a residual and a separate residual_out shaped as x")
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    elif out.shape != (1, n) or out.stride(-1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"gemv writes a contiguous [1, {n}] {x.dtype} row")
    pdl = programmatic_launch(x.device)
    block_n, block_k, warps, stages = config or _config(k, prologue, gated)
    if config is None:
        block_n = interpreted_rows(block_n, n)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        x if residual is None else residual,
        x if residual_out is None else residual_out,
        x if norm_weight is None else norm_weight,
        weight,
        weight if weight_scale is None else weight_scale,
        weight if bias is None else bias,
        out,
        n,
        eps,
        K=k,
        PROLOGUE=prologue,
        GATED=gated,
        HAS_BIAS=bias is not None,
        W_SCALE=weight_scale is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROW_BLOCK=triton.next_power_of_2(k),
        LIBDEVICE_EXP=not INTERPRETED,
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton.jit
def _gemv_rows_kernel(
    X,  # [M, K] 16-bit tokens, or with FP8 their e4m3 codes
    XScale,  # with FP8: float32 per token
    W,
    WScale,  # with FP8: float32 per row of W
    Bias,
    Out,
    M,
    N,
    stride_x,
    stride_out,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,  # W8A8: codes x codes on the FP8 tensor cores, both scales after
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETED_DOT: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr,
):
    """out[:M] = x[:M] @ W.T for a few tokens: one program per BLOCK_N weight rows streams
    them once for every token, W tile [BLOCK_N, BLOCK_K] times the tokens' slice on the
    tensor cores (tokens padded to BLOCK_T with zeros), float32 sums, no split over K."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    toks = tl.arange(0, BLOCK_T)
    tmask = toks < M
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    w_rows = W + rows[:, None].to(tl.int64) * K
    x_rows = X + toks[:, None] * stride_x
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        if INTERPRETED_DOT:
            # The interpreter's dot reads 16-bit floats as raw integers: float32
            # operands give the same exact products the tensor cores form.
            w = w.to(tl.float32)
            x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    if PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if FP8:
        acc *= tl.load(WScale + rows, mask=rmask, other=0.0)[:, None]
        acc *= tl.load(XScale + toks, mask=tmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    out = Out + toks[None, :] * stride_out + rows[:, None]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=rmask[:, None] & tmask[None, :])


def _rows_config(n: int, k: int, m: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for `m` tokens over an [n, k] weight.

    From `lab/probes/gemv_rows.py` (Llama-3.1-8B shapes, in a CUDA graph; the best option
    was the same at every token count): long rows (down, k = 14336) and the head stream
    best as 32 rows x 512, qkv and gate_up as 64 x 128, o (n = 4096) as 64 or 32 x 256
    alike. Fewer weight rows take smaller blocks, so that at least 64 programs share the
    read (one SM alone streams a small share of the bandwidth); kernels/linear.py leaves
    weights of fewer than 1024 rows to cuBLAS. Past GEMV_MAX_ROWS tokens (the wide weights
    only, kernels/linear.py) 64 x 128 in three stages (measured: lab/notebook/2026-12-01-figures-from-code-comments.md).
    """
    if m > GEMV_MAX_ROWS and n >= 64 * 64:
        return 64, 128, 4, 3
    if k > 8192 or n >= 65536:
        return 32, 512, 4, 4
    if n >= 96 * 64:
        return 64, 128, 4, 4
    return (32 if n >= 64 * 32 else 16), 256, 4, 4


def gemv_rows_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    early_trigger: bool | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) for a few tokens x [m, k] of a 16-bit dtype -> [m, n], written
    into `out` when given. `config` and `early_trigger` (default: up to
    EARLY_TRIGGER_MAX_ROWS tokens) override the launch options (benchmarks). Each
    program holds all m tokens' sums, so this pays for small m only (kernels/linear.py
    decides)."""
    m, n, k = _rows_shape(x, weight)
    if x.dtype not in TENSOR_CORE_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"gemv_rows takes bfloat16 or float16 rows and a weight of theirs, "
            f"got {x.dtype} and {weight.dtype}"
        )
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(-1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"gemv_rows writes [{m}, {n}] {x.dtype} rows with unit stride")
    config = config or _rows_config(n, k, m)
    _launch_rows(x, None, weight, None, bias, out, config, early_trigger)
    return out


def gemv_rows_fp8_triton(
    codes: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """(codes * x_scale) @ (weight * weight_scale).T (+ bias) -> [m, n] in `out_dtype`,
    for a few tokens quantized per row (triton_ops/fp8.py: e4m3 codes [m, k], float32
    scales [m] or [m, 1]) over FP8 rows: W8A8 on the FP8 tensor cores, as cuBLASLt's
    path past kernels/fp8.FP8_GEMV_MAX_ROWS tokens computes it. Widening the codes to
    bfloat16 instead costs as much as the 16-bit stream (no direct e4m3 -> bfloat16
    conversion)."""
    m, n, _ = _rows_shape(codes, weight)
    _check_scale(weight, weight_scale)
    if codes.dtype != FP8_DTYPE or not (
        x_scale.dtype == torch.float32 and x_scale.numel() == m and x_scale.is_contiguous()
    ):
        raise ValueError(
            f"gemv_rows_fp8 takes e4m3 token codes with a float32 scale each, got "
            f"{codes.dtype} and {x_scale.dtype} {tuple(x_scale.shape)}"
        )
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    config = config or _rows_fp8_config(n, m)
    _launch_rows(codes, x_scale, weight, weight_scale, bias, out, config, None)
    return out


def _rows_fp8_config(n: int, m: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the W8A8 few-token GEMV over `m` tokens: from
    lab/probes/gemv_fp8_dot.py on the H200 (Llama-3.1-8B shapes, 1 to 64 tokens),
    64 rows x 256 (gate_up, the widest, x 128, in three stages past 32 tokens); smaller
    weights take fewer rows, so that at least 64 programs share the read."""
    if n >= 16384:
        return 64, 128, 4, (3 if m > 32 else 4)
    return (64 if n >= 64 * 64 else 32 if n >= 64 * 32 else 16), 256, 4, 4


def _rows_shape(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    m, width = x.shape
    n, k = weight.shape
    if not (m >= 1 and width == k and x.stride(-1) == 1 and weight.is_contiguous()):
        raise ValueError(
            f"gemv_rows takes rows [m, {k}] with unit stride and a contiguous weight, "
            f"got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    return m, n, k


def _launch_rows(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: tuple[int, int, int, int],
    early_trigger: bool | None,
) -> None:
    m, n = out.shape
    pdl = programmatic_launch(x.device)
    block_n, block_k, warps, stages = config
    block_n = interpreted_rows(block_n, n)
    _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight if x_scale is None else x_scale,
        weight,
        weight if weight_scale is None else weight_scale,
        weight if bias is None else bias,
        out,
        m,
        n,
        x.stride(0),
        out.stride(0),
        K=weight.shape[1],
        HAS_BIAS=bias is not None,
        FP8=weight_scale is not None,
        BLOCK_T=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        INTERPRETED_DOT=INTERPRETED,
        PDL=pdl,
        EARLY_TRIGGER=m <= EARLY_TRIGGER_MAX_ROWS if early_trigger is None else early_trigger,
        launch_pdl=pdl,
        num_warps=warps,
        num_stages=stages,
    )


def _check_scale(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    """An FP8 weight comes with a contiguous float32 scale per row; a 16-bit one without."""
    if weight_scale is None:
        if weight.dtype == FP8_DTYPE:
            raise ValueError("an FP8 weight needs its weight_scale")
        return
    rows = weight.shape[0]
    if not (
        weight.dtype == FP8_DTYPE
        and weight_scale.dtype == torch.float32
        and weight_scale.shape == (rows,)
        and weight_scale.is_contiguous()
    ):
        raise ValueError(
            f"weight_scale goes with an FP8 weight: float32 [{rows}], got {weight.dtype} "
            f"and {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
