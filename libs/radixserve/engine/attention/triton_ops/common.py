"""What the decode and extend kernels share: the online-softmax step and launch choices."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

from radixserve.engine.kernels.dispatch import GEMV_MAX_ROWS
from radixserve.engine.kernels.fp8_format import FP8_DTYPE

# Scores are kept in base 2 (exp2 is one instruction; exp is exp2 plus a multiply), so
# the softmax scale is folded with log2(e) once on the host.
LOG2E = 1.4426950408889634

# triton.jit picks the interpreter or the compiler when a kernel is defined, from
# TRITON_INTERPRET as it stands then; the backend reads this to refuse CPU tensors
# handed to compiled kernels (and the tests to pick their device).
INTERPRETED: bool = bool(knobs.runtime.interpret)


def _let_interpreter_loop_to_loaded_bounds() -> None:
    """Work around triton-lang/triton#9171 in the interpreter (Triton <= 3.6).

    The interpreter holds a loaded scalar as a 1-element array and turns it into a
    Python int with int(array), which NumPy >= 2.4 refuses; so `range(0, seq_len, B)`
    with seq_len read from memory (what every kernel here loops over) fails on the CPU.
    The fix upstream takes the single element explicitly; this does the same when the
    interpreter patches its tensor class. Compiled kernels never run this code.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "radixserve_fixed", False):
        return

    def patch_lang_tensor(tensor: object, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.radixserve_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRETED:
    _let_interpreter_loop_to_loaded_bounds()


def interpreted_rows(block_n: int, n: int) -> int:
    """BLOCK_N under Triton's interpreter: it runs each program as a numpy pass, so a
    wide block (up to 256 of the n rows) costs about what a narrow one does and a head's
    12288 four-row programs would take minutes. Compiled, `block_n` as chosen."""
    return max(block_n, min(256, triton.next_power_of_2(n))) if INTERPRETED else block_n


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors the split counts are sized for; under the interpreter any
    value runs the same kernels (few: it is slow)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


# Grid dependency control (tl.extra.cuda.gdc_*, the launch_pdl option): recent Tritons (3.6 has it).
_HAS_GDC: bool = hasattr(tl.extra.cuda, "gdc_wait")


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may be launched as programmatic dependents (Hopper and
    later, compiled, a Triton that has it): such a kernel may start while the one before
    it finishes, and must `tl.extra.cuda.gdc_wait()` before it reads what that kernel
    writes."""
    return (
        _HAS_GDC
        and not INTERPRETED
        and device.type == "cuda"
        and _capability_major(device.index or 0) >= 9
    )


def few_token_dependent(device: torch.device, rows: int) -> bool:
    """Whether an elementwise kernel over `rows` tokens (norm, SiLU x mul, rotary) is
    launched as a programmatic dependent: in steps of up to GEMV_MAX_ROWS tokens, where
    it sits between the GEMVs (launched so too) and its launch overlaps their ends; beside
    cuBLAS's GEMMs (past GEMV_MAX_ROWS) it measured slower (measured:
    lab/notebook/2026-11-26-few-token-kernels-programmatic-dependents-decode.md)."""
    return rows <= GEMV_MAX_ROWS and programmatic_launch(device)


@triton.jit
def start_as_dependent(PDL: tl.constexpr):
    """A kernel launched as a programmatic dependent (PDL) waits here for the kernel
    before it to finish, and its writes to land, before it reads anything; then it lets
    the next kernel's launch begin (that kernel waits for this one in turn)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: full float32 for float32 inputs.

    Triton's default rounds float32 operands to tf32 on tensor cores (~1e-3 relative
    error), which would make a float32 engine disagree with the torch reference; for
    16-bit inputs the option is ignored.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one block of scores into a running softmax (flash-attention style).

    qk: [rows, BLOCK_N] scores in base 2, -inf where a key is not visible; every row
    must see at least one key over the whole loop. A row that has seen none yet (a
    window's keys start in a later block) keeps m_i -inf and sums nothing: its shift
    is 0 there, so no row computes -inf - -inf.
    v: [BLOCK_N, D] values of the block. m_i/l_i: running max and denominator per
    row; acc: [rows, D] unnormalised output.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - shift)  # rescales what was summed under the old max
    p = tl.exp2(qk - shift[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    # p goes to the value dtype so 16-bit inputs use the tensor cores; acc stays fp32.
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_new, acc


@triton.jit
def fold_partial(m, total, acc, lse, part):
    """Fold a normalised partial output `part` with its log2-sum-exp2 `lse` into a running
    merge: m is the largest lse so far, total the sum of exp2(lse - m), acc the sum of
    parts weighted by it (one row: scalars and [D]; or rows: [R] and [R, D]). An lse of
    -inf weighs 0 (its part must not be NaN: callers drop unwritten scratch); while m
    is still -inf the shift is 0, so exp2 gives 0, not NaN."""
    m_new = tl.maximum(m, lse)
    shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m - shift)
    weight = tl.exp2(lse - shift)
    acc = acc * tl.expand_dims(alpha, -1) + tl.expand_dims(weight, -1) * part
    return m_new, total * alpha + weight, acc


@triton.jit
def cap_scores(qk, cap_log2, SOFT_CAP: tl.constexpr):
    """Base-2 scores soft-capped where SOFT_CAP: cap * tanh(s / cap) of the natural-log
    scores s is C * tanh(qk / C) of the base-2 ones, C = cap * log2(e) (`cap_log2`).
    tanh(x) = 2 * sigmoid(2x) - 1: the interpreter has no libdevice tanh."""
    if SOFT_CAP:
        qk = cap_log2 * (2.0 * tl.sigmoid(2.0 * qk / cap_log2) - 1.0)
    return qk


def kv_fp8(buffer: torch.Tensor) -> bool:
    """Whether a KV buffer holds FP8 codes (the kernels' KV_FP8)."""
    return buffer.dtype == FP8_DTYPE


@triton.jit
def widen_kv(x, scale, KV_FP8: tl.constexpr):
    """Loaded K or V values: e4m3 codes widened to float32 times `scale` where KV_FP8,
    else as loaded (a 16-bit pool's kernels compile as before)."""
    if KV_FP8:
        x = x.to(tl.float32) * scale
    return x


@triton.jit
def attend_paged_range(
    q,
    kv_indices,
    lo,
    hi,
    K_Buffer,
    V_Buffer,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    kv_head,
    offs_d,
    d_mask,
    sm_scale_log2,
    m_i,
    l_i,
    acc,
    row_lo,
    cap_log2,
    k_scale,
    v_scale,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Keys [lo, hi) read through the slot table `kv_indices`, BLOCK_N at a time, folded
    into the running softmax: the loop the decode, extend and shared-prefix kernels
    share (an empty range leaves m_i, l_i and acc as they are). WINDOWED: row r sees
    only keys from row_lo[r] on (its sliding window's first); SOFT_CAP: cap_scores.
    KV_FP8: the buffers hold e4m3 codes, read as code * k_scale (v_scale), as
    kvcache/fp8.widen reads them."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        # int64 before scaling by the row stride: slot * stride overflows int32 in large
        # pools.
        slots = tl.load(kv_indices + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K_Buffer + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        k = widen_kv(k, k_scale, KV_FP8).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
        qk = cap_scores(qk, cap_log2, SOFT_CAP)
        visible = n_mask[None, :]
        if WINDOWED:
            visible = visible & (offs_n[None, :] >= row_lo[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        v = tl.load(
            V_Buffer + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = widen_kv(v, v_scale, KV_FP8).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)
    return m_i, l_i, acc
