"""Candidates for the FP8 projections of one to a few tokens, at the Llama-3.1-8B shapes,
against today's kernels (lab/notebook/2026-12-02-h200-gpu-verification-fp8-gemv.md: the
one-token FP8 GEMV is bound by widening each code to float32):

- `today_gemv`: gemv_triton over the FP8 rows (codes -> float32, CUDA-core products);
- `today_rows` (2026-12-02; since replaced): the few-token GEMV over the FP8 rows
  (codes -> bf16, bf16 tensor cores); `product_rows_w8a8`: its replacement,
  gemv_rows_fp8_triton after the tokens' quantization (kernels/fp8.py's path);
- `rows_f16`: the few-token kernel with codes widened to float16 only (one packed
  conversion for two codes) and the tokens in float16;
- `rows_fp8dot`: the tokens quantized per row first (triton_ops/fp8.py), then the FP8
  tensor cores on codes x codes, both scales applied to the float32 sums (W8A8, what
  the `_scaled_mm` path computes past 32 tokens); timed with and without the
  quantization kernel;
- `scaled_mm`: the same W8A8 through cuBLASLt (torch._scaled_mm, row-wise scales), the
  tokens padded to 16 rows; timed with the quantization kernel.

Each: error against the bf16 reference, and us per call in a CUDA graph over weight
copies larger than L2 (gemv_fp8_sweep.timed).

    python lab/probes/gemv_fp8_dot.py [--tokens 1 4 16] > dot.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from radixserve.engine.kernels.fp8 import quantize_weight
from radixserve.engine.kernels.triton_ops import gemv
from radixserve.engine.kernels.triton_ops.fp8 import quantize_tokens_triton

sys.path.insert(0, str(Path(__file__).parent))
from gemv_fp8_sweep import timed

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CONFIGS = list(itertools.product((16, 32, 64), (128, 256), (4,), (3, 4)))

F16, FP8DOT = 0, 1


@triton.jit
def _rows_kernel(
    X,  # [M, K]: float16 tokens (F16) or their e4m3 codes (FP8DOT)
    XScale,  # [M] float32 (FP8DOT)
    W,  # [N, K] e4m3 codes
    WScale,  # [N] float32
    Out,  # [M, N] bfloat16
    M,
    N,
    K: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    toks = tl.arange(0, BLOCK_T)
    tmask = toks < M
    w_rows = W + rows[:, None].to(tl.int64) * K
    x_rows = X + toks[:, None] * K
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=rmask[:, None], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=tmask[:, None], other=0.0)
        if MODE == 0:
            acc = tl.dot(w.to(tl.float16), tl.trans(x), acc)
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    acc *= tl.load(WScale + rows, mask=rmask, other=0.0)[:, None]
    if MODE == 1:
        acc *= tl.load(XScale + toks, mask=tmask, other=0.0)[None, :]
    out = Out + toks[None, :] * N + rows[:, None]
    tl.store(out, acc.to(tl.bfloat16), mask=rmask[:, None] & tmask[None, :])


def rows(x, x_scale, w, w_scale, mode, config):  # type: ignore[no-untyped-def]
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, warps, stages = config
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    _rows_kernel[(triton.cdiv(n, block_n),)](
        x, x if x_scale is None else x_scale, w, w_scale, out, m, n,
        K=k, MODE=mode, BLOCK_T=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def probe(name: str, n: int, k: int, m: int) -> dict[str, object]:
    dev = torch.device("cuda")
    copies = max(2, int(400e6 // (n * k)) + 1)
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    w8 = [quantize_weight(w) for w in w16]
    del w16
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = (x.float() @ (w8[0].data.float() * w8[0].scale[:, None]).T).float()
    x16 = x.half()
    xq, xs = quantize_tokens_triton(x)
    xs = xs.view(-1).contiguous()
    row: dict[str, object] = {"shape": name, "tokens": m}

    def error(y: torch.Tensor) -> float:
        return float((y.float() - ref).abs().max() / ref.abs().max())

    def record(label: str, fn, check) -> None:  # type: ignore[no-untyped-def]
        row[label + "_err"] = error(check())
        us = timed(fn, copies)
        row[label + "_us"] = us
        row[label + "_tbs"] = n * k / us / 1e6

    if m == 1:
        record(
            "today_gemv",
            lambda i: gemv.gemv_triton(x, w8[i].data, None, weight_scale=w8[i].scale),
            lambda: gemv.gemv_triton(x, w8[0].data, None, weight_scale=w8[0].scale),
        )
    record(
        "product_rows_w8a8",  # gemv_rows_fp8_triton with its quantization, as kernels/fp8.py
        lambda i: gemv.gemv_rows_fp8_triton(
            *quantize_tokens_triton(x), w8[i].data, w8[i].scale, None, torch.bfloat16
        ),
        lambda: gemv.gemv_rows_fp8_triton(xq, xs, w8[0].data, w8[0].scale, None, torch.bfloat16),
    )
    row["quantize_us"] = timed(lambda i: quantize_tokens_triton(x), copies)
    for label, mode, xin, xsc in (("rows_f16", F16, x16, None), ("rows_fp8dot", FP8DOT, xq, xs)):
        best = (float("inf"), None)
        for config in CONFIGS:
            if config[1] > k:
                continue
            try:
                err = error(rows(xin, xsc, w8[0].data, w8[0].scale, mode, config))
                us = timed(
                    lambda i, c=config, a=xin, b=xsc, md=mode: rows(
                        a, b, w8[i].data, w8[i].scale, md, c
                    ),
                    copies,
                )
            except Exception as exc:  # a config the compiler refuses
                print(name, label, config, type(exc).__name__, exc, file=sys.stderr)
                continue
            if us < best[0]:
                best = (us, config)
                row[label + "_err"] = err
        row[label + "_us"], row[label + "_config"] = best
        row[label + "_tbs"] = n * k / best[0] / 1e6
    pad = torch.zeros(16, k, device=dev, dtype=torch.bfloat16)

    def scaled_mm(i: int) -> torch.Tensor:
        pad[:m].copy_(x)
        q, s = quantize_tokens_triton(pad)
        return torch._scaled_mm(
            q, w8[i].data.t(), scale_a=s.view(-1, 1), scale_b=w8[i].scale.view(1, -1),
            out_dtype=torch.bfloat16,
        )[:m]  # fmt: skip

    try:
        record("scaled_mm", scaled_mm, lambda: scaled_mm(0))
    except Exception as exc:  # no row-wise scaling in this torch/cuBLASLt
        print(name, "scaled_mm", type(exc).__name__, exc, file=sys.stderr)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    for m in args.tokens:
        for name, (n, k) in SHAPES.items():
            print(json.dumps(probe(name, n, k, m)), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
