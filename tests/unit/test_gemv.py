"""The one-token GEMV (engine/kernels/triton_ops/gemv.py) under the Triton interpreter on
the CPU, against the unfused path: the op before the projection (RMSNorm with and
without the residual add) as its torch reference computes it, then the projection
summed in float64 (and, gated, SiLU x mul of its gate and up halves as the torch
reference computes it). Odd shapes exercise the row and column masks.

The GEMV sums in float32 in its own order, so 16-bit outputs may round an ulp apart
from the float64 sum; a wrong prologue, row or bias is off by far more. The residual
sum it stores is one rounding, so it matches bit for bit.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.kernels import dispatch
from radixserve.engine.kernels import linear as linear_ops
from radixserve.engine.kernels.activation import silu_and_mul_torch
from radixserve.engine.kernels.dispatch import TENSOR_CORE_DTYPES
from radixserve.engine.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from radixserve.engine.kernels.triton_ops import gemv
from tests.helpers import fused_kernel_cases as cases
from tests.helpers.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device(round_bf16=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5
# (n, k): rows not a multiple of the row block, a row shorter than one K block, a row
# that is not a power of two and spans blocks, a row longer than 8192 (the long-row
# configuration).
SHAPES = [(37, 96), (130, 300), (8, 9000)]


_project = cases.project_f64
_assert_close = cases.assert_close_projection


def _inputs(
    n: int, k: int, dtype: torch.dtype, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = cases.randn((1, k), dtype, DEVICE, seed=1)
    weight = (cases.randn((n, k), torch.float32, DEVICE, seed=2) * k**-0.5).to(dtype)
    b = cases.randn((n,), dtype, DEVICE, seed=3) if bias else None
    return x, weight, b


def _norm_weight(k: int, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.1 * cases.randn((k,), torch.float32, DEVICE, seed=7)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_plain(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    x, weight, b = _inputs(n, k, dtype, bias)
    _assert_close(gemv.gemv_triton(x, weight, b), _project(x, weight, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_norm(dtype: torch.dtype, n: int, k: int) -> None:
    x, weight, _ = _inputs(n, k, dtype, bias=False)
    norm_w = _norm_weight(k, dtype)
    out = gemv.gemv_triton(x, weight, None, gemv.NORM, norm_weight=norm_w, eps=EPS)
    _assert_close(out, _project(rms_norm_torch(x, norm_w, EPS), weight, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_add_norm_stores_the_sum(
    dtype: torch.dtype, n: int, k: int, bias: bool, gated: bool
) -> None:
    # Gated: weight [2n, k] holds gate rows then up rows; out [1, n] = silu(gate) * up.
    x, weight, b = _inputs(2 * n if gated else n, k, dtype, bias)
    residual = cases.randn((1, k), dtype, DEVICE, seed=4)
    norm_w = _norm_weight(k, dtype)
    summed = torch.full_like(x, float("nan"))
    before = (x.clone(), residual.clone())
    out = gemv.gemv_triton(
        x,
        weight,
        b,
        gemv.ADD_NORM,
        residual=residual,
        residual_out=summed,
        norm_weight=norm_w,
        eps=EPS,
        gated=gated,
    )
    normed, ref_sum = fused_add_rms_norm_torch(x, residual, norm_w, EPS)
    assert torch.equal(summed, ref_sum)
    ref = _project(normed, weight, b)
    _assert_close(out, silu_and_mul_torch(ref) if gated else ref)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


def test_gated_plain_and_odd_rows() -> None:
    x, weight, _ = _inputs(2 * 37, 96, torch.float32, bias=False)
    out = gemv.gemv_triton(x, weight, None, gated=True)
    _assert_close(out, silu_and_mul_torch(_project(x, weight, None)))
    with pytest.raises(ValueError, match="gate and up rows alike"):
        gemv.gemv_triton(x, weight[:73], None, gated=True)


def test_writes_into_out() -> None:
    x, weight, _ = _inputs(37, 96, torch.bfloat16, bias=False)
    out = torch.empty((1, 37), dtype=torch.bfloat16, device=DEVICE)
    assert gemv.gemv_triton(x, weight, None, out=out) is out
    _assert_close(out, _project(x, weight, None))


def test_bad_shapes_are_refused() -> None:
    x, weight, _ = _inputs(37, 96, torch.bfloat16, bias=False)
    with pytest.raises(ValueError, match="one contiguous"):
        gemv.gemv_triton(torch.cat([x, x]), weight, None)
    with pytest.raises(ValueError, match=r"\[1, 96\]"):
        gemv.gemv_triton(torch.cat([x, x], dim=1), weight, None)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv.gemv_triton(x, weight, None, gemv.NORM)
    with pytest.raises(ValueError, match="separate residual_out"):
        gemv.gemv_triton(
            x,
            weight,
            None,
            gemv.ADD_NORM,
            residual=x.clone(),
            residual_out=x,
            norm_weight=_norm_weight(96, torch.bfloat16),
        )
    with pytest.raises(ValueError, match="writes a contiguous"):
        gemv.gemv_triton(x, weight, None, out=torch.empty((1, 36), dtype=torch.bfloat16))


ROWS_DTYPES = list(TENSOR_CORE_DTYPES)


@pytest.mark.parametrize("dtype", ROWS_DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [2, 5, 16, 27])
@pytest.mark.parametrize("bias", [False, True])
def test_rows(dtype: torch.dtype, n: int, k: int, m: int, bias: bool) -> None:
    """The few-token GEMV: every token's row against the float64 sum (the tokens past m
    in its tile of 16 are masked out, and rows past n too)."""
    _, weight, b = _inputs(n, k, dtype, bias)
    x = cases.randn((m, k), dtype, DEVICE, seed=8)
    _assert_close(gemv.gemv_rows_triton(x, weight, b), _project(x, weight, b))


def test_rows_read_and_write_strided_rows() -> None:
    """Rows of a wider buffer in, rows of a wider buffer out (the head writes logits
    into the runner's buffer): strides are followed and nothing else is written."""
    _, weight, b = _inputs(37, 96, torch.bfloat16, bias=True)
    wide = cases.randn((3, 160), torch.bfloat16, DEVICE, seed=9)
    x = wide[:, 10:106]
    buffer = torch.full((3, 50), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = buffer[:, :37]
    assert gemv.gemv_rows_triton(x, weight, b, out=out) is out
    _assert_close(out, _project(x.contiguous(), weight, b))
    assert torch.equal(buffer[:, 37:], torch.full((3, 13), 7.0, dtype=torch.bfloat16))


def test_rows_refuse_what_they_cannot_run() -> None:
    _, weight, _ = _inputs(37, 96, torch.bfloat16, bias=False)
    x = cases.randn((2, 96), torch.bfloat16, DEVICE, seed=1)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        gemv.gemv_rows_triton(x.float(), weight.float(), None)
    with pytest.raises(ValueError, match=r"rows \[m, 96\]"):
        gemv.gemv_rows_triton(x[:, :95], weight, None)
    with pytest.raises(ValueError, match="writes"):
        gemv.gemv_rows_triton(x, weight, None, out=torch.empty((2, 36), dtype=torch.bfloat16))


def test_projections_take_the_rows_gemv_for_a_few_cuda_tokens_only() -> None:
    """Which path a projection takes: the few-token GEMV from 2 to GEMV_MAX_ROWS tokens
    of a 16-bit dtype on CUDA (to the device's gemv_wide_max_rows over a weight GEMV_WIDE_RATIO times
    wider than deep); never on the CPU."""
    n = linear_ops.GEMV_ROWS_MIN_N
    weight = torch.empty((n, n), dtype=torch.bfloat16)
    assert not linear_ops._use_gemv_rows(torch.empty((4, n), dtype=torch.bfloat16), weight)
    if torch.cuda.is_available() and not INTERPRETED:
        square = weight.cuda()
        wide = torch.empty((linear_ops.GEMV_WIDE_RATIO * n, n), dtype=torch.bfloat16).cuda()
        narrow = square[: n - 1]
        wide_rows = dispatch.gemv_wide_max_rows(square.device)
        rows = [
            linear_ops._use_gemv_rows(torch.empty((m, n), dtype=dt, device="cuda"), w)
            for m, dt, w in [
                (1, torch.bfloat16, square),
                (2, torch.bfloat16, square),
                (linear_ops.GEMV_MAX_ROWS, torch.bfloat16, square),
                (linear_ops.GEMV_MAX_ROWS + 1, torch.bfloat16, square),
                (4, torch.float32, square.float()),
                (4, torch.bfloat16, narrow),
                (linear_ops.GEMV_MAX_ROWS + 1, torch.bfloat16, wide),
                (wide_rows, torch.bfloat16, wide),
                (wide_rows + 1, torch.bfloat16, wide),
            ]
        ]
        assert rows == [False, True, True, False, False, False, True, True, False]


@pytest.mark.parametrize(
    ("device_name", "rows"),
    [
        ("NVIDIA H100 80GB HBM3", dispatch.GEMV_WIDE_MAX_ROWS),
        ("NVIDIA H200", 48),
        ("NVIDIA H200 NVL", 48),
        ("NVIDIA A100-SXM4-80GB", dispatch.GEMV_WIDE_MAX_ROWS),
    ],
)
def test_wide_weights_keep_the_gemv_to_the_devices_row_count(device_name: str, rows: int) -> None:
    """gate_up and the head take the few-token GEMV to 64 tokens, but to 48 on an H200,
    whose bandwidth lets cuBLASLt stream them faster at 64 (lab/notebook/2026-11-28-h200-quick-suite-token-gemv-row.md)."""
    assert dispatch.wide_max_rows_for(device_name) == rows
    assert dispatch.GEMV_MAX_ROWS < rows
    # Off CUDA (the interpreter's tests force the Triton path there) no device to ask.
    assert dispatch.gemv_wide_max_rows(torch.device("cpu")) == dispatch.GEMV_WIDE_MAX_ROWS


@pytest.mark.parametrize(
    ("n", "k", "block_n"),
    [(6144, 4096, 64), (28672, 4096, 64), (4096, 4096, 32), (2048, 2048, 32), (1024, 1024, 16)],
)
def test_rows_config_keeps_at_least_64_programs(n: int, k: int, block_n: int) -> None:
    """Weight rows per program shrink with the weight, so that at least 64 programs share
    its read (the 8B shapes keep their measured options)."""
    chosen, _, _, _ = gemv._rows_config(n, k, 16)
    assert chosen == block_n
    assert -(-n // chosen) >= 64


@pytest.mark.parametrize(
    ("n", "k", "config"),
    [
        (28672, 4096, (64, 128, 4, 3)),  # gate_up past 32 tokens: the measured best
        (128256, 4096, (64, 128, 4, 3)),  # the head
        (3072, 1024, None),  # too few weight rows for 64 programs of 64: the small-m choice
    ],
)
def test_rows_config_past_32_tokens(
    n: int, k: int, config: tuple[int, int, int, int] | None
) -> None:
    assert gemv._rows_config(n, k, 64) == (config or gemv._rows_config(n, k, 16))


def test_public_ops_match_the_unfused_path_off_cuda() -> None:
    """On CPU tensors the public ops are the norm / activation reference, then F.linear."""
    x = cases.randn((3, 96), torch.float32, torch.device("cpu"), seed=1)
    residual = cases.randn((3, 96), torch.float32, torch.device("cpu"), seed=2)
    weight = cases.randn((40, 96), torch.float32, torch.device("cpu"), seed=3)
    norm_w = _norm_weight(96, torch.float32).cpu()
    out, summed = linear_ops.add_norm_linear(x, residual, norm_w, EPS, weight, None)
    normed, ref_sum = fused_add_rms_norm_torch(x, residual, norm_w, EPS)
    assert torch.equal(summed, ref_sum)
    assert torch.equal(out, torch.nn.functional.linear(normed, weight))
    out, same = linear_ops.add_norm_linear(x, None, norm_w, EPS, weight, None)
    assert same is x
    assert torch.equal(out, torch.nn.functional.linear(rms_norm_torch(x, norm_w, EPS), weight))
    act, summed = linear_ops.add_norm_linear(x, residual, norm_w, EPS, weight, None, gated=True)
    assert torch.equal(summed, ref_sum)
    assert torch.equal(act, silu_and_mul_torch(torch.nn.functional.linear(normed, weight)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_public_ops_one_token_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The public ops' one-token branch (taken on CUDA; here forced, the kernels under the
    interpreter): the norm, the residual add and the gate's SiLU x mul folded into the
    GEMV, against the unfused path; the residual sum bit for bit."""
    monkeypatch.setattr(linear_ops, "_use_gemv", lambda x, weight: x.shape[0] == 1)
    x, weight, b = _inputs(130, 300, dtype, bias=True)
    residual = cases.randn((1, 300), dtype, DEVICE, seed=4)
    norm_w = _norm_weight(300, dtype)
    normed, ref_sum = fused_add_rms_norm_torch(x, residual, norm_w, EPS)
    for gated in (False, True):
        ref = _project(normed, weight, b)
        out, summed = linear_ops.add_norm_linear(x, residual, norm_w, EPS, weight, b, gated=gated)
        assert torch.equal(summed, ref_sum)
        _assert_close(out, silu_and_mul_torch(ref) if gated else ref)
        out, same = linear_ops.add_norm_linear(x, None, norm_w, EPS, weight, b, gated=gated)
        assert same is x
        ref = _project(rms_norm_torch(x, norm_w, EPS), weight, b)
        _assert_close(out, silu_and_mul_torch(ref) if gated else ref)
    _assert_close(linear_ops.linear(x, weight, b), _project(x, weight, b))


def test_no_dependent_launch_off_hopper_or_interpreted() -> None:
    """Programmatic dependent launch needs compiled kernels on sm_90+: never on the CPU
    or under the interpreter (the kernels then skip their grid-dependency waits)."""
    from radixserve.engine.attention.triton_ops.common import programmatic_launch

    assert not programmatic_launch(torch.device("cpu"))
    if INTERPRETED and torch.cuda.is_available():
        assert not programmatic_launch(torch.device("cuda"))
