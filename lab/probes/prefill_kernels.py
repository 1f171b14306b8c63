"""FlashInfer's paged prefill kernels, FA2 against SM90 (fa3), on the engine's step shapes.

The flashinfer backend runs every extend step (prompts, and the decoders of a mixed
batch without shared prefixes as one-token requests) through one
BatchPrefillWithPagedKVCacheWrapper over pages of one slot. This script times one
layer's attention (Llama-3.1-8B: 32 query heads, 8 KV heads, head dim 128, bf16) with
each kernel family on the shapes the benchmarks' steps have, with the slots scattered
as a radix cache's free list leaves them, and checks the two agree (the flashinfer
backend plans its extend passes on FA2's kernels: docs/performance.md says why).

    python lab/probes/prefill_kernels.py [--shapes question prefix ...] [--reps 50] [--triton]

`--triton` also times the Triton backend's extend kernel (the requests' new tokens as
contiguous K/V over their cached prefixes through the slot table) over a sweep of its
launch options, on the shapes whose requests all add many tokens.

Shapes (requests x new tokens / KV length each):
  question   16 x 128 / 2176: a cached shared-prefix run's question step
  prefix     1 x 2048 / 2048: a prompt's first chunk
  chunks     128 / 2176 + 1920 / 1920: the uncached run's chunk over two prompts
  short      64 x 16 / 2064: short prompts over cached prefixes
  mixed      128 / 2176 + 1920 / 1920 + 480 x 1 / 2300: an uncached mixed step
  decoders   480 x 1 / 2300: decoders alone as one-token requests
  long8k     1 x 2048 / 8192: the last chunk of an 8k-token prompt
  long32k    1 x 2048 / 32768: the last chunk of a 32k-token prompt
  long32k-mixed  that chunk beside 64 decoders (64 x 1 / 2300)
Per shape and kernel family: the median of CUDA-event timings (planning excluded: it is
once per step), x 32 layers for a step, and the two families' largest difference. Where
nothing is cached (every request's KV is its new tokens), also the ragged kernel over
the step's own K/V as contiguous tensors (no slot table), as SGLang runs new tokens.
Needs CUDA and flashinfer-python; fa3 needs an SM90 GPU and JIT-compiles on first use
(~90 s with MAX_JOBS=16).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import time_ms  # noqa: E402 (the CUDA-event median the sampling bench uses)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
LAYERS = 32
SHAPES: dict[str, list[tuple[int, int, int]]] = {  # (requests, new tokens, KV length)
    "question": [(16, 128, 2176)],
    "prefix": [(1, 2048, 2048)],
    "chunks": [(1, 128, 2176), (1, 1920, 1920)],
    "short": [(64, 16, 2064)],
    "mixed": [(1, 128, 2176), (1, 1920, 1920), (480, 1, 2300)],
    "decoders": [(480, 1, 2300)],
    "long8k": [(1, 2048, 8192)],
    "long32k": [(1, 2048, 32768)],
    "long32k-mixed": [(1, 2048, 32768), (64, 1, 2300)],
}


def _indptr(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=torch.int32).to(device)


# The Triton extend kernel takes every request's new tokens as contiguous K/V; shapes
# whose requests all add many tokens (its decoders would run the decode kernel).
TRITON_SHAPES = ("question", "prefix", "chunks", "short", "long8k")
TRITON_OPTIONS = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (m, n, w, st)
    for m in (64, 128)
    for n in (32, 64, 128)
    for w in (4, 8)
    for st in (1, 2, 3)
    if not (m == 128 and n == 128 and st == 3)  # more shared memory than a block has
]


def time_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    reference: torch.Tensor | None,
    reps: int,
) -> dict[str, object]:
    """The Triton extend kernel on the same step: each request's last `q_len` slots are
    its new tokens (given as contiguous K/V), the ones before its cached prefix. Best
    launch options first, with the default's time and the largest difference from FA2."""
    from radixserve.engine.attention.triton_ops.extend import _blocks, extend_attention

    device = q.device
    starts = list(itertools.accumulate(kv_lens, initial=0))
    new_slots = torch.cat(
        [indices[s + kv - n : s + kv] for s, kv, n in zip(starts, kv_lens, q_lens, strict=False)]
    ).long()
    prefix = [indices[s : s + kv - n] for s, kv, n in zip(starts, kv_lens, q_lens, strict=False)]
    k_new, v_new = k[new_slots, 0].contiguous(), v[new_slots, 0].contiguous()
    q_starts = torch.tensor(list(itertools.accumulate(q_lens, initial=0))[:-1], device=device)
    q_lens_t = torch.tensor(q_lens, device=device)
    kv_indptr = _indptr([len(p) for p in prefix], device)
    kv_indices = torch.cat(prefix).to(torch.int32)
    out = torch.empty_like(q)
    k_buf, v_buf = k[:, 0], v[:, 0]

    def run(blocks: tuple[int, int, int, int]) -> torch.Tensor:
        extend_attention(
            q, k_new, v_new, out, k_buf, v_buf, q_starts, q_lens_t, kv_indptr, kv_indices,
            max(q_lens), 1.0 / math.sqrt(HEAD_DIM), blocks=blocks,
        )  # fmt: skip
        return out

    group = NUM_HEADS // NUM_KV_HEADS
    default = _blocks(torch.bfloat16, max(q_lens) * group, device)
    times = {}
    for blocks in TRITON_OPTIONS:
        try:
            times[blocks] = time_ms(functools.partial(run, blocks), reps)
        except Exception as exc:  # out of resources for this block size
            print(f"  triton {blocks}: {type(exc).__name__}", flush=True)
    best = sorted(times, key=times.__getitem__)
    row: dict[str, object] = {
        "triton_default": list(default),
        "triton_default_ms": round(time_ms(functools.partial(run, default), reps), 4),
        "triton_best": [[list(b), round(times[b], 4)] for b in best[:4]],
    }
    if reference is not None:
        row["triton_max_abs_diff"] = (run(best[0]).float() - reference).abs().max().item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--backends", nargs="+", default=["fa2", "fa3"], choices=["fa2", "fa3"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument(
        "--triton",
        action="store_true",
        help="also the Triton backend's extend kernel, over a sweep of its launch options",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import flashinfer

    device = torch.device("cuda")
    workspace = torch.zeros(384 * 2**20, dtype=torch.uint8, device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    heads = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    options = dict(
        causal=True,
        sm_scale=1.0 / math.sqrt(HEAD_DIM),
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    for name in args.shapes:
        q_lens = [n for count, n, _ in SHAPES[name] for _ in range(count)]
        kv_lens = [kv for count, _, kv in SHAPES[name] for _ in range(count)]
        slots = sum(kv_lens)
        k = torch.randn(slots, 1, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, torch.bfloat16)
        v = torch.randn(slots, 1, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, torch.bfloat16)
        q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=g).to(device, torch.bfloat16)
        indices = torch.randperm(slots, generator=g).to(device, torch.int32)
        outs, row = {}, {"shape": name, "tokens": sum(q_lens)}
        for backend in args.backends:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", backend=backend
            )
            wrapper.plan(
                _indptr(q_lens, device),
                _indptr(kv_lens, device),
                indices,
                torch.ones(len(q_lens), dtype=torch.int32, device=device),
                *heads,
                1,  # page size
                **options,
            )

            def run(wrapper: object = wrapper, kv: object = (k, v), q: object = q) -> torch.Tensor:
                return wrapper.run(q, kv)  # type: ignore[attr-defined]

            outs[backend] = run().float()
            ms = time_ms(run, args.reps)
            row[f"{backend}_ms"] = round(ms, 4)
            row[f"{backend}_step_ms"] = round(ms * LAYERS, 2)
            if q_lens == kv_lens:  # nothing cached: the step's own K/V, contiguous
                ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                    workspace, "NHD", backend=backend
                )
                ragged.plan(_indptr(q_lens, device), _indptr(kv_lens, device), *heads, **options)
                own_k, own_v = k[indices.long(), 0], v[indices.long(), 0]

                def run_ragged(
                    wrapper: object = ragged, kv: object = (own_k, own_v), q: object = q
                ) -> torch.Tensor:
                    return wrapper.run(q, *kv)  # type: ignore[attr-defined,misc]

                diff = (run_ragged().float() - outs[backend]).abs().max().item()
                ms = time_ms(run_ragged, args.reps)
                row[f"{backend}_ragged_ms"] = round(ms, 4)
                row[f"{backend}_ragged_max_abs_diff"] = diff
        if args.triton and name in TRITON_SHAPES:
            row |= time_triton(q, k, v, indices, q_lens, kv_lens, outs.get("fa2"), args.reps)
        if "fa2" in outs and "fa3" in outs:
            row["max_abs_diff"] = (outs["fa2"] - outs["fa3"]).abs().max().item()
        print(json.dumps(row), flush=True)
    print(f"device: {torch.cuda.get_device_name()}, flashinfer {flashinfer.__version__}")


if __name__ == "__main__":
    main()
