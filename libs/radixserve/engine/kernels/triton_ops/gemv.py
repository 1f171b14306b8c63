"""Linear layers of a few tokens (GEMV) with the op before them fused in.

At a few tokens a projection is a stream over its weight, so the RMSNorm (with the
residual add) before qkv and gate_up, and SiLU x mul before down, are folded into the
GEMV's read of its input instead of running as kernels of their own: each program
recomputes the normalised (or activated) input slice by slice from L2, which costs
little next to its slice of the weight. One program per BLOCK_N output rows, no split
over K (no reduce kernel). One token: the products accumulate in float32 per lane and
are summed once (`_gemv_kernel`). More tokens: each weight tile meets every token's
slice on the tensor cores, the tokens padded to a tile of 16 (`_gemv_rows_kernel`).
On Hopper each GEMV is launched as a programmatic dependent: it waits for the kernel
before it, and releases the next one as soon as its own loop is done.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.triton_ops.common import INTERPRETED, programmatic_launch
from radixserve.engine.kernels.triton_ops.activation import silu_mul
from radixserve.engine.kernels.triton_ops.norm import weighted_norm

# What the kernel reads as its input row.
PLAIN = 0  # x as it is
NORM = 1  # rms_norm(x) * norm_weight
ADD_NORM = 2  # rms_norm(x + residual) * norm_weight; x + residual also stored
SILU_MUL = 3  # silu(gate) * up of x = [gate | up]


@triton.jit
def _input_slice(
    X,
    Residual,
    NormW,
    ks,
    kmask,
    rstd,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
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
    elif PROLOGUE == 3:
        up = tl.load(X + K + ks, mask=kmask, other=0.0).to(tl.float32)
        x = silu_mul(x, up, dtype, LIBDEVICE_EXP).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(
    X,
    Residual,
    ResidualOut,
    NormW,
    W,
    Bias,
    Out,
    N,
    eps,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
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
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = _input_slice(X, Residual, NormW, ks, kmask, rstd, K, PROLOGUE, LIBDEVICE_EXP)
        w = tl.load(w_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    if PDL:
        # Let the next kernel's programs launch while this one's last ones finish.
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(Out + rows, y.to(dtype), mask=rmask)


def _config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for an [n, k] weight.

    From a sweep on the H100 over the Llama-3.1-8B shapes (docs/performance.md): long
    rows (down, k = 14336) stream best as 8 rows x 1024; rows of 4096 as 2 (n >= 16384:
    gate_up, the head) or 4 rows x 2048 with 8 warps.
    """
    if k > 8192:
        return 8, 1024, 4, 4
    return (2 if n >= 16384 else 4), min(2048, triton.next_power_of_2(k)), 8, 3


# The dtypes of the few-token kernel: its products run on the tensor cores.
ROWS_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemv_rows_kernel(
    X,
    Residual,
    ResidualOut,
    NormW,
    W,
    Bias,
    Out,
    M,
    N,
    stride_x,
    stride_r,
    stride_ro,
    stride_out,
    eps,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    INTERPRETED_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[:M] = f(x[:M]) @ W.T for a few tokens: one program per BLOCK_N weight rows
    streams them once for every token, W tile [BLOCK_N, BLOCK_K] times the tokens'
    slice on the tensor cores (tokens padded to BLOCK_T with zeros), float32 sums, no
    split over K. f is the prologue, as in the one-token kernel (`_input_slice`); a norm
    first sums each token's squares over its whole row (from L2)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    toks = tl.arange(0, BLOCK_T)
    tmask = toks[:, None] < M
    dtype = X.dtype.element_ty
    if PDL:
        tl.extra.cuda.gdc_wait()
    x_rows = X + toks[:, None] * stride_x
    r_rows = Residual + toks[:, None] * stride_r
    rstd = tl.zeros([BLOCK_T, 1], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        squares = tl.zeros([BLOCK_T, 1], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)[None, :]
            kmask = tmask & (ks < K)
            v = tl.load(x_rows + ks, mask=kmask, other=0.0).to(tl.float32)
            if PROLOGUE == 2:
                r = tl.load(r_rows + ks, mask=kmask, other=0.0).to(tl.float32)
                summed = (v + r).to(dtype)
                if pid == 0:
                    tl.store(ResidualOut + toks[:, None] * stride_ro + ks, summed, mask=kmask)
                v = summed.to(tl.float32)
            squares += tl.sum(v * v, axis=1, keep_dims=True)
        rstd = tl.math.rsqrt(squares / K + eps)
    w_rows = W + rows[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)[None, :]
        kmask = ks < K
        w = tl.load(w_rows + ks, mask=rmask[:, None] & kmask, other=0.0)
        x = _input_slice(x_rows, r_rows, NormW, ks, tmask & kmask, rstd, K, PROLOGUE, LIBDEVICE_EXP)
        if INTERPRETED_DOT:
            # The interpreter's dot reads 16-bit floats as raw integers: float32
            # operands (the values are the 16-bit ones) give the tensor cores' products.
            acc = tl.dot(w.to(tl.float32), tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x.to(dtype)), acc)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    out = Out + toks[None, :] * stride_out + rows[:, None]
    tl.store(out, acc.to(dtype), mask=rmask[:, None] & (toks[None, :] < M))


def _rows_config(n: int, k: int, prologue: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for a few tokens over an [n, k] weight.

    From `bench/gemv_rows.py` on the H100 (Llama-3.1-8B shapes, 1-16 tokens, in a CUDA
    graph): long rows (down) and the head stream best as 32 rows x 512, rows of 4096 as
    64 x 256 (o, n = 4096) or 64 x 128 (qkv, gate_up); the best option was the same at
    every token count, within 0.5 us. A prologue reading a second input (the residual,
    or up beside gate) takes one stage less at 512 wide: four stages of its tiles need
    more shared memory than an SM has.
    """
    if k > 8192 or n >= 65536:
        return 32, 512, 4, 3 if prologue in (ADD_NORM, SILU_MUL) else 4
    if n <= 4096:
        return 64, 256, 4, 4
    return 64, 128, 4, 4


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
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """weight @ f(x) (+ bias) for a few tokens x ([m, k], or [m, 2k] for SILU_MUL; rows
    with unit stride) -> [m, n], written into `out` when given. f is the prologue
    (ADD_NORM also stores x + residual into residual_out). One token runs the one-token
    kernel; more (bfloat16 or float16 only) the few-token kernel, which holds every
    token's sums in each program, so it pays for a few tokens only (kernels/linear.py
    decides how many). `config` (benchmarks) runs the few-token kernel with these
    launch options (BLOCK_N, BLOCK_K, warps, stages), whatever m."""
    n, k = weight.shape
    width = 2 * k if prologue == SILU_MUL else k
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != width or x.stride(-1) != 1:
        raise ValueError(
            f"gemv takes rows [m, {width}] with unit stride for a weight {tuple(weight.shape)}, "
            f"got {tuple(x.shape)}"
        )
    m = x.shape[0]
    if weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError("gemv takes a contiguous weight of x's dtype")
    if (m > 1 or config is not None) and x.dtype not in ROWS_DTYPES:
        raise ValueError(f"gemv takes more than one token in bfloat16 or float16, not {x.dtype}")
    if prologue in (NORM, ADD_NORM) and norm_weight is None:
        raise ValueError("a norm prologue needs norm_weight")
    if prologue == ADD_NORM and not all(
        t is not None and t.shape == x.shape and t.stride(-1) == 1 and t is not x
        for t in (residual, residual_out)
    ):
        raise ValueError("ADD_NORM needs a residual and a separate residual_out shaped as x")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(-1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"gemv writes [{m}, {n}] {x.dtype} rows with unit stride")
    residual = x if residual is None else residual
    residual_out = x if residual_out is None else residual_out
    norm_weight = x if norm_weight is None else norm_weight
    pdl = programmatic_launch(x.device)
    if m == 1 and config is None:
        block_n, block_k, warps, stages = _config(n, k)
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x,
            residual,
            residual_out,
            norm_weight,
            weight,
            weight if bias is None else bias,
            out,
            n,
            eps,
            K=k,
            PROLOGUE=prologue,
            HAS_BIAS=bias is not None,
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
    block_n, block_k, warps, stages = config or _rows_config(n, k, prologue)
    _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        x,
        residual,
        residual_out,
        norm_weight,
        weight,
        weight if bias is None else bias,
        out,
        m,
        n,
        x.stride(0),
        residual.stride(0),
        residual_out.stride(0),
        out.stride(0),
        eps,
        K=k,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        BLOCK_T=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        LIBDEVICE_EXP=not INTERPRETED,
        INTERPRETED_DOT=INTERPRETED,
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=warps,
        num_stages=stages,
    )
    return out
